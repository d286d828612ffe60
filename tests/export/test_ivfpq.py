"""Bundles with the compressed index (export.build --index ivfpq): built for a label index and an
RAE memory (its instance keys too), loaded and verified (in the vetting child too), searched by
the same path as hnswlib's, appended to without a rebuild, compacted into a fresh index."""

import json

import numpy as np
import pytest

from bundle import BundleError
from bundle.manifest import IVF_INDEX_FILE, MANIFEST_FILE, RERANK_FILE, sha256_file
from engine import AppendBatch, appends_dir_beside, load_predictor
from engine.bundle import load_bundle
from engine.index import IvfPqIndex, ShardedIndex
from engine.loading import vet_in_child
from engine.offline import exact_rankings, recall_with_label_ties
from export.build import ExportParams, build_bundle
from export.compact import compact_bundle

# 64 cells, all scanned: the tests below check the served path against exact search at a breadth
# where it is exact, and bound its approximation at the bundle's breadth only loosely, since
# these keys come from a random tiny encoder whose vectors crowd together (PQ's hard case)
# and move with the CPU's float kernels. The scan's own recall is tested on generated vectors
# (tests/engine/test_ivfpq.py).
COMPRESSED = {"dim": 16, "index": "ivfpq", "pq_m": 8, "ivf_nlist": 64, "ivf_nprobe": 64}


def recall_exhaustive_and_served(predictor, vectors, keys: int) -> tuple[float, float]:
    """Tie-aware recall@10 against exact search, every key re-ranked (``ef`` = all keys) and
    at the bundle's own breadth."""
    exact = exact_rankings(predictor.bundle, vectors, 20)
    everything = [r.ids for r in predictor.search(vectors, 10, keys).rankings]
    served = [r.ids for r in predictor.search(vectors, 10).rankings]
    return recall_with_label_ties(exact, everything, 10), recall_with_label_ties(exact, served, 10)


@pytest.fixture(scope="module")
def compressed_rae(sample_train, distilbert_dir, tmp_path_factory):
    """The tiny_rae_bundle's inputs with the compressed index, and its labels as arrays."""
    out = tmp_path_factory.mktemp("ivfpq") / "rae"
    params = ExportParams(**COMPRESSED, max_train=300, rae_top_b=50, labels_format="arrays")
    build_bundle(out, sample_train.labels, sample_train, distilbert_dir, params)
    return out


