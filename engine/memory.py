"""Live memory: labels and training instances added to a served bundle without a rebuild.

RAE-XMC's memory K = [instances ; labels], V = [λ·Y ; (1−λ)·I] takes new rows without retraining
the encoder: an append encodes the new texts with the bundle's own encoder, adds them to the HNSW
index as keys (grown as needed) and their rows to V (a new instance's row is λ·y, a new label's
is (1−λ)·e_label). A label-index bundle takes new labels the same way (key id = label id).

Key ids: the bundle's keys keep theirs (RAE: instances 0..N−1, labels N..N+L−1); appended keys
follow in append order. A label keeps its id forever; new labels get the next ids.

Consistency. A search runs against one :class:`MemoryView` (labels, what each key is, value
rows), taken under :attr:`Memory.lock` together with the index query (the
:class:`~engine.index.protocol.KeyIndex`; its breadth is an argument of the query). An
append adds its keys in chunks of :data:`APPEND_CHUNK`, each hidden (invisible to searches) under
that lock, so searches run between chunks; then, under the lock, it shows them and publishes the
new view. A search sees all of an append or none of it, and waits at most one chunk's insertion.
An append that fails part-way (an insertion raises) takes its keys back out of the index
(``KeyIndex.take_back``) before it fails: the memory is as it was, and the next append goes where
this one would have.

Durability. An append is written to its log (:class:`~engine.append_log.AppendLog`, one
checksummed line, fsync'ed)
before it is applied and acknowledged; loading a bundle replays its log. A crash while writing
leaves a torn last line, which replay drops (none of the append); a crash after writing replays
it (all of it). ``python -m export.compact`` folds a log into a fresh bundle.

Lineage. The log is shared by every bundle of a lineage (a bundle and those compacted from it), so
before an append a memory first applies what other bundles of its lineage logged since it last
looked (:meth:`Memory.catch_up`): the log is the one order, and a label's id is its place in it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np
import scipy.sparse as sp

from bundle import StringColumn, UidLookup, XmcserveError
from engine.index.protocol import KeyIndex
from engine.rae import ValueRows, labels_of_keys

if TYPE_CHECKING:
    from engine.sparse import LabelColumns

log = logging.getLogger(__name__)

# Neighbours fetched beyond those asked for, so that keys tied in distance at the cut are all
# seen before the tie is broken by key id (see engine.index.protocol.best_first).
TIE_MARGIN = 8
# Keys inserted per hold of the search lock: a search waits at most this many insertions.
APPEND_CHUNK = 16
# Most label uids one appended instance may carry.
MAX_LABELS_PER_INSTANCE = 1000
# Index capacity grows by this factor (at least), so growing — a copy of the whole graph
# under the search lock — happens O(log n) times as the memory grows.
GROWTH = 1.5


class AppendRefused(XmcserveError, ValueError):
    """The append cannot be applied as given (unknown or duplicate uids, empty texts, …)."""


class AppendIdReused(AppendRefused):
    """The append's ``append_id`` was applied already, with other content."""


class LineageDiverged(XmcserveError, RuntimeError):
    """A record that another bundle of this memory's lineage logged does not apply to this memory:
    it no longer holds the log's order (a log edited or mixed by hand); nothing is appended."""


