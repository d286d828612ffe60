"""The serving engine as one object: what a front end calls, and all it calls (vLLM's
``EngineClient``, infinity's ``AsyncEmbeddingEngine``).

:class:`Engine` owns the variants (a primary bundle and an optional candidate, each a predictor
behind its own micro-batcher, sticky routing between them), loading a bundle (vetted in a
memory-capped child first, verified, warmed, its append log replayed), swapping one in, promoting
the candidate, rolling the primary back, the two-step append, and readiness. It speaks Python:
it raises the engine's errors and returns data; the HTTP app and its admin routes translate
requests into these calls and the answers and errors into responses.

Every method is called from one event loop. Nothing of the caller runs on the engine's threads
but the metric observers given at construction (``on_batch_done``, ``on_drop``: thread-safe
counters). An append crosses the event loop twice: its vectors are prepared on a worker thread,
which hands each chunk's encoding to the variant's encode thread directly and returns once; the
commit (log, fsync, apply) runs on a worker thread and returns once.

A front end that serialises its own admin changes (a server's workers taking turns) wraps
:meth:`Engine.reload`, :meth:`Engine.promote`, :meth:`Engine.rollback` and
:meth:`Engine.commit_append` in its turn; the engine serialises them within the process too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.to_thread

from bundle import XmcserveError
from engine.append_log import AppendLogError, appends_dir_beside, share_writes
from engine.batcher import BatchAnswer, BatcherConfig
from engine.encoder import EncoderOptions
from engine.loading import load_predictor, vet_in_child
from engine.memory import AppendBatch, AppendOutcome, LineageDiverged, MemoryBusy
from engine.search import Predictor, StageTimes
from engine.variants import Variants

log = logging.getLogger("xmcserve.admin")

# A vetting child may map this much beyond the bundle's files (interpreter, ONNX Runtime, arenas).
VET_BASE_BYTES = 1 << 30

# A load or a catch-up that found the lineage's append log held by another process's writer past
# the read wait (MemoryBusy: a brief wait, nothing diverged) is tried again this long at most,
# pausing from the first to the longest pause, doubling; past that it fails as it would have at once.
BUSY_WITHIN_S = 30.0
BUSY_FIRST_PAUSE_S = 0.05
BUSY_LONGEST_PAUSE_S = 2.0
BUSY_TRIES = 30  # and this many tries at most (each try itself waits up to the read wait)

T = TypeVar("T")


class VariantUnavailable(XmcserveError, LookupError):
    """The variant asked for has no bundle (no candidate loaded, nothing to roll back to)."""


class CatchUpFailed(XmcserveError, RuntimeError):
    """The incoming primary could not apply what its lineage logged since it was loaded (its log
    unreadable, diverged, or held): nothing changed."""


class BundleChanged(XmcserveError, RuntimeError):
    """The variant swapped bundles between an append's preparation and its commit: nothing
    appended (its vectors are the old bundle's)."""


@dataclass(frozen=True)
class BusyRetry:
    """How a load or a catch-up that found the append log held (:class:`MemoryBusy`) is tried
    again: within :attr:`within_s` and :attr:`tries`, pausing :attr:`first_pause_s`, doubling up to
    :attr:`longest_pause_s`; ``clock`` and ``sleep`` are injectable. A client's own admin call does
    not use it: it is refused at once (the client retries)."""

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


@dataclass(frozen=True)
class EngineParams:
    """How the engine loads and serves bundles.

    Attributes:
        encoder: how each bundle's encoder runs (provider, threads).
        batcher: each variant's micro-batching.
        verify_checksums: every file's sha256 checked at load.
        append_log_dir: where each lineage's append log lives (None: beside its bundle).
        replay_skip_refused: a logged append the bundle refuses is skipped (and reported) instead
            of refusing the bundle.
        variants: the primary's and the candidate's names.
        shared_appends: this process serves beside others of one server (``XMCSERVE_WORKERS``):
            it takes each append log's lock per append, so they append to a lineage in turns.
    """

    encoder: EncoderOptions = field(default_factory=EncoderOptions)
    batcher: BatcherConfig = field(default_factory=BatcherConfig)
    verify_checksums: bool = True
    append_log_dir: Path | None = None
    replay_skip_refused: bool = False
    variants: tuple[str, str] = ("A", "B")
    shared_appends: bool = False

    def appends_dir(self, bundle_path: Path) -> Path:
        return self.append_log_dir or appends_dir_beside(bundle_path)


@dataclass(frozen=True)
class Swap:
    """A bundle swapped into a variant: the one serving it now and the one it replaced."""

    variant: str
    predictor: Predictor
    previous: Predictor | None


@dataclass(frozen=True)
class PreparedAppend:
    """An append checked and encoded against one variant's bundle (:meth:`Engine.prepare_append`),
    waiting for :meth:`Engine.commit_append`; ``vectors`` None: its ``append_id`` is applied already."""

    variant: str
    predictor: Predictor
    batch: AppendBatch
    vectors: object


Vetter = Callable[[Path, Callable[[], None]], object]


class Engine:
    """The variants and everything done to them; see the module's docstring.

    ``on_batch_done(variant)`` / ``on_drop(variant)``: each variant's batch and drop observers
    (called on the engine's threads: thread-safe metrics only). ``vet_once(path, vet)``: runs
    ``vet`` (a child's load of ``path``) unless another process of the front end's group already
    vetted those files (None: always runs it)."""

    def __init__(
        self,
        params: EngineParams | None = None,
        on_batch_done: Callable[[str], Callable[[int, StageTimes], None]] = lambda name: None,
        on_drop: Callable[[str], Callable[[str], None]] = lambda name: None,
        vet_once: Vetter | None = None,
    ):
        self.params = params = params or EngineParams()
        if params.shared_appends:
            share_writes()  # before any log is opened for writing
        self.primary, self.candidate = params.variants
        self._variants = Variants.create(params.batcher, on_batch_done, on_drop, params.variants)
        self._vet_once = vet_once
        self._changes = asyncio.Lock()  # swaps and commits, one at a time

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start every variant's batcher threads (answers go to the running event loop)."""
        self._variants.start()

    async def stop(self) -> None:
        """Fail what is still queued (:class:`~engine.batcher.BatcherStoppedError`) and stop."""
        await self._variants.stop()

    # --- what is served --------------------------------------------------------------------------

    @property
    def variants(self) -> tuple[str, str]:
        return self.params.variants

    @property
    def ready(self) -> bool:
        """The primary has a bundle."""
        return self._variants[self.primary].ready

    def predictor(self, variant: str) -> Predictor | None:
        return self._variants[variant].predictor

    def source(self, variant: str) -> str | None:
        """Where the variant's bundle was loaded from."""
        return self._variants[variant].source

    def bundle_id(self, variant: str) -> str | None:
        return self._variants[variant].bundle_id

    @property
    def previous(self) -> Predictor | None:
        """The bundle the primary served before its last change (a rollback's target)."""
        return self._variants.previous.predictor if self._variants.previous else None

    @property
    def split_b(self) -> float:
        return self._variants.split_b

    def set_split(self, split_b: float) -> None:
        """The candidate's share of the traffic (sticky per request key)."""
        self._variants.split_b = split_b

    def queue_depth(self, variant: str) -> int:
        return self._variants[variant].batcher.depth

    def in_flight_batches(self, variant: str) -> int:
        return self._variants[variant].batcher.in_flight_batches

    def expected_wait_s(self) -> float | None:
        """The shortest expected queue wait of the variants that can answer (None: none can)."""
        waits = [slot.batcher.expected_wait_s() for slot in self._variants.slots.values() if slot.ready]
        return min(waits) if waits else None

    def describe(self) -> dict:
        """The split, the swaps, each variant's bundle, source, queue and memory, and the
        primary's previous bundle."""
        return self._variants.describe()

    # --- answering -------------------------------------------------------------------------------

    def choose(self, key: str | None, forced: str | None = None) -> str:
        """The variant that answers a request: ``forced`` (it must have a bundle), else the
        candidate for its share of the keys. Raises :class:`VariantUnavailable`."""
        try:
            return self._variants.choose(key, forced).name
        except LookupError as exc:
            raise VariantUnavailable(str(exc)) from None

    async def predict(
        self,
        variant: str,
        texts: list[str],
        k: int,
        ef: int | None = None,
        exclude: Collection[str] | list[Collection[str]] = (),
        timeout_s: float | None = None,
    ) -> BatchAnswer:
        """The variant's answer for ``texts``, batched with whatever else is queued (invisibly:
        an answer does not depend on its batch). ``exclude``: label *uids*, one collection for all
        texts or one per text; ``timeout_s``: how long it may wait to start. Raises
        :class:`~engine.batcher.QueueFullError`, :class:`~engine.batcher.DeadlineExceededError`,
        :class:`~engine.batcher.BatcherStoppedError`, :class:`MemoryBusy`; cancelling the call
        takes the request out of the queue when it has not started."""
        return await self._variants[variant].batcher.submit(texts, k, ef, exclude, timeout_s)

    # --- loading and swapping --------------------------------------------------------------------

    async def load(self, path: Path, vet: bool = True, busy: BusyRetry | None = None) -> Predictor:
        """Load, verify and warm a bundle off the event loop (the loop keeps serving meanwhile).
        With ``vet``, a child process under a memory limit (1 GiB + 4x the bundle's files) loads
        it first, so a bundle that would crash or exhaust the loader is refused before it enters
        here (once for a front end's group, through ``vet_once``, when checksums are verified).
        ``busy``: how a load that found its append log held is tried again (the load only: the vet
        has passed); None raises :class:`MemoryBusy` at once. Raises :class:`BundleError`."""
        params = self.params
        path = Path(path)
        if vet:
            files = sum(f.stat().st_size for f in path.glob("*") if f.is_file())
            limit = VET_BASE_BYTES + 4 * files

            def vet_bundle() -> None:
                vet_in_child(path, params.encoder, params.verify_checksums, limit)

            if self._vet_once is not None and params.verify_checksums:
                await anyio.to_thread.run_sync(lambda: self._vet_once(path, vet_bundle))
            else:
                await anyio.to_thread.run_sync(vet_bundle)
        appends_dir = params.appends_dir(path.resolve())

        def load() -> Awaitable[Predictor]:
            return anyio.to_thread.run_sync(
                lambda: load_predictor(
                    path, params.encoder, params.verify_checksums, appends_dir, params.replay_skip_refused
                )
            )

        predictor = await (busy.run(load, f"loading {path}") if busy is not None else load())
        bundle = predictor.bundle
        log.info(
            "bundle %s loaded from %s (%s, checksums %s)",
            bundle.bundle_id,
            path,
            bundle.encoder.provider,
            "verified" if params.verify_checksums else "not checked",
            extra={
                "event": "bundle_loaded",
                "bundle_id": bundle.bundle_id,
                "path": str(path),
                "provider": bundle.encoder.provider,
                "verified": params.verify_checksums,
            },
        )
        return predictor

    def install(self, variant: str, predictor: Predictor, source: str) -> Predictor | None:
        """Swap a loaded ``predictor`` into ``variant`` (atomic per batch); returns the one it
        replaced. Replacing the primary keeps the old one as :attr:`previous`."""
        return self._variants.install(variant, predictor, source)

    async def reload(self, variant: str, path: Path, vet: bool = True, busy: BusyRetry | None = None) -> Swap:
        """:meth:`load` the bundle at ``path`` and swap it into ``variant``; a bundle refused
        (:class:`BundleError`) leaves the variant as it was."""
        async with self._changes:
            predictor = await self.load(path, vet=vet, busy=busy)
            previous = self.install(variant, predictor, str(path))
        return Swap(variant, predictor, previous)

    async def promote(self, busy: BusyRetry | None = None) -> Swap:
        """The candidate becomes the primary, the candidate is emptied and the split reset; first
        the candidate applies what its lineage logged since it was loaded, so no acknowledged
        append is missing from the new primary. Raises :class:`VariantUnavailable` (no
        candidate), :class:`CatchUpFailed`."""
        async with self._changes:
            await self._caught_up(self._variants[self.candidate].predictor, busy)
            try:
                previous = self._variants.promote()
            except LookupError as exc:
                raise VariantUnavailable(str(exc)) from None
        return Swap(self.primary, self._variants[self.primary].predictor, previous)

    async def rollback(self, busy: BusyRetry | None = None) -> Swap:
        """The primary's previous bundle serves it again (a second rollback undoes the first),
        caught up with its lineage first. Raises :class:`VariantUnavailable`, :class:`CatchUpFailed`."""
        async with self._changes:
            if self._variants.previous is None:
                raise VariantUnavailable(
                    f"no previous {self.primary} bundle to roll back to ({self.primary} has not changed since start-up)"
                )
            await self._caught_up(self._variants.previous.predictor, busy)
            replaced = self._variants.rollback()
        return Swap(self.primary, self._variants[self.primary].predictor, replaced)

    async def _caught_up(self, predictor: Predictor | None, busy: BusyRetry | None) -> None:
        if predictor is None:
            return

        def catch_up():
            return anyio.to_thread.run_sync(predictor.memory.catch_up)

        try:
            await (busy.run(catch_up, f"catching up {predictor.bundle.bundle_id}") if busy is not None else catch_up())
        except (AppendLogError, LineageDiverged, MemoryBusy) as exc:
            raise CatchUpFailed(f"nothing changed: cannot catch up its append log: {exc}") from None

    # --- appends, in two steps -------------------------------------------------------------------

    async def prepare_append(self, variant: str, batch: AppendBatch) -> PreparedAppend:
        """Check ``batch`` against the variant's memory and encode its texts, chunk by chunk on
        the variant's encode thread between requests (a long append never holds up a request for
        more than a chunk), without the changes' lock: a long append never holds up a reload.
        Raises :class:`VariantUnavailable`, :class:`~engine.memory.AppendRefused`."""
        slot = self._variants[variant]
        predictor = slot.predictor
        if predictor is None:
            raise VariantUnavailable(f"variant {variant} has no bundle loaded")
        vectors = await anyio.to_thread.run_sync(
            predictor.prepare_append, batch, slot.batcher.run_when_idle_from_thread
        )
        return PreparedAppend(variant, predictor, batch, vectors)

    async def commit_append(self, prepared: PreparedAppend) -> AppendOutcome:
        """Log (fsync) and apply a prepared append; the next request sees all of it, never a part.
        Raises :class:`BundleChanged` (the variant swapped bundles since), the memory's
        :class:`~engine.memory.AppendRefused`, :class:`~engine.append_log.AppendLogHeld`,
        :class:`~engine.append_log.AppendLogError`, :class:`LineageDiverged`, :class:`MemoryBusy`."""
        async with self._changes:
            if self._variants[prepared.variant].predictor is not prepared.predictor:
                raise BundleChanged(f"variant {prepared.variant} changed bundles during the append: nothing appended")
            return await anyio.to_thread.run_sync(prepared.predictor.memory.commit, prepared.batch, prepared.vectors)
