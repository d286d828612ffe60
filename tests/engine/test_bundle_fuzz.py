"""Bundle fuzzing: every array of every file kind of two small bundles mutated (dtype and
signedness changes, spikes, negative and out-of-range values, NaN / inf / a float64 1e39, shape
changes, truncation; byte flips, field spikes and truncation of the native index files), the
checksums and the bundle id re-sealed so that each mutation reaches the checks behind them, and
each mutated bundle loaded in a child process and queried. Each must be refused (a
:class:`~bundle.BundleError`), or served with finite scores, label ids in range and exclusions
kept; one whose mutation keeps every value (a wider dtype) serves the unmutated bundle's answers.
Never a signal, an exception that escaped the loader's checks, or a non-finite score.

The two bundles between them hold every file kind a bundle has but the ONNX models and the
tokenizer (parsed by ONNX Runtime and tokenizers, not arrays): ``tiny_rae_bundle`` (labels.jsonl,
index.hnsw, values.npz) and one with label arrays, the compressed index (index.faiss, rerank.npy)
and a lexical fusion with a sparse ranker (fusion.npz, lexical.npz, sparse.npz), its fusion
made here from the files' own writers (export.fuse would take half a minute).

Deterministic: every position and value is drawn from a seed named by the file, array and
mutation. The bundles are loaded by one child at a time, one after another; a child that dies
is replaced, the bundle it was loading recorded as its crash.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from bundle import (
    CARD_FILE,
    CARD_README_FILE,
    FUSION_FILE,
    FUSION_MODEL_FILE,
    INDEX_FILE,
    IVF_INDEX_FILE,
    LABEL_ARRAY_FILES,
    LABELS_FILE,
    LEXICAL_FILE,
    MANIFEST_FILE,
    MAX_CARD_BYTES,
    RERANK_FILE,
    SPARSE_FILE,
    TOKENIZER_FILE,
    VALUES_FILE,
    Manifest,
    SparseRankerParams,
    content_id,
    sha256_file,
)
from bundle.hnsw_file import HNSW_HEADER
from engine.fusion import FEATURES, LEXICAL_FEATURES, SPARSE_FEATURES, ScoreFusion
from engine.lexical import Lexicon, save_key_terms
from engine.sparse import SparseRanker
from tests.conftest import ROOT, SAMPLE_DIR
from tests.engine.test_fusion import fusion_params as base_fusion_params
from tests.engine.test_fusion import random_onnx_tree

# read by ONNX Runtime and tokenizers (not arrays), or not by the service at all
NOT_ARRAYS = {"encoder.onnx", TOKENIZER_FILE, FUSION_MODEL_FILE, "head.npz", "head.json", CARD_README_FILE}
# the queries: three texts, and those of the memory's first keys (its first training instances),
# so that a spike in those keys' rows is met
FIRST_KEYS = 4
QUERIES = ["python library for numerical arrays", "GNU C library shared files", "tryton sale module"]
CHILD_TIMEOUT_S = 240  # the whole list of one child, on a loaded 2-core machine


@pytest.fixture(scope="module")
def fused_arrays_bundle(distilbert_dir, tmp_path_factory) -> Path:
    """300 sample instances in an RAE memory with label arrays and the compressed index, and a
    lexical fusion with a sparse ranker (a random tree and random weights: the files, not the
    quality, are under test)."""
    from export.build import ExportParams, build_bundle
    from xmc.data import load_jsonl_split

    train = load_jsonl_split(SAMPLE_DIR, "trn")
    out = tmp_path_factory.mktemp("fuzz") / "arrays-ivfpq-fused"
    params = ExportParams(dim=16, max_train=300, rae_top_b=50, labels_format="arrays", index="ivfpq")
    build_bundle(out, train.labels, train, distilbert_dir, params)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    labels, rng = manifest["counts"]["labels"], np.random.default_rng(0)
    lexicon = Lexicon.fit(out / TOKENIZER_FILE, manifest["tokenizer"]["max_length"], train.texts[:300])
    save_key_terms(out / LEXICAL_FILE, lexicon.rows([*train.texts[:300], *train.labels.texts]))
    weights = sp.random(len(lexicon.idf), labels, density=2e-6, format="csr", dtype=np.float32, random_state=rng)
    features = FEATURES + LEXICAL_FEATURES + SPARSE_FEATURES
    sparse = SparseRanker(weights, rng.normal(size=labels).astype(np.float32), depth=5)
    fusion = ScoreFusion(
        random_onnx_tree(features=features), np.zeros(labels, np.float32), lexicon, features, None, sparse
    )
    fusion_params = base_fusion_params(features).model_copy(
        update={
            "fitted_on": "the fuzz test",
            "lexical": [LEXICAL_FILE],
            "sparse": SparseRankerParams(depth=5, labels=labels, fit="centroid", fitted_on="the fuzz test"),
        }
    )
    fusion.save(out, fusion_params)
    manifest["fusion"] = fusion_params.model_dump(mode="json")
    for name in (FUSION_FILE, FUSION_MODEL_FILE, LEXICAL_FILE, SPARSE_FILE):
        manifest["files"][name] = sha256_file(out / name)
    write_sealed(out, manifest)
    return out


def write_sealed(path: Path, manifest: dict) -> None:
    """The manifest with the bundle id its content gives, as a careless or hostile exporter would
    write it: the mutation then meets the file checks, not the checksum or the id."""
    manifest["bundle_id"] = content_id(Manifest.model_validate(manifest))
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))


def seeded(*names: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32("/".join(names).encode()))


def array_mutations(a: np.ndarray, rng: np.random.Generator, hot: range | None = None):
    """(name, mutated array, keeps every value) for one array; the values spiked at a position
    drawn from ``hot`` when given (where the queries read)."""
    if a.ndim == 0 or a.dtype.kind in "US":  # the npz's format string
        yield "csc", np.array("csc"), False
        yield "empty", np.array(""), False
        return
    yield "two-d", a.reshape(1, -1) if a.ndim == 1 else a.reshape(-1), False
    if not len(a):
        return
    yield "truncated", a[:-1], False
    flat = a.reshape(-1)
    span = hot if hot is not None and len(hot) else range(len(flat))
    at, other = (span[int(i)] for i in rng.integers(0, len(span), 2))

    def changed(dtype=None, **at_values):
        out = flat.astype(dtype or a.dtype, copy=True)
        for value in at_values.values():
            out[at] = value
        return out.reshape(a.shape)

    if a.dtype.kind in "iu":
        for wider in (np.uint64, np.int64):
            if a.dtype != wider and (wider is np.int64 or flat.min() >= 0):
                yield f"as-{np.dtype(wider)}", changed(wider), True
        yield "as-int16", changed(np.int16), bool(np.abs(flat.astype(np.float64)).max() < 2**15)
        yield "as-float64", changed(np.float64), False
        yield "uint64-spike", changed(np.uint64, v=10**12), False
        yield "uint64-beyond-int64", changed(np.uint64, v=2**63 + 5), False
        yield "dtype-max", changed(v=np.iinfo(a.dtype).max), False
        yield "plus-one", changed(v=flat[at] + 1), False
        if a.dtype.kind == "i":
            yield "negative", changed(v=-1), False
        swapped = flat.copy()
        swapped[at], swapped[other] = flat[other], flat[at]
        yield "swapped", swapped.reshape(a.shape), at == other or flat[at] == flat[other]
    elif a.dtype.kind == "f":
        if a.dtype != np.float64:
            yield "as-float64", changed(np.float64), True
        yield "as-float16", changed(np.float16), False
        yield "as-int64", changed(np.int64), False
        for name, value in (("nan", np.nan), ("inf", np.inf), ("1e30", 1e30), ("minus-2", -2)):
            yield name, changed(np.float64, v=value), False
        yield "1e39-float64", changed(np.float64, v=1e39), False


def byte_mutations(data: bytes, rng: np.random.Generator, header_fields: int = 0):
    """(name, mutated bytes) for a native index file: its header's 8-byte words spiked, bytes
    flipped anywhere, the file cut or extended."""
    for word in range(header_fields):
        spiked = bytearray(data)
        spiked[8 * word : 8 * word + 8] = (2**40 + word).to_bytes(8, "little")
        yield f"header-word-{word}", bytes(spiked)
    for n, at in enumerate(rng.integers(0, len(data), 8).tolist()):
        flipped = bytearray(data)
        flipped[at] ^= 1 << int(rng.integers(0, 8))
        yield f"flip-{n}-at-{at}", bytes(flipped)
    for fraction in (0.0, 0.5, 0.999):
        yield f"cut-at-{fraction}", data[: int(len(data) * fraction)]
    yield "extended", data + b"\x00" * 8


def hot_positions(name: str, member: str, arrays: dict) -> range | None:
    """Where a spike meets the queries: the entries of the first keys' rows (the memory's first
    training instances, whose texts are among the queries) in a file of key rows."""
    if name not in (VALUES_FILE, LEXICAL_FILE) or member not in ("indptr", "indices", "data"):
        return None
    first = FIRST_KEYS
    return range(1, first + 1) if member == "indptr" else range(int(arrays["indptr"][first]))


def mutated_bundles(base: Path, out: Path, skip: frozenset[str] = frozenset()) -> list[tuple[Path, bool]]:
    """Every mutation of ``base``'s files (but ``skip``) as a bundle directory of its own under
    ``out`` (its other files hard links to ``base``'s), with whether it keeps every value."""
    manifest = json.loads((base / MANIFEST_FILE).read_text())
    made: list[tuple[Path, bool]] = []

    def bundle(name: str, slug: str, write, same: bool = False) -> None:
        target = out / f"{len(made):03d}-{name}-{slug}"
        target.mkdir(parents=True)
        for file in base.iterdir():
            if file.name not in (name, MANIFEST_FILE):
                os.link(file, target / file.name)
        write(target / name)
        sealed = json.loads(json.dumps(manifest))
        sealed["files"][name] = sha256_file(target / name)
        write_sealed(target, sealed)
        made.append((target, same))

    for name in sorted(set(manifest["files"]) - NOT_ARRAYS - skip):
        file = base / name
        if name.endswith(".npz"):
            with np.load(file, allow_pickle=False) as npz:
                arrays = dict(npz)
            for member, array in arrays.items():
                hot = hot_positions(name, member, arrays)
                for slug, mutated, same in array_mutations(array, seeded(name, member), hot):

                    def write(path, arrays=arrays, member=member, mutated=mutated):
                        np.savez(path, **(arrays | {member: mutated}))  # read alike, written faster

                    bundle(name, f"{member}-{slug}", write, same)
                without = {k: v for k, v in arrays.items() if k != member}
                bundle(name, f"{member}-missing", lambda path, without=without: np.savez(path, **without))
        elif name.endswith(".npy"):
            array = np.load(file, allow_pickle=False)
            for slug, mutated, same in array_mutations(array, seeded(name)):
                bundle(name, slug, lambda path, mutated=mutated: np.save(path, mutated), same)
        elif name in (INDEX_FILE, IVF_INDEX_FILE):
            words = HNSW_HEADER.size // 8 if name == INDEX_FILE else 6
            for slug, data in byte_mutations(file.read_bytes(), seeded(name), words):
                bundle(name, slug, lambda path, data=data: path.write_bytes(data))
        elif name == CARD_FILE:  # read into the server at load: cut, not JSON, not a card, oversized
            text = file.read_text()
            for slug, data in (
                ("cut", text[: len(text) // 2]),
                ("a-list", "[]"),
                ("unknown-field", json.dumps({**json.loads(text), "surprise": 1})),
                ("oversized", text + " " * MAX_CARD_BYTES),
            ):
                bundle(name, slug, lambda path, data=data: path.write_text(data))
        elif name == LABELS_FILE:
            lines = file.read_text().splitlines(keepends=True)
            for slug, text in (
                ("last-line-cut", "".join(lines[:-1])),
                ("uid-twice", "".join([*lines[:-1], lines[0]])),
                ("not-json", "".join([*lines[:5], "{not json\n", *lines[6:]])),
            ):
                bundle(name, slug, lambda path, text=text: path.write_text(text))
    for name in (VALUES_FILE, SPARSE_FILE, RERANK_FILE, LABEL_ARRAY_FILES[4]):
        if name in set(manifest["files"]) - skip:  # a file that is not the kind it should be at all
            bundle(name, "not-an-array-file", lambda path: path.write_bytes(b"PK\x03\x04 not a zip"))
    return made


def run_children(dirs: list[Path], queries: list[str], exclude: str, children: int = 2) -> dict[str, dict]:
    """Each directory's outcome, the list shared out between ``children`` child processes that
    run at once."""
    with ThreadPoolExecutor(children) as pool:
        parts = pool.map(lambda part: run_child(part, queries, exclude), [dirs[i::children] for i in range(children)])
        return {d: record for part in parts for d, record in part.items()}


def run_child(dirs: list[Path], queries: list[str], exclude: str) -> dict[str, dict]:
    """Each directory's outcome, loaded by a child process one after another; a child that dies
    (a signal, an exit without an answer) leaves the directory it was loading as that crash,
    and a new child goes on with the rest."""
    outcomes: dict[str, dict] = {}
    left = [str(d) for d in dirs]
    for _ in range(len(dirs) + 1):  # at most one child a crash, and the first
        if not left:
            break
        child = subprocess.run(
            [sys.executable, "-m", "tests.engine.bundle_fuzz_child"],
            input=json.dumps({"dirs": left, "queries": queries, "exclude": exclude}),
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=CHILD_TIMEOUT_S,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        started = None
        for line in child.stdout.splitlines():
            record = json.loads(line)
            if record.pop("start", False):
                started = record["dir"]
            else:
                outcomes[record["dir"]] = record
        if started is not None and started not in outcomes:
            outcomes[started] = {"outcome": "crash", "returncode": child.returncode, "stderr": child.stderr[-2000:]}
        elif child.returncode != 0:
            raise AssertionError(f"the fuzz child failed outside any bundle (exit {child.returncode}): {child.stderr}")
        left = [d for d in left if d not in outcomes]
    return outcomes


@pytest.fixture(scope="module")
def fuzzed(tiny_rae_bundle, fused_arrays_bundle, tmp_path_factory):
    """Each base bundle, its mutations, and the outcome of each (the bases' own first)."""
    root = tmp_path_factory.mktemp("fuzzed")
    cases = []
    # the value rows are mutated in the first bundle only: one file kind, one loader
    for base, skip in ((tiny_rae_bundle, frozenset()), (fused_arrays_bundle, frozenset({VALUES_FILE}))):
        copy = root / base.name / "base"
        shutil.copytree(base, copy)
        cases.append((copy, skip, mutated_bundles(copy, root / base.name, skip)))
    from xmc.data import load_jsonl_split

    dirs = [d for base, _, mutations in cases for d in (base, *(m for m, _ in mutations))]
    queries = [*QUERIES, *load_jsonl_split(SAMPLE_DIR, "trn").texts[:FIRST_KEYS]]
    return cases, run_children(dirs, queries, exclude="python3-numpy")


def test_every_mutated_bundle_is_refused_or_served_with_sound_answers(fuzzed):
    cases, outcomes = fuzzed
    problems = []
    for base, _, mutations in cases:
        reference = outcomes[str(base)]
        assert reference["outcome"] == "served" and reference["finite"], reference
        assert reference["excluded"], "the excluded uid is a label of the bundle"
        for path, same in mutations:
            got = outcomes[str(path)]
            name = path.name
            if got["outcome"] == "refused":
                continue
            if got["outcome"] != "served":
                problems.append(f"{name}: {got}")
            elif not (got["finite"] and got["ids_valid"] and got["exclusion_held"]) or (
                got["excluded"] != reference["excluded"]  # the uid is found, at its id
            ):
                problems.append(f"{name}: served unsound answers {got}")
            elif same and (got["ids"], got["scores"]) != (reference["ids"], reference["scores"]):
                problems.append(f"{name}: keeps every value, yet answers otherwise")
    assert not problems, "\n".join(problems)


def test_the_fuzz_reaches_every_file_kind_and_most_mutations_are_refused(fuzzed):
    """The mutations meet the checks behind the checksums (re-sealed), across every file kind."""
    cases, outcomes = fuzzed
    kinds = set()
    for base, skip, mutations in cases:
        names = {path.name.split("-", 1)[1] for path, _ in mutations}
        files = set(json.loads((base / MANIFEST_FILE).read_text())["files"])
        mutated = {f for f in files if any(n.startswith(f) for n in names)}
        assert mutated == files - NOT_ARRAYS - skip
        kinds |= mutated
        refused = sum(outcomes[str(path)]["outcome"] == "refused" for path, _ in mutations)
        assert refused > len(mutations) / 2
    expected = {LABELS_FILE, *LABEL_ARRAY_FILES, INDEX_FILE, IVF_INDEX_FILE, RERANK_FILE, VALUES_FILE}
    assert kinds == expected | {FUSION_FILE, LEXICAL_FILE, SPARSE_FILE, CARD_FILE}
