"""What the worker processes of one server share (``XMCSERVE_WORKERS`` > 1): one A/B state, one
order of appends, one ``/metrics`` view.

Every worker is a whole server (its own engine, batchers and event loop) on the one listening
socket; the kernel deals connections among them. What must not differ between them lives in the
group's run directory (``XMCSERVE_RUN_DIR``), which the supervisor creates empty at start:

- ``admin.log``: the admin changes (reload, promote, rollback, config) in the order they were
  made, one JSON line each, written and fsync'ed by the worker that made the change, after it
  made it. Every other worker applies the lines it has not applied yet, in order, with the same
  code (:meth:`WorkerGroup.follow`, every :data:`FOLLOW_INTERVAL_S`, and first thing in any admin
  call), so the workers go through the same states. A worker that starts later (one the
  supervisor restarted after a crash) does not repeat the log change by change: it folds it into
  the state it leaves (:class:`Routing`: which bundle A, B and A's previous serve, the split, the
  shadow share) and loads only those bundles before it serves, so a restart costs the live
  bundles' loads however long the log, and needs no bundle the group no longer serves (one an
  operator has deleted). A line's position is its generation.
- ``admin.lock``: one admin change at a time across the group (an exclusive ``flock``: a worker
  applies what the others logged, makes its change and logs it under it), appends included, so an
  append lands in the bundle that serves its variant in the group's order.
- ``acks/<pid>``: the generation each worker has applied. An admin call answers once every live
  worker has applied its change (or after :data:`CONVERGE_S`, saying which have not), so a request
  sent after the answer finds the change on whichever worker takes it.
- ``failures/<pid>``: the change a worker could not apply (its generation, op and reason). Such a
  worker no longer serves the group's state: it says so here and in its log, the admin call that
  made the change reports it in its answer (``workers.failed``), the worker refuses admin calls
  (503) and stops, and the supervisor starts one that loads the state the log leaves.
- ``vetted/<key>``: a bundle one worker has vetted in the memory-capped child (its path and
  manifest bytes, which name every file's checksum): the others load those very files without a
  child of their own, so a group's start costs one vet per bundle, not one per worker
  (:meth:`WorkerGroup.vet_once`).
- ``claims/<key>``: an event the group counts once though every worker sees it (the appends a
  start-up replay skipped, which each worker starting on that bundle replays alike): the worker
  that creates the file counts it (:meth:`WorkerGroup.claim`).
- ``metrics/``: prometheus-client's multiprocess files (``PROMETHEUS_MULTIPROC_DIR``): counters
  and histograms are summed over the workers, the gauges of live workers too.

A line torn by a worker killed while writing it (no newline) is cut off by the next worker that
logs a change (it holds the turn: nobody else is writing); a complete line that is not a change is
skipped with a log line. Either way it is counted as a generation by every worker alike.

Appends need nothing here: the lineage's append log is written in turns
(:func:`engine.append_log.share_writes`) and read by every worker before each batch,
under the log's shared lock (a bounded wait, then the batch answers 503).
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import anyio

from bundle import BundleError, XmcserveError
from service.rollout import PRIMARY

log = logging.getLogger("xmcserve.group")

RUN_DIR_ENV = "XMCSERVE_RUN_DIR"
WORKERS_ENV = "XMCSERVE_WORKERS"
# how often a worker looks for admin changes another made (one stat when there are none)
FOLLOW_INTERVAL_S = 0.1
# how long an admin call waits for the other workers to apply its change (a reload loads a bundle)
CONVERGE_S = 120.0
# how long an admin call waits for the group's turn (another worker's reload may hold it)
TURN_WAIT_S = 300.0
POLL_S = 0.01
# how long a worker that cannot start waits before it exits: uvicorn's supervisor restarts a dead
# worker at once, and one that cannot load the group's A would otherwise do so in a busy loop
START_RETRY_S = 5.0


class GroupError(XmcserveError, RuntimeError):
    """The group's shared state cannot be read or written."""


@dataclass(frozen=True)
class Convergence:
    """How many workers had applied an admin change when its call answered, and those that could
    not (``failed``: each one's pid, the generation it failed at, the op and its reason)."""

    generation: int
    applied: int
    workers: int
    failed: tuple[dict, ...] = ()

    def describe(self) -> dict:
        out = {"generation": self.generation, "applied": self.applied, "workers": self.workers}
        return out | ({"failed": list(self.failed)} if self.failed else {})


