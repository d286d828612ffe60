"""Users' own data into the Extreme Classification Repository layout that every stage reads.

    python -m xmc.convert --split trn=train.csv [--split dev=dev.csv | --dev-share 0.1] \\
        [--labels labels.csv] [--dataset hf-dir] [--filter dev=same_item_dev.csv] \\
        [--text-column text] [--labels-column labels] [--uid-column uid] --out data/mine

Inputs, told apart by their suffix: CSV (``.csv``, with a header), TSV (``.tsv``/``.tab``, with a
header), Parquet (``.parquet``/``.pq``, ``pyarrow``), JSON lines (``.jsonl``/``.json``), or a
directory a Hugging Face ``datasets`` Dataset was saved to (``save_to_disk``: read with
``pyarrow``, ``datasets`` need not be installed):

* each **split** (``--split trn=FILE``, ``dev``, ...): an instance a row, its text in
  ``--text-column`` (default ``text``), its labels in ``--labels-column`` (default ``labels``) and
  its uid in ``--uid-column`` (default: the ``uid`` column where the file has one, else the row
  number, 0-based). ``--dataset DIR`` reads a saved DatasetDict: its ``train``, ``validation``
  and ``test`` splits become ``trn``, ``dev`` and ``tst``.
* the **label table** (``--labels FILE``, optional): a label a row, its uid in
  ``--label-uid-column`` (default ``uid``) and its text in ``--label-text-column`` (default
  ``text``); an instance's labels name them by uid (``--labels-by uid``, the default) or by their
  0-based row (``--labels-by id``). **Without a label table** the labels are the names found in the
  training split's labels (sorted), each label's uid and text its name; a dev or test instance's
  label outside them is dropped, and an instance left with none of its labels is dropped (the
  summary counts both): training never saw them, so they would only count as misses.
* a **labels cell**: a list in JSON lines, Parquet or a dataset (a ``ClassLabel`` feature's ids are
  read as its names, unless ``--labels-by id``), or one string: a JSON list (``["a", "b"]``) or
  names split on ``--labels-separator`` (default ``|``).
* optional **filter pairs** of a split (``--filter dev=FILE``): columns ``uid`` (an instance of
  that split) and ``label`` (as in the labels cell): the instance *is* that label, so evaluation
  removes it from the ranking.
* **a dev split drawn from trn** (``--dev-share FRACTION``, ``--seed``) where no dev split is
  given: that share of the training rows, drawn as the data set builders draw theirs (the rows in
  uid order, shuffled with the seed), so the same inputs and seed always draw the same rows;
  filter pairs of trn follow their instances. The summary says what was drawn.

What it writes (:mod:`xmc.data` reads it: ``load_jsonl_split(out, "trn")``): ``lbl.json.gz``
(``uid``, ``title``; line = label id), ``<split>.json.gz`` (``uid``, ``title``, ``target_ind``)
and ``filter_labels_<split>.txt`` (``row label`` pairs).

Everything is checked before anything is written; each refusal names the file, the row (1 = the
first record after any header) and the reason: an unknown label, an empty text or uid, a
duplicate uid, a missing column (with the columns the file has), a row with more or fewer fields
than its header, a label id out of range, a filter pair naming an unknown instance. All refusals
are listed (up to ``--max-errors``), and the command exits 1 without writing.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from xmc.command import program
from xmc.data import DataFormatError, json_objects

SUFFIXES = {
    ".csv": "csv",
    ".tsv": "tsv",
    ".tab": "tsv",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "jsonl",
    ".json": "jsonl",
}
DELIMITERS = {"csv": ",", "tsv": "\t"}
LABELS_BY = ("uid", "id")
# a saved DatasetDict's split names → the layout's
DATASET_SPLITS = {"train": "trn", "validation": "dev", "valid": "dev", "dev": "dev", "test": "tst"}


class ConversionRefused(ValueError):
    """The inputs have problems; ``problems`` lists each as ``file: row n: reason``."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass
