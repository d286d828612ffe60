"""The compressed index (engine.index.ivfpq): its re-rank is exact on the candidates it scans,
it reaches brute force when it scans everything, appends go in without a rebuild, and a damaged
index file is refused before faiss reads it."""

import re
import struct

import numpy as np
import pytest

from bundle import IndexRefused
from bundle.manifest import IvfPqParams
from engine.index import IvfPqIndex
from engine.index import ivfpq as ivfpq_module
from engine.index.ivfpq import auto_nlist, lists_offset

DIM, KEYS, FIRST_KEY = 32, 3000, 500


def unit(rows, rng):
    x = rng.standard_normal((rows, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """3,000 clustered unit vectors in an index whose keys start at FIRST_KEY (a shard's)."""
    rng = np.random.default_rng(0)
    centres = unit(60, rng)
    keys = centres[rng.integers(0, 60, KEYS)] + 0.3 * unit(KEYS, rng)
    keys /= np.linalg.norm(keys, axis=1, keepdims=True)
    out = tmp_path_factory.mktemp("ivfpq")
    params = IvfPqParams(nlist=auto_nlist(KEYS), pq_m=16, nprobe=4, rerank_depth=50)
    IvfPqIndex.build(keys, params, seed=0, threads=1).save(out / "index.faiss", out / "rerank.npy")
    queries = centres[rng.integers(0, 60, 50)] + 0.3 * unit(50, rng)
    return out, params, keys, queries / np.linalg.norm(queries, axis=1, keepdims=True)


def load(built, **changes):
    out, params, _, _ = built
    return IvfPqIndex.load(
        out / "index.faiss", out / "rerank.npy", DIM, params.model_copy(update=changes), FIRST_KEY, KEYS
    )


def brute_force(stored, queries, k):
    sims = queries @ stored.T
    order = np.lexsort((np.broadcast_to(np.arange(len(stored)), sims.shape), -sims), axis=-1)[:, :k]
    return order, np.take_along_axis(sims, order, axis=1)


def test_scanning_every_cell_and_reranking_every_candidate_is_brute_force(built):
    _, params, keys, queries = built
    index = load(built, nprobe=params.nlist)
    found, distances = index.search(queries, 10, breadth=KEYS)
    stored = keys.astype(np.float16).astype(np.float32)  # what the bundle keeps: float16
    order, sims = brute_force(stored, queries, 10)
    np.testing.assert_array_equal(found, order + FIRST_KEY)
    np.testing.assert_allclose(1.0 - distances, sims, rtol=0, atol=1e-5)


def test_the_rerank_orders_the_scanned_candidates_exactly(built):
    """At a narrow scan the answer is the exact top k of the candidates the codes gave."""
    _, params, keys, queries = built
    index = load(built)
    import faiss

    _, candidates = index.index.search(queries, 40, params=faiss.SearchParametersIVF(nprobe=params.nprobe))
    found, distances = index.search(queries, 10, breadth=40)
    stored = keys.astype(np.float16).astype(np.float32)
    for row, query in enumerate(queries):
        scanned = candidates[row][candidates[row] >= 0]
        sims = stored[scanned] @ query
        best = scanned[np.lexsort((scanned, -sims))][:10]
        np.testing.assert_array_equal(found[row], best + FIRST_KEY)
        np.testing.assert_allclose(1.0 - distances[row], np.sort(sims)[::-1][:10], atol=1e-5)


def test_recall_against_brute_force_on_float32_keys(built):
    _, _, keys, queries = built
    found, _ = load(built, nprobe=8).search(queries, 10, breadth=100)
    truth, _ = brute_force(keys, queries, 10)
    recall = np.mean([len(set(f - FIRST_KEY) & set(t)) / 10 for f, t in zip(found, truth, strict=True)])
    assert recall >= 0.99


def test_appended_keys_are_found_hidden_while_marked_and_must_come_in_id_order(built):
    _, _, _, queries = built
    index = load(built)
    new_ids = FIRST_KEY + KEYS + np.arange(3)
    index.add(queries[:3], new_ids)
    assert index.count == KEYS + 3
    found, distances = index.search(queries[:3], 1, breadth=50)
    np.testing.assert_array_equal(found[:, 0], new_ids)
    np.testing.assert_allclose(distances[:, 0], 0.0, atol=1e-3)  # a float16 copy of the query itself
    index.hide(int(new_ids[1]))
    assert int(new_ids[1]) not in index.search(queries[1:2], 10, breadth=50)[0]
    index.show(int(new_ids[1]))
    assert index.search(queries[1:2], 1, breadth=50)[0][0, 0] == new_ids[1]
    np.testing.assert_allclose(index.vectors(new_ids), queries[:3], atol=1e-3)
    with pytest.raises(ValueError, match="id order"):
        index.add(queries[:1], [FIRST_KEY])


def test_an_index_with_appended_keys_saves_to_files_that_load_and_answer_the_same(built, tmp_path):
    """What a bundle holds of a compressed index (faiss's file, every key's float16 vector) is
    written back by save, appended keys included, and loads as the same index."""
    out, params, _, queries = built
    index = load(built)
    index.add(queries[:5], FIRST_KEY + KEYS + np.arange(5))
    index.save(tmp_path / "index.faiss", tmp_path / "rerank.npy")
    again = IvfPqIndex.load(tmp_path / "index.faiss", tmp_path / "rerank.npy", DIM, params, FIRST_KEY, KEYS + 5)
    assert again.count == KEYS + 5
    for one, two in zip(index.search(queries, 10, breadth=50), again.search(queries, 10, breadth=50), strict=True):
        np.testing.assert_array_equal(one, two)


def test_fewer_candidates_than_asked_are_padded_with_no_key(built):
    found, distances = load(built, nprobe=1).search(built[3][:2], KEYS, breadth=1)
    assert (found == -1).any() and np.isinf(distances[found == -1]).all()


def damaged(built, tmp_path, change):
    out, params, _, _ = built
    data = bytearray((out / "index.faiss").read_bytes())
    change(data, lists_offset(DIM, params.nlist, params.pq_m))
    (tmp_path / "index.faiss").write_bytes(bytes(data))
    (tmp_path / "rerank.npy").write_bytes((out / "rerank.npy").read_bytes())
    return tmp_path


def first_list_ids(data, offset):
    """(where list 0's id count is, how many ids it has)."""
    at = offset + struct.calcsize("<4sQQQQ")
    return at, struct.unpack_from("<Q", data, at)[0]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda data, offset: struct.pack_into("<Q", data, first_list_ids(data, offset)[0], 10**9), "declares"),
        (
            lambda data, offset: struct.pack_into("<q", data, first_list_ids(data, offset)[0] + 8, 10**7),
            "not the shard's keys",
        ),
        (lambda data, offset: data.__delitem__(slice(len(data) - 100, None)), "codes|ends inside"),
        (lambda data, offset: data.extend(b"\0" * 8), "after the last inverted list"),
        (lambda data, offset: data.__setitem__(slice(offset, offset + 4), b"xxxx"), "not the fast-scan lists"),
    ],
    ids=["list-longer-than-the-shard", "id-outside-the-shard", "truncated", "trailing-bytes", "not-block-lists"],
)
def test_a_damaged_index_file_is_refused_before_faiss_reads_it(built, tmp_path, change, reason):
    _, params, _, _ = built
    where = damaged(built, tmp_path, change)
    with pytest.raises(IndexRefused, match=reason):
        IvfPqIndex.load(where / "index.faiss", where / "rerank.npy", DIM, params, FIRST_KEY, KEYS)


