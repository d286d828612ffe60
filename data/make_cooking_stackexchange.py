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
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

import builders

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
    no_text = sum(1 for _, _, text in lines if not text)
    no_tag = sum(1 for _, tags, text in lines if text and not tags)
    rows = builders.merge_equal_texts((lineno, text, tags) for lineno, tags, text in lines if text)
    labels, splits, dropped = builders.keep_labels_frequent_in_trn(builders.shuffle_split(rows, seed), min_trn)
    n = len(rows)
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


def trn_instances_per_label(freq: Counter, counts: list[int], n_trn: int) -> dict:
    """The summary's figures of a many-shot set: how many labels have tens of trn texts. Each is 0
    (or None) where no tag is left, as with a tiny source built with --any-snapshot."""
    return {
        "mean": round(sum(counts) / max(1, len(counts)), 2),
        "median": statistics.median(counts) if counts else 0,
        "min": counts[0] if counts else 0,
        "p10": builders.quantile(counts, 0.10) if counts else 0,
        "p90": builders.quantile(counts, 0.90) if counts else 0,
        "max": counts[-1] if counts else 0,
        "top_label": freq.most_common(1)[0][0] if counts else None,
        "top_label_share_of_trn": round(counts[-1] / n_trn, 4) if counts else 0,
        f"share_of_labels_with_at_least_{MANY_SHOT}": round(
            sum(1 for c in counts if c >= MANY_SHOT) / max(1, len(counts)), 4
        ),
        f"labels_with_at_least_{MANY_SHOT}": sum(1 for c in counts if c >= MANY_SHOT),
        "labels_with_at_most_5": sum(1 for c in counts if c <= 5),
    }


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
    builders.require_snapshot(path, EXPECTED_SHA256, args.any_snapshot)

    lines = read_source(path.read_text(encoding="utf-8"))
    labels, splits, stats = build(lines, args.seed, args.min_trn)
    builders.write_data_set(args.out, labels, splits, label_title)
    report = builders.summary(labels, splits, stats, "trn_instances_per_label", trn_instances_per_label)
    print(json.dumps(report, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