@dataclass(frozen=True)
class Routing:
    """Where the bundles that A, B and A's previous (the rollback target) serve were loaded from,
    the share of traffic on B and the shadow share (None: the settings' own): the state a run of
    admin changes leaves, as the engine's variants (:mod:`engine.variants`) make them. Only changes
    that were made are logged, so every one applies (a promote has a B, a rollback a previous)."""

    primary: str
    candidate: str | None = None
    previous: str | None = None
    split_b: float = 0.0
    shadow_fraction: float | None = None

    def after(self, change: dict) -> Routing:
        op = change.get("op")
        if op == "reload" and change["variant"] == PRIMARY:  # the A it replaces becomes the previous
            return replace(self, primary=change["path"], previous=self.primary)
        if op == "reload":
            return replace(self, candidate=change["path"])
        if op == "promote":  # B becomes A, B empties, all traffic on A
            if self.candidate is None:
                raise GroupError("the admin log promotes with no B loaded")
            return replace(self, primary=self.candidate, previous=self.primary, candidate=None, split_b=0.0)
        if op == "rollback":  # a second rollback undoes the first
            if self.previous is None:
                raise GroupError("the admin log rolls back with no previous A")
            return replace(self, primary=self.previous, previous=self.primary)
        if op == "config":
            split_b = change.get("split_b")
            shadow = change.get("shadow_fraction")
            return replace(
                self,
                split_b=self.split_b if split_b is None else split_b,
                shadow_fraction=self.shadow_fraction if shadow is None else shadow,
            )
        raise GroupError(f"unknown admin change {op!r}")

    def replay(self, changes: list[dict]) -> Routing:
        routing = self
        for change in changes:
            routing = routing.after(change)
        return routing


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def of_live_workers(directory: Path, read: Callable[[str], object]) -> dict:
    """``read`` of each live worker's file in ``directory`` (``<pid>``), by pid; the files of dead
    workers are removed, and one mid-write or unreadable is left out."""
    out = {}
    for file in directory.glob("[0-9]*"):
        pid = int(file.name)
        if not alive(pid):
            file.unlink(missing_ok=True)
            continue
        try:
            out[pid] = read(file.read_text())
        except (FileNotFoundError, ValueError):
            continue
    return out


