"""The append log of a live memory (:mod:`engine.memory`) and its record codec.

One line per append, ``<sha256 of the payload> <json payload>``: the append's labels, instances,
idempotency key and its keys' vectors (base64 float32), so replay needs no encoder. A log is named
by the id of its lineage's first bundle (checked first: :func:`check_bundle_id`), so it is never
replayed onto another lineage and never lands outside its directory.

One log per lineage, one order: a bundle and every bundle compacted from it read and write the
same log (a compacted bundle from the offset its compaction folded to), so the n-th label appended
has the same id in all of them. One writer at a time, enforced by the OS: a process takes an
exclusive ``flock`` on the log at its first append and holds it for as long as it serves a bundle
of the lineage (:meth:`AppendLog.exclusive`); another process's append is refused meanwhile.
Before writing, a bundle applies the records it has not seen yet (another bundle of the lineage in
this process wrote them: :meth:`AppendLog.exclusive` yields them), so it always appends at the end
of the one order. Loading takes no lock and creates nothing: a bundle that never appends (a shadow,
a candidate) never touches the log's directory. Readers (compaction, inspection, catching up) read
the complete records up to a byte offset (:meth:`AppendLog.scan`), a consistent prefix whatever the
writer is doing, and never modify the file.

Several processes serving one lineage (``XMCSERVE_WORKERS``: :func:`share_writes`). Then no
process holds the lock while it serves: each append takes it for the append alone (an exclusive
``flock``, waited for :data:`LOCK_WAIT_S` at most), applies what the others logged, and writes at
the end of the one order; the others read what it wrote before their next search
(:meth:`AppendLog.grown`, :meth:`AppendLog.shared_reading`) under a shared ``flock``, so they never
read a record its writer may still take back; a search, a catch-up or a load that cannot have it
within :data:`READ_WAIT_S` is refused (:class:`~engine.memory.MemoryBusy`), never run
without those records. A process that holds a log in the default mode keeps
every other process's appends refused, as before.

Bounded reads. A log's tail can be large (a long run without compaction), and replay and catching
up read it in the serving process, under the admin lock, outside the vetting child's memory cap:
they read it :data:`READ_CHUNK_BYTES` at a time (:class:`LogScan`) and apply each record as it is
read, never holding the whole tail.

Where a log may be. A bundle of a lineage names its lineage's log relative to its own log
directory (``manifest.lineage.log``); :func:`lineage_log_path` accepts only a log in that
directory or in a ``<name>.appends`` directory beside it (a bundle's default log directory, for
a source in the same directory), so a crafted manifest cannot make an append create directories
or write a log anywhere else.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bundle import XmcserveError
from engine.memory import AppendBatch

log = logging.getLogger(__name__)

LOG_SUFFIX = ".appends.log"
# the default log directory of a bundle is ``<bundle dir><APPENDS_DIR_SUFFIX>`` (appends_dir_beside)
APPENDS_DIR_SUFFIX = ".appends"
# Bytes a reader takes from a log at a time. A record is read whole even when longer (one append
# is bounded by the server's append limits).
READ_CHUNK_BYTES = 1 << 20
# What a bundle id is (``<index kind>-<dim>d-<12 hex of the content hash>``): no separators, no
# dots, so a log file named from one stays in its directory.
BUNDLE_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,80}-[0-9a-f]{12}")


class AppendLogError(XmcserveError, RuntimeError):
    """The append log cannot be written or read; the memory is left as it was."""


class AppendLogHeld(AppendLogError):
    """Another process holds the log open for writing (one writer per lineage)."""


# How long an append waits for the log's lock when the processes of a group take it in turns (an
# append holds it for one fsync'ed write and its apply), and how often it looks.
LOCK_WAIT_S = 10.0
LOCK_POLL_S = 0.002
# How long a search, a catch-up or a load waits to read another process's records (their writer
# holds the lock for a write and an apply): past it nothing is read and the caller is refused
# (MemoryBusy: a /predict answers 503 with Retry-After) rather than answering without them.
READ_WAIT_S = 1.0

_shared_writes = False


def share_writes() -> None:
    """Make this process take each log's lock per append instead of holding it while it serves:
    the processes of one server (``XMCSERVE_WORKERS``) append to a lineage in turns, in one order.
    Called once, before any log is opened for writing."""
    global _shared_writes
    _shared_writes = True


def writes_shared() -> bool:
    return _shared_writes


def lock_within(fd: int, operation: int, seconds: float) -> bool:
    """``flock(fd, operation)``, retried without blocking for ``seconds`` at most."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(LOCK_POLL_S)


