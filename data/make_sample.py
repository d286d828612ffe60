"""Draw the small Debian-Related sample shipped in ``data/debian-sample/``.

The sample keeps the real dataset's shape: ``n_trn`` training and ``n_dev`` dev instances
drawn uniformly at random (seeded), the labels they use (their positives plus the labels that
*are* those instances, so the same-item filter problem is reproduced), label ids renumbered
densely in the original label order, and the two filter files restricted and renumbered.

Usage::

    python data/make_sample.py --src ../shared/data/debian-related --out data/debian-sample
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    # mtime=0 keeps the archive bytes reproducible, so re-running the script changes nothing.
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        for row in rows:
            gz.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))


def read_filter(path: Path) -> list[tuple[int, int]]:
    pairs = []
    for line in path.read_text().splitlines():
        if line.strip():
            row, label = line.split()
            pairs.append((int(row), int(label)))
    return pairs


def sample_split(rows: list[dict], n: int, rng: random.Random) -> list[int]:
    return sorted(rng.sample(range(len(rows)), min(n, len(rows))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--src",
        type=Path,
        default=Path("../shared/data/debian-related"),
        help="full Debian-Related dataset directory to sample from",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("data/debian-sample"), help="directory the sample is written to"
    )
    parser.add_argument("--n-trn", type=int, default=4000, help="training instances to draw")
    parser.add_argument("--n-dev", type=int, default=1000, help="dev instances to draw")
    parser.add_argument("--seed", type=int, default=20261121, help="random seed of the draw")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    labels = read_jsonl(args.src / "lbl.json.gz")
    splits = {}
    for name, n in (("trn", args.n_trn), ("dev", args.n_dev)):
        rows = read_jsonl(args.src / f"{name}.json.gz")
        keep = sample_split(rows, n, rng)
        filt = read_filter(args.src / f"filter_labels_{name}.txt")
        splits[name] = (rows, keep, filt)

    used: set[int] = set()
    for rows, keep, filt in splits.values():
        kept = set(keep)
        for i in keep:
            used.update(rows[i]["target_ind"])
        used.update(label for row, label in filt if row in kept)
    new_id = {old: new for new, old in enumerate(sorted(used))}

    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "lbl.json.gz", [labels[old] for old in sorted(used)])
    for name, (rows, keep, filt) in splits.items():
        new_row = {old: new for new, old in enumerate(keep)}
        out_rows = []
        for i in keep:
            row = dict(rows[i])
            row["target_ind"] = sorted(new_id[t] for t in row["target_ind"])
            out_rows.append(row)
        write_jsonl(args.out / f"{name}.json.gz", out_rows)
        pairs = sorted((new_row[r], new_id[lab]) for r, lab in filt if r in new_row)
        (args.out / f"filter_labels_{name}.txt").write_text("".join(f"{r} {lab}\n" for r, lab in pairs))
        print(f"{name}: {len(out_rows)} instances, {len(pairs)} filter pairs")
    print(f"labels: {len(used)}")


if __name__ == "__main__":
    main()
