"""Loading a bundle to serve: verified, its append logs replayed, warmed; and vetting one in a
child process first, so that a bundle that would crash or exhaust the loader costs the child."""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import resource
from contextlib import nullcontext
from pathlib import Path

from bundle import BundleError, Lineage, Manifest, content_id
from engine.append_log import (
    LOG_SUFFIX,
    AppendLog,
    AppendLogError,
    LogRead,
    LogScan,
    appends_dir_beside,
    batch_of,
    check_bundle_id,
    lineage_log_path,
)
from engine.bundle import Bundle, load_bundle
from engine.encoder import EncoderOptions
from engine.memory import AppendRefused, MemoryBusy
from engine.search import Predictor

log = logging.getLogger(__name__)

# The manifest parameter in which a bundle compacted before lineages (manifest.lineage) lists the
# logs it replays past an offset before its own.
SOURCE_LOGS = "source_logs"


def load_predictor(
    path: Path | str,
    options: EncoderOptions | None = None,
    verify: bool = True,
    appends_dir: Path | None = None,
    skip_refused: bool = False,
) -> Predictor:
    """A bundle loaded, verified and warmed by one prediction (the first search and aggregation
    allocate); a bundle that cannot answer is refused like a corrupt one (:class:`BundleError`).

    ``appends_dir``: where the bundle's lineage log lives (e.g. :func:`appends_dir_beside`): its
    appends are replayed (a compacted bundle's from the offset its compaction folded to), and new
    ones are written there before they are applied. Loading takes no lock and creates nothing; the
    first append takes the log's lock (another process holding it: that append is refused) and
    creates the directory. None: no log (appends live in memory only).

    ``skip_refused``: a logged append that no longer applies (its label uid exists already, say)
    is skipped and reported in the memory's ``replay_skipped`` instead of refusing the bundle."""
    return _load(Path(path), options, verify, appends_dir, True, skip_refused)[0]


def load_for_reading(
    path: Path | str, appends_dir: Path | None, options: EncoderOptions | None = None
) -> tuple[Predictor, list[LogRead]]:
    """The bundle with its logs replayed as they are now, without writing to them or locking them
    (a compaction, an inspection): the predictor, which has no log, and what was read of each
    log (its size and sha256), its lineage log last (a consistent prefix: a record being written
    meanwhile is left out)."""
    return _load(Path(path), options, True, appends_dir, False, False)


def _load(
    path: Path, options: EncoderOptions | None, verify: bool, appends_dir: Path | None, write: bool, skip: bool
) -> tuple[Predictor, list[LogRead]]:
    bundle = load_bundle(path, options, verify=verify)
    check_identity(bundle)
    try:
        sources, own = logs_to_replay(bundle, appends_dir)
    except AppendLogError as exc:
        raise BundleError(f"{path}: {exc}") from None
    predictor = Predictor(bundle, own.log if (own is not None and write) else None)
    reads, skipped, replayed = [], [], set()
    # with shared writes, no other process is between a write and its taking back while this reads
    reading = own.log.shared_reading() if own is not None and own.log.shared else nullcontext()
    try:
        with reading as readable:
            if readable is False:  # a writer of the group held it past the wait: its records may be taken back
                raise MemoryBusy(f"{path}: another worker held its append log past the read wait; load it again")
            for source in [*sources, *([own] if own is not None else [])]:
                scan = source.scan()
                if (file := file_identity(source.log.path)) in replayed:
                    # one file named twice (a bundle compacted before lineages, whose own log is its source's)
                    log.warning("%s: %s replayed once only (named twice)", path, source.log.path)
                    for _ in scan:  # read through for its size and digest only
                        pass
                else:
                    skipped += replay(predictor, scan, source.min_version, skip)
                replayed.add(file)
                reads.append(LogRead(source.log.path, source.log.bundle_id, scan.end, scan.sha256, scan.prefix_sha256))
            if own is not None:
                own.log.size = reads[-1].size  # the memory has applied its lineage log up to here
    except (AppendLogError, ValueError, KeyError, TypeError) as exc:
        raise BundleError(f"{path}: cannot replay its append log ({exc})") from None
    if skipped:
        predictor.memory.report_skipped(skipped)
    try:
        predictor.predict(["warm-up query"], k=10)
    except Exception as exc:
        raise BundleError(f"{path}: warm-up prediction failed ({type(exc).__name__}: {exc})") from None
    return predictor, reads


def file_identity(path: Path) -> tuple:
    """What makes two names one file: (device, inode) when it exists, its absolute path otherwise."""
    try:
        stat = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return ("missing", os.path.normpath(os.path.abspath(path)))
    return (stat.st_dev, stat.st_ino)


def check_identity(bundle: Bundle) -> None:
    """Refuse a bundle whose id is not a bundle id, or not the one its content gives: its append
    log is named from that id, so a free-form id could write outside the log directory, and two
    bundles claiming one id would share a log."""
    manifest = bundle.manifest
    try:
        check_bundle_id(manifest.bundle_id)
    except AppendLogError as exc:
        raise BundleError(f"{bundle.path}: {exc}") from None
    if manifest.bundle_id != (expected := content_id(manifest)):
        raise BundleError(f"{bundle.path}: bundle id {manifest.bundle_id} is not its content's ({expected})")


