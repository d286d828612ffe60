import gzip
import json

import numpy as np
import pytest

from xmc.data import (
    DataFormatError,
    label_frequencies,
    load_jsonl_split,
    load_raw_split,
    load_train_and_dev,
    read_filter,
    read_instances_jsonl,
    read_sparse_matrix,
    rows_of_uids,
    split_holdout,
)


def write_gz(path, rows):
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        for row in rows:
            fh.write(row if isinstance(row, str) else json.dumps(row))
            fh.write("\n")


@pytest.fixture
def jsonl_dir(tmp_path):
    write_gz(
        tmp_path / "lbl.json.gz",
        [{"uid": "a", "title": "alpha"}, {"uid": "b", "title": "beta"}, {"uid": "c", "title": "gamma"}],
    )
    write_gz(
        tmp_path / "trn.json.gz",
        [
            {"uid": "x", "title": "first", "content": "body text", "target_ind": [2, 0]},
            {"uid": "y", "title": "second", "target_ind": []},
        ],
    )
    (tmp_path / "filter_labels_trn.txt").write_text("0 1\n1 1\n")
    return tmp_path


def test_jsonl_split_reads_texts_labels_and_filter(jsonl_dir):
    ds = load_jsonl_split(jsonl_dir, "trn")
    assert ds.texts == ["first", "second"]
    assert ds.uids == ["x", "y"]
    assert ds.labels.uids == ["a", "b", "c"] and ds.labels.texts[2] == "gamma"
    assert ds.Y.shape == (2, 3)
    assert ds.Y.toarray().tolist() == [[1, 0, 1], [0, 0, 0]]
    assert ds.filter_pairs.tolist() == [[0, 1], [1, 1]]
    assert ds.filter_sets() == [{1}, {1}]
    assert label_frequencies(ds.Y).tolist() == [1, 0, 1]


def test_a_runs_splits_are_cut_and_share_the_label_space(jsonl_dir):
    write_gz(jsonl_dir / "dev.json.gz", [{"uid": "z", "title": "third", "target_ind": [1]}] * 3)
    train, dev = load_train_and_dev(jsonl_dir, "trn", "dev", max_train=1, max_dev=2)
    assert train.texts == ["first"] and train.filter_sets() == [{1}]
    assert len(dev) == 2 and dev.labels is train.labels
    full, none = load_train_and_dev(jsonl_dir, "trn", "")
    assert len(full) == 2 and none is None


def test_content_is_appended_only_on_request(jsonl_dir):
    texts, _, _ = read_instances_jsonl(jsonl_dir / "trn.json.gz", 3, use_content=True)
    assert texts == ["first body text", "second"]


def test_subset_renumbers_rows_and_keeps_their_filter_pairs(jsonl_dir):
    ds = load_jsonl_split(jsonl_dir, "trn").subset([1])
    assert ds.texts == ["second"] and ds.Y.shape == (1, 3)
    assert ds.filter_pairs.tolist() == [[0, 1]]


def test_a_holdout_is_a_seeded_disjoint_split_found_again_by_uid(sample_dir):
    train = load_jsonl_split(sample_dir, "trn")
    rest, held = split_holdout(train, 100, seed=3)
    assert len(rest) + len(held) == len(train) and not set(rest.uids) & set(held.uids)
    assert split_holdout(train, 100, seed=3)[1].uids == held.uids != split_holdout(train, 100, seed=4)[1].uids
    rows = rows_of_uids(train, held.uids)
    assert [train.texts[r] for r in rows] == held.texts and (train.Y[rows] != held.Y).nnz == 0
    with pytest.raises(ValueError, match="not .uniquely. in the split"):
        rows_of_uids(train, ["no-such-package"])
    with pytest.raises(ValueError, match="holdout must be in"):
        split_holdout(train, len(train), seed=0)