@pytest.fixture(scope="module")
def compressed_labels(sample_train, distilbert_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ivfpq") / "labels-2shards"
    params = ExportParams(**COMPRESSED, index_kind="labels", shards=2)
    build_bundle(out, sample_train.labels, None, distilbert_dir, params)
    return out


def test_an_rae_memory_with_the_compressed_index_answers_as_the_hnswlib_one(compressed_rae, tiny_rae_bundle, queries):
    compressed, graph = load_predictor(compressed_rae), load_predictor(tiny_rae_bundle)
    manifest = compressed.bundle.manifest
    assert manifest.ann == "ivfpq" and manifest.ivfpq.pq_m == 8 and manifest.ivfpq.nprobe == 64
    assert {IVF_INDEX_FILE, RERANK_FILE} <= set(manifest.files) and "index.hnsw" not in manifest.files
    assert isinstance(compressed.bundle.index, IvfPqIndex)
    assert manifest.counts.memory_rows == graph.bundle.manifest.counts.memory_rows  # the instance keys too
    # the label arrays hold what labels.jsonl holds: the same uids, texts and uid → id
    assert manifest.labels_format == "arrays" and "labels.jsonl" not in manifest.files
    assert compressed.bundle.label_uids == graph.bundle.label_uids
    assert compressed.bundle.label_texts == graph.bundle.label_texts
    some = [graph.bundle.label_uids[i] for i in (0, 17, len(graph.bundle.label_uids) - 1)]
    assert compressed.view.label_ids(some) == graph.view.label_ids(some) == {0, 17, len(graph.bundle.label_uids) - 1}
    # the labels served are those of exact search over the same keys, aggregated alike
    vectors, _ = compressed.bundle.encoder.encode(queries)
    exhaustive, served = recall_exhaustive_and_served(compressed, vectors, manifest.counts.memory_rows)
    assert exhaustive >= 0.99  # 1.0 here: only float summation order differs from exact search
    assert served >= 0.9  # 0.98 here; 0.985 and 0.99 on AVX-512 and AVX2 machines at 256 cells
    same_top1 = [
        a.ids[0] == b.ids[0]
        for a, b in zip(compressed.predict(queries, 5).rankings, graph.predict(queries, 5).rankings, strict=True)
    ]
    assert np.mean(same_top1) >= 0.9


def test_a_sharded_label_index_with_the_compressed_index_is_searched_shard_by_shard(compressed_labels, queries):
    predictor = load_predictor(compressed_labels)
    manifest = predictor.bundle.manifest
    assert [s.rerank for s in manifest.shards] == ["rerank-0.npy", "rerank-1.npy"]
    assert isinstance(predictor.bundle.index, ShardedIndex)
    vectors, _ = predictor.bundle.encoder.encode(queries)
    exhaustive, served = recall_exhaustive_and_served(predictor, vectors, manifest.counts.labels)
    assert exhaustive >= 0.99
    assert served >= 0.9


def test_appends_go_into_the_compressed_index_and_compaction_rebuilds_it(compressed_rae, tmp_path):
    appends = appends_dir_beside(tmp_path / "source")
    import shutil

    shutil.copytree(compressed_rae, tmp_path / "source")
    live = load_predictor(tmp_path / "source", appends_dir=appends)
    keys_before = live.view.num_keys
    text = "a brand new package for zebra striping of terminal output"
    outcome = live.append(
        AppendBatch(labels=[("zebra-stripes", text)], instances=[("zebra stripes for my terminal", ["zebra-stripes"])])
    )
    assert live.view.num_keys == keys_before + 2
    label = outcome.label_ids["zebra-stripes"]
    assert live.predict([text], 5).rankings[0].ids[0] == label  # found without a rebuild
    restarted = load_predictor(tmp_path / "source", appends_dir=appends)  # replayed from the log
    assert restarted.predict([text], 5).rankings[0].ids[0] == label

    manifest = compact_bundle(tmp_path / "source", tmp_path / "compacted", appends_dir=appends)
    assert manifest.ann == "ivfpq" and manifest.ivfpq == live.bundle.manifest.ivfpq
    assert manifest.labels_format == "arrays"
    assert manifest.counts.memory_rows == keys_before + 2
    compacted = load_predictor(tmp_path / "compacted", appends_dir=appends)
    assert compacted.bundle.index.count == keys_before + 2  # in the trained index, not appended
    assert compacted.bundle.index.added == 0
    assert compacted.predict([text], 5).rankings[0].ids[0] == label
    assert compacted.view.label_id("zebra-stripes") == label and compacted.bundle.label_texts[label] == text


def resign(path, name):
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    manifest["files"][name] = sha256_file(path / name)
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_a_damaged_code_file_is_refused_by_checksum_and_re_signed_by_its_body(compressed_rae, tmp_path):
    import shutil

    bundle = tmp_path / "bundle"
    shutil.copytree(compressed_rae, bundle)
    data = bytearray((bundle / IVF_INDEX_FILE).read_bytes())
    data[-40] ^= 0xFF  # a byte of the last list's codes
    data.extend(b"\0" * 16)  # and lists that no longer end with the file
    (bundle / IVF_INDEX_FILE).write_bytes(bytes(data))
    with pytest.raises(BundleError, match=f"checksum mismatch for {IVF_INDEX_FILE}"):
        load_bundle(bundle)
    resign(bundle, IVF_INDEX_FILE)
    with pytest.raises(BundleError, match=f"{IVF_INDEX_FILE}: IVF-PQ index refused: 16 bytes after"):
        load_bundle(bundle)
    with pytest.raises(BundleError, match="IVF-PQ index refused"):
        vet_in_child(bundle)


def test_re_rank_vectors_of_another_bundle_are_refused(compressed_rae, tmp_path):
    import shutil

    bundle = tmp_path / "bundle"
    shutil.copytree(compressed_rae, bundle)
    vectors = np.load(bundle / RERANK_FILE)
    np.save(bundle / RERANK_FILE, vectors[:-1])
    with pytest.raises(BundleError, match="checksum mismatch"):
        load_bundle(bundle)
    resign(bundle, RERANK_FILE)
    with pytest.raises(BundleError, match="re-rank vectors float16"):
        load_bundle(bundle)


def test_ivfpq_parameters_are_checked_before_the_build():
    with pytest.raises(ValueError, match="pq_m"):
        ExportParams(index="ivfpq", dim=16, pq_m=6)
    with pytest.raises(ValueError, match="even"):
        ExportParams(index="ivfpq", dim=15, pq_m=5)
    # by default one 4-bit sub-quantizer a dimension, whatever the dimension
    assert ExportParams(index="ivfpq", dim=16).ivfpq(1000).pq_m == 16
    assert ExportParams(index="ivfpq").ivfpq(1000).pq_m == 64
    # and an RAE memory scans more cells than a label index (its b keys reach into more of them)
    assert ExportParams(index="ivfpq").ivfpq(1000).nprobe == 256
    assert ExportParams(index="ivfpq", index_kind="labels").ivfpq(1000).nprobe == 128
    assert ExportParams(index="ivfpq", ivf_nprobe=8).ivfpq(1000).nprobe == 8
    with pytest.raises(ValueError, match="even"):
        ExportParams(index="ivfpq", dim=15)


def test_reindex_gives_the_same_bundle_with_the_compressed_index(tiny_rae_bundle, tmp_path, queries):
    from export.reindex import reindex_bundle

    params = ExportParams(index="ivfpq", pq_m=8, ivf_nlist=64, ivf_nprobe=64)
    manifest = reindex_bundle(tiny_rae_bundle, tmp_path / "ivfpq", params)
    source = load_predictor(tiny_rae_bundle)
    assert manifest.ann == "ivfpq" and manifest.params["reindexed_from"] == source.bundle.bundle_id
    assert manifest.files["encoder.onnx"] == source.bundle.manifest.files["encoder.onnx"]
    assert manifest.files["values.npz"] == source.bundle.manifest.files["values.npz"]
    reindexed = load_predictor(tmp_path / "ivfpq")
    keys = source.bundle.index.vectors(np.arange(manifest.counts.memory_rows))
    np.testing.assert_allclose(reindexed.bundle.index.vectors(np.arange(len(keys))), keys, atol=1e-3)
    vectors, _ = reindexed.bundle.encoder.encode(queries)
    exhaustive, served = recall_exhaustive_and_served(reindexed, vectors, manifest.counts.memory_rows)
    assert exhaustive >= 0.99
    assert served >= 0.9


def test_retune_changes_only_the_search_parameters(compressed_labels, tmp_path):
    from export.reindex import retune_bundle

    source = load_predictor(compressed_labels).bundle.manifest
    manifest = retune_bundle(compressed_labels, tmp_path / "retuned", nprobe=3, ef_search=50)
    assert manifest.served_files == source.served_files  # the same content, in the source's lineage (part of the id)
    assert manifest.lineage.bundle_id == source.bundle_id and manifest.lineage.offset == 0
    assert (manifest.ivfpq.nprobe, manifest.ivfpq.rerank_depth) == (3, 50)
    retuned = load_predictor(tmp_path / "retuned")
    assert [shard.nprobe for shard in retuned.bundle.index.shards] == [3, 3]


def as_schema_1(path):
    """Rewrite ``path``'s manifest as the writers of schema version 1 wrote it: an ivfpq bundle's
    re-rank depth in ``hnsw.ef_search``, no ``ivfpq.rerank_depth``."""
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    if manifest["ivfpq"] is not None:
        manifest["hnsw"]["ef_search"] = manifest["ivfpq"].pop("rerank_depth")
    manifest["schema_version"] = 1
    (path / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))