def header_fields(nlist):
    """Where each field of an IVF-PQ fast-scan index's header lies, as faiss's write_index lays it
    out: name → (offset, struct format)."""
    layout = [
        ("fourcc", "4s"), ("d", "i"), ("ntotal", "q"), ("dummies", "16s"), ("is_trained", "B"),
        ("metric_type", "i"), ("nlist", "Q"), ("nprobe", "Q"),
        ("quantizer fourcc", "4s"), ("quantizer.d", "i"), ("quantizer.ntotal", "q"), ("quantizer.dummies", "16s"),
        ("quantizer.is_trained", "B"), ("quantizer.metric_type", "i"), ("quantizer.codes", "Q"),
        ("centroids", f"{4 * nlist * DIM}s"),
        ("direct_map.type", "b"), ("direct_map.array", "Q"),
        ("by_residual", "B"), ("code_size", "Q"), ("bbs", "i"), ("M2", "Q"), ("implem", "i"), ("qbs2", "Q"),
        ("pq.d", "Q"), ("pq.M", "Q"), ("pq.nbits", "Q"), ("pq.centroids", "Q"), ("codebooks", f"{4 * 16 * DIM}s"),
    ]  # fmt: skip
    fields, offset = {}, 0
    for name, fmt in layout:
        fields[name] = (offset, "<" + fmt)
        offset += struct.calcsize("<" + fmt)
    return fields, offset