@dataclass(frozen=True)
class TailRecord:
    """A record past what a memory has applied: the append and its keys' vectors, and the byte
    offset its line ends at (the memory has applied the log up to there once it is applied)."""

    batch: AppendBatch
    vectors: np.ndarray
    end: int
    where: str


def check_bundle_id(bundle_id: str) -> str:
    """``bundle_id`` if it has a bundle id's form; raises :class:`AppendLogError` otherwise."""
    if not isinstance(bundle_id, str) or not BUNDLE_ID.fullmatch(bundle_id):
        raise AppendLogError(
            f"bundle id {bundle_id!r} is not of the form <kind>-<dim>d-<12 hex digits> "
            "(lowercase letters, digits, '-'): no append log is named from it"
        )
    return bundle_id


def lineage_log_path(appends_dir: Path, relative: str, bundle_id: str) -> Path:
    """The log a manifest's ``lineage`` names, ``relative`` to the bundle's log directory
    ``appends_dir``: the log of lineage ``bundle_id`` in that directory (a shared
    XMCSERVE_APPEND_LOG_DIR) or in a ``<name>.appends`` directory beside it (the default log
    directory of a bundle in the same directory, its lineage's first). Anywhere else is refused
    (:class:`AppendLogError`): the bundle's first append would create that directory and write there."""
    name = f"{check_bundle_id(bundle_id)}{LOG_SUFFIX}"
    if not isinstance(relative, str) or Path(relative).is_absolute() or Path(relative).name != name:
        raise AppendLogError(f"lineage log {relative!r}: not the relative path of the log {name}")
    base = Path(os.path.normpath(Path(appends_dir).absolute()))
    path = Path(os.path.normpath(base / relative))
    beside = path.parent.parent == base.parent and path.parent.name.endswith(APPENDS_DIR_SUFFIX)
    if path.parent != base and not beside:
        raise AppendLogError(
            f"lineage log {relative!r} is {path}: neither in the log directory {base} nor in a "
            f"<name>{APPENDS_DIR_SUFFIX} directory beside it; refused, nothing created (export the bundle "
            "beside its source, or give the export and the server one log directory: --appends-dir / "
            "XMCSERVE_APPEND_LOG_DIR)"
        )
    return path


@dataclass(frozen=True)
class LogRead:
    """What was read of a log up to its end: ``size``, the bytes its complete records fill (a
    prefix that never changes once written), and their ``sha256``; ``prefix_sha256``: the sha256
    of the bytes before the offset the read started at (None: the file is shorter). ``records``
    (oldest first) and the byte ``offsets`` they start at are kept by :meth:`AppendLog.read` only:
    a replay applies each record as it reads it and keeps none."""

    path: Path
    bundle_id: str
    size: int
    sha256: str
    prefix_sha256: str | None = None
    records: list[dict] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)


