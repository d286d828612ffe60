"""Loading a bundle to serve: verified, its append logs replayed, warmed; and vetting one in a
child process first, so that a bundle that would crash or exhaust the loader costs the child."""

from __future__ import annotations

import logging
import multiprocessing
import resource
from pathlib import Path

from service.engine.append_log import AppendLog, AppendLogError, batch_of
from service.engine.bundle import BundleError, load_bundle
from service.engine.encoder import EncoderOptions
from service.engine.search import Predictor

log = logging.getLogger(__name__)


def load_predictor(
    path: Path | str, options: EncoderOptions | None = None, verify: bool = True, appends_dir: Path | None = None
) -> Predictor:
    """A bundle loaded, verified and warmed by one prediction (the first search and aggregation
    allocate); a bundle that cannot answer is refused like a corrupt one (:class:`BundleError`).

    ``appends_dir``: where the bundle's append log lives (e.g. :func:`appends_dir_beside`); its
    appends are replayed, and new ones are written there before they are applied. None: no log
    (appends live in memory only). A bundle compacted from another (``params.compacted_from``)
    first replays the appends its source's log got after the compaction."""
    bundle = load_bundle(path, options, verify=verify)
    append_log = AppendLog.in_directory(appends_dir, bundle.bundle_id) if appends_dir is not None else None
    predictor = Predictor(bundle, append_log)
    try:
        if append_log is not None and (source := bundle.manifest.params.get("compacted_from")):
            folded = int(bundle.manifest.params.get("appends", 0))
            later = [r for r in AppendLog.in_directory(appends_dir, source).read(repair=False) if r["version"] > folded]
            replay(predictor, later)
        if append_log is not None:
            replay(predictor, append_log.read())
    except (AppendLogError, ValueError, KeyError, TypeError) as exc:
        raise BundleError(f"{path}: cannot replay its append log ({exc})") from None
    try:
        predictor.predict(["warm-up query"], k=10)
    except Exception as exc:
        raise BundleError(f"{path}: warm-up prediction failed ({type(exc).__name__}: {exc})") from None
    return predictor


def replay(predictor: Predictor, records: list[dict]) -> int:
    """Apply logged ``records`` to the predictor's memory, oldest first; returns how many were
    applied (a record whose ``append_id`` is already applied is skipped)."""
    applied = 0
    for record in records:
        applied += predictor.memory.replay(*batch_of(record, predictor.bundle.index.dim))
    if applied:
        log.info("replayed %d appends (memory version %d)", applied, predictor.view.version)
    return applied


def vet_in_child(
    path: Path | str, options: EncoderOptions | None = None, verify: bool = True, memory_limit_bytes: int = 0
) -> None:
    """:func:`load_predictor` in a child process under an address-space limit (0: none): a bundle
    that would crash the loader or make it allocate without bound costs the child, not the server
    that keeps serving. Raises :class:`BundleError` with the child's reason."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(
        target=_vet, args=(str(path), options, verify, memory_limit_bytes, sender), name="xmcserve-vet", daemon=True
    )
    child.start()
    sender.close()
    try:
        reason = receiver.recv() if receiver.poll(VET_TIMEOUT_S) else f"not loaded within {VET_TIMEOUT_S} s"
    except EOFError:  # the child died without a word: killed, out of memory, a crash in native code
        child.join(5)
        reason = f"the loader process died (exit code {child.exitcode})"
    finally:
        receiver.close()
        if child.is_alive():
            child.kill()
        child.join(5)
    if reason is not None:
        raise BundleError(f"{path}: {reason}")


VET_TIMEOUT_S = 300


def _vet(path: str, options, verify: bool, memory_limit_bytes: int, sender) -> None:
    if memory_limit_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
    try:
        load_predictor(path, options, verify)
        sender.send(None)
    except MemoryError:
        sender.send(f"loading needs more than the {memory_limit_bytes >> 20} MiB allowed")
    except BundleError as exc:
        sender.send(str(exc).removeprefix(f"{path}: "))
    except Exception as exc:
        sender.send(f"cannot be loaded ({type(exc).__name__}: {exc})")
