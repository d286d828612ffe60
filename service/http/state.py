"""What the single server serves: its variants (A, B) with their predictors and batchers, the
shadow mirror, the metrics that describe them, and how a bundle is loaded into a variant.

The app's lifespan builds one :class:`ServingState`; the /predict route reads it and the admin
routes (:mod:`service.http.admin`) change it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import anyio

import engine
from engine import MemoryBusy, Predictor
from service.http.group import WorkerGroup
from service.http.metrics import Metrics
from service.http.settings import Settings
from service.rollout.live import LiveTraffic
from service.rollout.shadow import ShadowMirror
from service.rollout.variants import Variants

log = logging.getLogger("xmcserve.admin")

# A vetting child may map this much beyond the bundle's files (interpreter, ONNX Runtime, arenas).
VET_BASE_BYTES = 1 << 30


# A worker applying a change another worker of its group made (or loading, at its start, the
# bundles the group's admin log leaves) outwaits a writer that held the lineage's append log past
# the read wait (MemoryBusy: a brief wait, nothing diverged) this long at most, pausing from the
# first to the longest pause, doubling; past that it fails as it would have at once.
BUSY_WITHIN_S = 30.0
BUSY_FIRST_PAUSE_S = 0.05
BUSY_LONGEST_PAUSE_S = 2.0
BUSY_TRIES = 30  # and this many tries at most (each try itself waits up to the read wait)

T = TypeVar("T")


@dataclass(frozen=True)
class BusyRetry:
    """How a load or a catch-up that found the append log held (:class:`MemoryBusy`) is tried
    again: within :attr:`within_s` and :attr:`tries`, pausing :attr:`first_pause_s`, doubling up to
    :attr:`longest_pause_s`; ``clock`` and ``sleep`` are injectable. A client's own admin call does
    not use it: it answers 503 with Retry-After at once (the client retries)."""

    within_s: float = BUSY_WITHIN_S
    tries: int = BUSY_TRIES
    first_pause_s: float = BUSY_FIRST_PAUSE_S
    longest_pause_s: float = BUSY_LONGEST_PAUSE_S
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[object]] = anyio.sleep

    async def run(self, attempt: Callable[[], Awaitable[T]], what: str) -> T:
        """``attempt()``'s result, tried again while it raises :class:`MemoryBusy` within the
        bounds (a log line per retry); the last :class:`MemoryBusy` once they are spent."""
        deadline = self.clock() + self.within_s
        pause = self.first_pause_s
        tried = 0
        while True:
            tried += 1
            try:
                return await attempt()
            except MemoryBusy as exc:
                left = deadline - self.clock()
                if tried >= self.tries or left <= 0:
                    log.error(
                        "%s: the append log was still held after %d tries: %s",
                        what,
                        tried,
                        exc,
                        extra={"event": "memory_busy_gave_up", "tries": tried, "reason": str(exc)},
                    )
                    raise
                wait = min(pause, left)
                log.warning(
                    "%s: %s; trying again in %.2f s (try %d of at most %d)",
                    what,
                    exc,
                    wait,
                    tried + 1,
                    self.tries,
                    extra={"event": "memory_busy_retry", "tries": tried, "pause_s": wait, "reason": str(exc)},
                )
                await self.sleep(wait)
                pause = min(2 * pause, self.longest_pause_s)


def refused_fields(variant: str, path: Path | str, exc: Exception) -> dict:
    """The structured fields of the log line saying a bundle was refused for ``variant``."""
    return {"event": "bundle_refused", "variant": variant, "path": str(path), "reason": str(exc)}


async def load_for_serving(
    path: Path, settings: Settings, vet: bool = True, group: WorkerGroup | None = None, busy: BusyRetry | None = None
) -> Predictor:
    """Load, verify and warm a bundle off the event loop (the loop keeps serving meanwhile).
    With ``vet``, a child process under a memory limit (1 GiB + 4x the bundle's files) loads it
    first, so a bundle that would crash or exhaust the loader is refused before it enters here;
    in a ``group`` whose loads verify checksums, once for all its workers
    (:meth:`~service.http.group.WorkerGroup.vet_once`). ``busy``: how a load that found its
    append log held (:class:`MemoryBusy`) is tried again (the load only: the vet has passed);
    None raises it at once."""
    options = settings.encoder_options()
    appends_dir = settings.admin.appends_dir(Path(path).resolve())
    if vet:
        files = sum(f.stat().st_size for f in Path(path).glob("*") if f.is_file())
        limit = VET_BASE_BYTES + 4 * files

        def vet_bundle() -> None:
            engine.vet_in_child(path, options, settings.verify_checksums, limit)

        if group is not None and settings.verify_checksums:
            await anyio.to_thread.run_sync(lambda: group.vet_once(Path(path), vet_bundle))
        else:
            await anyio.to_thread.run_sync(vet_bundle)

    def load() -> Awaitable[Predictor]:
        return anyio.to_thread.run_sync(
            lambda: engine.load_predictor(
                path, options, settings.verify_checksums, appends_dir, settings.admin.replay_skip_refused
            )
        )

    predictor = await (busy.run(load, f"loading {path}") if busy is not None else load())
    bundle = predictor.bundle
    log.info(
        "bundle %s loaded from %s (%s, checksums %s)",
        bundle.bundle_id,
        path,
        bundle.encoder.provider,
        "verified" if settings.verify_checksums else "not checked",
        extra={
            "event": "bundle_loaded",
            "bundle_id": bundle.bundle_id,
            "path": str(path),
            "provider": bundle.encoder.provider,
            "verified": settings.verify_checksums,
        },
    )
    return predictor


@dataclass
class ServingState:
    """The variants, the shadow mirror and the lock that serialises loads, promotes and appends."""

    settings: Settings
    metrics: Metrics
    variants: Variants
    shadow: ShadowMirror | None = None
    live: LiveTraffic | None = None  # each variant's recent /predict traffic, for the rollout page
    group: WorkerGroup | None = None  # the server's other worker processes (XMCSERVE_WORKERS), if any
    reload_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # how this worker outwaits a held append log where no client retries for it: applying another
    # worker's change, loading its start-up state
    busy_retry: BusyRetry = field(default_factory=BusyRetry)

    def __post_init__(self) -> None:
        self.metrics.appended_keys_of = self.appended_keys

    def appended_keys(self) -> list[tuple[str, int, int]]:
        """Each variant's appended labels and instances, as its memory (and /info) says."""
        out = []
        for name, slot in self.variants.slots.items():
            view = slot.predictor.view if slot.predictor is not None else None
            out.append((name, view.appended_labels if view else 0, view.appended_instances if view else 0))
        return out

    def install(
        self, name: str, predictor: Predictor, source: str, counted: bool = True, at_start: bool = False
    ) -> Predictor | None:
        """``counted``: its skipped replays in the metrics (not when applying another worker's
        reload: that worker counted them, and a group's counters are summed). ``at_start``: a
        start-up load, which every worker of a group makes alike: counted by the first only."""
        previous = self.variants.install(name, predictor, source)
        skipped = predictor.view.replay_skipped
        if counted and skipped and at_start and self.group is not None:
            event = f"replay_skipped {name} {predictor.bundle.bundle_id} {source} {len(skipped)}"
            counted = self.group.claim(event)
        if counted:
            self.metrics.replay_skipped.labels(variant=name).inc(len(predictor.view.replay_skipped))
        self.publish_bundle_info()
        return previous

    def publish_bundle_info(self) -> None:
        for name, slot in self.variants.slots.items():
            bundle = slot.predictor.bundle if slot.predictor else None
            self.metrics.bundle_info.labels(variant=name).info(
                {
                    "bundle_id": bundle.bundle_id if bundle else "",
                    "index_kind": bundle.manifest.index_kind if bundle else "",
                    "provider": bundle.encoder.provider if bundle else "",
                    "dim": str(bundle.manifest.dim) if bundle else "",
                }
            )

    def reloadable(self, source: str | None) -> str | None:
        """``source`` as ``/admin/reload`` takes it (relative to the bundle root), None when the
        bundle lies outside the root (only a restart serves it again)."""
        if not source:
            return None
        root, path = self.settings.admin.bundle_root.resolve(), Path(source).resolve()
        return str(path.relative_to(root)) if path.is_relative_to(root) else None

    def worker(self) -> dict:
        """Which process answered: its pid, and in a group, how many workers and the admin changes
        it has applied."""
        group = self.group
        return {
            "pid": os.getpid(),
            "workers": group.workers if group else 1,
            "admin_generation": group.applied if group else None,
        }

    def describe(self) -> dict:
        shadow = self.shadow
        routing = self.variants.describe()
        for slot in [*routing["variants"].values(), routing["previous"]]:
            slot["bundle"] = self.reloadable(slot["source"])
        return {
            **routing,
            "shadow": {
                "target": shadow.target if shadow else None,
                "fraction": shadow.config.fraction if shadow else 0.0,
                "queue_depth": shadow.depth if shadow else 0,
            },
        }
