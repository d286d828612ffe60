"""The append log of a live memory (:mod:`service.engine.memory`) and its record codec.

One line per append, ``<sha256 of the payload> <json payload>``: the append's labels, instances,
idempotency key and its keys' vectors (base64 float32), so replay needs no encoder. A log is named
by its bundle's id, so it is never replayed onto another bundle.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np

from service.engine.memory import AppendBatch

log = logging.getLogger(__name__)


class AppendLogError(RuntimeError):
    """The append log cannot be written or read; the memory is left as it was."""


class AppendLog:
    """The durable record of a memory's appends: one line per append, ``<sha256> <json>``,
    written and fsync'ed before the append is applied. Named by the bundle id, so a log is never
    replayed onto another bundle."""

    def __init__(self, path: Path, bundle_id: str):
        self.path = path
        self.bundle_id = bundle_id
        self.size = 0  # bytes this log holds as far as its owner knows (set by read and write)

    @classmethod
    def in_directory(cls, directory: Path, bundle_id: str) -> AppendLog:
        """The log of bundle ``bundle_id`` in ``directory``: ``<bundle id>.appends.log``."""
        return cls(directory / f"{bundle_id}.appends.log", bundle_id)

    def read(self, repair: bool = True) -> list[dict]:
        """Every complete record, oldest first. A torn last line (a crash while writing) is cut
        off the file (with ``repair``; not when reading another owner's log, which may be in the
        middle of a write); a damaged line before it means the log was altered, and is refused."""
        if not self.path.is_file():
            return []
        records, good_bytes = [], 0
        with self.path.open("rb") as fh:
            lines = fh.read().split(b"\n")
        complete, tail = lines[:-1], lines[-1]
        for number, line in enumerate(complete, start=1):
            record = self._decode(line)
            if record is None:
                if number == len(complete) and not tail:
                    log.warning("%s: dropping a damaged last record (an append cut off while written)", self.path)
                    break
                raise AppendLogError(f"{self.path}:{number}: damaged record before the end of the log")
            records.append(record)
            good_bytes += len(line) + 1
        if repair and good_bytes != self.path.stat().st_size:
            cut = self.path.stat().st_size - good_bytes
            log.warning("%s: cutting %d bytes of an unfinished record", self.path, cut)
            self._truncate(good_bytes)
        self.size = good_bytes
        return records

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
        failure the file is cut back to that size. Refused when the file is not the size its owner
        left it at: another process or predictor appended to it, and this memory has not seen
        those appends (reload the bundle to replay them)."""
        payload = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
        line = hashlib.sha256(payload).hexdigest().encode() + b" " + payload + b"\n"
        try:
            for directory in (self.path.parent.parent, self.path.parent):
                if not directory.exists():
                    directory.mkdir(parents=True, exist_ok=True)
                    sync_directory(directory.parent)  # the new entry must be durable too
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise AppendLogError(f"cannot write the append log {self.path}: {exc}") from exc
        try:
            start = os.fstat(fd).st_size
            if start != self.size:
                raise AppendLogError(
                    f"{self.path} was appended to by another writer ({start} bytes, this memory knows {self.size}): "
                    "reload the bundle to replay those appends"
                )
            try:
                written = 0
                while written < len(line):
                    written += os.write(fd, line[written:])
                os.fsync(fd)
            except OSError as exc:
                os.ftruncate(fd, start)
                os.fsync(fd)
                raise AppendLogError(f"cannot write the append log {self.path}: {exc}") from exc
            sync_directory(self.path.parent)
            self.size = start + len(line)
            return start
        finally:
            os.close(fd)

    def append(self, batch: AppendBatch, vectors: np.ndarray, version: int) -> int:
        """:meth:`write` the record of ``batch`` (its keys' ``vectors``) as memory ``version``."""
        return self.write(record_of(batch, vectors, self.bundle_id, version))

    def cut_back(self, size: int) -> None:
        """Take back the records past ``size`` (an append that failed to apply after it was logged)."""
        self._truncate(size)
        self.size = size

    def _truncate(self, size: int) -> None:
        fd = os.open(self.path, os.O_WRONLY)
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)


def appends_dir_beside(bundle_path: Path) -> Path:
    """Where a bundle's append logs go by default: ``<bundle dir>.appends/``, beside the bundle
    (which stays immutable)."""
    return Path(bundle_path).with_name(Path(bundle_path).name + ".appends")


def sync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
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
