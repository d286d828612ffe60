"""xmc.convert: CSV, TSV, Parquet, JSON lines and saved ``datasets`` directories, with label uids,
ids or names only, columns named as a team has them, and a seeded dev split → the repository
layout that xmc.data reads; every refusal names the file, the row and the reason, and nothing is
written."""

import csv
import json
from pathlib import Path

import pytest

from xmc.convert import ConversionRefused, ConvertParams, convert, draw_share, main
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
    counts = convert(ConvertParams({"trn": train}, tmp_path / "out", labels=labels_csv, filters={"trn": same})).counts
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
    convert(ConvertParams({"trn": jsonl}, tmp_path / "from-jsonl", labels=labels_csv, labels_by="id"))
    labels_table = pa.table({"uid": [u for u, _ in LABELS], "text": [t for _, t in LABELS]})
    pq.write_table(labels_table, tmp_path / "labels.parquet")
    train_table = pa.table({"text": [t for _, t, _ in TRAIN], "labels": [y.split("|") for _, _, y in TRAIN]})
    pq.write_table(train_table, tmp_path / "train.parquet")
    convert(ConvertParams({"trn": tmp_path / "train.parquet"}, tmp_path / "from-parquet", tmp_path / "labels.parquet"))
    for name in ("lbl.json.gz", "trn.json.gz"):
        assert (tmp_path / "from-jsonl" / name).read_bytes() == (tmp_path / "from-parquet" / name).read_bytes()
    assert load_jsonl_split(tmp_path / "from-parquet", "trn").uids == ["0", "1"]  # no uid column: row numbers


def refusals(tmp_path, labels, train, **options) -> list[str]:
    splits = train if isinstance(train, dict) else {"trn": train}
    with pytest.raises(ConversionRefused) as refused:
        convert(ConvertParams(splits, tmp_path / "refused", labels=labels, **options))
    assert not (tmp_path / "refused").exists()  # nothing written
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


def test_a_missing_column_is_refused_once_with_the_columns_the_file_has(tmp_path, labels_csv):
    train = write_csv(tmp_path / "train.csv", ["text", "tags"], [("a", "libc6"), ("b", "perl")])
    assert refusals(tmp_path, labels_csv, train) == [
        f"{train}: no column 'labels' (its columns: text, tags; --labels-column names another)"
    ]
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text(json.dumps({"body": "a", "labels": ["perl"]}) + "\n")
    assert refusals(tmp_path, labels_csv, jsonl) == [
        f"{jsonl}: no column 'text' (its first record's keys: body, labels; --text-column names another)"
    ]