class MemoryBusy(XmcserveError, RuntimeError):
    """The records the other processes of a group logged could not be read within the bounded wait
    (a writer held the log's lock for longer): nothing is answered from a memory that may lack an
    acknowledged append; the caller retries after ``retry_after_s`` (HTTP: 503, Retry-After)."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class AppendBatch:
    """One append: new labels (uid, text) and new training instances (text, label uids).

    ``append_id``: an idempotency key; an append whose id the memory already holds is not
    applied again (a client that lost the answer retries safely)."""

    labels: list[tuple[str, str]] = field(default_factory=list)
    instances: list[tuple[str, list[str]]] = field(default_factory=list)
    append_id: str | None = None

    @property
    def texts(self) -> list[str]:
        """The texts to encode, in key order: the new labels, then the new instances."""
        return [text for _, text in self.labels] + [text for text, _ in self.instances]

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps([self.labels, self.instances], ensure_ascii=False).encode()).hexdigest()


@dataclass(frozen=True)
class MemoryView:
    """What one search sees: the labels, what each key is, the value rows. Immutable; an
    append publishes a new one. ``label_uids``, ``label_texts`` and ``uid_to_id`` are shared
    append-only containers: a view owns their first ``num_labels`` entries."""

    label_uids: StringColumn
    label_texts: StringColumn
    uid_to_id: UidLookup
    num_labels: int
    num_keys: int
    base_keys: int
    base_train: int  # instance keys at the front of the bundle's memory (0 for a label index)
    appended_key_labels: np.ndarray  # label id of each appended key, −1 for an instance key
    values: ValueRows | None = None
    # the appended keys' term vectors, key order (a lexical score fusion reads them)
    appended_key_terms: sp.csr_matrix | None = None
    # a sparse ranker's weight columns of the labels after its fitted ones (made from their texts)
    sparse_columns: LabelColumns | None = None
    version: int = 0
    appended_instances: int = 0
    append_ids: dict[str, tuple[int, str]] = field(default_factory=dict)  # id → (version, fingerprint)
    # logged appends that no longer applied at load and were skipped (an operator's choice): where, why
    replay_skipped: tuple[dict, ...] = ()

    @property
    def appended_labels(self) -> int:
        return self.num_labels - (self.base_keys - self.base_train)

    def label_id(self, uid: str) -> int | None:
        label = self.uid_to_id.get(uid)
        # past num_labels, or left by an append that failed: not this view's label
        if label is None or label >= self.num_labels or self.label_uids[label] != uid:
            return None
        return label

    def label_ids(self, uids: Collection[str]) -> set[int]:
        """Ids of the known uids; unknown uids cannot be returned anyway, so they are ignored."""
        return {label for uid in uids if (label := self.label_id(uid)) is not None}

    def labels_of_keys(self, keys: np.ndarray) -> np.ndarray:
        """The label id of each key (any shape), −1 for instance keys and for no key (−1)."""
        labels = labels_of_keys(keys, self.base_train)
        appended = keys >= self.base_keys
        if appended.any():
            labels[appended] = self.appended_key_labels[keys[appended] - self.base_keys]
        return labels

    def describe(self) -> dict:
        return {
            "version": self.version,
            "keys": self.num_keys,
            "labels": self.num_labels,
            "appended_labels": self.appended_labels,
            "appended_instances": self.appended_instances,
        } | ({"replay_skipped": list(self.replay_skipped)} if self.replay_skipped else {})


def base_view(
    label_uids: Sequence[str],
    label_texts: Sequence[str],
    num_keys: int,
    values: sp.csr_matrix | None,
    append_ids: dict[str, tuple[int, str]] | None = None,
    uid_lookup: UidLookup | None = None,
) -> MemoryView:
    """The view of a bundle as built: its keys, labels (columns, or lists made into columns) and
    value matrix, and the append ids a compaction folded into it. The columns become the view's
    shared append-only containers; ``uid_lookup``: theirs (default: made from ``label_uids``)."""
    num_labels = len(label_uids)
    uids = label_uids if isinstance(label_uids, StringColumn) else StringColumn.of(label_uids)
    texts = label_texts if isinstance(label_texts, StringColumn) else StringColumn.of(label_texts)
    if uid_lookup is None or uid_lookup.uids is not uids:
        uid_lookup = UidLookup.of(uids)
    return MemoryView(
        label_uids=uids,
        label_texts=texts,
        uid_to_id=uid_lookup,
        num_labels=num_labels,
        num_keys=num_keys,
        base_keys=num_keys,
        base_train=num_keys - num_labels,
        appended_key_labels=np.zeros(0, dtype=np.int64),
        values=ValueRows(values) if values is not None else None,
        append_ids={key: (int(version), str(fp)) for key, (version, fp) in (append_ids or {}).items()},
    )


def check_batch(view: MemoryView, batch: AppendBatch, has_instance_memory: bool) -> None:
    """Raise :class:`AppendRefused` with every reason the batch cannot be applied to ``view``."""
    problems = []
    if batch.append_id is not None and not is_unicode(batch.append_id):
        problems.append("append_id is not valid Unicode (it contains a lone surrogate)")
    if not batch.labels and not batch.instances:
        problems.append("nothing to append: give labels and/or instances")
    if batch.instances and not has_instance_memory:
        problems.append("this bundle is a label index (no instance memory): it takes labels only")
    new_uids: set[str] = set()
    for i, (uid, text) in enumerate(batch.labels):
        if not uid:
            problems.append(f"labels[{i}]: empty uid")
        elif uid in new_uids:
            problems.append(f"labels[{i}]: uid {uid!r} given twice")
        elif view.label_id(uid) is not None:
            problems.append(f"labels[{i}]: uid {uid!r} already exists")
        new_uids.add(uid)
        if not text.strip():
            problems.append(f"labels[{i}]: empty text")
    for i, (text, uids) in enumerate(batch.instances):
        if not text.strip():
            problems.append(f"instances[{i}]: empty text")
        if not uids:
            problems.append(f"instances[{i}]: no labels (an instance without labels adds nothing)")
        elif len(uids) > MAX_LABELS_PER_INSTANCE:
            problems.append(f"instances[{i}]: {len(uids)} labels, at most {MAX_LABELS_PER_INSTANCE}")
        unknown = [uid for uid in uids if uid not in new_uids and view.label_id(uid) is None]
        if unknown:
            problems.append(f"instances[{i}]: unknown label uids {unknown[:5]} (add them in the same call)")
        if len(set(uids)) != len(uids):
            problems.append(f"instances[{i}]: a label uid given twice")
    if problems:
        raise AppendRefused("; ".join(problems[:20]))


def is_unicode(text: str) -> bool:
    """Whether ``text`` has a UTF-8 form (a lone surrogate, from a ``\\ud800`` JSON escape, has none)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def extend_view(
    view: MemoryView,
    batch: AppendBatch,
    lam: float | None,
    key_terms: sp.csr_matrix | None = None,
    sparse_columns: LabelColumns | None = None,
) -> MemoryView:
    """The view after ``batch``: new label ids, keys (labels first, then instances), value rows,
    (``key_terms``, the new keys' term vectors) term rows and (``sparse_columns``, the new labels')
    sparse ranker columns. Writes the new labels into the
    shared containers past ``view.num_labels`` (no older view reads there); a failed earlier
    attempt's leftovers there are overwritten."""
    del view.label_uids[view.num_labels :], view.label_texts[view.num_labels :]
    first_label = view.num_labels
    for offset, (uid, text) in enumerate(batch.labels):
        view.label_uids.append(uid)
        view.label_texts.append(text)
        view.uid_to_id[uid] = first_label + offset
    num_labels = first_label + len(batch.labels)
    new_label_ids = np.arange(first_label, num_labels, dtype=np.int64)
    key_labels = np.concatenate([new_label_ids, np.full(len(batch.instances), -1, dtype=np.int64)])
    values = view.values
    if values is not None:
        values = values.extended(value_rows(view, batch, new_label_ids, num_labels, lam))
    terms = view.appended_key_terms
    if key_terms is not None:
        terms = key_terms if terms is None else sp.vstack([terms, key_terms], format="csr")
    columns = view.sparse_columns
    if sparse_columns is not None:
        columns = sparse_columns if columns is None else columns.extended(sparse_columns)
    append_ids = view.append_ids
    if batch.append_id is not None:
        append_ids = {**append_ids, batch.append_id: (view.version + 1, batch.fingerprint())}
    return replace(
        view,
        num_labels=num_labels,
        num_keys=view.num_keys + len(key_labels),
        appended_key_labels=np.concatenate([view.appended_key_labels, key_labels]),
        values=values,
        appended_key_terms=terms,
        sparse_columns=columns,
        version=view.version + 1,
        appended_instances=view.appended_instances + len(batch.instances),
        append_ids=append_ids,
    )