def test_the_header_layout_the_forgeries_use_is_faiss_s(built):
    out, params, _, _ = built
    data = (out / "index.faiss").read_bytes()
    fields, end = header_fields(params.nlist)
    assert end == lists_offset(DIM, params.nlist, params.pq_m)

    def value(name):
        return struct.unpack_from(fields[name][1], data, fields[name][0])[0]

    written = {name: value(name) for name in ("fourcc", "d", "ntotal", "M2", "pq.d", "pq.M", "pq.nbits")}
    assert written == {"fourcc": b"IwPf", "d": DIM, "ntotal": KEYS, "M2": 16, "pq.d": DIM, "pq.M": 16, "pq.nbits": 4}
    assert (value("quantizer.codes"), value("pq.centroids"), value("code_size")) == (params.nlist * DIM, 16 * DIM, 8)


@pytest.mark.parametrize(
    ("field", "forged"),
    [
        ("d", 64),
        ("metric_type", 1),
        ("nlist", 1 << 40),
        ("quantizer fourcc", b"IxF2"),
        ("quantizer.ntotal", 1),
        ("quantizer.codes", 1 << 50),
        ("direct_map.type", 2),
        ("direct_map.array", 1 << 40),
        ("by_residual", 1),
        ("code_size", 1 << 40),
        ("bbs", 64),
        ("M2", 1 << 40),
        ("M2", 18),
        ("implem", 12),
        ("qbs2", 1 << 30),
        ("pq.d", 64),
        ("pq.M", 8),
        ("pq.nbits", 8),
        ("pq.nbits", 0),
        ("pq.centroids", 1 << 50),
        ("pq.centroids", 16 * DIM - 1),
    ],
)
def test_a_forged_header_field_is_refused_before_faiss_reads_the_file(built, tmp_path, monkeypatch, field, forged):
    """Each header field of a real index file, forged alone: refused by name, and faiss's reader
    (which before 1.15 trusted several of them) never sees the file."""
    _, params, _, _ = built
    fields, _ = header_fields(params.nlist)
    offset, fmt = fields[field]
    where = damaged(built, tmp_path, lambda data, _: struct.pack_into(fmt, data, offset, forged))

    def read_index(*args):
        raise AssertionError("faiss read a forged file")

    monkeypatch.setattr(ivfpq_module.faiss, "read_index", read_index)
    with pytest.raises(IndexRefused, match=f"header field {re.escape(field)} is "):
        IvfPqIndex.load(where / "index.faiss", where / "rerank.npy", DIM, params, FIRST_KEY, KEYS)


def test_a_file_ending_inside_its_header_is_refused(built, tmp_path):
    _, params, _, _ = built
    fields, _ = header_fields(params.nlist)
    where = damaged(built, tmp_path, lambda data, _: data.__delitem__(slice(fields["M2"][0] + 3, None)))
    with pytest.raises(IndexRefused, match="ends inside its header"):
        IvfPqIndex.load(where / "index.faiss", where / "rerank.npy", DIM, params, FIRST_KEY, KEYS)


