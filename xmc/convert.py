"""Users' own data into the Extreme Classification Repository layout that every stage reads.

    python -m xmc.convert --labels labels.csv --split trn=train.csv [--split dev=dev.csv] \\
        [--filter dev=same_item_dev.csv] [--labels-by uid|id] [--separator "|"] --out data/mine

Inputs, each a CSV (with a header), a Parquet file (``pyarrow``) or JSON lines, told apart by
their suffix (``.csv``, ``.parquet``/``.pq``, ``.jsonl``/``.json``):

* the **label table**: columns ``uid`` and ``text``, one row per label;
* each **split** (``trn``, ``dev``, ...): columns ``text``, ``labels`` and optionally ``uid``.
  ``labels`` names an instance's labels by the label table's ``uid`` (``--labels-by uid``, the
  default) or by its 0-based row (``--labels-by id``): a list in JSON lines and Parquet, or one
  string split on ``--separator`` (CSV; a string is split in the other formats too);
* optional **filter pairs** of a split: columns ``uid`` (an instance of that split) and ``label``
  (as in ``labels``): the instance *is* that label, so evaluation removes it from the ranking.

What it writes (:mod:`xmc.data` reads it: ``load_jsonl_split(out, "trn")``): ``lbl.json.gz``
(``uid``, ``title``; line = label id), ``<split>.json.gz`` (``uid``, ``title``, ``target_ind``)
and ``filter_labels_<split>.txt`` (``row label`` pairs).

Everything is checked before anything is written; each refusal names the file, the row (1 = the
first record after any header) and the reason: an unknown label, an empty text, a duplicate uid,
a missing column, a label id out of range, a filter pair naming an unknown instance. All
refusals are listed (up to ``--max-errors``), and the command exits 1 without writing.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from xmc.data import DataFormatError, json_objects

SUFFIXES = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".json": "jsonl"}
LABELS_BY = ("uid", "id")


class ConversionRefused(ValueError):
    """The inputs have problems; ``problems`` lists each as ``file: row n: reason``."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


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

    def raise_any(self) -> None:
        if self.found:
            extra = [f"... and {self.more} more"] if self.more else []
            raise ConversionRefused(self.found + extra)


def read_records(path: Path) -> Iterator[tuple[int, dict]]:
    """``(row, record)`` of a CSV, Parquet or JSON-lines file, row 1 = the first record."""
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise ConversionRefused([f"{path}: unknown format (expected one of {', '.join(sorted(SUFFIXES))})"])
    if not path.is_file():
        raise ConversionRefused([f"{path}: no such file"])
    if kind == "csv":
        with open(path, newline="", encoding="utf-8") as fh:
            yield from enumerate(csv.DictReader(fh), start=1)
    elif kind == "parquet":
        import pyarrow.parquet as pq  # only for Parquet inputs (the train extra installs it)

        yield from enumerate(pq.read_table(path).to_pylist(), start=1)
    else:
        row = 0  # records, not lines: blank lines are not rows, as in the other formats
        try:
            for _, record in json_objects(path):
                row += 1
                yield row, record
        except DataFormatError as exc:
            raise ConversionRefused([f"{path}: row {row + 1}: {exc.problem}"]) from None


def text_of(record: dict, column: str, path: Path, row: int, problems: Problems) -> str | None:
    value = record.get(column)
    if value is None:
        problems.add(path, row, f"no '{column}' column")
        return None
    text = str(value).strip()
    if not text:
        problems.add(path, row, f"empty {column}")
        return None
    return text


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
class Split(Records):
    """A split's instances, each with its label ids."""

    targets: list[list[int]] = field(default_factory=list)


def read_labels(path: Path, problems: Problems) -> Labels:
    """The label table: ``uid`` and ``text`` per row; a duplicate uid or an empty text is refused."""
    labels = Labels()
    for row, record in read_records(path):
        uid, text = text_of(record, "uid", path, row, problems), text_of(record, "text", path, row, problems)
        if uid is not None and labels.first_time(uid, path, row, problems) and text is not None:
            labels.keep(uid, text)
    if not labels.uids and not problems.found:
        problems.add(path, None, "no labels")
    return labels


def label_names(value, separator: str) -> list:
    """A record's ``labels`` cell as a list: a list as it is, a string split on ``separator``."""
    if value is None:
        return []
    if isinstance(value, str):
        return [part.strip() for part in value.split(separator) if part.strip()]
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def label_id(name, labels: Labels, labels_by: str, path: Path, row: int, problems: Problems) -> int | None:
    """The label id a ``labels`` entry names, or None (with its refusal added)."""
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