@pytest.mark.parametrize(
    "bad_line, problem",
    [
        ("{not json", "invalid JSON"),
        ('{"uid": "z", "title": "t", "target_ind": [7]}', "label id 7 outside"),
        ('{"uid": "z", "title": "t", "target_ind": "0"}', "must be a list of integers"),
        ('{"uid": "z", "target_ind": [0]}', "missing or non-string 'title'"),
    ],
)
def test_malformed_jsonl_line_names_file_and_line(tmp_path, bad_line, problem):
    path = tmp_path / "dev.json.gz"
    write_gz(path, [{"uid": "ok", "title": "fine", "target_ind": [0]}, bad_line])
    with pytest.raises(DataFormatError, match=rf"dev\.json\.gz:2: .*{problem}") as info:
        read_instances_jsonl(path, 3)
    assert info.value.lineno == 2


def test_sparse_matrix_format(tmp_path):
    path = tmp_path / "Y.txt"
    path.write_text("3 4\n0:1 3:0.5\n\n2:1\n")
    Y = read_sparse_matrix(path)
    assert Y.shape == (3, 4)
    np.testing.assert_allclose(Y.toarray(), [[1, 0, 0, 0.5], [0, 0, 0, 0], [0, 0, 1, 0]])


@pytest.mark.parametrize(
    "content, lineno, problem",
    [
        ("3 4\n0:1\n1:x\n", 3, "bad pair"),
        ("3 4\n0:1\n9:1\n", 3, "column 9 outside"),
        ("three four\n", 1, "header"),
        ("3 4\n0:1\n", 1, "declares 3 rows, file has 1"),
    ],
)
def test_sparse_matrix_errors(tmp_path, content, lineno, problem):
    path = tmp_path / "Y.txt"
    path.write_text(content)
    with pytest.raises(DataFormatError, match=rf"Y\.txt:{lineno}: .*{problem}"):
        read_sparse_matrix(path)


def test_filter_errors_name_the_line(tmp_path):
    path = tmp_path / "filter.txt"
    path.write_text("0 1\n0 x\n")
    with pytest.raises(DataFormatError, match=r"filter\.txt:2: "):
        read_filter(path, 2, 2)
    path.write_text("0 1\n5 1\n")
    with pytest.raises(DataFormatError, match=r"filter\.txt:2: row 5 outside"):
        read_filter(path, 2, 2)


def test_raw_text_layout(tmp_path):
    (tmp_path / "trn_X.txt").write_text("doc zero\ndoc one\n")
    (tmp_path / "Y.txt").write_text("2 3\n1:1 2:1\n0:1\n")
    (tmp_path / "labels.txt").write_text("l0\nl1\nl2\n")
    (tmp_path / "filter.txt").write_text("1 2\n")
    ds = load_raw_split(tmp_path / "trn_X.txt", tmp_path / "Y.txt", tmp_path / "labels.txt", tmp_path / "filter.txt")
    assert ds.texts == ["doc zero", "doc one"]
    assert ds.labels.texts == ["l0", "l1", "l2"]
    assert ds.Y.toarray().tolist() == [[0, 1, 1], [1, 0, 0]]
    assert ds.filter_pairs.tolist() == [[1, 2]]


def test_raw_text_row_count_mismatch(tmp_path):
    (tmp_path / "X.txt").write_text("only one\n")
    (tmp_path / "Y.txt").write_text("2 1\n0:1\n0:1\n")
    (tmp_path / "labels.txt").write_text("l0\n")
    with pytest.raises(DataFormatError, match="2 rows but 1 texts"):
        load_raw_split(tmp_path / "X.txt", tmp_path / "Y.txt", tmp_path / "labels.txt")


def test_shipped_sample_is_consistent(sample_dir):
    trn = load_jsonl_split(sample_dir, "trn")
    dev = load_jsonl_split(sample_dir, "dev", labels=trn.labels)
    assert len(trn) == 4000 and len(dev) == 1000
    assert trn.num_labels == dev.num_labels > 1000
    # Filter pairs are same-item pairs: the instance text is the label text, never a positive.
    for row, label in dev.filter_pairs[:50]:
        assert dev.uids[row] == dev.labels.uids[label]
        assert dev.Y[row, label] == 0