def value_rows(view: MemoryView, batch: AppendBatch, new_label_ids: np.ndarray, num_labels: int, lam: float | None):
    """The appended keys' rows of V: (1−λ)·e_label for a new label, λ·y for a new instance."""
    lam = 0.0 if lam is None else lam
    ids_of = {uid: view.label_id(uid) for _, uids in batch.instances for uid in uids}
    ids_of.update({uid: int(i) for (uid, _), i in zip(batch.labels, new_label_ids, strict=True)})
    columns = [[int(i)] for i in new_label_ids] + [[ids_of[uid] for uid in uids] for _, uids in batch.instances]
    weights = [1.0 - lam] * len(batch.labels) + [lam] * len(batch.instances)
    indptr = np.concatenate([[0], np.cumsum([len(c) for c in columns])])
    data = np.concatenate([np.full(len(c), w, dtype=np.float32) for c, w in zip(columns, weights, strict=True)])
    indices = np.concatenate([np.asarray(c, dtype=np.int64) for c in columns]) if columns else np.zeros(0, np.int64)
    rows = sp.csr_matrix((data, indices, indptr), shape=(len(columns), num_labels))
    rows.sort_indices()
    return rows


class TailRecord(Protocol):
    """An append another bundle of the lineage logged (:class:`~engine.append_log.TailRecord`)."""

    batch: AppendBatch
    vectors: np.ndarray
    end: int  # the log offset after it
    where: str


