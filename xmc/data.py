"""Readers for the Extreme Classification Repository formats, into one dataset object.

Supported layouts:

* **JSON-lines gz** (LF-AmazonTitles style, and ``../shared/data/debian-related``):
  ``lbl.json.gz`` (one label per line, line number = label id, ``uid`` + ``title``) and
  ``<split>.json.gz`` (``uid``, ``title``, optional ``content``, ``target_ind``).
* **Raw text + sparse labels**: a text file with one instance text per line, and a sparse label
  file whose first line is ``rows cols`` followed by one line of ``idx:val`` pairs per row.
* **Filter files**: ``row label`` pairs (the instance *is* that label); their scores are removed
  before top-k at evaluation.

Everything at the boundary is plain Python lists + ``scipy.sparse.csr_matrix``. A malformed
line raises :class:`DataFormatError` naming the file and the 1-based line number.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp


class DataFormatError(ValueError):
    """A data file does not follow its format; the message starts with ``file:line:``."""

    def __init__(self, path: Path | str, lineno: int, problem: str):
        super().__init__(f"{path}:{lineno}: {problem}")
        self.path = str(path)
        self.lineno = lineno
        self.problem = problem


@dataclass
class LabelSpace:
    """The label side of a dataset: label id = position."""

    uids: list[str]
    texts: list[str]

    def __len__(self) -> int:
        return len(self.uids)


@dataclass
class XMCDataset:
    """One split of an XMC dataset.

    Attributes:
        texts: instance texts, ``n`` of them.
        uids: instance identifiers (line numbers as strings when the format has none).
        Y: ``n x L`` CSR matrix of relevance (1.0 for positives).
        labels: the label space (uids and texts), shared by all splits.
        filter_pairs: ``k x 2`` int array of ``(row, label)`` pairs to drop before top-k
            (empty when the split has no filter file).
    """

    texts: list[str]
    uids: list[str]
    Y: sp.csr_matrix
    labels: LabelSpace
    filter_pairs: np.ndarray

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def filter_sets(self) -> list[set[int]]:
        """Per instance, the label ids its filter file removes."""
        sets: list[set[int]] = [set() for _ in range(len(self))]
        for row, label in self.filter_pairs:
            sets[int(row)].add(int(label))
        return sets

    def subset(self, rows: np.ndarray | list[int]) -> XMCDataset:
        """The dataset restricted to ``rows`` (renumbered), filter pairs kept for those rows."""
        rows = np.asarray(rows, dtype=np.int64)
        new_row = {int(r): i for i, r in enumerate(rows)}
        pairs = [(new_row[int(r)], int(lab)) for r, lab in self.filter_pairs if int(r) in new_row]
        return XMCDataset(
            texts=[self.texts[r] for r in rows],
            uids=[self.uids[r] for r in rows],
            Y=self.Y[rows],
            labels=self.labels,
            filter_pairs=_pairs_array(pairs),
        )


def _open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def json_objects(path: Path) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` of each non-blank line of a JSON-lines file (gzipped or not);
    a :class:`DataFormatError` at the first line that is not a JSON object."""
    with _open_text(path) as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataFormatError(path, lineno, f"invalid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise DataFormatError(path, lineno, "expected a JSON object")
            yield lineno, obj


def _text_of(obj: dict, path: Path, lineno: int, use_content: bool) -> str:
    title = obj.get("title")
    if not isinstance(title, str):
        raise DataFormatError(path, lineno, "missing or non-string 'title'")
    content = obj.get("content")
    if use_content and isinstance(content, str) and content.strip():
        return f"{title} {content}"
    return title


def read_label_jsonl(path: Path | str) -> LabelSpace:
    """Read ``lbl.json.gz``: one ``{"uid", "title"}`` object per line; line order = label id."""
    path = Path(path)
    uids, texts = [], []
    for lineno, obj in json_objects(path):
        texts.append(_text_of(obj, path, lineno, use_content=False))
        uids.append(str(obj.get("uid", len(uids))))
    return LabelSpace(uids=uids, texts=texts)


def read_instances_jsonl(
    path: Path | str, num_labels: int, use_content: bool = False
) -> tuple[list[str], list[str], sp.csr_matrix]:
    """Read ``<split>.json.gz``: ``uid``, ``title``, optional ``content``, ``target_ind``.

    Returns:
        (texts, uids, Y) with Y an ``n x num_labels`` CSR matrix of ones.
    """
    path = Path(path)
    texts, uids, indptr, indices = [], [], [0], []
    for lineno, obj in json_objects(path):
        targets = obj.get("target_ind", [])
        if not isinstance(targets, list) or not all(isinstance(t, int) for t in targets):
            raise DataFormatError(path, lineno, "'target_ind' must be a list of integers")
        bad = [t for t in targets if not 0 <= t < num_labels]
        if bad:
            raise DataFormatError(path, lineno, f"label id {bad[0]} outside [0, {num_labels})")
        texts.append(_text_of(obj, path, lineno, use_content))
        uids.append(str(obj.get("uid", len(uids))))
        indices.extend(sorted(set(targets)))
        indptr.append(len(indices))
    Y = _csr(indptr, indices, np.ones(len(indices), dtype=np.float32), (len(texts), num_labels))
    return texts, uids, Y


def read_raw_texts(path: Path | str) -> list[str]:
    """One text per line (the repository's raw-text layout); trailing newline stripped."""
    path = Path(path)
    with _open_text(path) as fh:
        return [line.rstrip("\n") for line in fh]


def read_sparse_matrix(path: Path | str, num_cols: int | None = None) -> sp.csr_matrix:
    """Read the repository's sparse format: ``rows cols`` header, then ``idx:val`` pairs per row."""
    path = Path(path)
    with _open_text(path) as fh:
        header = fh.readline().split()
        if len(header) != 2 or not all(h.isdigit() for h in header):
            raise DataFormatError(path, 1, "header must be 'rows cols'")
        rows, cols = int(header[0]), int(header[1])
        if num_cols is not None and cols != num_cols:
            raise DataFormatError(path, 1, f"declares {cols} columns, expected {num_cols}")
        indptr, indices, values = [0], [], []
        for lineno, line in enumerate(fh, start=2):
            for pair in line.split():
                idx, sep, val = pair.partition(":")
                try:
                    col, value = int(idx), float(val) if sep else 1.0
                except ValueError:
                    raise DataFormatError(path, lineno, f"bad pair {pair!r}, expected idx:val") from None
                if not 0 <= col < cols:
                    raise DataFormatError(path, lineno, f"column {col} outside [0, {cols})")
                indices.append(col)
                values.append(value)
            indptr.append(len(indices))
    if len(indptr) - 1 != rows:
        raise DataFormatError(path, 1, f"header declares {rows} rows, file has {len(indptr) - 1}")
    return _csr(indptr, indices, np.asarray(values, dtype=np.float32), (rows, cols))


def read_filter(path: Path | str, num_rows: int, num_labels: int) -> np.ndarray:
    """Read a filter file of ``row label`` pairs into a ``k x 2`` int64 array (bounds checked)."""
    path = Path(path)
    pairs = []
    with _open_text(path) as fh:
        for lineno, line in enumerate(fh, start=1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) != 2 or not all(f.isdigit() for f in fields):
                raise DataFormatError(path, lineno, "expected two non-negative integers 'row label'")
            row, label = int(fields[0]), int(fields[1])
            if row >= num_rows:
                raise DataFormatError(path, lineno, f"row {row} outside [0, {num_rows})")
            if label >= num_labels:
                raise DataFormatError(path, lineno, f"label {label} outside [0, {num_labels})")
            pairs.append((row, label))
    return _pairs_array(pairs)


def load_jsonl_split(
    data_dir: Path | str, split: str, use_content: bool = False, labels: LabelSpace | None = None
) -> XMCDataset:
    """Load ``<data_dir>/<split>.json.gz`` with ``lbl.json.gz`` and ``filter_labels_<split>.txt``.

    The filter file is optional; when present it is always attached, so every evaluation
    applies it.
    """
    data_dir = Path(data_dir)
    labels = labels or read_label_jsonl(data_dir / "lbl.json.gz")
    texts, uids, Y = read_instances_jsonl(data_dir / f"{split}.json.gz", len(labels), use_content)
    filter_path = data_dir / f"filter_labels_{split}.txt"
    pairs = read_filter(filter_path, len(texts), len(labels)) if filter_path.exists() else _pairs_array([])
    return XMCDataset(texts=texts, uids=uids, Y=Y, labels=labels, filter_pairs=pairs)


def load_raw_split(
    text_path: Path | str,
    label_matrix_path: Path | str,
    label_text_path: Path | str,
    filter_path: Path | str | None = None,
) -> XMCDataset:
    """Load the raw-text layout: instance texts, a sparse ``X_Y`` file and label texts."""
    label_texts = read_raw_texts(label_text_path)
    labels = LabelSpace(uids=[str(i) for i in range(len(label_texts))], texts=label_texts)
    texts = read_raw_texts(text_path)
    Y = read_sparse_matrix(label_matrix_path, num_cols=len(labels))
    if Y.shape[0] != len(texts):
        raise DataFormatError(label_matrix_path, 1, f"{Y.shape[0]} rows but {len(texts)} texts in {text_path}")
    pairs = read_filter(filter_path, len(texts), len(labels)) if filter_path else _pairs_array([])
    uids = [str(i) for i in range(len(texts))]
    return XMCDataset(texts=texts, uids=uids, Y=Y, labels=labels, filter_pairs=pairs)


def first_rows(dataset: XMCDataset, limit: int) -> XMCDataset:
    """The first ``limit`` instances (0 = all): the smoke-run cut of ``max_train``/``max_dev``."""
    return dataset.subset(np.arange(min(limit, len(dataset)))) if limit else dataset


def load_train_and_dev(
    data_dir: Path | str, train_split: str, dev_split: str, max_train: int = 0, max_dev: int = 0
) -> tuple[XMCDataset, XMCDataset | None]:
    """A training run's splits: the (cut) training split, and the (cut) dev split read over the
    training split's label space so that label ids agree; ``dev_split=""`` gives no dev split."""
    train = first_rows(load_jsonl_split(data_dir, train_split), max_train)
    if not dev_split:
        return train, None
    return train, first_rows(load_jsonl_split(data_dir, dev_split, labels=train.labels), max_dev)


def split_holdout(dataset: XMCDataset, count: int, seed: int) -> tuple[XMCDataset, XMCDataset]:
    """``dataset`` as (the rest, ``count`` instances drawn at random with ``seed``), rows in their
    original order on both sides; the same arguments always draw the same instances."""
    if not 0 <= count < len(dataset):
        raise ValueError(f"holdout must be in [0, {len(dataset)}): got {count}")
    held = np.zeros(len(dataset), dtype=bool)
    held[np.random.default_rng(seed).choice(len(dataset), size=count, replace=False)] = True
    return dataset.subset(np.flatnonzero(~held)), dataset.subset(np.flatnonzero(held))


def rows_of_uids(dataset: XMCDataset, uids: list[str]) -> np.ndarray:
    """The rows of ``dataset`` whose uids are ``uids`` (in that order); an unknown or ambiguous
    uid is an error, not a silent skip."""
    rows: dict[str, int] = {}
    for row, uid in enumerate(dataset.uids):
        rows[uid] = -1 if uid in rows else row
    missing = [uid for uid in uids if rows.get(uid, -1) < 0]
    if missing:
        raise ValueError(f"{len(missing)} uids are not (uniquely) in the split, e.g. {missing[:3]}")
    return np.array([rows[uid] for uid in uids], dtype=np.int64)


def label_frequencies(Y: sp.csr_matrix) -> np.ndarray:
    """Number of instances each label is positive for (the propensity and segment input)."""
    return np.asarray((Y > 0).sum(axis=0)).ravel().astype(np.int64)


def _csr(indptr, indices, data, shape) -> sp.csr_matrix:
    return sp.csr_matrix((data, np.asarray(indices, dtype=np.int64), np.asarray(indptr, dtype=np.int64)), shape=shape)


def _pairs_array(pairs: list[tuple[int, int]]) -> np.ndarray:
    return np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
