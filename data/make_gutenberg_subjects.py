"""Build Gutenberg-Subjects, a second real short-text XMC data set, from Project Gutenberg's catalog.

Instance: one English Project Gutenberg work; its text is ``"<title>, by <author>"`` (the title's
subtitle lines joined to it). Labels: the Library of Congress Subject Headings (LCSH) the catalog
gives that work, e.g. ``Science fiction``, ``Whaling -- Fiction``; a label's text is the heading.
Nothing here comes from Debian: it is a library catalog, not a package index.

Source: the two tables that the rOpenSci R package *gutenbergr* ships, ``gutenberg_metadata``
(id, title, author, language, ...) and ``gutenberg_subjects`` (id, subject type, subject), as
xz-compressed R data files. They are read here by a small reader of R's serialization format
(stdlib only), so neither R nor pandas is needed. Fetch them (the snapshot this data set was built
from is named in ``data/gutenberg-subjects/README.md``, with the files' sha256)::

    git clone https://github.com/ropensci/gutenbergr /tmp/gutenbergr   # or any copy of it
    mkdir -p data/raw/gutenberg-subjects
    cp /tmp/gutenbergr/data/gutenberg_metadata.rda /tmp/gutenbergr/data/gutenberg_subjects.rda \\
        data/raw/gutenberg-subjects/

then::

    python data/make_gutenberg_subjects.py            # writes data/gutenberg-subjects/

Steps: keep works whose language is exactly ``en`` and that have at least one LCSH heading;
build each text; merge works whose texts are equal (case-insensitively; several editions or
uploads of one work) into one instance with the union of their headings and the smallest ebook
number as uid; split at random (seeded) 70/15/15 into trn/dev/tst; keep the headings that occur
at least twice in trn, drop every instance left without a heading, and number the labels in
sorted heading order. A work is never itself a heading, so the filter files are empty.
"""

from __future__ import annotations

import argparse
import gzip
import json
import lzma
import re
import struct
import sys
from collections import Counter
from pathlib import Path

import builders

# The files data/gutenberg-subjects/ was built from; another copy can be used with --any-snapshot.
EXPECTED_SHA256 = {
    "gutenberg_metadata.rda": "e8f4cca2cbd64d68cde065c500e5e5bdaccaaca300ba11382c75342604213ccd",
    "gutenberg_subjects.rda": "c47454a0b79d5cfa65afdb4a86211a5f232173a65ee43ce67bb28f60668663ea",
}

# --------------------------------------------------------------------------------------------
# A reader of R's serialization format (XDR, versions 2 and 3), enough for data frames and
# tibbles of integer, double, logical, character and factor columns.
# --------------------------------------------------------------------------------------------

NILVALUE, REFSXP, ALTREP = 254, 255, 238
SYMSXP, LISTSXP, CLOSXP, ENVSXP, PROMSXP, LANGSXP = 1, 2, 3, 4, 5, 6
CHARSXP, LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP = 9, 10, 13, 14, 16, 19
ATTRLANGSXP, ATTRLISTSXP = 240, 239
# Singletons that carry no payload: global/empty/base environment, unbound value, missing arg,
# base namespace.
SINGLETONS = {253, 242, 241, 252, 251, 247}
NA_INTEGER = -(2**31)


class RObject:
    """A vector (``value`` a list) or pairlist (``value`` a list of ``(tag, value)``) and its
    attributes (a dict, tag name -> object)."""

    def __init__(self, kind: int, value, attributes: dict | None = None):
        self.kind = kind
        self.value = value
        self.attributes = attributes or {}

    def attr(self, name: str):
        obj = self.attributes.get(name)
        return obj.value if isinstance(obj, RObject) else obj


class Symbol(str):
    """An R symbol (a name), told apart from a character string."""


class RDataError(ValueError):
    pass


