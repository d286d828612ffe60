"""Micro-batching in two overlapped stages: concurrent /predict requests share one tokenizer call,
the encoder's session calls (one a text on the CPU, one per length-sorted chunk on CUDA:
:mod:`engine.encoder`) and one batched index search, and the encoder never waits for the
search of the batch before.

Requests wait in a bounded FIFO. An **encode** thread takes the oldest request and every queued
request that still fits in ``max_batch_size`` texts (waiting up to ``max_wait_ms`` for more when
the batch is not full), tokenizes and encodes them, and hands the vectors over a bounded queue of
:data:`HANDOFF_BATCHES` batches to the **search** thread (HNSW, RAE aggregation, fusion), which
hands the answers back to the event loop. While the search thread works on batch n the encoder
already runs batch n + 1, as TEI's batching task prepares the next batch while the model runs.
When nothing waits (no request queued, no batch before the search thread) and another encode
thread is idle for the next request, the encode thread searches its batch itself: the overlap
would gain nothing, and an idle server's request is spared a thread hand-off.

The batch size adapts to the queue by itself: an idle server encodes a lone request at once
(batch of one, lowest latency); under load requests accumulate while the encoder is busy and
the next batch takes all of them, up to ``max_batch_size`` (highest throughput). When the search
falls behind, the hand-off queue fills, the encoder waits, and the request queue's bound turns
the excess away (:class:`QueueFullError` → HTTP 429) instead of letting latency grow without bound.

Background work on the same model (encoding an append to the live memory) is a second, lower
priority class, as in Triton's priority levels: it runs on the encode thread only when no request
is queued, so it takes the encoder in turn with requests instead of beside them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import heapq
import itertools
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

from bundle import XmcserveError
from engine.encoder import EncodeTimes
from engine.lexical import QueryTerms
from engine.memory import MemoryView
from engine.search import Predictor, Ranking, StageTimes, excluded_label_ids

log = logging.getLogger(__name__)


class QueueFullError(XmcserveError, RuntimeError):
    """The request queue is at its bound; the caller should retry after ``retry_after_s``."""

    def __init__(self, depth: int, retry_after_s: int):
        super().__init__(f"request queue full ({depth} waiting); retry after {retry_after_s}s")
        self.retry_after_s = retry_after_s


class BatcherStoppedError(XmcserveError, RuntimeError):
    """The batcher was stopped (shutdown) before the request was answered."""


class DeadlineExceededError(XmcserveError, RuntimeError):
    """The request could not start before its deadline; it was taken out of the queue unrun."""

    def __init__(self, waited_s: float, retry_after_s: int = 1):
        super().__init__(f"request could not start within its deadline ({waited_s * 1000:.0f} ms in the queue)")
        self.retry_after_s = retry_after_s


@dataclass
class BatcherConfig:
    """Micro-batching parameters (defaults measured with ``bench/serving.py``).

    Attributes:
        max_batch_size: most texts per batch; one request with more texts still runs, alone.
        max_wait_ms: how long a non-full batch waits for more requests; 0 = take what is queued.
        max_queue: most requests waiting; beyond it requests are refused with 429.
        workers: batches encoded in parallel, each on an encode thread of its own (one search
            thread serves them all).
    """

    max_batch_size: int = 32
    max_wait_ms: float = 0.0
    max_queue: int = 128
    workers: int = 1


@dataclass
class BatchTimeline:
    """When one batch crossed each boundary between its stages (``time.perf_counter()`` readings,
    each taken once, by the thread that crossed it): a trace lays the stages end to end from
    these, so no wait between them (a full hand-off, a busy event loop) goes unaccounted for."""

    number: int  # the batch's sequence number in its batcher: requests with the same one shared it
    requests: int
    started: float  # taken from the queue by an encode thread
    encoded: float = 0.0  # its vectors ready
    searching: float = 0.0  # taken by the search thread
    searched: float = 0.0  # its rankings ready


@dataclass
class BatchAnswer:
    """One request's share of a batch; ``ef`` is what the batch's search ran at (at least the
    request's own)."""

    rankings: list[Ranking]
    times: StageTimes
    queue_wait_s: float
    timeline: BatchTimeline  # shared by the batch's answers
    batch_texts: int
    predictor: Predictor
    ef: int
    view: MemoryView  # the memory the ids refer to: ``view.label_uids[id]``


@dataclass(eq=False)  # identity hashing: jobs live in a set while they run
class _Job:
    texts: list[str]
    k: int
    ef: int | None
    exclude: Collection[str] | list[Collection[str]]
    future: asyncio.Future
    enqueued: float
    taken: bool = False  # by an encode thread: from then on it is answered, however late

    def settled(self) -> bool:
        """Out of the queue: taken by an encode thread, or withdrawn (its future done)."""
        return self.taken or self.future.done()


@dataclass(eq=False)
class _Background:
    work: Callable[[], Any]
    future: asyncio.Future | concurrent.futures.Future  # the loop's, or a waiting thread's
    queued: float


@dataclass
class _Encoded:
    """A batch between the stages: its jobs, the predictor that encoded it, its vectors and (a
    lexical score fusion) its term vectors."""

    jobs: list[_Job]
    predictor: Predictor
    vectors: np.ndarray
    terms: list[QueryTerms] | None
    times: EncodeTimes
    timeline: BatchTimeline


# Background work waits for an idle moment at most this long, then runs before the next batch:
# under a load that never leaves the queue empty it still advances (a piece per this interval).
BACKGROUND_MAX_WAIT_S = 0.5
# Encoded batches waiting for the search thread: one computing plus one ready keeps the search
# busy while the encoder runs ahead; more would only queue latency the request queue bounds.
HANDOFF_BATCHES = 2
# How often a thread blocked on a full hand-off looks whether the batcher is stopping.
STOP_POLL_S = 0.1
# How early a loop timer may fire (uvloop's clock counts milliseconds): a queued request whose
# deadline is this close when the deadline timer fires is refused then, as its own timer did.
DEADLINE_RESOLUTION_S = 0.001


class MicroBatcher:
    """Batches requests for the predictor returned by ``predictor_source`` (read per batch, so a
    swapped-in bundle takes the next batch while the running one finishes on the old).

    A request leaves the queue unrun, and ``on_drop(reason)`` is called, when its caller stops
    waiting (the awaiting task is cancelled, e.g. the HTTP client went away: ``"client_gone"``)
    or when it is still queued at its deadline (``"deadline"``, :class:`DeadlineExceededError`).
    A request already computing is answered however late: its batch is paid for.

    ``on_batch_done(texts, times)`` gets each answered batch's size and stage times, on the thread
    that searched the batch (before its answers reach the loop: the loop does nothing per batch
    but hand the answers over), so it must be thread-safe (Prometheus metrics are).
    Call :meth:`start` and :meth:`submit` from one event loop; answers and ``on_drop`` calls
    happen on that loop."""

    def __init__(
        self,
        predictor_source: Callable[[], Predictor],
        config: BatcherConfig | None = None,
        on_batch_done: Callable[[int, StageTimes], None] | None = None,
        on_drop: Callable[[str], None] | None = None,
    ):
        self.config = config or BatcherConfig()
        self._predictor_source = predictor_source
        self._on_batch_done = on_batch_done or (lambda texts, times: None)
        self._on_drop = on_drop or (lambda reason: None)
        self._lock = threading.Condition()  # guards everything below that both stages touch
        self._jobs: deque[_Job] = deque()
        self._background: deque[_Background] = deque()
        self._encoding: set[_Job] = set()  # taken by an encode thread
        self._texts_ahead = 0  # texts of the jobs queued or encoding (expected_wait_s)
        self._searching: set[_Job] = set()  # encoded, waiting for or in the search
        self._background_running: set[_Background] = set()
        self._handoff: queue.Queue[_Encoded | None] = queue.Queue(maxsize=HANDOFF_BATCHES)
        # The queued requests' deadlines (loop time, order, job): a heap behind one timer on the
        # loop, set for the earliest of them (loop-side only; jobs that left the queue are dropped
        # from its top as requests come and when the timer fires).
        self._deadlines: list[tuple[float, int, _Job]] = []
        self._deadline_order = itertools.count()
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._deadline_at = math.inf
        self._handed_off = 0  # batches given to the search thread and not yet searched
        self._idle_encoders = 0  # encode threads waiting for work
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.in_flight_batches = 0  # batches taken from the queue and not yet answered
        self._batches_taken = 0  # numbers the batches (BatchTimeline.number)
        self._seconds_per_text = 0.0  # moving average of the encode time per text of recent batches

    @property
    def depth(self) -> int:
        return len(self._jobs)

    def start(self) -> None:
        """Start the stage threads; answers go to the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._threads = [
            threading.Thread(target=self._encode_loop, name=f"xmcserve-encode-{i}", daemon=True)
            for i in range(self.config.workers)
        ]
        self._threads.append(threading.Thread(target=self._search_loop, name="xmcserve-search", daemon=True))
        for thread in self._threads:
            thread.start()

    async def stop(self) -> None:
        """Fail every request not yet answered with :class:`BatcherStoppedError` and let the stage
        threads end; a batch still computing finishes on its thread, unobserved."""
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        self._deadlines.clear()
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
            pending = [*self._jobs, *self._encoding, *self._searching, *self._background, *self._background_running]
            self._texts_ahead -= sum(len(job.texts) for job in self._jobs)  # encoding ones leave as they end
            self._jobs.clear()
            self._background.clear()
        with contextlib.suppress(queue.Full):  # wakes an idle search thread; a busy one sees _stopping
            self._handoff.put_nowait(None)
        for job in pending:
            if not job.future.done():
                job.future.set_exception(BatcherStoppedError("service shutting down"))

    async def submit(
        self,
        texts: list[str],
        k: int,
        ef: int | None,
        exclude: Collection[str] | list[Collection[str]],
        timeout_s: float | None = None,
    ) -> BatchAnswer:
        """Queue one request; ``exclude`` holds label *uids*, one collection for all texts or one
        per text (:func:`~engine.search.excluded_label_ids`), mapped to ids by the bundle
        that runs the batch (a reload may swap bundles between submit and run). ``timeout_s``:
        how long it may wait to start (None: as long as it takes). Nothing of the caller runs on
        the batcher's threads: the answer is data, made into a response by the front end."""
        if len(self._jobs) >= self.config.max_queue:
            raise QueueFullError(len(self._jobs), retry_after_s=1)
        if timeout_s is not None and self.expected_wait_s() > timeout_s:
            # refused now, in microseconds, rather than after waiting out the deadline
            self._on_drop("deadline")
            raise DeadlineExceededError(0.0)
        loop = asyncio.get_running_loop()
        job = _Job(texts, k, ef, exclude, loop.create_future(), time.perf_counter())
        with self._lock:
            if self._stopping:
                raise BatcherStoppedError("service shutting down")
            self._jobs.append(job)
            self._texts_ahead += len(texts)
            self._lock.notify()
        if timeout_s is not None:
            self._add_deadline(loop, job, loop.time() + timeout_s)
        try:
            return await job.future
        except asyncio.CancelledError:
            self._withdraw(job, "client_gone")
            raise

    async def run_when_idle(self, work: Callable[[], Any]) -> Any:
        """``work()``'s result, run on an encode thread when no request is queued (or once it has
        waited :data:`BACKGROUND_MAX_WAIT_S`): a request waits at most for one piece of such work.
        Keep each piece short (a few texts)."""
        job = _Background(work, asyncio.get_running_loop().create_future(), time.perf_counter())
        with self._lock:
            if self._stopping:
                raise BatcherStoppedError("service shutting down")
            self._background.append(job)
            self._lock.notify()
        try:
            return await job.future
        except asyncio.CancelledError:
            with self._lock:
                if job in self._background:
                    self._background.remove(job)
            raise

    def run_when_idle_from_thread(self, work: Callable[[], Any]) -> Any:
        """:meth:`run_when_idle` for a caller on another thread than the event loop (an append
        preparing its vectors chunk by chunk): it blocks that thread until ``work`` has run on an
        encode thread, and the loop takes no part in the hand-over."""
        job = _Background(work, concurrent.futures.Future(), time.perf_counter())
        with self._lock:
            if self._stopping:
                raise BatcherStoppedError("service shutting down")
            self._background.append(job)
            self._lock.notify()
        return job.future.result()

    def expected_wait_s(self) -> float:
        """How long a request queued now would wait to start: the texts ahead of it (queued and
        encoding) at the recent encode time per text, spread over the encode threads."""
        # a count kept as jobs come and go (read without the lock: asked twice a request)
        return self._texts_ahead * self._seconds_per_text / self.config.workers

    def _withdraw(self, job: _Job, reason: str, error: Exception | None = None) -> None:
        """Take a job that has not started out of the queue (nothing when it already runs): its
        future is cancelled, or fails with ``error``."""
        with self._lock:
            try:
                self._jobs.remove(job)
            except ValueError:
                return
            self._texts_ahead -= len(job.texts)
        if error is None:
            job.future.cancel()
        elif not job.future.done():
            job.future.set_exception(error)
        self._on_drop(reason)

    def _add_deadline(self, loop: asyncio.AbstractEventLoop, job: _Job, when: float) -> None:
        """The job's deadline behind the batcher's one timer (on the loop): a heap entry a request
        instead of a timer handle made and cancelled a request; the timer moves only for a deadline
        earlier than the one it is set for. The jobs that already left the queue are dropped from
        the heap's top first, so the heap holds no answer for long."""
        heap = self._deadlines
        while heap and heap[0][2].settled():
            heapq.heappop(heap)
        heapq.heappush(heap, (when, next(self._deadline_order), job))
        if when < self._deadline_at:
            if self._deadline_timer is not None:
                self._deadline_timer.cancel()
            self._deadline_at = when
            self._deadline_timer = loop.call_at(when, self._expire_due, loop)

    def _expire_due(self, loop: asyncio.AbstractEventLoop) -> None:
        """The deadline timer (on the loop): every job still queued at its deadline is refused
        (the others are left to finish), and the timer is set for the earliest deadline left."""
        self._deadline_timer, self._deadline_at = None, math.inf
        heap = self._deadlines
        due = loop.time() + DEADLINE_RESOLUTION_S  # a timer may fire this much before its time
        while heap and (heap[0][0] <= due or heap[0][2].settled()):
            _, _, job = heapq.heappop(heap)
            if not job.settled():
                self._withdraw(job, "deadline", DeadlineExceededError(time.perf_counter() - job.enqueued))
        if heap:
            self._deadline_at = heap[0][0]
            self._deadline_timer = loop.call_at(self._deadline_at, self._expire_due, loop)

    # --- encode stage (its own thread) ---------------------------------------------------------

    def _encode_loop(self) -> None:
        while (work := self._take()) is not None:
            if isinstance(work, _Background):
                self._run_background(work)
            else:
                self._encode(*work)

    def _take(self) -> tuple[list[_Job], BatchTimeline] | _Background | None:
        """The next piece of work for an encode thread: a batch (its timeline starting now, as its
        requests leave the queue), background work, or None (stop)."""
        with self._lock:
            self._idle_encoders += 1
            while not self._stopping and not self._jobs and not self._background:
                self._lock.wait()
            self._idle_encoders -= 1
            if self._stopping:
                return None
            if self._background and (not self._jobs or self._background_overdue()):
                job = self._background.popleft()
                self._background_running.add(job)
                return job
            batch = self._next_batch()
            if self._stopping:  # stop() has failed these jobs already
                return None
            self._encoding.update(batch)
            self.in_flight_batches += 1
            self._batches_taken += 1
            return batch, BatchTimeline(self._batches_taken, len(batch), time.perf_counter())

    def _background_overdue(self) -> bool:
        return time.perf_counter() - self._background[0].queued > BACKGROUND_MAX_WAIT_S

    def _next_batch(self) -> list[_Job]:
        """The oldest job and the queued ones that fit (called with the lock held; waiting for
        more releases it, so requests keep arriving)."""
        batch = [self._jobs.popleft()]
        batch[0].taken = True
        size = len(batch[0].texts)
        deadline = time.perf_counter() + self.config.max_wait_ms / 1000
        while size < self.config.max_batch_size and not self._stopping:
            if self._jobs:
                if size + len(self._jobs[0].texts) > self.config.max_batch_size:
                    break
                job = self._jobs.popleft()
                job.taken = True
                batch.append(job)
                size += len(job.texts)
                continue
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            self._lock.wait(remaining)
        return batch

    def _encode(self, batch: list[_Job], timeline: BatchTimeline) -> None:
        predictor = self._predictor_source()
        texts = [t for job in batch for t in job.texts]
        try:
            vectors, encode_times, terms = predictor.encode(texts)
        except Exception as exc:  # the model failed: every request of the batch gets the error
            with self._lock:
                self._encoding.difference_update(batch)
                self._texts_ahead -= len(texts)
            self._answer(batch, exc)
            return
        timeline.encoded = time.perf_counter()
        per_text = (timeline.encoded - timeline.started) / len(texts)
        with self._lock:
            self._seconds_per_text += 0.2 * (per_text - self._seconds_per_text) if self._seconds_per_text else per_text
            self._encoding.difference_update(batch)
            self._texts_ahead -= len(texts)
            self._searching.update(batch)
            # Nothing waits (no request queued, no batch before the search thread) and another
            # encode thread is idle for whatever arrives next: searching here saves the batch a
            # hand-off. Otherwise the search thread takes it, and this thread encodes on.
            inline = not self._jobs and self._handed_off == 0 and self._idle_encoders > 0
            if not inline:
                self._handed_off += 1
        encoded = _Encoded(batch, predictor, vectors, terms, encode_times, timeline)
        if inline:
            self._search(encoded)
            return
        while not self._stopping:
            try:
                self._handoff.put(encoded, timeout=STOP_POLL_S)
                return
            except queue.Full:
                continue

    def _run_background(self, job: _Background) -> None:
        try:
            result, error = job.work(), None
        except Exception as exc:
            result, error = None, exc
        with self._lock:
            self._background_running.discard(job)
        if isinstance(job.future, concurrent.futures.Future):  # a thread waits on it, not the loop
            _settle(job.future, result, error)
        else:
            self._call_on_loop(_settle, job.future, result, error)

    # --- search stage (its own thread) ---------------------------------------------------------

    def _search_loop(self) -> None:
        while (encoded := self._handoff.get()) is not None and not self._stopping:
            self._search(encoded)
            with self._lock:
                self._handed_off -= 1

    def _search(self, encoded: _Encoded) -> None:
        encoded.timeline.searching = time.perf_counter()
        try:
            answers: list[BatchAnswer] | Exception = _search_batch(encoded)
        except Exception as exc:
            answers = exc
        encoded.timeline.searched = time.perf_counter()
        if not isinstance(answers, Exception):
            try:
                self._on_batch_done(len(encoded.vectors), answers[0].times)
            except Exception:  # the batch's answers stand; the stage thread must not die of it
                log.exception("on_batch_done failed")
        self._answer(encoded.jobs, answers)

    # --- back on the event loop ----------------------------------------------------------------

    def _answer(self, batch: list[_Job], answers: list[BatchAnswer] | Exception) -> None:
        with self._lock:
            self._searching.difference_update(batch)
            self.in_flight_batches -= 1
        self._call_on_loop(self._resolve, batch, answers)

    def _call_on_loop(self, callback: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            self._loop.call_soon_threadsafe(callback, *args)

    def _resolve(self, batch: list[_Job], answers: list[BatchAnswer] | Exception) -> None:
        if isinstance(answers, Exception):
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(answers)
            return
        for job, answer in zip(batch, answers, strict=True):
            if not job.future.done():  # its caller may have stopped waiting
                job.future.set_result(answer)


def _settle(future: asyncio.Future | concurrent.futures.Future, result: Any, error: Exception | None) -> None:
    if future.done():  # its caller stopped waiting
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _search_batch(encoded: _Encoded) -> list[BatchAnswer]:
    """The search stage of one encoded batch: each request's rankings, each searched at its own
    ef (the bundle's default when it gave none), so that no answer depends on what it was batched
    with."""
    jobs, predictor = encoded.jobs, encoded.predictor
    # Uids map to ids of the memory the batch searches (a live memory grows between batches, by
    # this process's appends and, in a group of workers, the others').
    view = predictor.latest_view()
    exclude = [ids for job in jobs for ids in excluded_label_ids(view, job.exclude, len(job.texts))]
    ks = [job.k for job in jobs for _ in job.texts]
    efs = [job.ef or predictor.default_ef for job in jobs for _ in job.texts]
    texts = [text for job in jobs for text in job.texts]
    prediction = predictor.search(encoded.vectors, ks, efs, exclude, view, texts, encoded.terms)
    times = prediction.times
    times.add_encoding(encoded.times)
    answers, offset = [], 0
    for job in jobs:
        rankings = prediction.rankings[offset : offset + len(job.texts)]
        ef = max(prediction.efs[offset : offset + len(job.texts)])
        offset += len(job.texts)
        answers.append(
            BatchAnswer(
                rankings=rankings,
                times=times,
                queue_wait_s=encoded.timeline.started - job.enqueued,
                timeline=encoded.timeline,
                batch_texts=len(encoded.vectors),
                predictor=predictor,
                ef=ef,
                view=prediction.view,
            )
        )
    return answers