def test_a_bundle_written_at_schema_1_loads_and_answers_the_same(compressed_rae, tiny_rae_bundle, queries, tmp_path):
    """Bundles written before the breadth was named per index kind: the re-rank depth read from
    hnsw.ef_search, the same checksums, id and answers; an hnswlib bundle unchanged but its version."""
    import shutil

    for source in (compressed_rae, tiny_rae_bundle):
        old = tmp_path / source.name
        shutil.copytree(source, old)
        as_schema_1(old)
        assert json.loads((old / MANIFEST_FILE).read_text())["schema_version"] == 1
        current, upgraded = load_predictor(source), load_predictor(old)  # checksums verified, id checked
        manifest = upgraded.bundle.manifest
        assert manifest.bundle_id == current.bundle.manifest.bundle_id and manifest.schema_version == 2
        assert manifest.search_breadth == current.bundle.manifest.search_breadth
        assert manifest.ivfpq == current.bundle.manifest.ivfpq
        for k in (1, 10):
            got, expected = upgraded.predict(queries, k), current.predict(queries, k)
            assert [list(r.ids) for r in got.rankings] == [list(r.ids) for r in expected.rankings]
            assert got.ef == expected.ef


def test_an_ivfpq_bundle_at_schema_1_searches_at_its_hnsw_ef_search(compressed_labels, queries, tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(compressed_labels, old)
    as_schema_1(old)
    manifest = json.loads((old / MANIFEST_FILE).read_text())
    manifest["hnsw"]["ef_search"] = 13  # the depth version 1 re-ranked at
    (old / MANIFEST_FILE).write_text(json.dumps(manifest))
    upgraded, current = load_predictor(old), load_predictor(compressed_labels)
    assert upgraded.bundle.manifest.ivfpq.rerank_depth == upgraded.default_ef == 13
    got, expected = upgraded.predict(queries, 10), current.predict(queries, 10, ef=13)
    assert [list(r.ids) for r in got.rankings] == [list(r.ids) for r in expected.rankings] and got.ef == expected.ef