class ConvertParams:
    """What to convert and how; the command line's options (``python -m xmc.convert --help``).

    Attributes:
        splits: split name (``trn``, ``dev``, ...) → its file or saved ``datasets`` Dataset directory
        out: the output data directory
        labels: the label table; None: the labels are the names the training split holds
        dataset: a saved ``datasets`` DatasetDict directory whose train/validation/test splits are
            read as trn/dev/tst (beside ``splits``)
        filters: split name → its filter pairs file
        labels_by: ``uid``: labels name the table's uids; ``id``: its 0-based rows
        separator: splits a labels cell given as one string
        text_column, labels_column: the instances' columns
        uid_column: the instances' uid column; None: ``uid`` where a file has it, else row numbers
        label_uid_column, label_text_column: the label table's columns
        dev_share: the share of trn drawn as dev (0: none), where no dev split is given
        seed: the seed of that draw
        max_errors: refusals listed before the rest are counted
    """

    splits: dict[str, Path]
    out: Path
    labels: Path | None = None
    dataset: Path | None = None
    filters: dict[str, Path] = field(default_factory=dict)
    labels_by: str = "uid"
    separator: str = "|"
    text_column: str = "text"
    labels_column: str = "labels"
    uid_column: str | None = None
    label_uid_column: str = "uid"
    label_text_column: str = "text"
    dev_share: float = 0.0
    seed: int = 0
    max_errors: int = 50


@dataclass
class Summary:
    """What a conversion wrote: ``counts`` (labels, instances per split, filter pairs) and
    ``notes`` (a drawn dev split, the label space's origin, what was dropped)."""

    out: Path
    counts: dict[str, int]
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        counts = ", ".join(f"{name} {count}" for name, count in self.counts.items())
        return [f"wrote {self.out}: {counts}", *(f"  {note}" for note in self.notes)]


@dataclass
class Problems:
    """The refusals found so far; past ``limit`` they are counted, not kept."""

    limit: int = 50
    found: list[str] = field(default_factory=list)
    more: int = 0

    def add(self, path: Path, row: int | None, reason: str) -> None:
        if len(self.found) >= self.limit:
            self.more += 1
            return
        self.found.append(f"{path}: {f'row {row}: ' if row is not None else ''}{reason}")

    def add_refused(self, refused: ConversionRefused) -> None:
        for problem in refused.problems:
            if len(self.found) >= self.limit:
                self.more += 1
            else:
                self.found.append(problem)

    def raise_any(self) -> None:
        if self.found:
            extra = [f"... and {self.more} more"] if self.more else []
            raise ConversionRefused(self.found + extra)


# --- reading a file's records, whatever its format -------------------------------------------------


@dataclass
class Source:
    """One input's records: ``columns`` (None for JSON lines, where each record has its own keys),
    ``records`` yielding ``(row, record)`` (row 1 = the first record; a record that is a string is
    that row's refusal, e.g. a CSV row with more fields than its header) and, for a saved dataset,
    the names of its ``ClassLabel`` columns' ids."""

    path: Path
    columns: list[str] | None
    records: Iterator[tuple[int, dict | str]]
    class_names: dict[str, list[str]] = field(default_factory=dict)


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and (path / "state.json").is_file()


def is_saved_dataset_dict(path: Path) -> bool:
    return path.is_dir() and (path / "dataset_dict.json").is_file()


def open_source(path: Path) -> Source:
    """The records of a CSV, TSV, Parquet or JSON-lines file, or of a saved ``datasets`` Dataset."""
    if is_saved_dataset_dict(path):
        raise ConversionRefused([f"{path}: a saved DatasetDict (give it with --dataset, or one split: {path}/train)"])
    if is_saved_dataset(path):
        return open_saved_dataset(path)
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        formats = ", ".join(sorted(SUFFIXES))
        raise ConversionRefused([f"{path}: unknown format (expected one of {formats}, or a saved datasets directory)"])
    if not path.is_file():
        raise ConversionRefused([f"{path}: no such file"])
    if kind in DELIMITERS:
        return open_delimited(path, DELIMITERS[kind])
    if kind == "parquet":
        import pyarrow.parquet as pq  # only for Parquet inputs (the train extra installs it)

        table = pq.ParquetFile(path)
        return Source(path, list(table.schema_arrow.names), numbered(table.iter_batches(batch_size=8192)))
    return Source(path, None, json_records(path))


def open_delimited(path: Path, delimiter: str) -> Source:
    # utf-8-sig: a spreadsheet's export often starts with a byte order mark, not part of the header
    with open(path, newline="", encoding="utf-8-sig") as fh:
        header = next(csv.reader(fh, delimiter=delimiter), [])
    if not header:
        raise ConversionRefused([f"{path}: empty (expected a header row)"])

    def records() -> Iterator[tuple[int, dict | str]]:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            reader = csv.reader(fh, delimiter=delimiter)
            next(reader)
            row = 0
            for fields in reader:
                if not fields:
                    continue  # blank lines are not rows, as csv.DictReader has it
                row += 1
                if len(fields) != len(header):
                    hint = "quoted" if delimiter == "," else "quoted, or the file read as CSV"
                    yield row, f"{len(fields)} fields, the header has {len(header)} (a delimiter in a text: {hint})"
                else:
                    yield row, dict(zip(header, fields, strict=True))

    return Source(path, header, records())