class WorkerGroup:
    """This worker's view of its group's run directory (see the module docstring)."""

    def __init__(self, run_dir: Path, workers: int, pid: int | None = None):
        self.run_dir = Path(run_dir)
        self.workers = workers
        self.pid = pid or os.getpid()
        self.log_path = self.run_dir / "admin.log"
        self.lock_path = self.run_dir / "admin.lock"
        self.acks_dir = self.run_dir / "acks"
        self.failures_dir = self.run_dir / "failures"
        self.metrics_dir = self.run_dir / "metrics"
        self.vetted_dir = self.run_dir / "vetted"
        self.claims_dir = self.run_dir / "claims"
        self.applied = 0  # admin log lines this worker has applied
        self._read_offset = 0  # where the first line it has not applied starts
        # the change this worker could not apply (generation, op, reason): it stops following
        self.failed: dict | None = None

    @classmethod
    def from_environment(cls) -> WorkerGroup | None:
        """The group the supervisor started this process in; None for a server of one process."""
        run_dir, workers = os.environ.get(RUN_DIR_ENV), int(os.environ.get(WORKERS_ENV, "1") or 1)
        if workers <= 1 or not run_dir:
            return None
        return cls(Path(run_dir), workers)

    @staticmethod
    def prepare(run_dir: Path) -> None:
        """The supervisor's start: an empty run directory (a new server starts from its settings,
        as one process does)."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        for name in ("admin.log", "admin.lock"):
            (run_dir / name).unlink(missing_ok=True)
        for sub in ("acks", "failures", "metrics", "vetted", "claims"):
            directory = run_dir / sub
            directory.mkdir(exist_ok=True)
            for file in directory.iterdir():
                file.unlink()

    def claim(self, event: str) -> bool:
        """True for the first worker of the group to claim ``event`` (any string naming it), False
        for every later one: what the group counts once though each worker sees it."""
        self.claims_dir.mkdir(exist_ok=True)
        try:
            os.close(os.open(self.claims_dir / hashlib.sha256(event.encode()).hexdigest(), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return False
        return True

    def vet_once(self, bundle_dir: Path, vet: Callable[[], None]) -> bool:
        """Run ``vet`` (the memory-capped child's load of ``bundle_dir``) unless a worker of this
        group already vetted these very files; True when it ran here. The key is the bundle's path
        and its manifest's bytes, which hold every file's checksum: a load that verifies them
        reads what was vetted, so a worker starting beside the others (or replacing one) waits on
        the one vetting instead of starting a child of its own. A refusal is kept too: the others
        are refused at once with its reason, not one after another (a vet that times out takes
        minutes). Raises the vet's :class:`~bundle.BundleError`."""
        bundle_dir = Path(bundle_dir).resolve()
        try:
            manifest = (bundle_dir / "manifest.json").read_bytes()
        except OSError:
            vet()  # refused there, with the loader's own message
            return True
        key = hashlib.sha256(str(bundle_dir).encode() + b"\0" + manifest).hexdigest()
        mark = self.vetted_dir / key
        self.vetted_dir.mkdir(exist_ok=True)
        with open(self.vetted_dir / f"{key}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one vet at a time per bundle: the others wait for its mark
            if mark.exists():
                return False
            refusal = self.vetted_dir / f"{key}.refused"
            if refusal.exists():
                raise BundleError(f"refused by another worker's vet: {refusal.read_text()}")
            try:
                vet()
            except BundleError as exc:
                refusal.write_text(str(exc))
                raise
            mark.touch()
            return True

    # admin log

    def lines_after(self) -> list[tuple[int, dict | None]]:
        """The complete lines past what this worker applied, oldest first, each as (its length,
        the change; None for a line that is not one); a line being written, without its newline
        yet, is left for later."""
        try:
            with open(self.log_path, "rb") as file:
                file.seek(self._read_offset)
                data = file.read()
        except FileNotFoundError:
            return []
        out = []
        for line in data[: data.rfind(b"\n") + 1].splitlines(keepends=True):
            try:
                change = json.loads(line)
            except ValueError:
                change = None
            out.append((len(line), change if isinstance(change, dict) else None))
        return out

    def changes_after(self) -> list[dict]:
        """The changes of :meth:`lines_after`."""
        return [change for _, change in self.lines_after() if change is not None]

    def _skipped(self, length: int) -> None:
        """A complete line that is not a change (torn, then followed by another): counted as a
        generation, as every worker counts it, and said."""
        log.warning(
            "worker %d: skipping admin log line %d (byte %d): not an admin change (a worker killed while writing it)",
            self.pid,
            self.applied + 1,
            self._read_offset,
            extra={"event": "group_line_skipped", "generation": self.applied + 1},
        )
        self._advance(length)

    def grown(self) -> bool:
        try:
            return self.log_path.stat().st_size > self._read_offset
        except FileNotFoundError:
            return False

    def take_log(self) -> list[dict]:
        """Every change logged so far, counted as applied: a starting worker that builds the
        state they leave (:class:`Routing`) instead of making them one by one."""
        changes = []
        for length, change in self.lines_after():
            if change is None:
                self._skipped(length)
                continue
            changes.append(change)
            self._advance(length)
        return changes

    def _advance(self, length: int) -> None:
        self._read_offset += length
        self.applied += 1

    def record(self, change: dict) -> int:
        """Log a change this worker made (it holds the turn and has applied every earlier one);
        returns its generation."""
        line = encoded(change)
        if self.failed is not None:
            raise GroupError(
                f"worker {self.pid} could not apply admin change {self.failed['generation']}: it logs none"
            )
        fd = os.open(self.log_path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            if (size := os.fstat(fd).st_size) != self._read_offset:
                self._cut_torn_tail(fd, size)
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        self._read_offset += len(line)
        self.applied += 1
        return self.applied

    def _cut_torn_tail(self, fd: int, size: int) -> None:
        """The log is longer than what this worker applied: changes it has not applied (refused:
        its change would jump the order) or, with no newline past that point, a line torn by a
        worker killed while writing it. This worker holds the turn, so nobody is writing it: it
        is cut off (no worker has read it: a line counts only once whole)."""
        tail = os.pread(fd, size - self._read_offset, self._read_offset) if size > self._read_offset else b"\n"
        if b"\n" in tail:
            raise GroupError(f"{self.log_path} holds changes this worker has not applied")
        log.warning(
            "worker %d: cutting %d bytes of a torn admin change off %s (a worker killed while writing it)",
            self.pid,
            len(tail),
            self.log_path,
            extra={"event": "group_line_cut", "bytes": len(tail)},
        )
        os.ftruncate(fd, self._read_offset)
        os.fsync(fd)

    # acknowledgements

    def acknowledge(self) -> None:
        """Publish the generation this worker has applied (written whole: a rename)."""
        self.acks_dir.mkdir(exist_ok=True)
        temporary = self.acks_dir / f".{self.pid}.tmp"
        temporary.write_text(str(self.applied))
        os.replace(temporary, self.acks_dir / str(self.pid))

    def withdraw(self) -> None:
        (self.acks_dir / str(self.pid)).unlink(missing_ok=True)

    def report_failure(self, generation: int, change: dict, reason: str) -> None:
        """Say that this worker could not apply change ``generation`` (written whole: a rename),
        for the admin call that made it to report."""
        self.failed = {"pid": self.pid, "generation": generation, "op": change.get("op"), "reason": reason}
        self.failures_dir.mkdir(exist_ok=True)
        temporary = self.failures_dir / f".{self.pid}.tmp"
        temporary.write_text(json.dumps(self.failed))
        os.replace(temporary, self.failures_dir / str(self.pid))

    def failures(self) -> dict[int, dict]:
        """The failures of the live workers (those of dead ones are removed)."""
        return of_live_workers(self.failures_dir, json.loads)

    def acknowledged(self) -> dict[int, int]:
        """Each live worker's applied generation (the files of dead ones are removed)."""
        return of_live_workers(self.acks_dir, lambda text: int(text or 0))

    async def converged(self, generation: int, timeout_s: float = CONVERGE_S, clock=time.monotonic) -> Convergence:
        """Wait until every live worker has applied ``generation`` or failed to apply a change up
        to it (at most ``timeout_s``)."""
        deadline = clock() + timeout_s
        while True:
            acks, failures = self.acknowledged(), self.failures()
            failed = tuple(f for pid, f in failures.items() if pid in acks and f["generation"] <= generation)
            failed_pids = {f["pid"] for f in failed}
            applied = sum(1 for pid, g in acks.items() if g >= generation and pid not in failed_pids)
            if applied + len(failed) >= len(acks) or clock() >= deadline:
                return Convergence(generation, applied, len(acks), failed)
            await asyncio.sleep(POLL_S)

    # the turn

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """The group's one admin change at a time: an exclusive lock on ``admin.lock``, waited for
        off the event loop (:data:`TURN_WAIT_S` at most)."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            deadline = time.monotonic() + TURN_WAIT_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise GroupError("another worker's admin change is taking too long") from None
                    await anyio.sleep(POLL_S)
            yield
        finally:
            os.close(fd)  # releases the lock

    async def follow(self, apply: Callable[[dict], Awaitable[None]]) -> int:
        """Apply, in order, the changes the other workers logged since this one last looked, then
        publish how far it got; returns how many. A change that fails here is not raised into
        whatever call is following (it is not that call's): it is logged, reported for the admin
        call that made it (:meth:`report_failure`), and this worker stops following (:attr:`failed`:
        it no longer holds the group's state, and is to be replaced)."""
        if self.failed is not None or not self.grown():
            return 0
        done = 0
        for length, change in self.lines_after():
            if change is None:
                self._skipped(length)
                continue
            try:
                await apply(change)
            except Exception as exc:
                generation = self.applied + 1
                reason = getattr(exc, "detail", None) or f"{type(exc).__name__}: {exc}"
                log.error(
                    "worker %d could not apply admin change %d (%s): %s",
                    self.pid,
                    generation,
                    change.get("op"),
                    reason,
                    exc_info=not hasattr(exc, "detail"),
                    extra={"event": "group_change_failed", "generation": generation, "change": change},
                )
                self.report_failure(generation, change, str(reason))
                self._advance(length)
                break
            self._advance(length)
            done += 1
        self.acknowledge()
        return done


def encoded(change: dict) -> bytes:
    return json.dumps(change, sort_keys=True, separators=(",", ":")).encode() + b"\n"