class _Reader:
    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0
        self.refs: list = []

    def int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def length(self) -> int:
        n = self.int()
        if n == -1:  # a long vector: two more words
            n = (self.int() << 32) + self.int()
        return n

    def item(self):
        flags = self.int()
        kind = flags & 0xFF
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if kind == NILVALUE:
            return None
        if kind in SINGLETONS:
            return RObject(kind, None)
        if kind == REFSXP:
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if kind == SYMSXP:
            sym = Symbol(self.item())
            self.refs.append(sym)
            return sym
        if kind in (LISTSXP, LANGSXP, CLOSXP, PROMSXP, ATTRLANGSXP, ATTRLISTSXP):
            return self.pairlist(kind, has_attr, has_tag)
        if kind == ENVSXP:
            env = RObject(ENVSXP, None)
            self.refs.append(env)
            self.int()  # locked
            enclos, frame, hashtab, attributes = self.item(), self.item(), self.item(), self.item()
            env.value = (enclos, frame, hashtab)
            env.attributes = _attr_dict(attributes)
            return env
        if kind == CHARSXP:
            n = self.int()
            if n == -1:
                return None  # NA_character_
            text = self.data[self.pos : self.pos + n].decode("utf-8", "replace")
            self.pos += n
            return text
        if kind in (LGLSXP, INTSXP):
            n = self.length()
            value = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
        elif kind == REALSXP:
            n = self.length()
            value = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        elif kind in (STRSXP, VECSXP):
            value = [self.item() for _ in range(self.length())]
        elif kind == ALTREP:
            return self.altrep()
        else:
            raise RDataError(f"unsupported R object type {kind} at byte {self.pos - 4}")
        attributes = _attr_dict(self.item()) if has_attr else {}
        return RObject(kind, value, attributes)

    def pairlist(self, kind: int, has_attr: bool, has_tag: bool) -> RObject:
        cells, attributes = [], {}
        while True:  # the CDR chain is read iteratively: a long pairlist would overflow recursion
            if has_attr:
                attributes.update(_attr_dict(self.item()))
            tag = self.item() if has_tag else None
            cells.append((tag, self.item()))
            flags = self.int()
            if flags & 0xFF != kind:
                self.pos -= 4
                tail = self.item()
                if tail is not None:
                    cells.append((None, tail))
                return RObject(kind, cells, attributes)
            has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))

    def altrep(self) -> RObject:
        info, state, attributes = self.item(), self.item(), self.item()
        cls = info.value[0][1] if isinstance(info, RObject) and info.value else None
        if cls == "compact_intseq":  # state: (n, start, step) as doubles
            n, start, step = (int(x) for x in state.value)
            return RObject(INTSXP, [start + i * step for i in range(n)], _attr_dict(attributes))
        if cls == "compact_realseq":
            n, start, step = state.value
            return RObject(REALSXP, [start + i * step for i in range(int(n))], _attr_dict(attributes))
        if cls in ("wrap_integer", "wrap_real", "wrap_string", "wrap_logical", "deferred_string"):
            inner = state.value[0][1] if state.kind == LISTSXP else state.value[0]
            obj = inner if isinstance(inner, RObject) else RObject(STRSXP, [inner])
            obj.attributes.update(_attr_dict(attributes))
            return obj
        raise RDataError(f"unsupported ALTREP class {cls!r}")


def _attr_dict(obj) -> dict:
    if obj is None:
        return {}
    return {str(tag): value for tag, value in obj.value}


def read_rda(path: Path) -> dict[str, RObject]:
    """The objects an ``.rda`` / ``.RData`` file saves, by name (gzip, bzip2, xz or plain)."""
    raw = path.read_bytes()
    if raw[:6] == b"\xfd7zXZ\x00":
        raw = lzma.decompress(raw)
    elif raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    elif raw[:3] == b"BZh":
        import bz2

        raw = bz2.decompress(raw)
    if raw[:5] not in (b"RDX2\n", b"RDX3\n") or raw[5:7] != b"X\n":
        raise RDataError(f"{path}: not an XDR R data file (starts {raw[:7]!r})")
    reader = _Reader(raw)
    reader.pos = 7
    version = reader.int()
    reader.int()  # R version that wrote it
    reader.int()  # minimal R version to read it
    if version == 3:
        n = reader.int()  # then the native encoding's name
        reader.pos += n
    saved = reader.item()
    return {str(tag): value for tag, value in saved.value}


def data_frame_columns(frame: RObject) -> dict[str, list]:
    """A data frame's columns as Python lists; factors become their level strings, NA None."""
    columns = {}
    for name, column in zip(frame.attr("names"), frame.value, strict=True):
        values = column.value
        levels = column.attr("levels")
        if levels is not None:
            values = [levels[k - 1] if k != NA_INTEGER else None for k in values]
        elif column.kind in (LGLSXP, INTSXP):
            values = [None if k == NA_INTEGER else k for k in values]
        columns[name] = values
    return columns


# --------------------------------------------------------------------------------------------
# The data set
# --------------------------------------------------------------------------------------------


def clean_title(title: str) -> str:
    """Main title, then the subtitle lines joined to it by ': ' (by a space after ':;,.); MARC
    subfield codes dropped and ' : ' / ' ; ' closed up."""
    lines = [" ".join(line.split()) for line in re.split(r"[\r\n]+", title)]
    lines = [line for line in lines if line]
    if not lines:
        return ""
    text = lines[0]
    if len(lines) > 1:
        rest = " ".join(lines[1:])
        text = f"{text} {rest}" if text[-1] in ":;,." else f"{text}: {rest}"
    # Newer records keep MARC subfield codes and ISBD spacing: "Hosanna : $b Bible stories retold".
    text = re.sub(r"\s+\$[a-z](?=\s|$)", "", text)
    return re.sub(r"\s+([:;,])", r"\1", text)


def author_name(author: str | None) -> str:
    """'Kennedy, John F. (John Fitzgerald)' -> 'John F. Kennedy'; other forms kept as given."""
    if not author:
        return ""
    name = " ".join(re.sub(r"\s*\([^)]*\)", "", author).split())
    if name.count(",") == 1:
        last, first = (part.strip() for part in name.split(","))
        if last and first:
            return f"{first} {last}"
    return name


