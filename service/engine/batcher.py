"""Micro-batching: concurrent /predict requests share one tokenizer call, one ONNX call per
length-sorted chunk and one batched HNSW query.

Requests wait in a bounded FIFO. A worker takes the oldest request, adds every queued request
that still fits in ``max_batch_size`` texts (waiting up to ``max_wait_ms`` for more when the
batch is not full), runs the batch on a dedicated thread, and resolves each request's future.
While a batch runs, the next one accumulates, so batches grow with load by themselves and an
idle server answers a lone request without waiting. A full queue refuses at once
(:class:`QueueFullError` → HTTP 429) instead of letting latency grow without bound.

Background work on the same model (encoding an append to the live memory) is a second, lower
priority class, as in Triton's priority levels: it runs on the batch thread only when no request
is queued, so it takes the cores in turn with requests instead of beside them.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from service.engine.memory import MemoryView
from service.engine.search import Prediction, Predictor, Ranking, StageTimes


class QueueFullError(RuntimeError):
    """The request queue is at its bound; the caller should retry after ``retry_after_s``."""

    def __init__(self, depth: int, retry_after_s: int):
        super().__init__(f"request queue full ({depth} waiting); retry after {retry_after_s}s")
        self.retry_after_s = retry_after_s


class BatcherStoppedError(RuntimeError):
    """The batcher was stopped (shutdown) before the request ran."""


class DeadlineExceededError(RuntimeError):
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
        workers: batches run in parallel (each on its own thread).
    """

    max_batch_size: int = 32
    max_wait_ms: float = 0.0
    max_queue: int = 128
    workers: int = 1


@dataclass
class BatchAnswer:
    """One request's share of a batch; ``ef`` is what the batch's search ran at (at least the
    request's own)."""

    rankings: list[Ranking]
    times: StageTimes
    queue_wait_s: float
    batch_texts: int
    predictor: Predictor
    ef: int
    view: MemoryView  # the memory the ids refer to: ``view.label_uids[id]``


@dataclass(eq=False)  # identity hashing: jobs live in a set while they run
class _Job:
    texts: list[str]
    k: int
    ef: int | None
    exclude: list[Collection[str]]
    future: asyncio.Future
    enqueued: float


@dataclass(eq=False)
class _Background:
    work: Callable[[], Any]
    future: asyncio.Future
    queued: float


# Background work waits for an idle moment at most this long, then runs before the next batch:
# under a load that never leaves the queue empty it still advances (a piece per this interval).
BACKGROUND_MAX_WAIT_S = 0.5