class LogScan:
    """The complete records of a log from byte ``start`` to the length it had when the scan
    began, read :data:`READ_CHUNK_BYTES` at a time: iterate it for ``(start, end, record)`` of each,
    oldest first. A torn last record (a crash while writing) is left out; a damaged one before the
    end refuses the log (:class:`AppendLogError`, raised when the scan reaches it).

    Once iterated through: ``end``, where the last complete record ends; ``length``, the bytes the
    file had from ``start`` (more than ``end``: a torn tail). With ``digest``, the first ``start``
    bytes are hashed first (``prefix_sha256``, None when the file is shorter; ``lines_before``, the
    records they hold), and ``sha256`` is then that of the first ``end`` bytes."""

    def __init__(self, log: AppendLog, start: int = 0, digest: bool = False):
        self.log, self.start, self.end, self.length = log, start, start, start
        self.lines_before = 0
        self._tail = b""  # what follows the last newline read: a record being written, or torn
        self.prefix_sha256: str | None = None
        self._hash = hashlib.sha256() if digest else None
        try:
            self._file = open(log.path, "rb")  # noqa: SIM115 (closed when the scan ends)
        except (FileNotFoundError, NotADirectoryError):  # nothing appended yet
            self._file = None
        except OSError as exc:
            raise AppendLogError(f"cannot read the append log {log.path}: {exc}") from exc
        size = os.fstat(self._file.fileno()).st_size if self._file is not None else 0
        self.length = max(size, start)
        if digest:
            self._hash_prefix(size)

    @property
    def sha256(self) -> str | None:
        return self._hash.hexdigest() if self._hash is not None else None

    def _hash_prefix(self, size: int) -> None:
        remaining = self.start if self.start <= size else 0
        while remaining:
            block = self._file.read(min(READ_CHUNK_BYTES, remaining))
            self._hash.update(block)
            self.lines_before += block.count(b"\n")
            remaining -= len(block)
        if self.start <= size:
            self.prefix_sha256 = self._hash.hexdigest()

    def _lines(self) -> Iterator[tuple[int, bytes]]:
        """(offset, line without its newline) of each complete line, a chunk at a time; what
        follows the last newline is left in ``self._tail``."""
        if self._file is None:
            return
        offset, remaining = self.start, self.length - self.start
        self._file.seek(self.start)
        while remaining > 0 and (chunk := self._file.read(min(READ_CHUNK_BYTES, remaining))):
            remaining -= len(chunk)
            lines = chunk.split(b"\n")
            lines[0] = self._tail + lines[0]
            self._tail = lines.pop()
            for line in lines:
                yield offset, line
                offset += len(line) + 1

    def __iter__(self) -> Iterator[tuple[int, int, dict]]:
        damaged = None
        try:
            for offset, line in self._lines():
                if damaged is not None:  # a line after a damaged one: not a crash but an altered log
                    raise AppendLogError(f"{self.log.path} (byte {damaged}): damaged record before the end of the log")
                record = self.log._decode(line)
                if record is None:
                    damaged = offset  # a record torn by a crash mid-write, if nothing follows it
                    continue
                self.end = offset + len(line) + 1
                if self._hash is not None:
                    self._hash.update(line + b"\n")
                yield offset, self.end, record
        finally:
            if self._file is not None:
                self._file.close()
        if damaged is not None:
            if self._tail:
                raise AppendLogError(f"{self.log.path} (byte {damaged}): damaged record before the end of the log")
            log.warning("%s: leaving out a damaged last record (an append cut off while written)", self.log.path)


class _Writer:
    """This process's write handle on one log: the file, open for appending, and the exclusive
    flock on it, held until the last :class:`AppendLog` using it is gone."""

    def __init__(self, path: Path):
        self.path = path
        for directory in (path.parent.parent, path.parent):
            if not directory.exists():
                directory.mkdir(parents=True, exist_ok=True)
                sync_directory(directory.parent)  # the new entry must be durable too
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        # held: the lock taken once, for this writer's life; shared: taken by each hold()
        self.shared = writes_shared()
        try:
            if not self.shared:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise self.held_elsewhere() from None
        except OSError:
            os.close(self.fd)
            raise
        sync_directory(path.parent)  # the log's entry, if this open created it
        # one write at a time among this process's predictors; re-entrant, as a memory catches up
        # and writes under one hold (AppendLog.exclusive, then AppendLog.write)
        self.lock = threading.RLock()
        self._depth = 0  # nested holds of this process (shared: the flock is taken by the outermost)
        weakref.finalize(self, os.close, self.fd)

    def held_elsewhere(self) -> AppendLogHeld:
        return AppendLogHeld(
            f"{self.path} is held for writing by another process (one writer per lineage): append through "
            "that process, or serve this bundle with an XMCSERVE_APPEND_LOG_DIR of its own"
        )

    @contextmanager
    def hold(self) -> Iterator[None]:
        """This process's turn to write: the thread lock, and with shared writes the file's
        exclusive lock for as long as the outermost hold lasts."""
        with self.lock:
            if self.shared and self._depth == 0 and not lock_within(self.fd, fcntl.LOCK_EX, LOCK_WAIT_S):
                raise self.held_elsewhere()
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self.shared and self._depth == 0:
                    fcntl.flock(self.fd, fcntl.LOCK_UN)


_writers: weakref.WeakValueDictionary[Path, _Writer] = weakref.WeakValueDictionary()
_writers_lock = threading.Lock()


def _writer_of(path: Path) -> _Writer:
    """The process's one writer of ``path`` (two predictors of one bundle share it)."""
    key = Path(os.path.abspath(path))
    with _writers_lock:
        writer = _writers.get(key)
        if writer is None:
            writer = _writers[key] = _Writer(path)
        return writer