def joined_names(names: list[str]) -> str:
    """['A'] -> 'A'; ['A', 'B'] -> 'A and B'; ['A', 'B', 'C'] -> 'A, B and C'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def instance_text(title: str, authors: str | None | list[str | None]) -> str:
    """The title, then ``, by`` and the work's authors in catalog order (none: the title alone)."""
    text = clean_title(title)
    raw = authors if isinstance(authors, list) else [authors]
    names = list(dict.fromkeys(name for name in map(author_name, raw) if name))
    return f"{text}, by {joined_names(names)}" if text and names else text


def works(metadata: dict[str, list]) -> dict[int, tuple[str, list[str | None], str]]:
    """One entry per ebook number: (title, [author, ...], language), in catalog order. The table
    has one row per (work, author): a work of two authors is two rows, which would otherwise be
    two instances with one uid, possibly in two splits with the same headings."""
    out: dict[int, tuple[str, list[str | None], str]] = {}
    for gid, title, author, language in zip(
        metadata["gutenberg_id"], metadata["title"], metadata["author"], metadata["language"], strict=True
    ):
        if gid in out:
            out[gid][1].append(author)
        else:
            out[gid] = (title, [author], language)
    return out


def build(metadata: dict[str, list], subjects: dict[str, list], seed: int, min_trn: int):
    """(labels, splits, stats): labels a sorted list of headings; splits name -> list of
    ``(uid, text, [heading, ...])``."""
    headings: dict[int, list[str]] = {}
    for gid, kind, subject in zip(subjects["gutenberg_id"], subjects["subject_type"], subjects["subject"], strict=True):
        if kind == "lcsh" and subject and subject.strip():
            heads = headings.setdefault(gid, [])
            subject = " ".join(subject.split())
            if subject not in heads:
                heads.append(subject)

    english = [
        (gid, title, authors)
        for gid, (title, authors, language) in works(metadata).items()
        if language == "en" and title
    ]
    texts = ((gid, instance_text(title, authors), headings[gid]) for gid, title, authors in english if gid in headings)
    rows = builders.merge_equal_texts((gid, text, heads) for gid, text, heads in texts if text)
    labels, splits, dropped = builders.keep_labels_frequent_in_trn(builders.shuffle_split(rows, seed), min_trn)
    stats = {
        "english_works": len(english),
        "with_lcsh_after_merge": len(rows),
        "distinct_headings_all": len({h for _, _, hs in rows for h in hs}),
        "dropped": dropped,
    }
    return labels, splits, stats


def trn_label_frequency(freq: Counter, counts: list[int], n_trn: int) -> dict:
    """The summary's figures of a long-tailed set: how many headings have only a few trn works."""
    return {
        "max": counts[-1],
        "top_label": freq.most_common(1)[0][0],
        "top_label_share_of_trn": round(counts[-1] / n_trn, 4),
        "p10": builders.quantile(counts, 0.10),
        "p99": builders.quantile(counts, 0.99),
        "median": builders.quantile(counts, 0.50),
        "p90": builders.quantile(counts, 0.90),
        "labels_with_2_positives": sum(1 for c in counts if c == 2),
        "labels_with_at_most_5": sum(1 for c in counts if c <= 5),
        "labels_with_at_least_100": sum(1 for c in counts if c >= 100),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--raw",
        type=Path,
        default=Path("data/raw/gutenberg-subjects"),
        help="folder holding gutenberg_metadata.rda and gutenberg_subjects.rda",
    )
    parser.add_argument("--out", type=Path, default=Path("data/gutenberg-subjects"), help="folder written")
    parser.add_argument("--seed", type=int, default=20261127, help="seed of the random split")
    parser.add_argument("--min-trn", type=int, default=2, help="keep headings with at least this many trn positives")
    parser.add_argument(
        "--any-snapshot",
        action="store_true",
        help="build from raw files other than the ones README.md names (the counts will differ)",
    )
    args = parser.parse_args(argv)

    paths = {name: args.raw / name for name in EXPECTED_SHA256}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        sys.exit(f"missing raw file(s): {', '.join(missing)} (see this script's docstring to fetch them)")
    for name, path in paths.items():
        builders.require_snapshot(path, EXPECTED_SHA256[name], args.any_snapshot)

    ((_, meta_frame),) = read_rda(paths["gutenberg_metadata.rda"]).items()
    ((_, subj_frame),) = read_rda(paths["gutenberg_subjects.rda"]).items()
    metadata, subjects = data_frame_columns(meta_frame), data_frame_columns(subj_frame)
    labels, splits, stats = build(metadata, subjects, args.seed, args.min_trn)
    builders.write_data_set(args.out, labels, splits)
    report = builders.summary(labels, splits, stats, "trn_label_frequency", trn_label_frequency)
    print(json.dumps(report, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
