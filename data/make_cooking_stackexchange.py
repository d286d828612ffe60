"""Build Cooking-StackExchange, a many-shot multi-label data set, from the fastText tutorial's file.

Instance: one question on the Cooking Stack Exchange site; its text is the question's title, e.g.
``How much does potato starch affect a cheese sauce recipe?``. Labels: the site's tags of that
question, e.g. ``sauce``, ``cheese``, ``food-safety``; a label's ``uid`` is the tag and its
``title`` the tag with ``-`` turned into a space (``food safety``): bare names, no description.
Unlike Debian-Related and Gutenberg-Subjects this is the many-shot regime: a few hundred labels,
most of them with tens or hundreds of training texts.

Source: ``cooking.stackexchange.txt`` of the fastText text-classification tutorial, 15,404 lines
``__label__<tag> ... <title>`` derived from the site's public data dump under CC-BY-SA 3.0 (the
archive's ``readme.txt``). The copy this data set was built from is named in
``data/cooking-stackexchange/README.md`` with its sha256. Fetch it, either from the fastText
tutorial's archive::

    wget https://dl.fbaipublicfiles.com/fasttext/data/cooking.stackexchange.tar.gz
    mkdir -p data/raw/cooking-stackexchange
    tar xzf cooking.stackexchange.tar.gz -C data/raw/cooking-stackexchange cooking.stackexchange.txt

or from a public git copy of it::

    git clone https://github.com/HuStanding/ml /tmp/hustanding-ml   # or any copy of it
    mkdir -p data/raw/cooking-stackexchange
    cp /tmp/hustanding-ml/fasttext/data/cooking.stackexchange.txt data/raw/cooking-stackexchange/

then::

    python data/make_cooking_stackexchange.py          # writes data/cooking-stackexchange/

Steps: read each line; its labels are the tokens that start with ``__label__`` (wherever they
stand), its text the other tokens joined by single spaces; the uid is the 1-based line number;
lines with no text are dropped; lines whose texts are equal (case-insensitively; the same question
title asked twice) are merged into one instance with the union of their tags and the smaller line
number as uid; split at random (seeded) 70/15/15 into trn/dev/tst; keep the tags that occur at
least twice in trn, drop every instance left without a tag, and number the labels in sorted tag
order. A question is never itself a tag, so the filter files are empty.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import statistics
import sys
from collections import Counter
from pathlib import Path

RAW_NAME = "cooking.stackexchange.txt"
# The file data/cooking-stackexchange/ was built from; another copy can be used with --any-snapshot.
EXPECTED_SHA256 = "336008afdcdd26569f0558dbf41982238ed1ea59db066860c6b56f8a335d6da0"
LABEL_PREFIX = "__label__"
# a label with at least this many trn texts counts as many-shot in the summary
MANY_SHOT = 20


def parse_line(line: str) -> tuple[list[str], str]:
    """(tags in the order given, once each; text): ``__label__`` tokens anywhere are tags."""
    tags: list[str] = []
    words: list[str] = []
    for token in line.split():
        if token.startswith(LABEL_PREFIX):
            tag = token[len(LABEL_PREFIX) :]
            if tag and tag not in tags:
                tags.append(tag)
        else:
            words.append(token)
    return tags, " ".join(words).strip()


def read_source(text: str) -> list[tuple[int, list[str], str]]:
    """(line number, tags, text) of every line of the source file."""
    return [(lineno, *parse_line(line)) for lineno, line in enumerate(text.splitlines(), start=1)]


def label_title(tag: str) -> str:
    return tag.replace("-", " ")


def build(lines: list[tuple[int, list[str], str]], seed: int, min_trn: int):
    """(labels, splits, stats): labels a sorted list of tags; splits name -> list of
    ``(uid, text, [tag, ...])``."""
    merged: dict[str, list] = {}  # text key -> [smallest line number, text, tags]
    no_text = no_tag = 0
    for lineno, tags, text in lines:
        if not text:
            no_text += 1
            continue
        if not tags:
            no_tag += 1
        entry = merged.setdefault(text.casefold(), [lineno, text, []])
        if lineno < entry[0]:
            entry[0], entry[1] = lineno, text
        entry[2].extend(t for t in tags if t not in entry[2])

    rows = sorted(merged.values())  # by line number, then shuffled with the seed
    random.Random(seed).shuffle(rows)
    n = len(rows)
    n_trn, n_dev = round(0.70 * n), round(0.15 * n)
    parts = {"trn": rows[:n_trn], "dev": rows[n_trn : n_trn + n_dev], "tst": rows[n_trn + n_dev :]}

    trn_count = Counter(t for _, _, tags in parts["trn"] for t in tags)
    labels = sorted(t for t, c in trn_count.items() if c >= min_trn)
    keep = set(labels)
    splits, dropped = {}, {}
    for name, part in parts.items():
        out = []
        lost = 0
        for lineno, text, tags in part:
            kept = [t for t in tags if t in keep]
            lost += len(tags) - len(kept)
            if kept:
                out.append((str(lineno), text, kept))
        splits[name] = out
        dropped[name] = {
            "instances": len(part) - len(out),
            "positives": lost,
            "positives_before": sum(len(t) for _, _, t in part),
        }
    stats = {
        "source_lines": len(lines),
        "lines_without_text": no_text,
        "lines_without_tag": no_tag,
        "instances_after_merge": n,
        "merged_lines": len(lines) - no_text - n,
        "distinct_tags_all": len({t for _, _, ts in rows for t in ts}),
        "dropped": dropped,
    }
    return labels, splits, stats


def write_jsonl(path: Path, rows) -> None:
    # mtime=0 keeps the archive bytes reproducible, so re-running the script changes nothing.
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        for row in rows:
            gz.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))


def write(out: Path, labels: list[str], splits: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    label_id = {t: i for i, t in enumerate(labels)}
    write_jsonl(out / "lbl.json.gz", ({"uid": t, "title": label_title(t)} for t in labels))
    for name, rows in splits.items():
        write_jsonl(
            out / f"{name}.json.gz",
            ({"uid": uid, "title": text, "target_ind": sorted(label_id[t] for t in tags)} for uid, text, tags in rows),
        )
        (out / f"filter_labels_{name}.txt").write_text("")  # a question is never a tag


def summary(labels: list[str], splits: dict, stats: dict) -> dict:
    freq = Counter(t for _, _, tags in splits["trn"] for t in tags)
    counts = sorted(freq.values())
    n_trn = len(splits["trn"])

    def quantile(q: float) -> int:
        return counts[min(len(counts) - 1, int(q * len(counts)))]

    out = {
        "labels": len(labels),
        "instances": {name: len(rows) for name, rows in splits.items()},
        "avg_labels_per_instance": {
            name: round(sum(len(t) for _, _, t in rows) / max(1, len(rows)), 3) for name, rows in splits.items()
        },
        "avg_title_chars": {
            name: round(sum(len(t) for _, t, _ in rows) / max(1, len(rows)), 1) for name, rows in splits.items()
        },
        "trn_instances_per_label": {
            "mean": round(sum(counts) / max(1, len(counts)), 2),
            "median": statistics.median(counts) if counts else 0,
            "min": counts[0] if counts else 0,
            "p10": quantile(0.10) if counts else 0,
            "p90": quantile(0.90) if counts else 0,
            "max": counts[-1] if counts else 0,
            "top_label": freq.most_common(1)[0][0] if counts else None,
            "top_label_share_of_trn": round(counts[-1] / n_trn, 4) if counts else 0,
            f"share_of_labels_with_at_least_{MANY_SHOT}": round(
                sum(1 for c in counts if c >= MANY_SHOT) / max(1, len(counts)), 4
            ),
            f"labels_with_at_least_{MANY_SHOT}": sum(1 for c in counts if c >= MANY_SHOT),
            "labels_with_at_most_5": sum(1 for c in counts if c <= 5),
        },
        "top_labels": freq.most_common(10),
        "labels_never_positive_in_dev": len(set(labels) - {t for _, _, ts in splits["dev"] for t in ts}),
    }
    out.update(stats)
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--raw", type=Path, default=Path("data/raw/cooking-stackexchange"), help=f"folder holding {RAW_NAME}"
    )
    parser.add_argument("--out", type=Path, default=Path("data/cooking-stackexchange"), help="folder written")
    parser.add_argument("--seed", type=int, default=20261202, help="seed of the random split")
    parser.add_argument("--min-trn", type=int, default=2, help="keep tags with at least this many trn positives")
    parser.add_argument(
        "--any-snapshot",
        action="store_true",
        help="build from a raw file other than the one README.md names (the counts will differ)",
    )
    args = parser.parse_args(argv)

    path = args.raw / RAW_NAME
    if not path.is_file():
        sys.exit(f"missing raw file: {path} (see this script's docstring to fetch it)")
    digest = sha256(path)
    if digest != EXPECTED_SHA256 and not args.any_snapshot:
        sys.exit(
            f"{path}: sha256 {digest} is not the one this data set was built from; pass --any-snapshot to build anyway"
        )

    lines = read_source(path.read_text(encoding="utf-8"))
    labels, splits, stats = build(lines, args.seed, args.min_trn)
    write(args.out, labels, splits)
    print(json.dumps(summary(labels, splits, stats), indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
