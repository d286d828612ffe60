"""data/make_cooking_stackexchange.py: its line parser and its rules, on a tiny hand-written source file."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

from tests.data.conftest import DATA, load_script
from xmc.data import load_jsonl_split

SCRIPT = DATA / "make_cooking_stackexchange.py"


# line 1 onwards; "bread" and "food-safety" are common, "rare-tag" occurs once, line 5 has no text,
# lines 2 and 7 are one title case-insensitively (7's extra tag joins 2's), line 9's only tag is rare
SOURCE = [
    "__label__bread __label__baking How do I bake bread?",
    "__label__food-safety Is raw   chicken safe?",
    "__label__bread Why is my bread dense?",
    "__label__food-safety __label__bread Can bread go bad?",
    "__label__bread __label__baking",
    "__label__baking How hot should the oven be? __label__bread",
    "__label__chicken IS RAW CHICKEN SAFE?",
    "__label__food-safety How long do eggs keep?",
    "__label__rare-tag A question with a tag seen once",
    "__label__chicken __label__food-safety How to store chicken?",
] + [f"__label__bread __label__food-safety __label__chicken __label__baking Question number {i}?" for i in range(20)]


def source_file(tmp_path: Path) -> Path:
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "cooking.stackexchange.txt").write_text("\n".join(SOURCE) + "\n", encoding="utf-8")
    return raw


def test_labels_are_label_tokens_anywhere_and_the_text_the_rest():
    module = load_script(SCRIPT)
    assert module.parse_line("__label__baking How hot should the oven be? __label__bread") == (
        ["baking", "bread"],
        "How hot should the oven be?",
    )
    assert module.parse_line("__label__a  Two   spaces\there __label__a") == (["a"], "Two spaces here")
    assert module.parse_line("__label__bread __label__baking") == (["bread", "baking"], "")
    assert module.label_title("food-safety") == "food safety"
    lines = module.read_source("\n".join(SOURCE[:3]) + "\n")
    assert [lineno for lineno, _, _ in lines] == [1, 2, 3]


def test_merge_keeps_the_smallest_line_and_the_union_of_tags():
    module = load_script(SCRIPT)
    lines = module.read_source("\n".join(SOURCE) + "\n")
    labels, splits, stats = module.build(lines, seed=5, min_trn=1)
    assert stats["lines_without_text"] == 1 and stats["merged_lines"] == 1
    assert stats["instances_after_merge"] == len(SOURCE) - 2
    rows = {uid: (text, tags) for part in splits.values() for uid, text, tags in part}
    assert "7" not in rows and "5" not in rows
    assert rows["2"] == ("Is raw chicken safe?", ["food-safety", "chicken"])


def test_script_writes_the_layout_the_readers_load(tmp_path):
    raw = source_file(tmp_path)
    out = tmp_path / "out"
    command = [sys.executable, str(SCRIPT), "--raw", str(raw), "--out", str(out), "--any-snapshot", "--seed", "3"]
    done = subprocess.run(command, check=True, capture_output=True, text=True, timeout=60)
    stats = json.loads(done.stdout)
    n = len(SOURCE) - 2  # one line without text, two lines one title
    assert stats["instances_after_merge"] == n
    splits = {name: load_jsonl_split(out, name) for name in ("trn", "dev", "tst")}
    before = {name: len(splits[name]) + stats["dropped"][name]["instances"] for name in splits}
    assert before == {"trn": round(0.7 * n), "dev": round(0.15 * n), "tst": n - round(0.7 * n) - round(0.15 * n)}
    labels = splits["trn"].labels
    assert labels.uids == sorted(labels.uids) and "rare-tag" not in labels.uids
    assert labels.texts == [uid.replace("-", " ") for uid in labels.uids]
    assert splits["trn"].Y.sum(axis=0).A1.min() >= 2  # every label has at least two positives in trn
    uids = [set(s.uids) for s in splits.values()]
    assert not (uids[0] & uids[1] or uids[0] & uids[2] or uids[1] & uids[2])
    for name, split in splits.items():
        assert all(split.Y.getnnz(axis=1) >= 1) and len(split.filter_pairs) == 0
        assert "5" not in split.uids and "7" not in split.uids and "9" not in split.uids
        assert (out / f"filter_labels_{name}.txt").read_text() == ""
    first = {name: (out / f"{name}.json.gz").read_bytes() for name in ("lbl", "trn", "dev", "tst")}
    assert json.loads(gzip.decompress(first["lbl"]).splitlines()[0]).keys() == {"uid", "title"}
    subprocess.run(command, check=True, capture_output=True, timeout=60)
    assert first == {name: (out / f"{name}.json.gz").read_bytes() for name in first}  # byte-identical
    other = subprocess.run([*command[:-1], "4"], check=True, capture_output=True, text=True, timeout=60)
    assert json.loads(other.stdout)["instances_after_merge"] == n  # another seed: another split, same rows


def test_refuses_a_source_other_than_the_named_snapshot(tmp_path):
    raw = source_file(tmp_path)
    command = [sys.executable, str(SCRIPT), "--raw", str(raw), "--out", str(tmp_path / "out")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "sha256" in done.stderr and not (tmp_path / "out").exists()


def test_names_a_missing_source_file(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--raw", str(tmp_path), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "cooking.stackexchange.txt" in done.stderr