class SourceLog:
    """A log that a bundle replays past ``offset``: its lineage log (offset 0 for the lineage's
    first bundle, where a compacted one's compaction stopped reading, its sha256 checked here), or
    a log a bundle compacted before lineages replays before its own. ``seen``: the bytes the log
    held when the bundle was made from its source (``manifest.lineage.seen``); a shorter log is
    refused, as it is not the one whose appends the source acknowledged."""

    def __init__(self, log: AppendLog, offset: int = 0, sha256: str | None = None, min_version: int = 0, seen: int = 0):
        self.log, self.offset, self.sha256, self.min_version, self.seen = log, offset, sha256, min_version, seen

    def scan(self) -> LogScan:
        """The log's records past ``offset``, to be read a chunk at a time; its first ``offset``
        bytes (and its length, at least ``seen``) are checked here, before any record is read."""
        if self.offset and not self.log.path.exists():
            raise AppendLogError(
                f"{self.log.path} is missing: the compaction folded its first {self.offset} bytes, and the appends "
                "acknowledged after that are in it (serve this bundle with the log directory it was compacted for)"
            )
        size = self.log.path.stat().st_size if self.log.path.exists() else 0
        if size < self.seen:
            raise AppendLogError(
                f"{self.log.path} holds {size} bytes, but its lineage's log held {self.seen} when this bundle was "
                "made: the appends its source acknowledged are in another log directory. Serve it with its source's "
                "log directory (XMCSERVE_APPEND_LOG_DIR), or make it again with --appends-dir naming that directory"
            )
        scan = self.log.scan(self.offset, digest=True)
        if self.sha256 is not None and scan.prefix_sha256 != self.sha256:
            raise AppendLogError(f"{self.log.path}: its first {self.offset} bytes are not those the compaction folded")
        return scan


def logs_to_replay(bundle: Bundle, appends_dir: Path | None) -> tuple[list[SourceLog], SourceLog | None]:
    """The logs a bundle replays (none without a log directory): the legacy source logs of a bundle
    compacted before lineages, and the log it writes to. That is its lineage's log
    (``manifest.lineage``, named by its path relative to the log directory the bundle is served
    with: the first bundle's log in a shared XMCSERVE_APPEND_LOG_DIR, the one beside the first
    bundle by default; refused anywhere else: :func:`lineage_log_path`) from the offset the bundle
    was made at (compacted, or reindexed or derived from a bundle of the lineage), or, for a bundle
    built, its own from 0."""
    if appends_dir is None:
        return [], None
    lineage = bundle.manifest.lineage
    if lineage is not None:
        path = lineage_log_of(appends_dir, lineage, is_default_dir(appends_dir, bundle.path))
        return [], SourceLog(AppendLog(path, lineage.bundle_id), lineage.offset, lineage.sha256, 0, lineage.seen or 0)
    own = SourceLog(AppendLog.in_directory(appends_dir, bundle.bundle_id))
    return legacy_source_logs(bundle, appends_dir), own


def is_default_dir(appends_dir: Path, bundle_path: Path) -> bool:
    """Whether ``appends_dir`` is the bundle's own default log directory (``<bundle dir>.appends``)
    rather than one shared by the bundles it serves with (XMCSERVE_APPEND_LOG_DIR)."""
    return os.path.realpath(appends_dir) == os.path.realpath(appends_dir_beside(Path(bundle_path).resolve()))


def lineage_log_of(appends_dir: Path, lineage: Lineage, default_dir: bool) -> Path:
    """The log of ``lineage`` for a bundle served with log directory ``appends_dir``. Two places may
    hold it: the log named by ``lineage.log`` (relative to the log directory the bundle was made
    for: beside its source when made without --appends-dir) and the lineage's log in
    ``appends_dir`` itself, named by the lineage's bundle id (where its source writes when served
    with the same XMCSERVE_APPEND_LOG_DIR). The one that exists is the lineage's; both, as two files,
    is refused (two logs of one lineage: which appends were acknowledged is not known). Neither: no
    append was logged yet, and the first goes to the named one in the bundle's default directory,
    to ``appends_dir``'s otherwise, where its source finds it. Raises :class:`AppendLogError`."""
    named = lineage_log_path(appends_dir, lineage.log, lineage.bundle_id)
    in_dir = Path(os.path.normpath(Path(appends_dir).absolute())) / f"{lineage.bundle_id}{LOG_SUFFIX}"
    found = {file_identity(path): path for path in (in_dir, named) if path.exists()}
    if len(found) > 1:
        raise AppendLogError(
            f"two logs of lineage {lineage.bundle_id}: {in_dir} and {named}; serve the bundle with the log directory "
            "its source writes to (XMCSERVE_APPEND_LOG_DIR), or make it with --appends-dir naming that directory"
        )
    if found:
        return next(iter(found.values()))
    return named if default_dir else in_dir


