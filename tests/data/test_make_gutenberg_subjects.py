"""data/make_gutenberg_subjects.py: its R-data reader and its rules, on tiny hand-written tables."""

import gzip
import json
import lzma
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.data.conftest import DATA, load_script
from xmc.data import load_jsonl_split

SCRIPT = DATA / "make_gutenberg_subjects.py"


# --- a writer of R's XDR serialization, just what the tables need ------------------------------


class Writer:
    def __init__(self):
        self.out = bytearray()
        self.symbols: dict[str, int] = {}

    def int(self, value: int) -> None:
        self.out += struct.pack(">i", value)

    def flags(self, kind: int, attr: bool = False, tag: bool = False) -> None:
        self.int(kind | (attr << 9) | (tag << 10))

    def char(self, text: str | None) -> None:
        self.flags(9)
        if text is None:
            self.int(-1)
        else:
            data = text.encode()
            self.int(len(data))
            self.out += data

    def symbol(self, name: str) -> None:
        if name in self.symbols:  # a repeated symbol is a reference, as R writes it
            self.int((self.symbols[name] << 8) | 255)
            return
        self.flags(1)
        self.char(name)
        self.symbols[name] = len(self.symbols) + 1

    def attributes(self, attrs: dict) -> None:
        for name, write_value in attrs.items():
            self.flags(2, tag=True)
            self.symbol(name)
            write_value()
        self.int(254)

    def strings(self, values, attrs=None) -> None:
        self.flags(16, attr=bool(attrs))
        self.int(len(values))
        for value in values:
            self.char(value)
        if attrs:
            self.attributes(attrs)

    def ints(self, values, attrs=None, kind=13) -> None:
        self.flags(kind, attr=bool(attrs))
        self.int(len(values))
        for value in values:
            self.int(value)
        if attrs:
            self.attributes(attrs)

    def factor(self, values: list[str | None]) -> None:
        levels = sorted({v for v in values if v is not None})
        codes = [levels.index(v) + 1 if v is not None else -(2**31) for v in values]
        self.ints(codes, {"levels": lambda: self.strings(levels), "class": lambda: self.strings(["factor"])})

    def tibble(self, columns: dict) -> None:
        n = len(next(iter(columns.values()))[1])
        self.flags(19, attr=True)
        self.int(len(columns))
        for kind, values in columns.values():
            {"int": self.ints, "str": self.strings, "factor": self.factor}[kind](values)
        self.attributes(
            {
                "names": lambda: self.strings(list(columns)),
                "row.names": lambda: self.ints([-(2**31), -n]),
                "class": lambda: self.strings(["tbl_df", "tbl", "data.frame"]),
            }
        )


def write_rda(path: Path, name: str, columns: dict) -> None:
    w = Writer()
    w.out += b"RDX3\nX\n"
    for value in (3, 0x040400, 0x030500, 5):
        w.int(value)
    w.out += b"UTF-8"
    w.flags(2, tag=True)
    w.symbol(name)
    w.tibble(columns)
    w.int(254)
    path.write_bytes(lzma.compress(bytes(w.out)))


def catalog(tmp_path: Path) -> Path:
    """Thirteen works: English and not, with and without headings, two editions of one work, and
    one work of two authors (two rows of the metadata table, as the catalog has them)."""
    works = [
        # id, title, author, language, headings
        (1, "The Time Machine", "Wells, H. G. (Herbert George)", "en", ["Science fiction", "Time travel -- Fiction"]),
        (
            2,
            "The War of the Worlds",
            "Wells, H. G. (Herbert George)",
            "en",
            ["Science fiction", "Mars (Planet) -- Fiction"],
        ),
        (3, "The First Men in the Moon", "Wells, H. G. (Herbert George)", "en", ["Science fiction"]),
        (4, "A Princess of Mars", "Burroughs, Edgar Rice", "en", ["Science fiction", "Mars (Planet) -- Fiction"]),
        (5, "Hosanna : $b Bible stories retold", "Shaw, Catharine", "en", ["Bible stories"]),
        (6, "Bible Stories\r\nRetold for the Young", "Various", "en", ["Bible stories"]),
        (7, "Bible stories\nretold for the young", "Various", "en", ["Bible stories", "Children's stories"]),
        (8, "Sea Stories", None, "en", ["Sea stories"]),
        (9, "Sea Stories", None, "en", ["Sea stories"]),
        (10, "Voyage au centre de la Terre", "Verne, Jules", "fr", ["Science fiction"]),
        (11, "No Headings Here", "Nobody, A.", "en", []),
        (12, "Lone Heading", "Someone, B.", "en", ["A heading seen once"]),
        (13, "The Federalist Papers", "Hamilton, Alexander", "en", ["Science fiction", "Bible stories"]),
        (13, "The Federalist Papers", "Madison, James", "en", []),
    ]
    raw = tmp_path / "raw"
    raw.mkdir()
    write_rda(
        raw / "gutenberg_metadata.rda",
        "gutenberg_metadata",
        {
            "gutenberg_id": ("int", [w[0] for w in works]),
            "title": ("str", [w[1] for w in works]),
            "author": ("str", [w[2] for w in works]),
            "language": ("factor", [w[3] for w in works]),
        },
    )
    pairs = [(w[0], h) for w in works for h in w[4]] + [(1, "PR")]
    write_rda(
        raw / "gutenberg_subjects.rda",
        "gutenberg_subjects",
        {
            "gutenberg_id": ("int", [p[0] for p in pairs]),
            "subject_type": ("factor", ["lcc" if p[1] == "PR" else "lcsh" for p in pairs]),
            "subject": ("str", [p[1] for p in pairs]),
        },
    )
    return raw


