"""engine.lexical: a text's terms are its word pieces and their hashed pairs, the idf is
fitted on the memory's texts, and a key's lexical similarity is the cosine of the two unit
idf-weighted term vectors, for the bundle's keys and a live memory's appended ones alike, whether
a batch's products are merged in compiled code or looked up (every similarity test runs both)."""

import numpy as np
import pytest
import scipy.sparse as sp

import engine.lexical as lexical
from engine.lexical import (
    BIGRAM_BUCKETS,
    KeyTerms,
    Lexicon,
    QueryTerms,
    key_terms_of,
    save_key_terms,
    term_rows,
)
from xmc.checkpoint import default_encoder_dir

TOKENIZER = default_encoder_dir() / "tokenizer.json"
MEMORY = [
    "tryton-modules-sale: Tryton application platform - sale module",
    "tryton-modules-stock: Tryton application platform - stock module",
    "libc6: GNU C Library: Shared libraries",
    "python3-numpy: Fast array facility to the Python 3 language",
    "python3: interactive high-level object-oriented language",
]


@pytest.fixture(params=["looked_up", "merged"], autouse=True)
def products(request, monkeypatch):
    """Each test with the keys' products looked up, and again merged (whatever the batch's size)."""
    monkeypatch.setattr(lexical, "MERGE_FROM_KEYS", 10**9 if request.param == "looked_up" else 0)
    return request.param


@pytest.fixture(scope="module")
def lexicon():
    return Lexicon.fit(TOKENIZER, 128, MEMORY)


def test_terms_are_word_pieces_and_hashed_pairs_without_special_tokens(lexicon):
    encoding = lexicon.tokenizer.encode("libc6 library")
    pieces = [i for i, special in zip(encoding.ids, encoding.special_tokens_mask, strict=True) if not special]
    assert len(pieces) < len(encoding.ids)  # [CLS] and [SEP] were there
    row = term_rows(lexicon.tokenizer, ["libc6 library"])
    pairs = {
        lexicon.vocab_size + (a * 1_000_003 + b) % BIGRAM_BUCKETS for a, b in zip(pieces[:-1], pieces[1:], strict=True)
    }
    assert set(row.indices.tolist()) == set(pieces) | pairs
    assert row.shape == (1, lexicon.vocab_size + BIGRAM_BUCKETS)


def test_idf_is_fitted_on_the_memory_texts(lexicon):
    rows = term_rows(lexicon.tokenizer, MEMORY)
    df = np.bincount(rows.indices, minlength=rows.shape[1])
    np.testing.assert_allclose(lexicon.idf, np.log((len(MEMORY) + 1) / (df + 1)), rtol=1e-6)
    shared = lexicon.tokenizer.encode("tryton").ids[1]  # in two of the five texts
    assert lexicon.idf[shared] == pytest.approx(np.log(6 / 3))


def test_a_key_s_similarity_is_the_cosine_of_the_idf_weighted_term_vectors(lexicon):
    keys = KeyTerms(lexicon.rows(MEMORY))
    query = "tryton-modules-purchase: Tryton application platform - purchase module"
    got = keys.similarities(lexicon.query_terms([query]), np.array([[0, 1, 2, 4, -1]]))

    def vector(text):
        row = term_rows(lexicon.tokenizer, [text]).toarray()[0] * lexicon.idf
        return row / np.linalg.norm(row)

    expected = [vector(query) @ vector(MEMORY[k]) for k in (0, 1, 2, 4)] + [0.0]
    np.testing.assert_allclose(got[0], expected, atol=1e-5)
    assert got[0, 0] > 0.4 and got[0, 2] < 0.05  # a sibling module shares pieces, libc6 does not
    identical = keys.similarities(lexicon.query_terms([MEMORY[3]]), np.array([[3]]))
    assert identical[0, 0] == pytest.approx(1.0, abs=1e-5)


def test_appended_keys_and_a_shard_s_range_are_scored_alike(lexicon):
    rows = lexicon.rows(MEMORY)
    queries, keys = lexicon.query_terms(MEMORY[:2]), np.array([[4, 3, 2], [0, 1, 4]])
    whole = KeyTerms(rows).similarities(queries, keys)
    grown = KeyTerms(rows[:3]).with_appended(rows[3:])  # keys 3 and 4 appended to a live memory
    np.testing.assert_allclose(grown.similarities(queries, keys), whole)
    shard = KeyTerms(rows[2:], first_key=2)  # a shard holding keys 2..4 answers with global key ids
    np.testing.assert_allclose(shard.similarities(queries[:1], keys[:1]), whole[:1])


def test_a_batch_s_similarities_are_each_query_s_alone(lexicon):
    keys = KeyTerms(lexicon.rows(MEMORY))
    texts = [MEMORY[1], "python3 numpy array", "", "libc6"]
    queries = lexicon.query_terms(texts)
    ids = np.array([[0, 1, 2, -1], [3, 4, 0, 1], [2, 3, -1, -1], [2, -1, 4, 0]])
    batch = keys.similarities(queries, ids)
    for i in range(len(texts)):
        np.testing.assert_array_equal(batch[i], keys.similarities(queries[i : i + 1], ids[i : i + 1])[0])
    assert batch[0, 1] == pytest.approx(1.0, abs=1e-5) and batch[1, 0] > 0.3 and not batch[2].any()