class AppendWriter(Protocol):
    """Where a memory writes its appends before applying them (an
    :class:`~engine.append_log.AppendLog`), shared with the other bundles of its lineage."""

    size: int  # how far into the log this memory has applied

    def append(self, batch: AppendBatch, vectors: np.ndarray, version: int) -> int:
        """Write the append durably; returns the size to :meth:`cut_back` to if applying fails."""

    def cut_back(self, size: int) -> None: ...

    def tail(self, dim: int) -> Iterable[TailRecord]:
        """The records past ``size``, read as they are taken, without a lock."""

    def exclusive(self, dim: int) -> AbstractContextManager[Iterable[TailRecord]]:
        """Hold the log for writing; yields the records past ``size``, read as they are taken."""

    @property
    def shared(self) -> bool:
        """Whether other processes append to it in turns with this one (``XMCSERVE_WORKERS``)."""

    def grown(self) -> bool:
        """Whether it holds records past ``size`` (cheap: a search asks before it runs)."""

    def shared_reading(self) -> AbstractContextManager[bool]:
        """No writer mid-append while the block runs; yields False when that could not be had
        within the bounded wait (True when there is no file yet: nothing to read)."""


@dataclass(frozen=True)
class AppendOutcome:
    """What an append did: the memory version it made, and the ids of the new labels."""

    version: int
    label_ids: dict[str, int]
    instances: int
    repeated: bool = False  # the append id was already applied: nothing was done again


