"""What the real data set builders (make_cooking_stackexchange.py, make_gutenberg_subjects.py)
share: from instances ``(uid, text, labels)`` to the seeded trn/dev/tst split, the label filter,
the gzip JSON-lines files xmc.data reads, and the summary the builders print.

A builder reads its own source into those instances and says what its counts mean; the steps
after that are one procedure, written once here so that the data sets stay built alike. Each data
set's README gives counts measured on files these exact steps wrote, so a change here changes the
files of both (a rebuild is byte-identical only while these steps are). Standard library only,
like the builders: building a data set needs nothing installed. The builders ``import builders``,
found because a script run as ``python data/make_<name>.py`` has data/ as sys.path[0] (the tests'
loader, tests/data/conftest.py, puts it there too).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

# trn and dev shares of the instances; tst gets the rest
TRN_SHARE, DEV_SHARE = 0.70, 0.15


def merge_equal_texts(instances: Iterable[tuple[int, str, list[str]]]) -> list[list]:
    """One row ``[uid, text, labels]`` per text, compared case-insensitively, in the order the
    texts first occur: the same question asked twice, or two editions of one work, would otherwise
    be two instances of one text, perhaps one in trn and one in tst. A row keeps the smallest uid
    with its text, and the union of the labels in the order first seen."""
    merged: dict[str, list] = {}  # text key -> [smallest uid, its text, labels]
    for uid, text, labels in instances:
        entry = merged.setdefault(text.casefold(), [uid, text, []])
        if uid < entry[0]:
            entry[0], entry[1] = uid, text
        entry[2].extend(label for label in labels if label not in entry[2])
    return list(merged.values())


def shuffle_split(rows: list[list], seed: int) -> dict[str, list[list]]:
    """trn/dev/tst, 70/15/15 of ``rows`` at random (the seed's). The rows are sorted by uid
    first, so the split depends on the rows and the seed alone, not on the order the source
    happens to list them in."""
    rows = sorted(rows)
    random.Random(seed).shuffle(rows)
    n = len(rows)
    n_trn, n_dev = round(TRN_SHARE * n), round(DEV_SHARE * n)
    return {"trn": rows[:n_trn], "dev": rows[n_trn : n_trn + n_dev], "tst": rows[n_trn + n_dev :]}


def keep_labels_frequent_in_trn(parts: dict[str, list[list]], min_trn: int) -> tuple[list[str], dict, dict]:
    """(labels, splits, dropped). A label with fewer than ``min_trn`` positives in trn cannot be
    learned from it, and in dev/tst would only count as a miss every method makes: labels are the
    others, sorted (a label's id is its place there). splits: each part's rows as ``(str(uid),
    text, labels kept)``, those left without a label dropped, as they have nothing to be scored
    on; dropped: per split, those instances and the positives lost, for the summary."""
    trn_count = Counter(label for _, _, labels in parts["trn"] for label in labels)
    labels = sorted(label for label, count in trn_count.items() if count >= min_trn)
    keep = set(labels)
    splits, dropped = {}, {}
    for name, part in parts.items():
        out = []
        lost = 0
        for uid, text, row_labels in part:
            kept = [label for label in row_labels if label in keep]
            lost += len(row_labels) - len(kept)
            if kept:
                out.append((str(uid), text, kept))
        splits[name] = out
        dropped[name] = {
            "instances": len(part) - len(out),
            "positives": lost,
            "positives_before": sum(len(row_labels) for _, _, row_labels in part),
        }
    return labels, splits, dropped


def write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    """``rows`` as gzip-compressed JSON lines. mtime=0 keeps the archive bytes reproducible, so
    re-running a builder on the same source changes nothing."""
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        for row in rows:
            gz.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))


def write_data_set(out: Path, labels: list[str], splits: dict, label_title: Callable[[str], str] | None = None) -> None:
    """The folder xmc.data's JSON-lines reader loads: lbl.json.gz (``uid``, ``title``: the label
    itself where ``label_title`` is None), one ``<split>.json.gz`` a split (``target_ind`` the
    sorted label ids) and empty filter files: an instance is never itself a label (a question is
    no tag, a work no heading), so no (instance, label) pair is to be filtered out."""
    out.mkdir(parents=True, exist_ok=True)
    label_id = {label: i for i, label in enumerate(labels)}
    title = label_title or (lambda label: label)
    write_jsonl(out / "lbl.json.gz", ({"uid": label, "title": title(label)} for label in labels))
    for name, rows in splits.items():
        write_jsonl(
            out / f"{name}.json.gz",
            (
                {"uid": uid, "title": text, "target_ind": sorted(label_id[label] for label in row_labels)}
                for uid, text, row_labels in rows
            ),
        )
        (out / f"filter_labels_{name}.txt").write_text("")


def quantile(counts: list[int], q: float) -> int:
    """The ``q`` quantile of the sorted, non-empty ``counts`` (the nearest rank below)."""
    return counts[min(len(counts) - 1, int(q * len(counts)))]


def summary(
    labels: list[str],
    splits: dict,
    stats: dict,
    frequency_key: str,
    describe_frequency: Callable[[Counter, list[int], int], dict],
) -> dict:
    """What a builder prints, and its data set's README quotes: sizes, labels per instance, text
    lengths, then under ``frequency_key`` ``describe_frequency(trn positives a label, their
    sorted counts, trn instances)`` (a many-shot set and a long-tailed one are told by different
    figures), the top labels, and the builder's own ``stats`` last."""
    freq = Counter(label for _, _, row_labels in splits["trn"] for label in row_labels)
    counts = sorted(freq.values())
    out = {
        "labels": len(labels),
        "instances": {name: len(rows) for name, rows in splits.items()},
        "avg_labels_per_instance": {
            name: round(sum(len(ls) for _, _, ls in rows) / max(1, len(rows)), 3) for name, rows in splits.items()
        },
        "avg_title_chars": {
            name: round(sum(len(t) for _, t, _ in rows) / max(1, len(rows)), 1) for name, rows in splits.items()
        },
        frequency_key: describe_frequency(freq, counts, len(splits["trn"])),
        "top_labels": freq.most_common(10),
        "labels_never_positive_in_dev": len(set(labels) - {label for _, _, ls in splits["dev"] for label in ls}),
    }
    out.update(stats)
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def require_snapshot(path: Path, expected_sha256: str, any_snapshot: bool) -> None:
    """Exit, naming ``path``, unless it is the raw file the data set was built from (or
    ``any_snapshot`` says to build anyway): the README's counts hold for that snapshot only."""
    digest = sha256(path)
    if digest != expected_sha256 and not any_snapshot:
        sys.exit(
            f"{path}: sha256 {digest} is not the one this data set was built from; pass --any-snapshot to build anyway"
        )