class MicroBatcher:
    """Batches requests for the predictor returned by ``predictor_source`` (read per batch, so a
    swapped-in bundle takes the next batch while the running one finishes on the old).

    A request leaves the queue unrun, and ``on_drop(reason)`` is called, when its caller stops
    waiting (the awaiting task is cancelled, e.g. the HTTP client went away: ``"client_gone"``)
    or when it is still queued at its deadline (``"deadline"``, :class:`DeadlineExceededError`).
    A request already computing is answered however late: its batch is paid for."""

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
        self._jobs: deque[_Job] = deque()
        self._background: deque[_Background] = deque()
        self._arrived = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=self.config.workers, thread_name_prefix="xmcserve-batch")
        self._workers: list[asyncio.Task] = []
        self._running: set[_Job] = set()
        self._background_running: set[_Background] = set()
        self.in_flight_batches = 0
        self._seconds_per_text = 0.0  # moving average of the compute time per text of recent batches

    @property
    def depth(self) -> int:
        return len(self._jobs)

    def start(self) -> None:
        self._workers = [asyncio.create_task(self._work(), name=f"batcher-{i}") for i in range(self.config.workers)]

    async def stop(self) -> None:
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        for job in [*self._running, *self._jobs, *self._background, *self._background_running]:
            if not job.future.done():
                job.future.set_exception(BatcherStoppedError("service shutting down"))
        self._jobs.clear()
        self._background.clear()
        self._running.clear()
        # Without waiting: a batch still on its thread finishes there, unobserved.
        self._executor.shutdown(wait=False)

    async def submit(
        self,
        texts: list[str],
        k: int,
        ef: int | None,
        exclude: list[Collection[str]],
        timeout_s: float | None = None,
    ) -> BatchAnswer:
        """Queue one request; ``exclude`` holds label *uids* per text, mapped to ids by the bundle
        that runs the batch (a reload may swap bundles between submit and run). ``timeout_s``:
        how long it may wait to start (None: as long as it takes)."""
        if len(self._jobs) >= self.config.max_queue:
            raise QueueFullError(len(self._jobs), retry_after_s=1)
        if timeout_s is not None and self.expected_wait_s() > timeout_s:
            # refused now, in microseconds, rather than after waiting out the deadline
            self._on_drop("deadline")
            raise DeadlineExceededError(0.0)
        job = _Job(texts, k, ef, exclude, asyncio.get_running_loop().create_future(), time.perf_counter())
        self._jobs.append(job)
        self._arrived.set()
        try:
            if timeout_s is not None:
                await asyncio.wait({job.future}, timeout=timeout_s)
                if not job.future.done() and self._withdraw(job, "deadline"):
                    raise DeadlineExceededError(time.perf_counter() - job.enqueued)
            return await job.future
        except asyncio.CancelledError:
            self._withdraw(job, "client_gone")
            raise

    async def run_when_idle(self, work: Callable[[], Any]) -> Any:
        """``work()``'s result, run on the batch thread when no request is queued (or once it has
        waited :data:`BACKGROUND_MAX_WAIT_S`): a request waits at most for one piece of such work.
        Keep each piece short (a few texts)."""
        job = _Background(work, asyncio.get_running_loop().create_future(), time.perf_counter())
        self._background.append(job)
        self._arrived.set()
        try:
            return await job.future
        except asyncio.CancelledError:
            if job in self._background:
                self._background.remove(job)
            raise

    def expected_wait_s(self) -> float:
        """How long a request queued now would wait to start: the texts ahead of it (queued and
        computing) at the recent compute time per text, spread over the workers."""
        ahead = sum(len(job.texts) for job in self._jobs) + sum(len(job.texts) for job in self._running)
        return ahead * self._seconds_per_text / self.config.workers

    def _withdraw(self, job: _Job, reason: str) -> bool:
        """Take a job that has not started out of the queue; False when it already runs."""
        try:
            self._jobs.remove(job)
        except ValueError:
            return False
        job.future.cancel()
        self._on_drop(reason)
        return True

    async def _wait_for_work(self) -> None:
        while not self._jobs and not self._background:
            self._arrived.clear()
            await self._arrived.wait()

    def _background_overdue(self) -> bool:
        return bool(self._background) and time.perf_counter() - self._background[0].queued > BACKGROUND_MAX_WAIT_S

    async def _run_background(self, loop: asyncio.AbstractEventLoop) -> None:
        job = self._background.popleft()
        if job.future.done():
            return
        self._background_running.add(job)
        try:
            result, error = await loop.run_in_executor(self._executor, job.work), None
        except Exception as exc:
            result, error = None, exc
        finally:
            self._background_running.discard(job)
        if job.future.done():  # its caller stopped waiting
            return
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    async def _next_batch(self) -> list[_Job]:
        batch = [self._jobs.popleft()]
        size = len(batch[0].texts)
        deadline = time.perf_counter() + self.config.max_wait_ms / 1000
        while size < self.config.max_batch_size:
            if self._jobs:
                if size + len(self._jobs[0].texts) > self.config.max_batch_size:
                    break
                job = self._jobs.popleft()
                batch.append(job)
                size += len(job.texts)
                continue
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except asyncio.TimeoutError:
                break
        # Requests whose client went away are not worth computing.
        return [job for job in batch if not job.future.done()]

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wait_for_work()
            if not self._jobs or self._background_overdue():
                await self._run_background(loop)
                continue
            batch = await self._next_batch()
            if not batch:
                continue
            started = time.perf_counter()
            predictor = self._predictor_source()
            self.in_flight_batches += 1
            self._running.update(batch)
            try:
                answers = await loop.run_in_executor(self._executor, _run_batch, predictor, batch, started)
            except Exception as exc:  # the model failed: every request of the batch gets the error
                answers = [exc] * len(batch)
            finally:
                self.in_flight_batches -= 1
            # Reached only when not cancelled: on shutdown, stop() fails the jobs still in _running.
            self._running.difference_update(batch)
            texts = sum(len(job.texts) for job in batch)
            per_text = (time.perf_counter() - started) / texts
            self._seconds_per_text += 0.2 * (per_text - self._seconds_per_text) if self._seconds_per_text else per_text
            if not isinstance(answers[0], Exception):
                self._on_batch_done(answers[0].batch_texts, answers[0].times)
            for job, answer in zip(batch, answers, strict=True):
                if job.future.done():
                    continue
                if isinstance(answer, Exception):
                    job.future.set_exception(answer)
                else:
                    job.future.set_result(answer)


def predict_jobs(predictor: Predictor, jobs: Sequence[_Job]) -> tuple[list[list[Ranking]], Prediction, int]:
    """Several requests as one prediction: their rankings (one list per job), the prediction
    (stage times, the ef it ran at) and the batch's text count."""
    texts = [t for job in jobs for t in job.texts]
    ks = [job.k for job in jobs for _ in job.texts]
    # Uids map to ids of the memory the batch searches (a live memory grows between batches).
    # A request's flat exclude list is one object shared by all its texts: mapped once.
    view = predictor.view
    mapped: dict[int, set[int]] = {}
    exclude = [
        mapped[id(e)] if id(e) in mapped else mapped.setdefault(id(e), view.label_ids(e))
        for job in jobs
        for e in job.exclude
    ]
    # One HNSW call for the batch at the widest ef any request is owed (its own, or the bundle's
    # default when it gave none): a wider search only adds recall, a narrower one would take
    # recall from requests that did not ask for it.
    ef = max(job.ef or predictor.default_ef for job in jobs)
    prediction = predictor.predict(texts, ks, ef, exclude, view)
    per_job, offset = [], 0
    for job in jobs:
        per_job.append(prediction.rankings[offset : offset + len(job.texts)])
        offset += len(job.texts)
    return per_job, prediction, len(texts)


def _run_batch(predictor: Predictor, batch: list[_Job], started: float) -> list[BatchAnswer]:
    per_job, prediction, batch_texts = predict_jobs(predictor, batch)
    return [
        BatchAnswer(
            rankings=rankings,
            times=prediction.times,
            queue_wait_s=started - job.enqueued,
            batch_texts=batch_texts,
            predictor=predictor,
            ef=prediction.ef,
            view=prediction.view,
        )
        for job, rankings in zip(batch, per_job, strict=True)
    ]