def json_records(path: Path) -> Iterator[tuple[int, dict | str]]:
    row = 0  # records, not lines: blank lines are not rows, as in the other formats
    try:
        for _, record in json_objects(path):
            row += 1
            yield row, record
    except DataFormatError as exc:
        yield row + 1, f"{exc.problem} (the rest of the file is not read)"


def numbered(batches) -> Iterator[tuple[int, dict | str]]:
    """``(row, record)`` of Arrow record batches, row 1 = the first record of the first batch."""
    row = 0
    for batch in batches:
        for record in batch.to_pylist():
            row += 1
            yield row, record


def open_saved_dataset(path: Path) -> Source:
    """A ``datasets`` Dataset saved to disk, read with pyarrow: the Arrow stream files its
    ``state.json`` lists (``_data_files``, in order), and the ``ClassLabel`` names of
    ``dataset_info.json``'s features."""
    import pyarrow as pa  # only for saved datasets (the train extra installs it)

    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
        files = [path / entry["filename"] for entry in state["_data_files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ConversionRefused([f"{path}/state.json: not a saved dataset's state ({exc})"]) from None
    missing = [str(file) for file in files if not file.is_file()]
    if missing or not files:
        raise ConversionRefused([f"{path}: state.json lists no data files, or missing ones: {missing}"])

    def reader(file: Path):
        try:
            return pa.ipc.open_stream(pa.memory_map(str(file)))  # what save_to_disk writes
        except pa.ArrowInvalid:
            return pa.ipc.open_file(pa.memory_map(str(file)))

    try:
        schema = reader(files[0]).schema
    except pa.ArrowInvalid as exc:
        raise ConversionRefused([f"{files[0]}: not an Arrow file ({exc})"]) from None
    features = saved_features(path, schema.metadata or {})

    def batches():
        for file in files:
            yield from reader(file)

    names = {column: found for column, feature in features.items() if (found := class_label_names(feature))}
    return Source(path, list(schema.names), numbered(batches()), names)


def saved_features(path: Path, metadata: dict) -> dict:
    """A saved dataset's features: ``dataset_info.json``'s, else those ``datasets`` also puts in
    the Arrow schema's metadata (``huggingface``: ``{"info": {"features": ...}}``); {} if neither."""
    for read in (
        lambda: json.loads((path / "dataset_info.json").read_text(encoding="utf-8"))["features"],
        lambda: json.loads(metadata[b"huggingface"])["info"]["features"],
    ):
        try:
            features = read()
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(features, dict):
            return features
    return {}


def class_label_names(feature) -> list[str] | None:
    """A ``ClassLabel`` feature's names, also inside a ``Sequence``/``List`` (``datasets``'
    ``dataset_info.json``: ``{"_type": "ClassLabel", "names": [...]}``; a list of one feature is an
    old-style sequence); None for any other feature."""
    if isinstance(feature, list) and len(feature) == 1:
        return class_label_names(feature[0])
    if not isinstance(feature, dict):
        return None
    kind = feature.get("_type")
    if kind == "ClassLabel":
        names = feature.get("names")
        return [str(name) for name in names] if isinstance(names, list) and names else None
    if kind in ("Sequence", "List", "LargeList"):
        return class_label_names(feature.get("feature"))
    return None


def dataset_dict_splits(path: Path) -> tuple[dict[str, Path], list[str]]:
    """A saved DatasetDict's splits as ``{layout name: directory}`` (train → trn, validation →
    dev, test → tst) and the names of those it has under other names (not read)."""
    if not is_saved_dataset_dict(path):
        hint = f" (a single Dataset: --split trn={path})" if is_saved_dataset(path) else ""
        raise ConversionRefused([f"--dataset {path}: not a saved DatasetDict (no dataset_dict.json){hint}"])
    try:
        names = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ConversionRefused([f"{path}/dataset_dict.json: no list of splits ({exc})"]) from None
    splits: dict[str, Path] = {}
    other = []
    for name in names:
        layout = DATASET_SPLITS.get(str(name).lower())
        if layout is None:
            other.append(str(name))
        elif layout in splits:
            raise ConversionRefused([f"{path}: splits {splits[layout].name!r} and {name!r} are both {layout}"])
        else:
            splits[layout] = path / str(name)
    return splits, other


# --- columns ---------------------------------------------------------------------------------------


Wanted = dict[str, str]  # the columns read of a source: each name → how to name another (its option)


@dataclass
class Rows:
    """A source's records that have the wanted columns (the others refused as they are read),
    and the columns it has: the header's, or a JSON-lines file's first record's keys."""

    columns: list[str]
    records: Iterator[tuple[int, dict]]


def source_or_refusal(path: Path, problems: Problems) -> Source | None:
    """``open_source(path)``, or None with its refusal added: the other inputs are still checked."""
    try:
        return open_source(path)
    except ConversionRefused as refused:
        problems.add_refused(refused)
        return None


def open_rows(source: Source | None, wanted: Wanted, problems: Problems) -> Rows | None:
    """The rows of ``source``, or None where a wanted column is missing or the file cannot be read
    from its start (refused once, with the columns it has) or opened at all (``source`` None)."""
    if source is None:
        return None
    records = iter(source.records)
    first = next(records, None)
    if first is None:
        return Rows(source.columns or [], iter(()))
    if source.columns is None and isinstance(first[1], str):  # JSON lines unreadable from the start
        problems.add(source.path, first[0], first[1])
        return None
    have = source.columns if source.columns is not None else list(first[1])
    where = "its columns" if source.columns is not None else "its first record's keys"
    missing = [column for column in wanted if column not in have]
    for column in missing:
        listed = ", ".join(have) or "none"
        problems.add(source.path, None, f"no column {column!r} ({where}: {listed}; {wanted[column]})")
    return None if missing else Rows(have, checked_rows(source.path, _chain(first, records), wanted, problems))


def checked_rows(path: Path, records, wanted: Wanted, problems: Problems) -> Iterator[tuple[int, dict]]:
    for row, record in records:
        if isinstance(record, str):
            problems.add(path, row, record)
            continue
        absent = [column for column in wanted if column not in record]
        if absent:  # JSON lines only: a header's columns are in every row
            problems.add(path, row, f"no {absent[0]!r} key (its keys: {', '.join(record) or 'none'})")
            continue
        yield row, record


def _chain(first, rest):
    yield first
    yield from rest


def cell_text(record: dict, column: str, what: str, path: Path, row: int, problems: Problems) -> str | None:
    value = record.get(column)
    text = "" if value is None else str(value).strip()
    if not text:
        problems.add(path, row, f"empty {what}")
        return None
    return text


def label_entries(value, separator: str) -> list:
    """A labels cell as a list: a list as it is, a string holding a JSON list as that list, any
    other string split on ``separator``, one value as a list of it."""
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("[") and text.endswith("]"):
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = None
            if isinstance(parsed, list):
                return parsed
        return [part.strip() for part in value.split(separator) if part.strip()]
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


# --- the label table and the instances ----------------------------------------------------------------


@dataclass
class Records:
    """The rows kept of one input file: uids and texts in order, each uid's position among them
    (``ids``), and the input row each uid was first seen on (a later row with it is a duplicate)."""

    uids: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    ids: dict[str, int] = field(default_factory=dict)
    first_row: dict[str, int] = field(default_factory=dict)

    def first_time(self, uid: str, path: Path, row: int, problems: Problems) -> bool:
        """Whether ``uid`` is new here; a duplicate is refused, naming the row it was first seen on."""
        if uid in self.first_row:
            problems.add(path, row, f"duplicate uid {uid!r} (first at row {self.first_row[uid]})")
            return False
        self.first_row[uid] = row
        return True

    def keep(self, uid: str, text: str) -> None:
        self.ids[uid] = len(self.uids)
        self.uids.append(uid)
        self.texts.append(text)


Labels = Records  # the label table: a label's id is its position


@dataclass
class Instances(Records):
    """A split's instances as read, each with its labels: ids of the label table, or without one
    the names the labels cell holds (looked up once trn's names are known)."""

    entries: list[list] = field(default_factory=list)

    def add(self, uid: str, text: str, entries: list) -> None:
        self.keep(uid, text)
        self.entries.append(entries)

    def take(self, positions: list[int]) -> Instances:
        """Those at ``positions``, in that order (a share drawn, or the rest)."""
        part = Instances()
        for i in positions:
            part.add(self.uids[i], self.texts[i], self.entries[i])
        return part


@dataclass
class Split:
    """A split as written: uids, texts and label ids."""

    uids: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    targets: list[list[int]] = field(default_factory=list)


def read_labels(path: Path, params: ConvertParams, problems: Problems) -> Labels | None:
    """The label table: a uid and a text per row; a duplicate uid or an empty text is refused.
    None where a column is missing (refused): no label can be looked up in it."""
    labels = Labels()
    uid_column, text_column = params.label_uid_column, params.label_text_column
    wanted = {uid_column: "--label-uid-column names another", text_column: "--label-text-column names another"}
    rows = open_rows(source_or_refusal(path, problems), wanted, problems)
    if rows is None:
        return None
    for row, record in rows.records:
        uid = cell_text(record, uid_column, "uid", path, row, problems)
        text = cell_text(record, text_column, "text", path, row, problems)
        if uid is not None and labels.first_time(uid, path, row, problems) and text is not None:
            labels.keep(uid, text)
    if not labels.uids and not problems.found:
        problems.add(path, None, "no labels")
    return labels


def read_instances(path: Path, params: ConvertParams, table: Labels | None, problems: Problems) -> Instances:
    """A split's instances: text, uid and labels of each row; the labels as ids of ``table``, or
    without one as the names they are (looked up once trn's names are known)."""
    source = source_or_refusal(path, problems)
    wanted = {
        params.text_column: "--text-column names another",
        params.labels_column: "--labels-column names another",
    }
    uid_column = params.uid_column
    if uid_column is not None:
        wanted[uid_column] = "--uid-column names another"
    instances = Instances()
    rows = open_rows(source, wanted, problems)
    if rows is None:
        return instances
    if uid_column is None and "uid" in rows.columns:
        uid_column = "uid"  # a file's own uid column, read as before there was --uid-column
    names = source.class_names.get(params.labels_column) if params.labels_by == "uid" else None
    for row, record in rows.records:
        text = cell_text(record, params.text_column, "text", path, row, problems)
        if uid_column is None:
            uid = str(row - 1)
        elif uid_column not in record:
            problems.add(path, row, f"no {uid_column!r} key (its keys: {', '.join(record)})")
            continue
        else:
            uid = cell_text(record, uid_column, "uid", path, row, problems)
            if uid is None:
                continue
        entries = label_entries(record[params.labels_column], params.separator)
        if names is not None:
            entries = class_label_entries(entries, names, path, row, problems)
        if entries is not None:
            entries = [entry for entry in entries if str(entry).strip()]
        if table is not None and entries is not None:
            ids = [label_id(entry, table, params.labels_by, path, row, problems) for entry in entries]
            entries = None if None in ids else ids
        if instances.first_time(uid, path, row, problems) and text is not None and entries is not None:
            instances.add(uid, text, entries)
    return instances


def class_label_entries(entries: list, names: list[str], path: Path, row: int, problems: Problems) -> list | None:
    """A ``ClassLabel`` column's ids as its names (-1, datasets' "no label", dropped)."""
    out = []
    for entry in entries:
        if isinstance(entry, int) and not isinstance(entry, bool):
            if entry == -1:
                continue
            if not 0 <= entry < len(names):
                problems.add(path, row, f"label id {entry} outside the {len(names)} names of its ClassLabel")
                return None
            out.append(names[entry])
        else:
            out.append(entry)
    return out


def label_id(name, labels: Labels, labels_by: str, path: Path, row: int, problems: Problems) -> int | None:
    """The label id a labels entry names in the label table, or None (with its refusal added)."""
    if labels_by == "uid":
        found = labels.ids.get(str(name).strip())
        if found is None:
            problems.add(path, row, f"unknown label {str(name)!r} (not a uid of the label table)")
        return found
    try:
        number = int(str(name).strip())
    except ValueError:
        problems.add(path, row, f"label {name!r} is not a label id (--labels-by id)")
        return None
    if not 0 <= number < len(labels.uids):
        problems.add(path, row, f"unknown label id {number} (the label table has {len(labels.uids)} rows)")
        return None
    return number


OUTSIDE = -1  # a label name outside a label space of names: dropped, not refused


@dataclass
class LabelSpace:
    """The labels written: the table's (``table``: the instances' labels are its ids already), or
    the names of the training split, each its own text. ``look_up`` gives a name's label id, or
    :data:`OUTSIDE` where the space lacks it: dropped, where a table's unknown label is refused."""

    labels: Labels
    table: bool

    @classmethod
    def of_names(cls, instances: Instances) -> LabelSpace:
        labels = Labels()
        for name in sorted({str(entry).strip() for entries in instances.entries for entry in entries}):
            labels.keep(name, name)
        return cls(labels, table=False)

    def look_up(self, entry) -> int:
        return entry if self.table else self.labels.ids.get(str(entry).strip(), OUTSIDE)


@dataclass
class Dropped:
    """Per split, what a label space without a table leaves out: labels, and instances left without any."""

    positives: int = 0
    instances: int = 0
    names: set[str] = field(default_factory=set)


def resolve(instances: Instances, space: LabelSpace) -> tuple[Split, dict[str, int], Dropped]:
    """The split with label ids; ``kept`` maps a kept instance's uid to its row in the split."""
    split, kept, dropped = Split(), {}, Dropped()
    for uid, text, entries in zip(instances.uids, instances.texts, instances.entries, strict=True):
        ids = [space.look_up(entry) for entry in entries]
        known = [i for i in ids if i != OUTSIDE]
        if len(known) < len(ids):
            dropped.positives += len(ids) - len(known)
            dropped.names.update(str(e).strip() for e, i in zip(entries, ids, strict=True) if i == OUTSIDE)
            if not known:
                dropped.instances += 1
                continue
        kept[uid] = len(split.uids)
        split.uids.append(uid)
        split.texts.append(text)
        split.targets.append(sorted(set(known)))
    return split, kept, dropped


# --- filter pairs ---------------------------------------------------------------------------------


FILTER_COLUMNS = "filter pairs have columns uid and label"


@dataclass
class FilterPair:
    """An instance's uid and the label it is: an id of the label table, or without one a name."""

    uid: str
    label: int | str


def read_filter_pairs(
    path: Path, instances: Instances, table: Labels | None, labels_by: str, problems: Problems
) -> list[FilterPair]:
    """A split's filter pairs (``uid``, ``label``), each naming an instance of that split and a
    label (an id of ``table``, or without one a name)."""
    pairs = []
    rows = open_rows(source_or_refusal(path, problems), {"uid": FILTER_COLUMNS, "label": FILTER_COLUMNS}, problems)
    for row, record in rows.records if rows is not None else ():
        uid, label = record.get("uid"), record.get("label")
        if uid in (None, "") or label in (None, ""):
            problems.add(path, row, "a filter pair needs 'uid' and 'label'")
            continue
        instance = str(uid).strip()
        if instance not in instances.ids:
            problems.add(path, row, f"unknown instance uid {str(uid)!r}")
        if table is not None:
            label = label_id(label, table, labels_by, path, row, problems)
        if instance in instances.ids and label is not None:
            pairs.append(FilterPair(instance, label))
    return pairs


def filter_rows(pairs: list[FilterPair], kept: dict[str, int], space: LabelSpace) -> tuple[list[tuple[int, int]], int]:
    """``(row, label)`` pairs of a split's kept instances, and how many were dropped (an instance
    or, with no label table, a label the split does not have)."""
    rows, dropped = set(), 0
    for pair in pairs:
        found = space.look_up(pair.label)
        if found == OUTSIDE or pair.uid not in kept:
            dropped += 1
        else:
            rows.add((kept[pair.uid], found))
    return sorted(rows), dropped


# --- a dev split drawn from trn -----------------------------------------------------------------------


def draw_share(uids: list[str], share: float, seed: int) -> list[int]:
    """The positions of ``round(share * n)`` of ``uids`` drawn at random with ``seed``, in order.
    As data/builders.py's shuffle_split draws: in uid order, shuffled by ``random.Random(seed)``,
    so the draw depends on the uids and the seed, not on the order the file lists them in."""
    order = sorted(range(len(uids)), key=uids.__getitem__)
    random.Random(seed).shuffle(order)
    return sorted(order[: round(share * len(uids))])


# --- the conversion ---------------------------------------------------------------------------------


def named_paths(items: list[str], option: str) -> dict[str, Path]:
    """``NAME=FILE`` arguments as a mapping; a name given twice or a malformed item is an error."""
    named: dict[str, Path] = {}
    for item in items:
        name, sep, file = item.partition("=")
        if not sep or not name or not file or not name.replace("_", "").replace("-", "").isalnum():
            raise ConversionRefused([f"{option} {item!r}: expected NAME=FILE (NAME like trn or dev)"])
        if name in named:
            raise ConversionRefused([f"{option}: split {name!r} given twice"])
        named[name] = Path(file)
    return named


def input_splits(params: ConvertParams, notes: list[str]) -> dict[str, Path]:
    """``params.splits`` with a DatasetDict's splits; each split given once, the options consistent."""
    splits = dict(params.splits)
    if params.dataset is not None:
        found, other = dataset_dict_splits(params.dataset)
        twice = sorted(set(found) & set(splits))
        if twice:
            raise ConversionRefused([f"--split {name}: also split {found[name].name!r} of --dataset" for name in twice])
        splits.update(found)
        if other:
            hint = f"--split NAME={params.dataset}/<split> reads one"
            notes.append(f"not read: split(s) {', '.join(other)} of {params.dataset} ({hint})")
    wrong = []
    if params.labels_by not in LABELS_BY:
        wrong.append(f"--labels-by {params.labels_by!r}: expected one of {', '.join(LABELS_BY)}")
    if not splits:
        wrong.append("no split given (--split trn=FILE, or --dataset DIR)")
    wrong += [f"--filter {name}: no split {name}" for name in sorted(set(params.filters) - set(splits))]
    if params.labels is None and "trn" not in splits:
        wrong.append("without a label table (--labels), the labels are trn's: give --split trn=FILE")
    if params.labels is None and params.labels_by == "id":
        wrong.append("--labels-by id names rows of a label table: give --labels FILE")
    if params.dev_share:
        if not 0 < params.dev_share < 1:
            wrong.append(f"--dev-share {params.dev_share}: expected a fraction between 0 and 1")
        if "trn" not in splits:
            wrong.append("--dev-share draws dev from trn: give --split trn=FILE")
        if "dev" in splits:
            wrong.append(f"--dev-share: a dev split is given ({splits['dev']}); give one or the other")
    if wrong:
        raise ConversionRefused(wrong)
    return splits


def convert(params: ConvertParams) -> Summary:
    """Validate every input, then write the repository layout under ``params.out``; returns what
    was written. Raises :class:`ConversionRefused` (nothing written) on any problem."""
    notes: list[str] = []
    splits = input_splits(params, notes)
    problems = Problems(limit=params.max_errors)
    table = read_labels(params.labels, params, problems) if params.labels is not None else None
    read = {name: read_instances(path, params, table, problems) for name, path in splits.items()}
    pairs = {
        name: read_filter_pairs(path, read[name], table, params.labels_by, problems)
        for name, path in params.filters.items()
    }
    if params.labels is not None and table is None:
        problems.raise_any()  # the table's columns are refused: no label was looked up in it
    if params.dev_share:
        read, pairs = draw_dev(read, pairs, splits["trn"], params, notes, problems)

    space = LabelSpace(table, table=True) if table is not None else LabelSpace.of_names(read["trn"])
    if table is None:
        notes.append(f"labels: the {len(space.labels.uids)} names in trn's labels, each its own text (no --labels)")
    written, filters = {}, {}
    for name, instances in read.items():
        split, kept, dropped = resolve(instances, space)
        written[name] = split
        if dropped.positives:
            shown = ", ".join(sorted(dropped.names)[:5]) + (", ..." if len(dropped.names) > 5 else "")
            notes.append(
                f"{name}: dropped {dropped.positives} label(s) not in trn ({shown}) and {dropped.instances}"
                " instance(s) left with none"
            )
        if name in pairs:
            filters[name], lost = filter_rows(pairs[name], kept, space)
            if lost:
                notes.append(f"{name}: dropped {lost} filter pair(s) of a dropped instance or label")
    if not space.labels.uids and not problems.found:
        problems.add(splits["trn"], None, f"no labels (the {params.labels_column!r} cells are all empty)")
    problems.raise_any()
    return write_layout(params.out, space.labels, written, filters, notes)


def draw_dev(
    read: dict[str, Instances],
    pairs: dict[str, list[FilterPair]],
    trn_path: Path,
    params: ConvertParams,
    notes: list[str],
    problems: Problems,
) -> tuple[dict[str, Instances], dict[str, list[FilterPair]]]:
    """trn split into trn and a dev of ``params.dev_share`` of its rows; trn's filter pairs follow
    their instances."""
    trn = read["trn"]
    if not trn.uids and problems.found:
        return read, pairs  # trn is refused already: no share of it to draw
    drawn = draw_share(trn.uids, params.dev_share, params.seed)
    if not 0 < len(drawn) < len(trn.uids):
        problems.add(
            trn_path,
            None,
            f"--dev-share {params.dev_share} of its {len(trn.uids)} instances draws {len(drawn)} (a dev split"
            " needs one instance, and trn one left)",
        )
        return read, pairs
    chosen = set(drawn)
    read = dict(read)
    read["trn"] = trn.take([i for i in range(len(trn.uids)) if i not in chosen])
    read["dev"] = trn.take(drawn)
    if "trn" in pairs:
        pairs = dict(pairs)
        dev_uids = set(read["dev"].uids)
        pairs["dev"] = [pair for pair in pairs["trn"] if pair.uid in dev_uids]
        pairs["trn"] = [pair for pair in pairs["trn"] if pair.uid not in dev_uids]
    drawn_by = f"--dev-share {params.dev_share}, --seed {params.seed}"
    notes.append(f"dev: {len(drawn)} of trn's {len(trn.uids)} instances drawn ({drawn_by})")
    return read, pairs


def write_layout(
    out: Path, labels: Labels, splits: dict[str, Split], filters: dict[str, list[tuple[int, int]]], notes: list[str]
) -> Summary:
    out.mkdir(parents=True, exist_ok=True)
    write_json_lines(
        out / "lbl.json.gz", ({"uid": u, "title": t} for u, t in zip(labels.uids, labels.texts, strict=True))
    )
    counts = {"labels": len(labels.uids)}
    for name, split in splits.items():
        records = zip(split.uids, split.texts, split.targets, strict=True)
        write_json_lines(out / f"{name}.json.gz", ({"uid": u, "title": t, "target_ind": y} for u, t, y in records))
        counts[name] = len(split.uids)
    for name, pairs in filters.items():
        (out / f"filter_labels_{name}.txt").write_text("".join(f"{row} {label}\n" for row, label in pairs))
        counts[f"filter_labels_{name}"] = len(pairs)
    return Summary(out, counts, notes)


def write_json_lines(path: Path, records) -> None:
    # mtime=0: the same inputs give the same bytes (a bundle records its data's content)
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as fh:
        for record in records:
            fh.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=program("xmc.convert"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--split",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="a split's instances (a CSV, TSV, Parquet or JSON-lines file, or a saved datasets Dataset directory);"
        " repeat for trn, dev, ...",
    )
    parser.add_argument(
        "--dataset",
        type=Path,
        metavar="DIR",
        help="a saved datasets DatasetDict (save_to_disk): its train, validation and test splits become trn, dev, tst",
    )
    parser.add_argument(
        "--labels",
        type=Path,
        metavar="FILE",
        help="label table (columns --label-uid-column, --label-text-column); without it the labels are the names"
        " trn's labels hold, each its own text, and dev/tst labels outside them are dropped",
    )
    column = {"metavar": "COLUMN"}
    parser.add_argument("--text-column", default="text", **column, help="the instances' text column (default: text)")
    labels_help = "the instances' labels: label names or ids (default: labels)"
    parser.add_argument("--labels-column", default="labels", **column, help=labels_help)
    parser.add_argument(
        "--uid-column",
        **column,
        help="the instances' uid column (default: uid where a file has it, else the row number, 0-based)",
    )
    parser.add_argument("--label-uid-column", default="uid", **column, help="the label table's uids (default: uid)")
    parser.add_argument(
        "--label-text-column",
        default="text",
        **column,
        help="the label table's text column (default: text; its uid column again for a table of names only)",
    )
    parser.add_argument(
        "--filter",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="filter pairs of split NAME: columns uid (instance) and label (the instance is that label)",
    )
    parser.add_argument(
        "--labels-by",
        choices=LABELS_BY,
        default="uid",
        help="how labels and filter pairs name a label: its uid in the label table, or its 0-based row there",
    )
    parser.add_argument(
        "--labels-separator",
        "--separator",
        dest="separator",
        default="|",
        metavar="SEP",
        help="splits a labels cell given as one string (not a JSON list) into labels (default: |)",
    )
    parser.add_argument(
        "--dev-share",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="where no dev split is given: draw this share of trn's instances as dev (seeded; default: 0, none)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the seed of the --dev-share draw (default: 0)")
    parser.add_argument("--max-errors", type=int, default=50, help="refusals listed before the rest are counted")
    parser.add_argument("--out", type=Path, required=True, help="output data directory (the repository layout)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary = convert(
            ConvertParams(
                splits=named_paths(args.split, "--split"),
                out=args.out,
                labels=args.labels,
                dataset=args.dataset,
                filters=named_paths(args.filter, "--filter"),
                labels_by=args.labels_by,
                separator=args.separator,
                text_column=args.text_column,
                labels_column=args.labels_column,
                uid_column=args.uid_column,
                label_uid_column=args.label_uid_column,
                label_text_column=args.label_text_column,
                dev_share=args.dev_share,
                seed=args.seed,
                max_errors=args.max_errors,
            )
        )
    except ConversionRefused as refused:
        print("refused, nothing written:", file=sys.stderr)
        for problem in refused.problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    print("\n".join(summary.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
