"""A distributed front end's search (every shard alone: ShardSearcher, merge_answers, rank over the
carried value rows) gives the single process's answers (ShardedIndex under Memory.knn, rank over
V) bit for bit: both index kinds, shards smaller than what is fetched, small and large ef,
exclusions and keys tied in distance, a plain and a lexical score fusion (each shard scores its
own keys' lexical similarity); and a shard's batch of requests answers each as if alone."""

from types import SimpleNamespace

import hnswlib
import numpy as np
import pytest
import scipy.sparse as sp

from engine.fusion import FEATURES, LEXICAL_FEATURES, ScoreFusion
from engine.index import HnswIndex, ShardedIndex
from engine.lexical import KeyTerms, Lexicon
from engine.memory import Memory, base_view, fetch_and_ef
from engine.search import Neighbours, merged_neighbours, neighbours_needed, rank_batch
from engine.shards import ShardAnswer, ShardQuery, ShardSearcher
from tests.engine.test_fusion import random_onnx_tree
from xmc.checkpoint import default_encoder_dir

DIM, RAE_LABELS = 8, 30


def build(kind: str, sizes: list[int], rng: np.random.Generator):
    keys = rng.normal(size=(sum(sizes), DIM)).astype(np.float32)
    keys[len(keys) // 2] = keys[-1] = keys[1]  # keys tied in distance to any query
    keys[3] = keys[2]
    keys /= np.linalg.norm(keys, axis=1, keepdims=True)
    indexes, shards, first = [], [], 0
    for size in sizes:
        index = hnswlib.Index(space="ip", dim=DIM)
        index.init_index(max_elements=size, ef_construction=50, M=8, random_seed=0)
        index.add_items(keys[first : first + size], np.arange(first, first + size), num_threads=1)
        indexes.append(HnswIndex(index))
        shards.append(SimpleNamespace(first_key=first, keys=size))
        first += size
    labels = len(keys) if kind == "labels" else RAE_LABELS
    values, rae = None, None
    if kind == "rae_memory":
        train = sp.random(len(keys) - labels, labels, density=0.05, format="csr", random_state=1, dtype=np.float32)
        train.data[:] = 1
        values = sp.vstack([0.7 * train, 0.3 * sp.identity(labels, dtype=np.float32, format="csr")]).tocsr()
        rae = SimpleNamespace(top_b=7, tau=0.05, mode="joint", lam=0.7)
    manifest = SimpleNamespace(
        index_kind=kind,
        rae=rae,
        fusion=None,
        hnsw=SimpleNamespace(ef_search=16),
        counts=SimpleNamespace(memory_rows=len(keys)),
    )
    view = base_view([str(i) for i in range(labels)], ["t"] * labels, len(keys), values)
    return keys, indexes, shards, values, manifest, view


def single_process(indexes, manifest, view, queries, ks, ef, exclude, fusion=None, lexical=None):
    """``lexical``: (the keys' term vectors, the queries' terms) for a lexical fusion."""
    index = indexes[0] if len(indexes) == 1 else ShardedIndex(indexes)
    memory = Memory(index, view, None, None)
    keys, sims, ran_at = memory.knn(queries, max(neighbours_needed(manifest, ks, exclude)), ef, view)
    similarities = lexical[0].similarities(lexical[1], keys) if lexical else None
    found = Neighbours(keys, sims, view.labels_of_keys(keys), view.values, similarities, ran_at)
    return rank_batch(manifest, found, ks, exclude, fusion), ran_at


def distributed(indexes, shards, values, manifest, view, queries, ks, ef, exclude, fusion=None, lexical=None):
    neighbours = max(neighbours_needed(manifest, ks, exclude))
    fetch, ef = fetch_and_ef(neighbours, ef, manifest.counts.memory_rows)
    answers = []
    for index, shard in zip(indexes, shards, strict=True):
        rows = values[shard.first_key : shard.first_key + shard.keys] if values is not None else None
        terms = None
        if lexical:  # the shard holds only its own keys' term vectors
            terms = KeyTerms(lexical[0].rows[shard.first_key : shard.first_key + shard.keys], shard.first_key)
        searcher = ShardSearcher(index, rows, shard, key_terms=terms)
        answers.append(searcher.search(queries, fetch, ef, lexical[1] if lexical else None))
    found = merged_neighbours(answers, neighbours, view)
    return rank_batch(manifest, found, ks, exclude, fusion), found.ef


@pytest.mark.parametrize(
    ("kind", "sizes"),
    [
        ("labels", [40]),
        ("labels", [3, 30, 2, 5]),
        ("rae_memory", [60]),
        ("rae_memory", [4, 50, 6]),
        ("rae_memory", [2, 2, 70]),
    ],
)
def test_the_distributed_search_equals_the_single_process(kind, sizes):
    check_distributed_equals_single_process(kind, sizes, None)


@pytest.mark.parametrize("sizes", [[60], [4, 50, 6]])
def test_a_fused_ranking_is_the_same_on_shards(sizes):
    """Fusion features read value rows by key position: the shards' carried rows must give the
    single process's features, so the same fused answers."""
    log_frequency = np.log1p(np.arange(RAE_LABELS, dtype=np.float32) % 4)
    check_distributed_equals_single_process("rae_memory", sizes, ScoreFusion(random_onnx_tree(depth=5), log_frequency))


WORDS = ["libc6", "python3", "numpy", "tryton", "sale", "stock", "module", "gnu", "library", "shared", "data", "tools"]


@pytest.mark.parametrize("sizes", [[60], [4, 50, 6]])
def test_a_lexically_fused_ranking_is_the_same_on_shards(sizes):
    tree = random_onnx_tree(depth=5, features=FEATURES + LEXICAL_FEATURES)
    check_distributed_equals_single_process("rae_memory", sizes, tree, lexical=True)


def random_texts(rng: np.random.Generator, count: int) -> list[str]:
    return [" ".join(rng.choice(WORDS, int(rng.integers(1, 5)))) for _ in range(count)]


def check_distributed_equals_single_process(kind, sizes, fusion, lexical=False):
    """``fusion``: None, a fusion, or (with ``lexical``) the tree of a lexical one, whose lexicon
    is fitted on random texts of the keys."""
    rng = np.random.default_rng(sum(sizes))
    keys, indexes, shards, values, manifest, view = build(kind, sizes, rng)
    key_terms = None
    if lexical:
        texts = random_texts(rng, len(keys))
        lexicon = Lexicon.fit(default_encoder_dir() / "tokenizer.json", 32, texts)
        fusion = ScoreFusion(fusion, np.zeros(RAE_LABELS, np.float32), lexicon)
        key_terms = KeyTerms(lexicon.rows(texts))
    for trial in range(30):
        picked = keys[rng.integers(0, len(keys), int(rng.integers(1, 4)))]
        queries = picked + rng.normal(scale=0.05, size=picked.shape).astype(np.float32)
        queries[0] = keys[1]  # a query exactly on the tied keys
        queries /= np.linalg.norm(queries, axis=1, keepdims=True)
        ks = [int(rng.integers(1, 12))] * len(queries)
        ef = [16, 5, 1000][trial % 3]
        exclude = [set(rng.choice(view.num_labels, int(rng.integers(0, 4)), replace=False).tolist()) for _ in ks]
        terms = (key_terms, lexicon.query_terms(random_texts(rng, len(queries)))) if lexical else None
        expected, expected_ef = single_process(indexes, manifest, view, queries, ks, ef, exclude, fusion, terms)
        got, got_ef = distributed(indexes, shards, values, manifest, view, queries, ks, ef, exclude, fusion, terms)
        assert got_ef == expected_ef
        for a, b in zip(expected, got, strict=True):
            assert a.ids.tolist() == b.ids.tolist() and a.scores.tolist() == b.scores.tolist()


def test_a_shard_answers_each_request_of_a_batch_as_if_alone():
    """One search at the batch's largest ef would change the small-ef requests' answers (it did
    for about 7 % of them here); one search per ef does not."""
    rng = np.random.default_rng(7)
    keys, indexes, shards, _, _, _ = build("labels", [400], rng)
    searcher = ShardSearcher(indexes[0], None, shards[0])
    asks = [(3, 10), (200, 250), (9, 10), (1, 3)]
    for _ in range(20):
        vectors = keys[rng.integers(0, len(keys), len(asks))] + rng.normal(scale=0.3, size=(len(asks), DIM))
        vectors = (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)
        requests = [ShardQuery(vectors[i : i + 1], fetch, ef) for i, (fetch, ef) in enumerate(asks)]
        for request, answer in zip(requests, searcher.search_many(requests), strict=True):
            alone = searcher.search(request.vectors, request.fetch, request.ef)
            assert answer.ef == alone.ef
            assert answer.keys[:, : request.fetch].tolist() == alone.keys[:, : request.fetch].tolist()


def test_split_keeps_each_requests_value_rows():
    rows = sp.csr_matrix(np.arange(12, dtype=np.float32).reshape(6, 2))  # 3 queries x 2 keys
    keys = np.arange(6).reshape(3, 2)
    first, second = ShardAnswer(keys, keys.astype(np.float32), rows, 5).split([1, 2])
    assert first.keys.tolist() == [[0, 1]] and second.keys.tolist() == [[2, 3], [4, 5]]
    assert first.rows.toarray().tolist() == [[0, 1], [2, 3]]
    assert second.rows.toarray().tolist() == [[4, 5], [6, 7], [8, 9], [10, 11]]