class AppendLog:
    """The durable record of a memory's appends: one line per append, ``<sha256> <json>``,
    written and fsync'ed before the append is applied. Named by the bundle id, so a log is never
    replayed onto another bundle."""

    def __init__(self, path: Path, bundle_id: str):
        self.path = path
        self.bundle_id = bundle_id
        self.size = 0  # bytes this log holds as far as its owner knows (set by read and write)
        self._writer: _Writer | None = None

    @classmethod
    def in_directory(cls, directory: Path, bundle_id: str) -> AppendLog:
        """The log of bundle ``bundle_id`` in ``directory``: ``<bundle id>.appends.log``."""
        return cls(Path(directory) / f"{check_bundle_id(bundle_id)}{LOG_SUFFIX}", bundle_id)

    def open_for_writing(self) -> None:
        """Open the log for appending and take its lock, for as long as this object lives (the
        log's directory is created here, at the first append, never at load). Raises
        :class:`AppendLogHeld` when another process holds it, :class:`AppendLogError` when it
        cannot be opened (its directory cannot be created, say)."""
        try:
            self._writer = _writer_of(self.path)
        except AppendLogHeld:
            raise
        except OSError as exc:
            raise AppendLogError(f"cannot open the append log {self.path} for writing: {exc}") from exc

    @property
    def writing(self) -> bool:
        """Whether this process holds the log open for writing."""
        return self._writer is not None

    def scan(self, start: int = 0, digest: bool = False) -> LogScan:
        """The complete records from byte ``start`` on, read a chunk at a time (:class:`LogScan`);
        no lock taken, nothing changed."""
        return LogScan(self, start, digest)

    def read(self, repair: bool = False) -> LogRead:
        """Every complete record, oldest first, held in memory at once: an inspection's read (a
        replay or a catch-up goes through :meth:`scan` and keeps none). A torn last line (a crash
        while writing) is left out, and cut off the file with ``repair`` (only by the log's writer:
        a reader may be looking at a write in progress); a damaged line before it means the log was
        altered, and is refused."""
        scan = self.scan(0, digest=True)
        records, offsets = [], []
        for start, _, record in scan:
            records.append(record)
            offsets.append(start)
        if repair and scan.length != scan.end:
            if self._writer is None:
                raise AppendLogError(f"{self.path}: a torn last record, and the log is not open for writing")
            log.warning("%s: cutting %d bytes of an unfinished record", self.path, scan.length - scan.end)
            self._truncate(scan.end)
        self.size = scan.end
        return LogRead(self.path, self.bundle_id, scan.end, scan.sha256, scan.prefix_sha256, records, offsets)

    def tail(self, dim: int) -> Iterator[TailRecord]:
        """The complete records past :attr:`size` (appended since this memory last read or wrote
        the log: by another bundle of its lineage), oldest first, read as they are taken; no lock
        taken, nothing changed."""
        return self._tail(dim, repair=False)

    @contextmanager
    def exclusive(self, dim: int) -> Iterator[Iterator[TailRecord]]:
        """Hold the log for writing (opened and locked at the first call: :meth:`open_for_writing`)
        and yield the records past :attr:`size`, read as they are taken, which the caller applies
        before it writes: while this block runs nobody else appends. A torn last record (a writer
        that died mid-write; only a dead writer can leave one, as the lock is held) is cut off once
        the records are all taken (a write is refused until then: :meth:`write` checks the size)."""
        if self._writer is None:
            self.open_for_writing()
        with self._writer.hold():
            yield self._tail(dim, repair=True)

    @property
    def shared(self) -> bool:
        """Whether the processes of a group write this log in turns (:func:`share_writes`)."""
        return writes_shared()

    def grown(self) -> bool:
        """Whether the file holds more than this memory has applied (another process appended):
        one ``stat``, the check a search makes before it runs."""
        try:
            return os.stat(self.path).st_size != self.size
        except (FileNotFoundError, NotADirectoryError):
            return False

    @contextmanager
    def shared_reading(self) -> Iterator[bool]:
        """A shared lock on the log while another process's records are read (no writer is then
        between a write and its taking back); yields False when it was not had within
        :data:`READ_WAIT_S` (the caller then reads nothing: :class:`~engine.memory.MemoryBusy`),
        True without a file (nothing to read, nothing to take back)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            yield True
            return
        try:
            got = lock_within(fd, fcntl.LOCK_SH, READ_WAIT_S)
            yield got
        finally:
            os.close(fd)  # closing releases the lock

    def _tail(self, dim: int, repair: bool) -> Iterator[TailRecord]:
        scan = self.scan(self.size)
        for start, end, record in scan:
            batch, vectors = batch_of(record, dim)
            yield TailRecord(batch, vectors, end, f"{self.path} (byte {start})")
        if repair and scan.length != scan.end:
            log.warning("%s: cutting %d bytes of an unfinished record", self.path, scan.length - scan.end)
            self._truncate(scan.end)

    def _decode(self, line: bytes) -> dict | None:
        digest, _, payload = line.partition(b" ")
        if hashlib.sha256(payload).hexdigest().encode() != digest:
            return None
        record = json.loads(payload)
        if not isinstance(record, dict) or record.get("bundle_id") != self.bundle_id:
            raise AppendLogError(f"{self.path}: a record of bundle {record.get('bundle_id')}, not {self.bundle_id}")
        return record

    def write(self, record: dict) -> int:
        """Append one record durably (unbuffered, fsync'ed) and return the size before it; on any
        failure (a full disk, say) the file is cut back to that size. Refused when the file is not
        the size its owner left it at: another predictor of this process appended to it, and this
        memory has not applied those appends (a writer calls it inside :meth:`exclusive`, after
        applying what that yields, so this never happens there)."""
        payload = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
        line = hashlib.sha256(payload).hexdigest().encode() + b" " + payload + b"\n"
        if self._writer is None:
            self.open_for_writing()
        writer = self._writer
        with writer.hold():
            start = os.fstat(writer.fd).st_size
            if start != self.size:
                raise AppendLogError(
                    f"{self.path} was appended to by another writer ({start} bytes, this memory knows {self.size}): "
                    "reload the bundle to replay those appends"
                )
            try:
                written = 0
                while written < len(line):
                    written += os.write(writer.fd, line[written:])
                os.fsync(writer.fd)
            except OSError as exc:
                try:
                    os.ftruncate(writer.fd, start)
                    os.fsync(writer.fd)
                except OSError:
                    log.exception(
                        "%s: cannot cut back a failed write (the size check refuses further appends)", self.path
                    )
                raise AppendLogError(f"cannot write the append log {self.path}: {exc}") from exc
            self.size = start + len(line)
            return start

    def append(self, batch: AppendBatch, vectors: np.ndarray, version: int) -> int:
        """:meth:`write` the record of ``batch`` (its keys' ``vectors``) as memory ``version``."""
        return self.write(record_of(batch, vectors, self.bundle_id, version))

    def cut_back(self, size: int) -> None:
        """Take back the records past ``size`` (an append that failed to apply after it was logged)."""
        self._truncate(size)
        self.size = size

    def _truncate(self, size: int) -> None:
        with self._writer.hold():
            os.ftruncate(self._writer.fd, size)
            os.fsync(self._writer.fd)


def appends_dir_beside(bundle_path: Path) -> Path:
    """Where a bundle's append logs go by default: ``<bundle dir>.appends/``, beside the bundle
    (which stays immutable)."""
    return Path(bundle_path).with_name(Path(bundle_path).name + ".appends")


def sync_directory(path: Path) -> None:
    """Make the entries of directory ``path`` (names created, renamed or removed) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def record_of(batch: AppendBatch, vectors: np.ndarray, bundle_id: str, version: int) -> dict:
    return {
        "bundle_id": bundle_id,
        "version": version,
        "append_id": batch.append_id,
        "labels": [list(label) for label in batch.labels],
        "instances": [[text, list(uids)] for text, uids in batch.instances],
        "vectors": base64.b64encode(np.ascontiguousarray(vectors, dtype=np.float32).tobytes()).decode(),
    }


def batch_of(record: dict, dim: int) -> tuple[AppendBatch, np.ndarray]:
    try:
        batch = AppendBatch(
            labels=[(str(uid), str(text)) for uid, text in record["labels"]],
            instances=[(str(text), [str(u) for u in uids]) for text, uids in record["instances"]],
            append_id=record.get("append_id"),
        )
        vectors = np.frombuffer(base64.b64decode(record["vectors"]), dtype=np.float32).reshape(-1, dim)
    except (KeyError, TypeError, ValueError) as exc:
        raise AppendLogError(f"append record {record.get('version')}: malformed ({exc})") from None
    if len(vectors) != len(batch.labels) + len(batch.instances):
        raise AppendLogError(f"append record {record.get('version')}: {len(vectors)} vectors for its keys")
    return batch, vectors