def read_split(path: Path, labels: Labels, labels_by: str, separator: str, problems: Problems) -> Split:
    split = Split()
    for row, record in read_records(path):
        text = text_of(record, "text", path, row, problems)
        uid = str(record["uid"]).strip() if record.get("uid") not in (None, "") else str(row - 1)
        if "labels" not in record:
            problems.add(path, row, "no 'labels' column")
            continue
        names = label_names(record["labels"], separator)
        targets = [label_id(name, labels, labels_by, path, row, problems) for name in names]
        if split.first_time(uid, path, row, problems) and text is not None and None not in targets:
            split.keep(uid, text)
            split.targets.append(sorted(set(targets)))
    return split


def read_filter_pairs(
    path: Path, split: Split, labels: Labels, labels_by: str, problems: Problems
) -> list[tuple[int, int]]:
    pairs = set()
    for row, record in read_records(path):
        uid, label = record.get("uid"), record.get("label")
        if uid in (None, "") or label in (None, ""):
            problems.add(path, row, "a filter pair needs 'uid' and 'label'")
            continue
        instance = split.ids.get(str(uid).strip())
        if instance is None:
            problems.add(path, row, f"unknown instance uid {str(uid)!r}")
        found = label_id(label, labels, labels_by, path, row, problems)
        if instance is not None and found is not None:
            pairs.add((instance, found))
    return sorted(pairs)


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


def convert(
    labels_path: Path,
    splits: dict[str, Path],
    out: Path,
    filters: dict[str, Path] | None = None,
    labels_by: str = "uid",
    separator: str = "|",
    max_errors: int = 50,
) -> dict[str, int]:
    """Validate every input, then write the repository layout under ``out``; returns the counts
    written. Raises :class:`ConversionRefused` (nothing written) on any problem."""
    filters = filters or {}
    problems = Problems(limit=max_errors)
    if labels_by not in LABELS_BY:
        raise ConversionRefused([f"--labels-by {labels_by!r}: expected one of {', '.join(LABELS_BY)}"])
    unknown = sorted(set(filters) - set(splits))
    if unknown:
        raise ConversionRefused([f"--filter {name}: no --split {name}" for name in unknown])
    labels = read_labels(labels_path, problems)
    read = {name: read_split(path, labels, labels_by, separator, problems) for name, path in splits.items()}
    pairs = {name: read_filter_pairs(path, read[name], labels, labels_by, problems) for name, path in filters.items()}
    problems.raise_any()
    out.mkdir(parents=True, exist_ok=True)
    write_json_lines(
        out / "lbl.json.gz", ({"uid": u, "title": t} for u, t in zip(labels.uids, labels.texts, strict=True))
    )
    counts = {"labels": len(labels.uids)}
    for name, split in read.items():
        records = zip(split.uids, split.texts, split.targets, strict=True)
        write_json_lines(out / f"{name}.json.gz", ({"uid": u, "title": t, "target_ind": y} for u, t, y in records))
        counts[name] = len(split.uids)
    for name, split_pairs in pairs.items():
        (out / f"filter_labels_{name}.txt").write_text("".join(f"{row} {label}\n" for row, label in split_pairs))
        counts[f"filter_labels_{name}"] = len(split_pairs)
    return counts


def write_json_lines(path: Path, records) -> None:
    # mtime=0: the same inputs give the same bytes (a bundle records its data's content)
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as fh:
        for record in records:
            fh.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--labels", type=Path, required=True, help="label table: columns uid, text")
    parser.add_argument(
        "--split",
        action="append",
        required=True,
        metavar="NAME=FILE",
        help="a split's instances (columns text, labels, optional uid); repeat for trn, dev, ...",
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
        "--separator", default="|", help="splits a labels cell given as one string (CSV) into labels (default: |)"
    )
    parser.add_argument("--max-errors", type=int, default=50, help="refusals listed before the rest are counted")
    parser.add_argument("--out", type=Path, required=True, help="output data directory (the repository layout)")
    args = parser.parse_args(argv)
    try:
        counts = convert(
            args.labels,
            named_paths(args.split, "--split"),
            args.out,
            filters=named_paths(args.filter, "--filter"),
            labels_by=args.labels_by,
            separator=args.separator,
            max_errors=args.max_errors,
        )
    except ConversionRefused as refused:
        print("refused, nothing written:", file=sys.stderr)
        for problem in refused.problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: " + ", ".join(f"{name} {count}" for name, count in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
