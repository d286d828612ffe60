"""A synthetic XMC data set of the Debian-Related shape at any size (e.g. 10^6 labels, millions
of instances), seeded, in the same JSON-lines layout, for runs at a scale no real data set here has.

    python data/make_synthetic.py --out /tmp/synthetic-1m --labels 1000000 --trn 2000000

What it reproduces of Debian-Related (``../shared/data/debian-related/README.md``):

* Texts are ``"<name>: <words>"`` titles. Words come from the vocabulary of the shipped sample's
  titles; each label belongs to a *topic* (a small set of words, about 40 labels per topic) and
  its title draws from that topic, so a query and its labels share words the way a package
  and its dependencies do, and a text encoder has something to learn.
* Instances have ~5 labels: a draw of their own topic's labels (skewed towards a few of them)
  plus the globally popular labels (the first in ~38 % of instances, as libc6 is), so label
  frequencies are Zipf-like and some labels are never positive in trn (zero-shot).
* Many instances *are* labels (same uid and text, ~68 % as in Debian-Related while there are
  enough labels): that label is never their target and is listed in the split's filter file.
* Splits ``trn``, ``dev`` and ``tst`` are one shuffled draw, so dev and tst are held out from
  the same distribution. ``stats.json`` records the shape that came out.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import Counter
from pathlib import Path

import numpy as np

SAMPLE = Path(__file__).resolve().parent / "debian-sample"
LABELS_PER_TOPIC = 40
TOPIC_WORDS = 8
ITEM_FRACTION = 0.68  # instances that are themselves labels (Debian-Related: 68 %)
POPULAR_LABELS = 20  # labels with a global pull: the first in ~38 % of instances
FIRST_POPULAR_RATE = 0.38


def vocabulary(sample: Path) -> tuple[np.ndarray, np.ndarray]:
    """The sample's title words (lowercase, 3+ letters) and their sampling weights (√frequency)."""
    counts: Counter[str] = Counter()
    for name in ("lbl.json.gz", "trn.json.gz"):
        with gzip.open(sample / name, "rt", encoding="utf-8") as fh:
            for line in fh:
                counts.update(re.findall(r"[a-z]{3,}", json.loads(line)["title"].lower()))
    words = np.array(sorted(counts))
    weights = np.sqrt(np.array([counts[w] for w in words], dtype=np.float64))
    return words, weights / weights.sum()


def base36(values: np.ndarray) -> list[str]:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = []
    for value in values.tolist():
        text = ""
        while True:
            value, rest = divmod(value, 36)
            text = digits[rest] + text
            if not value:
                break
        out.append(text)
    return out