def test_reader_reads_tibbles_with_factors_na_and_symbol_references(tmp_path):
    module = load_script(SCRIPT)
    raw = catalog(tmp_path)
    ((name, frame),) = module.read_rda(raw / "gutenberg_metadata.rda").items()
    columns = module.data_frame_columns(frame)
    assert name == "gutenberg_metadata" and list(columns) == ["gutenberg_id", "title", "author", "language"]
    assert columns["gutenberg_id"][:3] == [1, 2, 3] and columns["author"][7] is None
    assert columns["language"][9] == "fr" and columns["title"][5] == "Bible Stories\r\nRetold for the Young"


def test_texts_merge_and_label_rules():
    module = load_script(SCRIPT)
    assert module.instance_text("Bible Stories\r\nRetold for the Young", "Various") == (
        "Bible Stories: Retold for the Young, by Various"
    )
    assert module.instance_text("Hosanna : $b Bible stories retold", "Shaw, Catharine") == (
        "Hosanna: Bible stories retold, by Catharine Shaw"
    )
    assert (
        module.instance_text("The Time Machine", "Wells, H. G. (Herbert George)") == "The Time Machine, by H. G. Wells"
    )
    assert module.instance_text("Sea Stories", None) == "Sea Stories"
    authors = ["Hamilton, Alexander", "Madison, James", None, "Jay, John"]
    assert module.instance_text("The Federalist Papers", authors) == (
        "The Federalist Papers, by Alexander Hamilton, James Madison and John Jay"
    )


def test_a_work_of_several_authors_is_one_instance():
    module = load_script(SCRIPT)
    metadata = {
        "gutenberg_id": [5, 7, 5],
        "title": ["The Communist Manifesto", "Sea Stories", "The Communist Manifesto"],
        "author": ["Marx, Karl", None, "Engels, Friedrich"],
        "language": ["en", "en", "en"],
    }
    subjects = {
        "gutenberg_id": [5, 5, 7],
        "subject_type": ["lcsh", "lcsh", "lcsh"],
        "subject": ["Socialism", "Communism", "Sea stories"],
    }
    assert module.works(metadata)[5] == ("The Communist Manifesto", ["Marx, Karl", "Engels, Friedrich"], "en")
    _, splits, stats = module.build(metadata, subjects, seed=1, min_trn=1)
    uids = [uid for part in splits.values() for uid, _, _ in part]
    # two works, not three instances (one per author row, two of them with the uid 5)
    assert stats["english_works"] == 2 and stats["with_lcsh_after_merge"] == 2
    assert len(uids) == len(set(uids))


def test_script_writes_the_layout_the_readers_load(tmp_path):
    raw = catalog(tmp_path)
    out = tmp_path / "out"
    command = [sys.executable, str(SCRIPT), "--raw", str(raw), "--out", str(out), "--any-snapshot", "--seed", "3"]
    done = subprocess.run(command, check=True, capture_output=True, text=True, timeout=60)
    stats = json.loads(done.stdout)
    # 12 English works, 11 with headings; 6 and 7 are one text case-insensitively, as are 8 and 9;
    # 13's two rows (one per author) are one work
    assert stats["english_works"] == 12 and stats["with_lcsh_after_merge"] == 9
    splits = {name: load_jsonl_split(out, name) for name in ("trn", "dev", "tst")}
    labels = splits["trn"].labels
    assert labels.uids == sorted(labels.uids) and labels.uids == labels.texts
    assert "PR" not in labels.uids and "A heading seen once" not in labels.uids
    trn_counts = splits["trn"].Y.sum(axis=0).A1
    assert trn_counts.min() >= 2  # every label has at least two positives in trn
    assert all(len(set(s.uids)) == len(s.uids) for s in splits.values())  # one row a work
    uids = [set(s.uids) for s in splits.values()]
    assert not (uids[0] & uids[1] or uids[0] & uids[2] or uids[1] & uids[2])
    for split in splits.values():
        assert all(split.Y.getnnz(axis=1) >= 1) and len(split.filter_pairs) == 0
        assert "10" not in split.uids and "7" not in split.uids and "9" not in split.uids
    assert sum(len(s) for s in splits.values()) == 9 - sum(d["instances"] for d in stats["dropped"].values())
    for name in ("trn", "dev", "tst"):
        assert (out / f"filter_labels_{name}.txt").read_text() == ""
    first = {name: gzip.decompress((out / f"{name}.json.gz").read_bytes()) for name in ("lbl", "trn")}
    subprocess.run(command, check=True, capture_output=True, timeout=60)
    assert first == {name: gzip.decompress((out / f"{name}.json.gz").read_bytes()) for name in ("lbl", "trn")}


def test_refuses_raw_files_other_than_the_named_snapshot(tmp_path):
    raw = catalog(tmp_path)
    command = [sys.executable, str(SCRIPT), "--raw", str(raw), "--out", str(tmp_path / "out")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "sha256" in done.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("missing", ["gutenberg_metadata.rda", "gutenberg_subjects.rda"])
def test_names_a_missing_raw_file(tmp_path, missing):
    raw = catalog(tmp_path)
    (raw / missing).unlink()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--raw", str(raw), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and missing in done.stderr