def test_rerank_vectors_of_another_shape_or_not_finite_are_refused(built, tmp_path):
    out, params, keys, _ = built
    (tmp_path / "index.faiss").write_bytes((out / "index.faiss").read_bytes())
    np.save(tmp_path / "rerank.npy", keys[:-1].astype(np.float16))
    with pytest.raises(IndexRefused, match="expected float16"):
        IvfPqIndex.load(tmp_path / "index.faiss", tmp_path / "rerank.npy", DIM, params, FIRST_KEY, KEYS)
    broken = keys.astype(np.float16)
    broken[7, 3] = np.nan
    np.save(tmp_path / "rerank.npy", broken)
    with pytest.raises(IndexRefused, match="not finite"):
        IvfPqIndex.load(tmp_path / "index.faiss", tmp_path / "rerank.npy", DIM, params, FIRST_KEY, KEYS)


def test_an_index_of_other_parameters_than_the_manifests_is_refused(built):
    out, params, _, _ = built
    with pytest.raises(IndexRefused):
        IvfPqIndex.load(out / "index.faiss", out / "rerank.npy", DIM, params.model_copy(update={"pq_m": 8}), 0, KEYS)
    with pytest.raises(IndexRefused, match="the shard's keys"):  # the header's ntotal says it first
        IvfPqIndex.load(out / "index.faiss", out / "rerank.npy", DIM, params, 0, KEYS - 1)


def test_keys_with_equal_vectors_come_in_key_order():
    """Identical keys (an instance whose text is a label's) tie exactly: the smaller key id first,
    whether the candidates are few (sorted whole) or many (partitioned first)."""
    from engine.index import best_first

    sims = np.array([[0.5, 0.9, 0.9, 0.1, 0.9, 0.2] * 10], dtype=np.float32)
    keys = np.arange(60)[::-1].reshape(1, 60).copy()
    for k in (3, 5, 25):
        order = best_first(keys, -sims, k)
        expected = np.lexsort((keys[0], -sims[0]))[:k]
        np.testing.assert_array_equal(order[0], expected)


def test_a_shard_gives_an_empty_value_row_where_it_found_no_key():
    import scipy.sparse as sp

    from bundle.manifest import Shard
    from engine.shards import ShardSearcher

    values = sp.csr_matrix(np.arange(1, 13, dtype=np.float32).reshape(4, 3))
    searcher = ShardSearcher(None, values, Shard(index="i", values="v", rerank="r", first_key=10, keys=4))
    rows = searcher.value_rows(np.array([[13, -1], [10, 11]]))
    np.testing.assert_array_equal(rows.toarray(), [[10, 11, 12], [0, 0, 0], [1, 2, 3], [4, 5, 6]])


def test_every_index_kind_is_a_key_index_and_takes_its_breadth_per_call(built):
    """hnswlib keeps ef as index state: HnswIndex sets and uses it under its own lock, so searches
    at different breadths on several threads each get the answer they get alone."""
    from concurrent.futures import ThreadPoolExecutor

    import hnswlib

    from engine.index import HnswIndex, KeyIndex, ShardedIndex

    _, _, keys, queries = built
    graph = hnswlib.Index(space="ip", dim=DIM)
    graph.init_index(max_elements=KEYS, ef_construction=20, M=4, random_seed=0)
    graph.add_items(keys, np.arange(KEYS), num_threads=1)
    hnsw = HnswIndex(graph)
    for index in (hnsw, load(built), ShardedIndex([hnsw])):
        assert isinstance(index, KeyIndex)
    calls = [(queries[i % len(queries)][None, :], breadth) for i in range(200) for breadth in (10, 400)]
    alone = [hnsw.search(q, 10, breadth) for q, breadth in calls]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda call: hnsw.search(call[0], 10, call[1]), calls))
    for (a_keys, a_dist), (t_keys, t_dist) in zip(alone, together, strict=True):
        np.testing.assert_array_equal(a_keys, t_keys)
        np.testing.assert_array_equal(a_dist, t_dist)
    # a narrow graph (M 4, ef 10) misses some of what a wide search finds: the breadth did matter
    assert any(not np.array_equal(a[0], b[0]) for a, b in zip(alone[::2], alone[1::2], strict=True))