class Memory:
    """The key index of a bundle and the view of what its keys mean, with appends.

    Thread-safe: searches take :attr:`lock` for the query (an index's insertions are not safe
    against its queries, and the view must match the keys the query could see); appends are
    serialised among themselves.

    ``key_terms_of``: the term vectors of texts (a lexical fusion's
    :meth:`~engine.lexical.Lexicon.rows`), computed for every appended key; None: none kept.
    ``label_columns_of``: a sparse ranker's weight columns of new labels from their term vectors
    (:meth:`~engine.sparse.SparseRanker.label_columns`); None: the bundle has no ranker.
    """

    def __init__(
        self,
        index: KeyIndex,
        view: MemoryView,
        lam: float | None,
        log: AppendWriter | None,
        key_terms_of: Callable[[list[str]], sp.csr_matrix] | None = None,
        label_columns_of: Callable[[sp.csr_matrix], LabelColumns] | None = None,
    ):
        self.index = index
        self.lam = lam
        self.log = log
        self.key_terms_of = key_terms_of
        self.label_columns_of = label_columns_of
        self.lock = threading.Lock()
        self._append_lock = threading.RLock()
        self._view = view

    @property
    def view(self) -> MemoryView:
        return self._view

    @property
    def has_instance_memory(self) -> bool:
        return self._view.values is not None

    def knn(self, vectors: np.ndarray, n: int, ef: int, view: MemoryView) -> tuple[np.ndarray, np.ndarray, int]:
        """Best-first (key ids, similarities) of the ``n`` nearest keys of ``view`` (−1: none),
        and the breadth (ef) the search ran at. Keys published after ``view`` are fetched too (the
        index holds them) and then dropped, so ``view`` still gets its ``n``."""
        with self.lock:
            newer = self._view.num_keys - view.num_keys
            fetch, ef = fetch_and_ef(n + newer, ef, self._view.num_keys)
            # One thread: the search runs on the batcher's own thread beside the encode threads.
            keys, distances = self.index.search(vectors, fetch, ef, threads=1)
        # best first by distance, then key: every KeyIndex answers in that order
        sims = (1.0 - distances).astype(np.float32)
        if newer:
            keys, sims = _only_visible(keys, sims, view.num_keys, n)
        return keys[:, :n], sims[:, :n], ef

    def prepare(self, batch: AppendBatch, encode: Callable[[list[str]], np.ndarray]) -> np.ndarray | None:
        """Check ``batch`` against the memory and encode it (the slow part, no lock held);
        None when its ``append_id`` was applied already. Raises :class:`AppendRefused`. The
        lineage's newer records are applied first, so a label another bundle added is known."""
        self.catch_up()
        view = self._view
        if self._repeated(view, batch) is not None:
            return None
        check_batch(view, batch, self.has_instance_memory)
        return encode(batch.texts)

    def commit(self, batch: AppendBatch, vectors: np.ndarray | None) -> AppendOutcome:
        """Log and apply a prepared batch; checked again, since another append may have come
        first. If applying fails after the log was written, the record is taken back. Under the
        log's lock, what other bundles of the lineage logged is applied first: this append goes
        at the end of the one order."""
        log_held = self.log.exclusive(self.index.dim) if self.log is not None else nullcontext([])
        with self._append_lock, log_held as newer:
            self._apply_logged(newer)
            view = self._view
            if (repeated := self._repeated(view, batch)) is not None:
                return repeated
            check_batch(view, batch, self.has_instance_memory)
            if vectors is None or len(vectors) != len(batch.texts):
                raise AppendRefused("the batch was not prepared against this memory")
            size = self.log.append(batch, vectors, view.version + 1) if self.log else 0
            try:
                return self._apply(view, batch, vectors)
            except BaseException:
                if self.log is not None:
                    self.log.cut_back(size)
                raise

    def replay(self, batch: AppendBatch, vectors: np.ndarray) -> bool:
        """Apply one logged append at load, before serving; False when its ``append_id`` is
        already applied (the same append logged twice: skipped, as a live retry would be).
        Raises :class:`AppendRefused` when it no longer applies."""
        with self._append_lock:  # re-entrant: catching up replays under the append lock
            if self._repeated(self._view, batch) is not None:
                return False
            check_batch(self._view, batch, self.has_instance_memory)
            if len(vectors) != len(batch.texts):
                raise AppendRefused(f"{len(vectors)} vectors for {len(batch.texts)} keys")
            self._apply(self._view, batch, vectors)
            return True

    def catch_up(self) -> int:
        """Apply the records other bundles of this lineage logged since this memory last read or
        wrote its log (a promote, a rollback and every append call it); returns how many."""
        if self.log is None:
            return 0
        with self._append_lock, self._reading_others(self.log):
            return self._apply_logged(self.log.tail(self.index.dim))

    def follow(self) -> int:
        """Apply what the other processes of a group logged since this memory last read or wrote
        its log, when they share it (``XMCSERVE_WORKERS``): a batch calls it before it searches, so
        an append that any process acknowledged is in every search that starts after. One ``stat``
        when nothing is new; returns how many appends were applied."""
        log = self.log
        if log is None or not log.shared or not log.grown():
            return 0
        with self._append_lock, self._reading_others(log):
            return self._apply_logged(log.tail(self.index.dim))

    @contextmanager
    def _reading_others(self, log: AppendWriter) -> Iterator[None]:
        """With a log the processes of a group share, its shared lock for the block (no writer is
        then between a write and its taking back); :class:`MemoryBusy` when it is not had within
        the bounded wait: a search on what this memory has would miss an acknowledged append."""
        if not log.shared:
            yield
            return
        with log.shared_reading() as readable:
            if not readable:
                raise MemoryBusy(
                    "another worker held the append log past the read wait: its newest appends are not read yet"
                )
            yield

    def _apply_logged(self, records: Iterable[TailRecord]) -> int:
        applied = 0
        for record in records:
            try:
                applied += self.replay(record.batch, record.vectors)
            except AppendRefused as exc:
                raise LineageDiverged(f"{record.where} no longer applies to this memory: {exc}") from None
            self.log.size = record.end
        return applied

    def report_skipped(self, skipped: list[dict]) -> None:
        """Record the logged appends that replay left out (see :attr:`MemoryView.replay_skipped`)."""
        with self._append_lock, self.lock:
            self._view = replace(self._view, replay_skipped=self._view.replay_skipped + tuple(skipped))

    def _repeated(self, view: MemoryView, batch: AppendBatch) -> AppendOutcome | None:
        if batch.append_id is None or batch.append_id not in view.append_ids:
            return None
        version, fingerprint = view.append_ids[batch.append_id]
        if fingerprint != batch.fingerprint():
            raise AppendIdReused(f"append_id {batch.append_id!r} was already used for another append")
        return AppendOutcome(version, {uid: view.uid_to_id[uid] for uid, _ in batch.labels}, len(batch.instances), True)

    def _apply(self, view: MemoryView, batch: AppendBatch, vectors: np.ndarray) -> AppendOutcome:
        terms = self.key_terms_of(batch.texts) if self.key_terms_of is not None else None
        # the new labels' keys come first: their term rows are the labels' texts' (a replay recomputes them)
        columns = None
        if self.label_columns_of is not None and terms is not None:
            columns = self.label_columns_of(terms[: len(batch.labels)])
        new_view = extend_view(view, batch, self.lam, terms, columns)
        keys = np.arange(view.num_keys, new_view.num_keys)
        try:
            self._reserve(new_view.num_keys)
            for start in range(0, len(keys), APPEND_CHUNK):
                chunk = keys[start : start + APPEND_CHUNK]
                with self.lock:
                    self.index.add(vectors[start : start + len(chunk)], chunk, threads=1)
                    for key in chunk:
                        self.index.hide(int(key))
        except BaseException:
            # Keys of earlier chunks (and part of this one) are in the index: out with them, or the
            # next append's ids would collide with them (ivfpq refused every later append) and a
            # key inserted but not yet hidden would answer searches past the view's keys.
            with self.lock:
                self.index.take_back(view.num_keys, new_view.num_keys)
            raise
        with self.lock:
            for key in keys:
                self.index.show(int(key))
            self._view = new_view
        labels = {uid: new_view.uid_to_id[uid] for uid, _ in batch.labels}
        return AppendOutcome(new_view.version, labels, len(batch.instances))

    def _reserve(self, keys: int) -> None:
        capacity = self.index.capacity
        if keys > capacity:
            with self.lock:
                self.index.reserve(max(keys, int(capacity * GROWTH)))


def fetch_and_ef(n: int, ef: int, num_keys: int) -> tuple[int, int]:
    """Neighbours to ask the index for when ``n`` are wanted (:data:`TIE_MARGIN` more, at most
    every key), and the ef that search runs at (at least that many)."""
    fetch = min(n + TIE_MARGIN, num_keys)
    return fetch, max(ef, fetch)


def _only_visible(keys: np.ndarray, sims: np.ndarray, num_keys: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the keys below ``num_keys`` (best first), padded with −1 to ``n``."""
    out_keys = np.full((len(keys), n), -1, dtype=np.int64)
    out_sims = np.full((len(keys), n), -np.inf, dtype=np.float32)
    for i in range(len(keys)):
        visible = keys[i] < num_keys
        row_keys, row_sims = keys[i][visible][:n], sims[i][visible][:n]
        out_keys[i, : len(row_keys)], out_sims[i, : len(row_sims)] = row_keys, row_sims
    return out_keys, out_sims