def test_the_command_lists_the_refusals_and_exits_1(tmp_path, labels_csv, capsys):
    train = write_csv(tmp_path / "train.csv", ["text", "labels"], [("a", "nosuch"), ("", "libc6")])
    code = main(["--labels", str(labels_csv), "--split", f"trn={train}", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1 and "row 1: unknown label 'nosuch'" in err and "row 2: empty text" in err
    assert not (tmp_path / "out").exists()
    train = write_csv(tmp_path / "train.csv", ["text", "labels"], [("a", "perl")])
    assert main(["--labels", str(labels_csv), "--split", f"trn={train}", "--out", str(tmp_path / "out")]) == 0
    assert "trn 1" in capsys.readouterr().out


# --- data as teams have it: columns, TSV, saved datasets, names only, a drawn dev split ------------


def params(tmp_path, splits, **options) -> ConvertParams:
    return ConvertParams(splits, tmp_path / "out", **options)


def test_columns_are_named_as_the_files_have_them(tmp_path):
    labels = write_csv(tmp_path / "tags.csv", ["tag", "summary"], LABELS)
    train = write_csv(tmp_path / "train.csv", ["name", "description", "depends"], TRAIN)
    columns = {"text_column": "description", "labels_column": "depends", "uid_column": "name"}
    label_columns = {"label_uid_column": "tag", "label_text_column": "summary"}
    convert(params(tmp_path, {"trn": train}, labels=labels, **columns, **label_columns))
    data = load_jsonl_split(tmp_path / "out", "trn")
    assert data.uids == ["curl", "vim"] and data.texts == ["curl: command line tool", "vim: editor"]
    assert data.labels.texts == [text for _, text in LABELS] and data.Y.toarray().tolist() == [[1, 1, 0], [1, 0, 0]]


def test_a_mapped_column_the_file_lacks_is_refused_naming_the_file_and_its_columns(tmp_path, labels_csv):
    train = write_csv(tmp_path / "train.csv", ["uid", "text", "labels"], TRAIN)
    assert refusals(tmp_path, labels_csv, train, text_column="body", uid_column="id") == [
        f"{train}: no column 'body' (its columns: uid, text, labels; --text-column names another)",
        f"{train}: no column 'id' (its columns: uid, text, labels; --uid-column names another)",
    ]
    empty = write_csv(tmp_path / "empty.csv", ["uid", "text", "labels"], [("a", "", "libc6")])
    assert refusals(tmp_path, labels_csv, empty, label_text_column="title") == [
        f"{labels_csv}: no column 'title' (its columns: uid, text; --label-text-column names another)",
        f"{empty}: row 1: empty text",  # the instances still checked, their labels not looked up
    ]


def test_an_explicit_uid_column_with_an_empty_cell_is_refused(tmp_path, labels_csv):
    train = write_csv(tmp_path / "train.csv", ["id", "text", "labels"], [("a", "x", "perl"), ("", "y", "perl")])
    assert refusals(tmp_path, labels_csv, train, uid_column="id") == [f"{train}: row 2: empty uid"]


def write_tsv(path, header, rows) -> Path:
    path.write_text("".join("\t".join(fields) + "\n" for fields in [header, *rows]), encoding="utf-8")
    return path


def test_tsv_reads_like_csv_and_a_row_with_a_field_too_many_is_refused(tmp_path, labels_csv):
    rows = [("curl", "curl: transfers URLs, e.g. http, ftp", "libc6|zlib1g"), ("vim", "vim: editor", "libc6")]
    train = write_tsv(tmp_path / "train.tsv", ["uid", "text", "labels"], rows)
    assert convert(params(tmp_path, {"trn": train}, labels=labels_csv)).counts == {"labels": 3, "trn": 2}
    assert load_jsonl_split(tmp_path / "out", "trn").texts[0] == "curl: transfers URLs, e.g. http, ftp"
    tab = write_tsv(tmp_path / "train.tab", ["uid", "text", "labels"], [rows[1], ("ls", "ls: list", "x", "libc6")])
    assert refusals(tmp_path, labels_csv, tab) == [
        f"{tab}: row 2: 4 fields, the header has 3 (a delimiter in a text: quoted, or the file read as CSV)"
    ]


def test_a_byte_order_mark_is_not_part_of_the_first_column_name(tmp_path, labels_csv):
    train = tmp_path / "train.csv"
    train.write_text("\ufeffuid,text,labels\ncurl,curl: tool,libc6\n", encoding="utf-8")
    convert(params(tmp_path, {"trn": train}, labels=labels_csv))
    assert load_jsonl_split(tmp_path / "out", "trn").uids == ["curl"]


def test_a_labels_cell_split_on_the_separator_or_read_as_a_json_list(tmp_path, labels_csv):
    train = write_csv(
        tmp_path / "train.csv", ["text", "labels"], [("a", "libc6, zlib1g"), ("b", '["perl", "libc6"]'), ("c", "")]
    )
    convert(params(tmp_path, {"trn": train}, labels=labels_csv, separator=","))
    assert load_jsonl_split(tmp_path / "out", "trn").Y.toarray().tolist() == [[1, 1, 0], [1, 0, 1], [0, 0, 0]]


def test_without_a_label_table_the_labels_are_the_names_of_trn_each_its_own_text(tmp_path):
    rows = [("a", "zlib1g|libc6"), ("b", "perl"), ("c", "libc6")]
    train = write_csv(tmp_path / "train.csv", ["text", "labels"], rows)
    dev = write_csv(tmp_path / "dev.csv", ["text", "labels"], [("d", "libc6|unseen"), ("e", "unseen"), ("f", "perl")])
    summary = convert(params(tmp_path, {"trn": train, "dev": dev}))
    assert summary.counts == {"labels": 3, "trn": 3, "dev": 2}
    trn = load_jsonl_split(tmp_path / "out", "trn")
    assert trn.labels.uids == trn.labels.texts == ["libc6", "perl", "zlib1g"]  # sorted: the same ids every time
    assert trn.Y.toarray().tolist() == [[1, 0, 1], [0, 1, 0], [1, 0, 0]]
    dev_data = load_jsonl_split(tmp_path / "out", "dev")
    assert dev_data.texts == ["d", "f"] and dev_data.Y.toarray().tolist() == [[1, 0, 0], [0, 1, 0]]
    assert summary.notes == [
        "labels: the 3 names in trn's labels, each its own text (no --labels)",
        "dev: dropped 2 label(s) not in trn (unseen) and 1 instance(s) left with none",
    ]


def test_label_ids_need_a_label_table_and_names_only_need_a_trn_split(tmp_path):
    train = write_csv(tmp_path / "train.csv", ["text", "labels"], [("a", "0")])
    with pytest.raises(ConversionRefused, match="--labels-by id names rows of a label table"):
        convert(params(tmp_path, {"trn": train}, labels_by="id"))
    with pytest.raises(ConversionRefused, match="the labels are trn's: give --split trn=FILE"):
        convert(params(tmp_path, {"dev": train}))


def save_dataset(directory: Path, rows: list[dict], features: dict, shards: int = 1) -> Path:
    """What ``datasets.Dataset.save_to_disk`` writes (datasets is not a dependency): Arrow IPC
    stream files ``data-0000i-of-0000n.arrow``, ``dataset_info.json`` with the features and
    ``state.json`` listing the data files."""
    pa = pytest.importorskip("pyarrow")
    directory.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    per_shard = -(-len(rows) // shards)
    files = []
    for shard in range(shards):
        name = f"data-{shard:05d}-of-{shards:05d}.arrow"
        with pa.OSFile(str(directory / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.slice(shard * per_shard, per_shard))
        files.append({"filename": name})
    (directory / "dataset_info.json").write_text(json.dumps({"features": features, "splits": None}))
    state = {"_data_files": files, "_fingerprint": "0", "_format_columns": None, "_format_kwargs": {}}
    (directory / "state.json").write_text(json.dumps({**state, "_format_type": None, "_split": None}))
    return directory


TAGS = ["libc6", "perl", "zlib1g"]
FEATURES = {
    "sentence": {"dtype": "string", "_type": "Value"},
    "tags": {"feature": {"names": TAGS, "_type": "ClassLabel"}, "_type": "Sequence"},
}


def test_a_saved_dataset_with_class_label_ids_reads_as_their_names_over_its_shards(tmp_path):
    rows = [{"sentence": f"text {i}", "tags": [i % 3, (i + 1) % 3]} for i in range(5)]
    saved = save_dataset(tmp_path / "hf", rows, FEATURES, shards=2)
    columns = {"text_column": "sentence", "labels_column": "tags"}
    assert convert(params(tmp_path, {"trn": saved}, **columns)).counts == {"labels": 3, "trn": 5}
    data = load_jsonl_split(tmp_path / "out", "trn")
    assert data.labels.uids == TAGS and data.uids == ["0", "1", "2", "3", "4"]
    assert data.Y.toarray().tolist()[3] == [1, 1, 0] and data.Y.toarray().tolist()[4] == [0, 1, 1]
    rows[3]["sentence"] = " "  # in the second shard: the row is counted over the shards
    saved = save_dataset(tmp_path / "hf-empty", rows, FEATURES, shards=2)
    assert refusals(tmp_path, None, saved, **columns) == [f"{saved}: row 4: empty text"]


def test_a_saved_dataset_dict_gives_trn_dev_and_tst(tmp_path, labels_csv):
    root = tmp_path / "hf"
    splits = {"train": 4, "validation": 2, "test": 2, "unsupervised": 1}
    for name, count in splits.items():
        rows = [{"text": f"{name} {i}", "labels": ["libc6", "perl"][: 1 + i % 2]} for i in range(count)]
        save_dataset(root / name, rows, {"text": {"_type": "Value"}, "labels": [{"_type": "Value"}]})
    (root / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    summary = convert(params(tmp_path, {}, labels=labels_csv, dataset=root))
    assert summary.counts == {"labels": 3, "trn": 4, "dev": 2, "tst": 2}
    assert summary.notes == [f"not read: split(s) unsupervised of {root} (--split NAME={root}/<split> reads one)"]
    assert load_jsonl_split(tmp_path / "out", "tst").texts == ["test 0", "test 1"]
    with pytest.raises(ConversionRefused, match="a saved DatasetDict"):
        convert(params(tmp_path, {"trn": root}, labels=labels_csv))
    with pytest.raises(ConversionRefused, match="--split dev: also split 'validation' of --dataset"):
        convert(params(tmp_path, {"dev": root / "validation"}, labels=labels_csv, dataset=root))


def test_a_drawn_dev_split_is_deterministic_disjoint_and_independent_of_the_row_order(tmp_path, labels_csv):
    rows = [(f"pkg{i}", f"pkg{i}: text", LABELS[i % 3][0]) for i in range(40)]
    train = write_csv(tmp_path / "train.csv", ["uid", "text", "labels"], rows)
    same = write_csv(tmp_path / "same.csv", ["uid", "label"], [(uid, "perl") for uid, _, _ in rows])

    def drawn(out, file, seed=0):
        options = {"labels": labels_csv, "filters": {"trn": same}, "dev_share": 0.25, "seed": seed}
        summary = convert(ConvertParams({"trn": file}, tmp_path / out, **options))
        return summary, load_jsonl_split(tmp_path / out, "trn"), load_jsonl_split(tmp_path / out, "dev")

    summary, trn, dev = drawn("a", train)
    assert summary.counts == {"labels": 3, "trn": 30, "dev": 10, "filter_labels_trn": 30, "filter_labels_dev": 10}
    assert summary.notes == ["dev: 10 of trn's 40 instances drawn (--dev-share 0.25, --seed 0)"]
    assert not set(trn.uids) & set(dev.uids) and sorted(trn.uids + dev.uids) == sorted(uid for uid, _, _ in rows)
    assert trn.uids == [uid for uid, _, _ in rows if uid in set(trn.uids)]  # file order kept on both sides
    assert dev.filter_pairs.tolist() == [[row, 2] for row in range(10)]  # trn's filter pairs follow their instances
    for name in ("trn.json.gz", "dev.json.gz"):
        convert(ConvertParams({"trn": train}, tmp_path / "again", labels=labels_csv, dev_share=0.25))
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "again" / name).read_bytes()
    reversed_file = write_csv(tmp_path / "reversed.csv", ["uid", "text", "labels"], rows[::-1])
    assert sorted(drawn("b", reversed_file)[2].uids) == sorted(dev.uids)
    assert sorted(drawn("c", train, seed=1)[2].uids) != sorted(dev.uids)


def test_draw_share_rounds_the_share_and_depends_on_the_uids_and_seed(tmp_path):
    uids = [f"u{i}" for i in range(19)]
    assert len(draw_share(uids, 0.2, 0)) == 4 and draw_share(uids, 0.2, 0) == draw_share(uids, 0.2, 0)
    assert draw_share(uids, 0.2, 0) == sorted(draw_share(uids, 0.2, 0))


def test_a_dev_share_is_refused_beside_a_dev_split_out_of_range_or_drawing_none(tmp_path, labels_csv):
    train = write_csv(tmp_path / "train.csv", ["uid", "text", "labels"], TRAIN)
    with pytest.raises(ConversionRefused) as refused:
        convert(params(tmp_path, {"trn": train, "dev": train}, labels=labels_csv, dev_share=1.5))
    assert refused.value.problems == [
        "--dev-share 1.5: expected a fraction between 0 and 1",
        f"--dev-share: a dev split is given ({train}); give one or the other",
    ]
    assert refusals(tmp_path, labels_csv, train, dev_share=0.1) == [
        f"{train}: --dev-share 0.1 of its 2 instances draws 0 (a dev split needs one instance, and trn one left)"
    ]


def test_every_refusal_is_listed_with_its_file_and_row_up_to_max_errors(tmp_path, labels_csv):
    train = write_tsv(tmp_path / "train.tsv", ["text", "labels"], [("", "libc6"), ("b", "nosuch"), ("c", "perl|x")])
    dev = write_csv(tmp_path / "dev.csv", ["text", "labels"], [("d", "nope")])
    splits = {"trn": train, "dev": dev, "tst": tmp_path / "tst.csv"}
    problems = refusals(tmp_path, labels_csv, splits)
    assert problems == [
        f"{train}: row 1: empty text",
        f"{train}: row 2: unknown label 'nosuch' (not a uid of the label table)",
        f"{train}: row 3: unknown label 'x' (not a uid of the label table)",
        f"{dev}: row 1: unknown label 'nope' (not a uid of the label table)",
        f"{tmp_path / 'tst.csv'}: no such file",
    ]
    assert refusals(tmp_path, labels_csv, splits, max_errors=2) == [*problems[:2], "... and 3 more"]


def test_the_command_maps_columns_draws_dev_and_says_so(tmp_path, capsys):
    rows = [(f"p{i}", f"p{i}: text", "a,b" if i % 2 else "a") for i in range(10)]
    train = write_tsv(tmp_path / "train.tsv", ["name", "description", "depends"], rows)
    out = tmp_path / "out"
    argv = ["--split", f"trn={train}", "--text-column", "description", "--labels-column", "depends"]
    argv += ["--uid-column", "name", "--labels-separator", ",", "--dev-share", "0.2", "--seed", "3", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        f"wrote {out}: labels 2, trn 8, dev 2",
        "  dev: 2 of trn's 10 instances drawn (--dev-share 0.2, --seed 3)",
        "  labels: the 2 names in trn's labels, each its own text (no --labels)",
    ]
    assert main(["--split", f"trn={train}", "--out", str(tmp_path / "bad")]) == 1
    assert "no column 'text' (its columns: name, description, depends; --text-column names another)" in (
        capsys.readouterr().err
    )


def test_a_label_table_of_names_only_gives_its_uid_column_as_the_text_too(tmp_path):
    labels = write_csv(tmp_path / "tags.csv", ["tag"], [("perl",), ("libc6",)])
    train = write_csv(tmp_path / "train.csv", ["text", "labels"], [("a", "libc6")])
    convert(params(tmp_path, {"trn": train}, labels=labels, label_uid_column="tag", label_text_column="tag"))
    assert load_jsonl_split(tmp_path / "out", "trn").labels.texts == ["perl", "libc6"]  # the table's order kept
