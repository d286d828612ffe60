"""data/make_synthetic.py: a seeded data set of Debian-Related's shape that the readers load."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from xmc.data import load_jsonl_split

ROOT = Path(__file__).resolve().parents[2]
SIZES = ["--labels", "2000", "--trn", "4000", "--dev", "400", "--tst", "400"]


def generate(out: Path, seed: int = 0) -> dict:
    command = [sys.executable, str(ROOT / "data" / "make_synthetic.py"), "--out", str(out), *SIZES]
    done = subprocess.run([*command, "--seed", str(seed)], check=True, capture_output=True, text=True, timeout=120)
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("synthetic") / "a"
    return out, generate(out)


def test_splits_load_with_the_debian_related_shape(synthetic):
    out, stats = synthetic
    splits = {name: load_jsonl_split(out, name) for name in ("trn", "dev", "tst")}
    trn = splits["trn"]
    assert trn.num_labels == 2000 and [len(s) for s in splits.values()] == [4000, 400, 400]
    per_instance = np.diff(trn.Y.indptr)
    assert per_instance.min() >= 1 and 4.0 < per_instance.mean() < 7.0  # Debian-Related: 5.26
    frequency = np.bincount(trn.Y.indices, minlength=trn.num_labels)
    assert 0.3 < frequency.max() / len(trn) < 0.46  # the most popular label, as libc6 (38 %)
    assert (frequency == 0).sum() > 0  # zero-shot labels exist
    assert stats["splits"]["trn"]["labels_per_instance"] == pytest.approx(per_instance.mean(), abs=0.01)
    # held out: no instance of dev or tst is an instance of trn
    assert not set(trn.uids) & (set(splits["dev"].uids) | set(splits["tst"].uids))


def test_same_item_pairs_are_filtered_never_targets(synthetic):
    out, _ = synthetic
    for name in ("trn", "tst"):
        split = load_jsonl_split(out, name)
        assert len(split.filter_pairs) > 0.3 * len(split)
        for row, label in split.filter_pairs:
            assert split.texts[row] == split.labels.texts[label] and split.uids[row] == split.labels.uids[label]
            assert split.Y[row, label] == 0  # the instance's own label is never its target


def test_instances_share_words_with_their_labels(synthetic):
    # the signal a text encoder learns: a title and its labels' titles come from one topic
    out, _ = synthetic
    trn = load_jsonl_split(out, "trn")

    def words(text: str) -> set[str]:
        return set(text.split(":", 1)[1].split())

    shared = [bool(words(trn.texts[i]) & words(trn.labels.texts[trn.Y.indices[trn.Y.indptr[i]]])) for i in range(500)]
    random_pairs = [bool(words(trn.texts[i]) & words(trn.labels.texts[(7 * i) % 2000])) for i in range(500)]
    assert np.mean(shared) > np.mean(random_pairs) + 0.3


def test_same_seed_same_files_other_seed_other_files(synthetic, tmp_path):
    out, _ = synthetic
    generate(tmp_path / "again")
    generate(tmp_path / "other", seed=1)
    for name in ("lbl.json.gz", "trn.json.gz", "filter_labels_tst.txt"):
        again = load_bytes(tmp_path / "again" / name)
        assert again == load_bytes(out / name)
        assert again != load_bytes(tmp_path / "other" / name)


def load_bytes(path: Path) -> bytes:
    import gzip

    return gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
