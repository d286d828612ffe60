"""The append log of a live memory (:mod:`service.engine.memory`) and its record codec.

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
the complete records up to a byte offset (:meth:`AppendLog.read`), a consistent prefix whatever the
writer is doing, and never modify the file.
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
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.engine.memory import AppendBatch

log = logging.getLogger(__name__)

LOG_SUFFIX = ".appends.log"
# What a bundle id is (``<index kind>-<dim>d-<12 hex of the content hash>``): no separators, no
# dots, so a log file named from one stays in its directory.
BUNDLE_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,80}-[0-9a-f]{12}")


class AppendLogError(RuntimeError):
    """The append log cannot be written or read; the memory is left as it was."""


class AppendLogHeld(AppendLogError):
    """Another process holds the log open for writing (one writer per lineage)."""


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


@dataclass(frozen=True)
class LogRead:
    """The complete records of a log read up to its end: ``records`` (oldest first) and the byte
    offset each starts at; ``size``: the bytes they fill, a prefix that never changes once written;
    ``prefix_sha256``: the sha256 of the first ``prefix`` bytes asked for (None: the file is shorter)."""

    path: Path
    bundle_id: str
    records: list[dict]
    offsets: list[int]
    size: int
    sha256: str
    prefix_sha256: str | None = None


class _Writer:
    """This process's write handle on one log: the file, open for appending, and the exclusive
    flock on it, held until the last :class:`AppendLog` using it is gone."""

    def __init__(self, path: Path):
        for directory in (path.parent.parent, path.parent):
            if not directory.exists():
                directory.mkdir(parents=True, exist_ok=True)
                sync_directory(directory.parent)  # the new entry must be durable too
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise AppendLogHeld(
                f"{path} is held for writing by another process (one writer per lineage): append through "
                "that process, or serve this bundle with an XMCSERVE_APPEND_LOG_DIR of its own"
            ) from None
        except OSError:
            os.close(self.fd)
            raise
        sync_directory(path.parent)  # the log's entry, if this open created it
        # one write at a time among this process's predictors; re-entrant, as a memory catches up
        # and writes under one hold (AppendLog.exclusive, then AppendLog.write)
        self.lock = threading.RLock()
        weakref.finalize(self, os.close, self.fd)


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

    def read(self, repair: bool = False, prefix: int = 0) -> LogRead:
        """Every complete record, oldest first. A torn last line (a crash while writing) is left
        out, and cut off the file with ``repair`` (only by the log's writer: a reader may be
        looking at a write in progress); a damaged line before it means the log was altered, and
        is refused. ``prefix``: also hash the log's first ``prefix`` bytes."""
        data = self.path.read_bytes() if self.path.is_file() else b""
        records, offsets, good_bytes = [], [], 0
        lines = data.split(b"\n")
        complete, tail = lines[:-1], lines[-1]
        for number, line in enumerate(complete, start=1):
            record = self._decode(line)
            if record is None:
                if number == len(complete) and not tail:
                    log.warning("%s: leaving out a damaged last record (an append cut off while written)", self.path)
                    break
                raise AppendLogError(f"{self.path}:{number}: damaged record before the end of the log")
            records.append(record)
            offsets.append(good_bytes)
            good_bytes += len(line) + 1
        if repair and good_bytes != len(data):
            if self._writer is None:
                raise AppendLogError(f"{self.path}: a torn last record, and the log is not open for writing")
            log.warning("%s: cutting %d bytes of an unfinished record", self.path, len(data) - good_bytes)
            self._truncate(good_bytes)
        self.size = good_bytes
        digest = hashlib.sha256(data[:good_bytes]).hexdigest()
        head = hashlib.sha256(data[:prefix]).hexdigest() if prefix <= len(data) else None
        return LogRead(self.path, self.bundle_id, records, offsets, good_bytes, digest, head)

    def tail(self, dim: int) -> list[TailRecord]:
        """The complete records past :attr:`size` (appended since this memory last read or wrote
        the log: by another bundle of its lineage), oldest first; no lock taken, nothing changed."""
        return self._scan(dim)[0]

    @contextmanager
    def exclusive(self, dim: int) -> Iterator[list[TailRecord]]:
        """Hold the log for writing (opened and locked at the first call: :meth:`open_for_writing`)
        and yield the records past :attr:`size`, which the caller applies before it writes: while
        this block runs nobody else appends. A torn last record (a writer that died mid-write; only
        a dead writer can leave one, as the lock is held) is cut off first."""
        if self._writer is None:
            self.open_for_writing()
        with self._writer.lock:
            records, end, length = self._scan(dim)
            if length != end:
                log.warning("%s: cutting %d bytes of an unfinished record", self.path, length - end)
                self._truncate(end)
            yield records

    def _scan(self, dim: int) -> tuple[list[TailRecord], int, int]:
        """The complete records from byte :attr:`size` on, the offset the last one ends at and the
        file's length."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.size)
                data = fh.read()
        except (FileNotFoundError, NotADirectoryError):  # nothing appended yet
            return [], self.size, self.size
        except OSError as exc:
            raise AppendLogError(f"cannot read the append log {self.path}: {exc}") from exc
        records, end = [], self.size
        lines = data.split(b"\n")
        complete = lines[:-1]
        for number, line in enumerate(complete, start=1):
            record = self._decode(line)
            if record is None:
                if number == len(complete) and not lines[-1]:
                    break  # torn by a crash mid-write, with its newline: not a complete record
                raise AppendLogError(f"{self.path} (byte {end}): damaged record before the end of the log")
            end += len(line) + 1
            batch, vectors = batch_of(record, dim)
            records.append(TailRecord(batch, vectors, end, f"{self.path} (byte {end - len(line) - 1})"))
        return records, end, self.size + len(data)

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
        with writer.lock:
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
        with self._writer.lock:
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