class Generator:
    """Draws labels and instances; every random choice comes from one seeded generator."""

    def __init__(self, num_labels: int, seed: int, sample: Path):
        self.rng = np.random.default_rng(seed)
        self.words, self.word_weights = vocabulary(sample)
        self.num_topics = max(1, num_labels // LABELS_PER_TOPIC)
        self.topic_words = self.rng.choice(len(self.words), size=(self.num_topics, TOPIC_WORDS), p=self.word_weights)
        self.label_topic = self.rng.permutation(num_labels) % self.num_topics
        order = np.argsort(self.label_topic, kind="stable")
        self.topic_labels = order  # labels grouped by topic: topic t owns order[starts[t]:starts[t+1]]
        self.topic_starts = np.searchsorted(self.label_topic[order], np.arange(self.num_topics + 1))
        self.popular = self.rng.choice(num_labels, size=min(POPULAR_LABELS, num_labels), replace=False)

    def titles(self, topics: np.ndarray, ids: np.ndarray, min_words: int, max_words: int) -> list[str]:
        """``"<topic word>-<id>: w1 … wk"``, k topic words plus one word from anywhere."""
        n = len(topics)
        k = self.rng.integers(min_words, max_words + 1, size=n)
        picks = self.topic_words[topics[:, None], self.rng.integers(0, TOPIC_WORDS, size=(n, max_words))]
        noise = self.rng.choice(len(self.words), size=n, p=self.word_weights)
        names = base36(ids)
        titles = []
        for i in range(n):
            body = " ".join(self.words[picks[i, : k[i]]].tolist() + [str(self.words[noise[i]])])
            titles.append(f"{self.words[picks[i, 0]]}-{names[i]}: {body}")
        return titles

    def targets(self, topics: np.ndarray, own: np.ndarray) -> list[np.ndarray]:
        """Per instance: 1 + Poisson(3) labels of its topic (skewed to the topic's first labels)
        and each popular label g with probability 0.38 / (g + 1)^0.8; never its own label (−1: none)."""
        n = len(topics)
        counts = 1 + np.minimum(self.rng.poisson(3.0, size=n), 30)
        rows = np.repeat(np.arange(n), counts)
        starts, sizes = self.topic_starts[topics[rows]], np.diff(self.topic_starts)[topics[rows]]
        within = np.floor(self.rng.random(len(rows)) ** 3 * sizes).astype(np.int64)
        labels = self.topic_labels[starts + within]
        rates = FIRST_POPULAR_RATE / (np.arange(len(self.popular)) + 1.0) ** 0.8
        hits = self.rng.random((n, len(self.popular))) < rates
        pop_rows, pop_cols = np.nonzero(hits)
        rows = np.concatenate([rows, pop_rows])
        labels = np.concatenate([labels, self.popular[pop_cols]])
        keep = labels != own[rows]
        pairs = np.unique(np.stack([rows[keep], labels[keep]], axis=1), axis=0)
        split_at = np.searchsorted(pairs[:, 0], np.arange(1, n))
        out = np.split(pairs[:, 1], split_at)
        for i in np.flatnonzero([len(t) == 0 for t in out]):  # only its own label was drawn
            out[i] = self.popular[:1] if self.popular[0] != own[i] else self.popular[1:2]
        return out


def write_jsonl(path: Path, rows) -> None:
    with gzip.open(path, "wt", encoding="utf-8", compresslevel=1) as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def generate(out: Path, num_labels: int, splits: dict[str, int], seed: int, sample: Path = SAMPLE) -> dict:
    """Write the data set into ``out`` and return its shape (also written to ``stats.json``)."""
    gen = Generator(num_labels, seed, sample)
    label_titles = gen.titles(gen.label_topic, np.arange(num_labels), 3, 6)
    label_uids = [title.split(":", 1)[0] for title in label_titles]
    total = sum(splits.values())
    # instances that are labels: a label appears as at most one instance, as a package does
    items = gen.rng.choice(num_labels, size=min(round(ITEM_FRACTION * total), int(0.8 * num_labels)), replace=False)
    own = np.full(total, -1, dtype=np.int64)
    own[: len(items)] = items
    own = own[gen.rng.permutation(total)]
    is_item = own >= 0
    topics = np.where(is_item, gen.label_topic[np.maximum(own, 0)], gen.rng.integers(0, gen.num_topics, size=total))
    fresh = gen.titles(topics[~is_item], num_labels + np.arange(int((~is_item).sum())), 3, 6)
    titles = np.empty(total, dtype=object)
    titles[~is_item] = fresh
    titles[is_item] = [label_titles[i] for i in own[is_item]]
    targets = gen.targets(topics, own)

    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "lbl.json.gz", ({"uid": u, "title": t} for u, t in zip(label_uids, label_titles, strict=True)))
    stats: dict = {"labels": num_labels, "seed": seed, "splits": {}}
    start = 0
    for name, size in splits.items():
        rows = range(start, start + size)
        write_jsonl(
            out / f"{name}.json.gz",
            ({"uid": titles[i].split(":", 1)[0], "title": titles[i], "target_ind": targets[i].tolist()} for i in rows),
        )
        with open(out / f"filter_labels_{name}.txt", "w") as fh:
            fh.writelines(f"{i - start} {own[i]}\n" for i in rows if own[i] >= 0)
        stats["splits"][name] = split_stats(targets[start : start + size], own[start : start + size], num_labels)
        start += size
    (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def split_stats(targets: list[np.ndarray], own: np.ndarray, num_labels: int) -> dict:
    frequency = np.bincount(np.concatenate(targets), minlength=num_labels) if targets else np.zeros(num_labels)
    return {
        "instances": len(targets),
        "labels_per_instance": round(float(np.mean([len(t) for t in targets])), 2) if targets else 0.0,
        "filter_pairs": int((own >= 0).sum()),
        "labels_never_positive": int((frequency == 0).sum()),
        "most_frequent_label_share": round(float(frequency.max() / max(len(targets), 1)), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory to write the data set into")
    parser.add_argument("--labels", type=int, default=1_000_000, help="number of labels")
    parser.add_argument("--trn", type=int, default=2_000_000, help="training instances")
    parser.add_argument("--dev", type=int, default=20_000, help="dev instances (for tuning)")
    parser.add_argument("--tst", type=int, default=20_000, help="held-out test instances")
    parser.add_argument("--seed", type=int, default=0, help="seed of every random choice")
    parser.add_argument("--vocabulary-from", type=Path, default=SAMPLE, help="data set whose title words are used")
    args = parser.parse_args()
    splits = {"trn": args.trn, "dev": args.dev, "tst": args.tst}
    stats = generate(args.out, args.labels, splits, args.seed, args.vocabulary_from)
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
