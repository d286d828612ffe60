"""xmc.convert: CSV, Parquet and JSON lines with label uids or ids → the repository layout that
xmc.data reads; every refusal names the file, the row and the reason, and nothing is written."""

import csv
import json

import pytest

from xmc.convert import ConversionRefused, convert, main
from xmc.data import load_jsonl_split

LABELS = [("libc6", "libc6: GNU C Library"), ("zlib1g", "zlib1g: compression library"), ("perl", "perl: Larry Wall's")]
TRAIN = [("curl", "curl: command line tool", "libc6|zlib1g"), ("vim", "vim: editor", "libc6")]


def write_csv(path, header, rows):
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        writer.writerows(rows)
    return path


@pytest.fixture
def labels_csv(tmp_path):
    return write_csv(tmp_path / "labels.csv", ["uid", "text"], LABELS)


def test_a_csv_with_label_uids_reads_back_as_the_same_dataset(tmp_path, labels_csv):
    train = write_csv(tmp_path / "train.csv", ["uid", "text", "labels"], TRAIN)
    same = write_csv(tmp_path / "same.csv", ["uid", "label"], [("curl", "perl")])
    counts = convert(labels_csv, {"trn": train}, tmp_path / "out", filters={"trn": same})
    assert counts == {"labels": 3, "trn": 2, "filter_labels_trn": 1}
    data = load_jsonl_split(tmp_path / "out", "trn")
    assert data.labels.uids == ["libc6", "zlib1g", "perl"] and data.texts == ["curl: command line tool", "vim: editor"]
    assert data.uids == ["curl", "vim"]
    assert data.Y.toarray().tolist() == [[1, 1, 0], [1, 0, 0]]
    assert data.filter_pairs.tolist() == [[0, 2]]


def test_jsonl_with_label_ids_and_parquet_give_the_same_files(tmp_path, labels_csv):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"text": t, "labels": [0, 1] if "|" in y else [0]}) + "\n" for _, t, y in TRAIN)
    )
    convert(labels_csv, {"trn": jsonl}, tmp_path / "from-jsonl", labels_by="id")
    labels_table = pa.table({"uid": [u for u, _ in LABELS], "text": [t for _, t in LABELS]})
    pq.write_table(labels_table, tmp_path / "labels.parquet")
    train_table = pa.table({"text": [t for _, t, _ in TRAIN], "labels": [y.split("|") for _, _, y in TRAIN]})
    pq.write_table(train_table, tmp_path / "train.parquet")
    convert(tmp_path / "labels.parquet", {"trn": tmp_path / "train.parquet"}, tmp_path / "from-parquet")
    for name in ("lbl.json.gz", "trn.json.gz"):
        assert (tmp_path / "from-jsonl" / name).read_bytes() == (tmp_path / "from-parquet" / name).read_bytes()
    assert load_jsonl_split(tmp_path / "from-parquet", "trn").uids == ["0", "1"]  # no uid column: row numbers


def refusals(tmp_path, labels, train, **options) -> list[str]:
    with pytest.raises(ConversionRefused) as refused:
        convert(labels, {"trn": train}, tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()  # nothing written
    return refused.value.problems


def test_an_unknown_label_names_file_row_and_label(tmp_path, labels_csv):
    train = write_csv(tmp_path / "train.csv", ["text", "labels"], [("a", "libc6"), ("b", "libc6|nosuch")])
    assert refusals(tmp_path, labels_csv, train) == [
        f"{train}: row 2: unknown label 'nosuch' (not a uid of the label table)"
    ]


def test_a_label_id_out_of_range_is_refused(tmp_path, labels_csv):
    train = write_csv(tmp_path / "train.csv", ["text", "labels"], [("a", "0|3")])
    assert refusals(tmp_path, labels_csv, train, labels_by="id") == [
        f"{train}: row 1: unknown label id 3 (the label table has 3 rows)"
    ]


def test_empty_texts_are_refused_in_the_labels_and_the_instances(tmp_path):
    labels = write_csv(tmp_path / "labels.csv", ["uid", "text"], [("a", "A"), ("b", "  ")])
    train = write_csv(tmp_path / "train.csv", ["text", "labels"], [("x", "a"), ("", "a")])
    assert refusals(tmp_path, labels, train) == [f"{labels}: row 2: empty text", f"{train}: row 2: empty text"]


def test_duplicate_uids_are_refused_with_the_first_row(tmp_path):
    labels = write_csv(tmp_path / "labels.csv", ["uid", "text"], [("a", "A"), ("b", "B"), ("a", "again")])
    train = write_csv(tmp_path / "train.csv", ["uid", "text", "labels"], [("i", "x", "a"), ("i", "y", "b")])
    assert refusals(tmp_path, labels, train) == [
        f"{labels}: row 3: duplicate uid 'a' (first at row 1)",
        f"{train}: row 2: duplicate uid 'i' (first at row 1)",
    ]


def test_a_filter_pair_of_an_unknown_instance_is_refused(tmp_path, labels_csv):
    train = write_csv(tmp_path / "train.csv", ["uid", "text", "labels"], TRAIN)
    same = write_csv(tmp_path / "same.csv", ["uid", "label"], [("curl", "perl"), ("emacs", "perl")])
    assert refusals(tmp_path, labels_csv, train, filters={"trn": same}) == [
        f"{same}: row 2: unknown instance uid 'emacs'"
    ]


def test_a_missing_column_is_refused(tmp_path, labels_csv):
    train = write_csv(tmp_path / "train.csv", ["text", "tags"], [("a", "libc6")])
    assert refusals(tmp_path, labels_csv, train) == [f"{train}: row 1: no 'labels' column"]


def test_the_command_lists_the_refusals_and_exits_1(tmp_path, labels_csv, capsys):
    train = write_csv(tmp_path / "train.csv", ["text", "labels"], [("a", "nosuch"), ("", "libc6")])
    code = main(["--labels", str(labels_csv), "--split", f"trn={train}", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1 and "row 1: unknown label 'nosuch'" in err and "row 2: empty text" in err
    assert not (tmp_path / "out").exists()
    train = write_csv(tmp_path / "train.csv", ["text", "labels"], [("a", "perl")])
    assert main(["--labels", str(labels_csv), "--split", f"trn={train}", "--out", str(tmp_path / "out")]) == 0
    assert "trn 1" in capsys.readouterr().out