def carried_lineage(source: Path, manifest: Manifest, out: Path, appends_dir: Path | None) -> Lineage:
    """The lineage of a bundle written to ``out`` from the bundle ``source`` (``manifest``) with the
    same memory, only served otherwise (reindexed, derived, fused): the source's lineage log, from
    the offset the source starts at in it (0 for the lineage's first bundle), named relative to the
    new bundle's log directory. So the new bundle replays every append the lineage acknowledged,
    with the same label ids and ``append_id`` values, and appends to the same log: promoting it
    loses nothing. ``appends_dir``: the shared log directory both are served with
    (XMCSERVE_APPEND_LOG_DIR); None: each bundle's own ``<bundle dir>.appends/``, where the new
    bundle finds the log only when it is written beside a bundle of the lineage
    (:func:`lineage_log_path`; elsewhere a warning says so: served with a log directory, it is
    refused at load, never served without its lineage's appends). Raises :class:`AppendLogError`
    when ``source`` was compacted before lineages (its appends are spread over several logs:
    compact it first)."""
    source, out = Path(source).resolve(), Path(out).resolve()
    if manifest.lineage is None and (SOURCE_LOGS in manifest.params or "compacted_from" in manifest.params):
        raise AppendLogError(
            f"{source} was compacted before lineages: its appends are in several logs, which one bundle made from "
            "it cannot go on in; compact it first (python -m export.compact) and make the new bundle from that"
        )
    source_dir = Path(appends_dir).absolute() if appends_dir is not None else appends_dir_beside(source)
    target_dir = Path(appends_dir).absolute() if appends_dir is not None else appends_dir_beside(out)
    lineage = manifest.lineage or Lineage(
        bundle_id=manifest.bundle_id,
        log=f"{check_bundle_id(manifest.bundle_id)}{LOG_SUFFIX}",
        offset=0,
        sha256=hashlib.sha256(b"").hexdigest(),
    )
    path = lineage_log_of(source_dir, lineage, appends_dir is None)
    # how far the log went: the new bundle is refused where its log holds less (not the lineage's)
    scan = AppendLog(path, lineage.bundle_id).scan(0)
    for _ in scan:
        pass
    carried = lineage.model_copy(update={"log": os.path.relpath(path, target_dir), "seen": scan.end})
    try:
        lineage_log_path(target_dir, carried.log, carried.bundle_id)  # where the new bundle looks for it
    except AppendLogError as exc:
        log.warning("%s: served with its default log directory, it will be refused: %s", out, exc)
    return carried


def legacy_source_logs(bundle: Bundle, appends_dir: Path) -> list[SourceLog]:
    """The logs a bundle compacted before lineages replays before its own (``params.source_logs``
    past their offsets; older still, ``params.compacted_from`` past the appends it folded)."""
    params = bundle.manifest.params
    if SOURCE_LOGS not in params:
        if source := params.get("compacted_from"):
            return [SourceLog(AppendLog.in_directory(appends_dir, source), 0, None, int(params.get("appends", 0)))]
        return []
    sources = []
    for entry in params[SOURCE_LOGS]:
        relative = Path(entry["log"])
        if relative.is_absolute() or relative.name != f"{check_bundle_id(entry['bundle_id'])}{LOG_SUFFIX}":
            raise AppendLogError(f"source log {entry['log']!r}: not the relative path of a bundle's log")
        log_of = AppendLog(Path(appends_dir) / relative, entry["bundle_id"])
        sources.append(SourceLog(log_of, int(entry["offset"]), str(entry["sha256"])))
    return sources


def replay(predictor: Predictor, scan: LogScan, min_version: int, skip: bool) -> list[dict]:
    """Apply the records of ``scan`` (past memory version ``min_version``) to the predictor's
    memory as they are read, oldest first; a record whose ``append_id`` is already applied is passed
    over. A record that no longer applies refuses the load, or with ``skip`` is left out: returns
    those left out (where, and why)."""
    applied, skipped = 0, []
    for number, (start, _, record) in enumerate(scan, start=scan.lines_before + 1):
        if record.get("version", 0) <= min_version:
            continue
        try:
            applied += predictor.memory.replay(*batch_of(record, predictor.bundle.index.dim))
        except (AppendRefused, AppendLogError) as exc:
            where = {"log": str(scan.log.path), "line": number, "byte": start, "append_id": record.get("append_id")}
            if not skip:
                raise AppendLogError(
                    f"{scan.log.path}:{number} (byte {start}, append_id {record.get('append_id')!r}) no longer "
                    f"applies: {exc}; nothing served (skip such records: skip_refused / XMCSERVE_REPLAY_SKIP_REFUSED)"
                ) from None
            log.error("%s:%d: skipping a logged append that no longer applies: %s", scan.log.path, number, exc)
            skipped.append({**where, "reason": str(exc)})
    if applied:
        log.info("replayed %d appends of %s (memory version %d)", applied, scan.log.path, predictor.view.version)
    return skipped


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