def test_a_query_term_outside_the_keys_term_space_matches_nothing_and_leaves_other_queries_alone():
    rows = sp.csr_matrix((np.array([1.0, 1.0], dtype=np.float32), np.array([2, 3]), np.array([0, 1, 2])), shape=(2, 10))
    outside = QueryTerms(np.array([2, 12, 15]), np.array([0.6, 0.6, 0.53], dtype=np.float32))
    inside = QueryTerms(np.array([3], dtype=np.int32), np.array([0.7], dtype=np.float32))
    got = KeyTerms(rows).similarities([outside, inside], np.array([[0, 1], [1, 0]]))
    np.testing.assert_allclose(got, [[0.6, 0.0], [0.7, 0.0]], rtol=1e-6)


def test_a_text_with_no_terms_has_similarity_zero(lexicon):
    keys = KeyTerms(lexicon.rows(MEMORY + [""]))
    got = keys.similarities(lexicon.query_terms(["", "libc6"]), np.array([[0, 5], [2, 5]]))
    assert got[0].tolist() == [0.0, 0.0] and got[1, 0] > 0 and got[1, 1] == 0.0


def test_key_term_files_round_trip_and_are_checked(lexicon, tmp_path):
    rows = lexicon.rows(MEMORY)
    save_key_terms(tmp_path / "lexical.npz", rows)
    loaded = key_terms_of(sp.load_npz(tmp_path / "lexical.npz").tocsr(), first_key=7)
    assert loaded.first_key == 7 and (loaded.rows != rows).nnz == 0
    with pytest.raises(ValueError, match="unit vectors"):
        key_terms_of(sp.csr_matrix(rows * 2))


def test_an_idf_of_the_wrong_size_is_refused(lexicon):
    with pytest.raises(ValueError, match="idf must be"):
        Lexicon(TOKENIZER, 128, lexicon.idf[:-1])


def test_an_idf_is_checked_finite_as_float32(lexicon):
    """A float64 1e39 is finite as stored and inf as served (float32): every query with that
    term would score NaN."""
    idf = lexicon.idf.astype(np.float64)
    idf[lexicon.tokenizer.encode("libc6").ids[1]] = 1e39
    with pytest.raises(ValueError, match="idf must be"):
        Lexicon(TOKENIZER, 128, idf)


def test_a_query_s_terms_are_its_row_of_the_key_term_matrix(lexicon):
    texts = [*MEMORY, "", "libc6 libc6 library"]
    rows = lexicon.rows(texts)
    for i, query in enumerate(lexicon.query_terms(texts)):
        np.testing.assert_array_equal(query.ids, rows.indices[rows.indptr[i] : rows.indptr[i + 1]])
        np.testing.assert_allclose(query.weights, rows.data[rows.indptr[i] : rows.indptr[i + 1]], rtol=1e-6)


def test_merged_and_looked_up_products_agree_on_a_batch_with_appended_keys_and_absent_terms(lexicon):
    texts = MEMORY + [f"{a} {b}" for a in MEMORY for b in MEMORY[:2]]
    rows = lexicon.rows(texts)
    keys = KeyTerms(rows[:10]).with_appended(rows[10:])
    rng = np.random.default_rng(7)
    queries = lexicon.query_terms([f"{t} extra words" for t in texts[::3]]) + [
        QueryTerms(np.array([3, 2**30]), np.ones(2, dtype=np.float32))
    ]
    query_of = np.repeat(np.arange(len(queries)), 12)
    ids = rng.integers(0, len(texts), len(query_of))
    merged = keys.merged_products(queries, query_of, ids)
    looked_up = keys.looked_up_products(queries, query_of, ids)
    np.testing.assert_array_equal(merged, looked_up)
    assert (merged > 0.1).sum() > len(merged) // 10  # the batch has real matches to compare


def test_a_merged_batch_gives_each_query_exactly_its_looked_up_similarities(lexicon, monkeypatch):
    monkeypatch.setattr(lexical, "MERGE_FROM_KEYS", 5)  # the batch's 10 keys merged, each query's 3 or 4 looked up
    texts = MEMORY + [f"{a} {b}" for a in MEMORY for b in MEMORY[:2]]
    keys = KeyTerms(lexicon.rows(texts[:9])).with_appended(lexicon.rows(texts[9:]))
    queries = lexicon.query_terms([MEMORY[1], "python3 numpy array", "libc6 tryton"])
    ids = np.array([[0, 1, 12, -1], [3, 4, 0, 1], [2, 13, 9, -1]])
    batch = keys.similarities(queries, ids)
    for i in range(len(queries)):
        np.testing.assert_array_equal(batch[i], keys.similarities(queries[i : i + 1], ids[i : i + 1])[0])
    assert (batch > 0.1).sum() >= 4


def test_keys_outside_the_held_range_are_refused_not_wrapped(lexicon):
    shard = KeyTerms(lexicon.rows(MEMORY[2:]), first_key=2)
    queries = lexicon.query_terms(["libc6"])
    with pytest.raises(IndexError, match="outside"):
        shard.merged_products(queries, np.array([0]), np.array([-1]))
    with pytest.raises(IndexError, match="outside"):
        shard.merged_products(queries, np.array([0]), np.array([3]))


def test_a_batch_of_many_keys_is_merged_and_one_query_is_looked_up(lexicon, products, monkeypatch):
    monkeypatch.setattr(lexical, "MERGE_FROM_KEYS", 5)
    keys = KeyTerms(lexicon.rows(MEMORY))
    called = []
    for name in ("merged_products", "looked_up_products"):
        method = getattr(KeyTerms, name)
        monkeypatch.setattr(KeyTerms, name, lambda self, *a, _m=method, _n=name: called.append(_n) or _m(self, *a))
    keys.similarities(lexicon.query_terms(MEMORY[:2]), np.array([[0, 1, 2], [3, 4, -1]]))
    keys.similarities(lexicon.query_terms(MEMORY[:1]), np.array([[0, 1, 2, 3]]))
    assert called == ["merged_products", "looked_up_products"]
