"""engine.sparse: a sparse linear ranker's margins are the dense product's, a query's row is
the same bits alone and in any batch, its top leaves out the excluded labels and ranks by margin
(ties by label id), labels without weights get the lowest bias, labels after the fitted ones are
scored by their own columns (one-vs-rest: scaled to the fitted ones), dense weights add each query's
vector part batch-invariantly, and a broken file is refused."""

import numpy as np
import pytest
import scipy.sparse as sp

from bundle import BundleError
from engine.lexical import QueryTerms
from engine.sparse import LabelColumns, SparseRanker, StoredSlots, top_margins


def random_ranker(rng, terms=60, labels=25, depth=5, density=0.2) -> SparseRanker:
    weights = sp.random(terms, labels, density=density, format="csr", dtype=np.float32, random_state=rng)
    weights.data -= 0.3
    return SparseRanker(weights, rng.normal(size=labels).astype(np.float32), depth)


def random_queries(rng, n, terms=60) -> list[QueryTerms]:
    out = []
    for _ in range(n):
        ids = np.sort(rng.choice(terms + 5, size=rng.integers(0, 8), replace=False))  # some beyond the weights
        weights = rng.random(len(ids)).astype(np.float32)
        out.append(QueryTerms(ids, weights / max(np.linalg.norm(weights), 1e-9)))
    return out


def dense(queries, terms) -> np.ndarray:
    Q = np.zeros((len(queries), terms), dtype=np.float64)
    for i, q in enumerate(queries):
        inside = q.ids < terms
        Q[i, q.ids[inside]] = q.weights[inside]
    return Q


def test_margins_are_the_dense_product_plus_the_bias_and_the_top_is_by_margin():
    rng = np.random.default_rng(0)
    ranker = random_ranker(rng)
    queries = random_queries(rng, 12)
    exclude = [set() for _ in queries]
    exclude[3] = {0, 1, 2}
    margins = ranker.margins(queries, width=30, exclude=exclude)
    expected = dense(queries, 60) @ ranker.weights.toarray() + ranker.bias
    assert margins.all.shape == (12, 30)
    for i in range(12):
        query, labels = np.full(30, i), np.arange(30)
        got = ranker.margin_of(margins, query, labels)
        np.testing.assert_allclose(got[:25], expected[i], rtol=1e-5, atol=1e-6)
        assert np.all(got[25:] == ranker.bias.min())  # labels appended after export have no weights
        start, end = margins.top.indptr[i], margins.top.indptr[i + 1]
        top, ranks = margins.top.indices[start:end], margins.top_ranks[start:end]
        assert not set(top) & exclude[i]
        stored = margins.all.indices[margins.all.indptr[i] : margins.all.indptr[i + 1]]
        allowed = [label for label in stored if label not in exclude[i]]
        best = sorted(allowed, key=lambda label: (-got[label], label))[: ranker.depth]
        assert [top[np.argsort(ranks)][r] for r in range(len(top))] == best


def test_a_querys_margins_are_the_same_bits_alone_and_in_any_batch():
    rng = np.random.default_rng(1)
    ranker = random_ranker(rng, terms=200, labels=80, density=0.3)
    queries = random_queries(rng, 20, terms=200)
    together = ranker.margins(queries, 80, [()] * 20)
    for i, query in enumerate(queries):
        alone = ranker.margins([query], 80, [()])
        row = slice(together.all.indptr[i], together.all.indptr[i + 1])
        assert together.all.indices[row].tolist() == alone.all.indices.tolist()
        assert together.all.data[row].tobytes() == alone.all.data.tobytes()


def test_ties_in_the_top_go_to_the_lower_label_id():
    margins = sp.csr_matrix(np.array([[0.5, 0.9, 0.5, 0.5, 0.1]], dtype=np.float32))
    top, ranks = top_margins(margins, 3, [()])
    assert top.indices.tolist() == [0, 1, 2] and ranks.tolist() == [1, 0, 2]


def test_stored_slots_find_exactly_the_stored_pairs():
    matrix = sp.csr_matrix(np.array([[0, 2, 0], [3, 0, 4]], dtype=np.float32))
    at, found = StoredSlots(matrix)(np.array([0, 0, 1, 1, 1]), np.array([0, 1, 0, 1, 2]))
    assert found.tolist() == [False, True, True, False, True]
    assert matrix.data[at].tolist() == [2, 3, 4]


def test_stored_slots_find_pairs_in_any_storage_order():
    # row 1 stores label 2 before label 0 (as an aggregation in key order does)
    matrix = sp.csr_matrix(
        (np.array([2, 4, 3], dtype=np.float32), np.array([1, 2, 0]), np.array([0, 1, 3])), shape=(2, 3)
    )
    assert not matrix.has_sorted_indices
    at, found = StoredSlots(matrix)(np.array([0, 0, 1, 1, 1, 1]), np.array([0, 1, 0, 1, 2, 3]))
    assert found.tolist() == [False, True, True, False, True, False]  # label 3 is beyond the width
    assert matrix.data[at].tolist() == [2, 3, 4]


def test_the_file_round_trips_and_a_wrong_shape_or_bias_is_refused(tmp_path):
    rng = np.random.default_rng(2)
    ranker = random_ranker(rng)
    path = tmp_path / "sparse.npz"
    ranker.save(path)
    loaded = SparseRanker.load(path, 60, 25, depth=5)
    assert (loaded.weights != ranker.weights).nnz == 0 and loaded.bias.tobytes() == ranker.bias.tobytes()
    with pytest.raises(BundleError, match="shape"):
        SparseRanker.load(path, 61, 25, depth=5)
    with np.load(path) as z:
        arrays = dict(z)
    arrays["bias"] = np.full(25, np.nan, dtype=np.float32)
    np.savez(path, **arrays)
    with pytest.raises(BundleError, match="bias"):
        SparseRanker.load(path, 60, 25, depth=5)


def test_a_bias_is_checked_finite_as_float32_and_sized_from_its_header(tmp_path):
    """A float64 1e39 is finite as stored and inf as the float32 margins are computed in; a bias
    declaring more values than labels is refused from its header, before it is inflated."""
    ranker = random_ranker(np.random.default_rng(3))
    path = tmp_path / "sparse.npz"
    ranker.save(path)
    with np.load(path) as z:
        arrays = dict(z)
    arrays["bias"] = np.full(25, 1e39, dtype=np.float64)
    np.savez(path, **arrays)
    with pytest.raises(BundleError, match="finite float32"):
        SparseRanker.load(path, 60, 25, depth=5)
    arrays["bias"] = np.zeros(26, dtype=np.float32)
    np.savez(path, **arrays)
    with pytest.raises(BundleError, match="bias"):
        SparseRanker.load(path, 60, 25, depth=5)


def test_later_labels_columns_are_scored_ranked_and_batch_invariant_like_the_fitted_ones():
    """A live memory's later labels (their :class:`LabelColumns`) are margins of the same product:
    the dense product of the fitted and later columns side by side plus both biases, in the top by
    margin, the same bits alone and in any batch; a later label no query term points to has its bias."""
    rng = np.random.default_rng(3)
    ranker = random_ranker(rng, labels=25)
    later = random_ranker(rng, labels=7)
    columns = LabelColumns(later.weights, later.bias)
    queries = random_queries(rng, 15)
    margins = ranker.margins(queries, width=32, exclude=[()] * 15, later=columns)
    weights = np.hstack([ranker.weights.toarray(), later.weights.toarray()])
    expected = dense(queries, 60) @ weights + np.concatenate([ranker.bias, later.bias])
    assert margins.all.shape == (15, 32)
    for i, query in enumerate(queries):
        got = ranker.margin_of(margins, np.full(32, i), np.arange(32))
        np.testing.assert_allclose(got, expected[i], rtol=1e-5, atol=1e-6)
        start, end = margins.top.indptr[i], margins.top.indptr[i + 1]
        stored = margins.all.indices[margins.all.indptr[i] : margins.all.indptr[i + 1]]
        best = sorted(stored, key=lambda label: (-got[label], label))[: ranker.depth]
        top, ranks = margins.top.indices[start:end], margins.top_ranks[start:end]
        assert [top[np.argsort(ranks)][r] for r in range(len(top))] == best
        alone = ranker.margins([query], 32, [()], later=columns)
        row = slice(margins.all.indptr[i], margins.all.indptr[i + 1])
        assert margins.all.data[row].tobytes() == alone.all.data.tobytes()
    assert any(label >= 25 for label in margins.top.indices)  # later labels reach the top


def test_a_one_vs_rest_rankers_later_label_gets_its_text_at_the_fitted_columns_median_norm_and_bias():
    """One-vs-rest has no closed form for a label fitted on its text alone: its unit text row is
    scaled to the fitted columns' median norm and given their median bias, so a twin of a fitted
    label's text is scored on the fitted labels' scale (and enters the top for that text)."""
    rng = np.random.default_rng(4)
    fitted = random_ranker(rng, terms=60, labels=25)
    ranker = SparseRanker(fitted.weights, fitted.bias, 5, "one_vs_rest", {"prune": 0.0})
    text = QueryTerms(np.array([3, 10, 41]), np.array([0.6, 0.0, 0.8], dtype=np.float32))
    rows = sp.csr_matrix((text.weights, text.ids, [0, 3]), shape=(1, 60))
    columns = ranker.label_columns(rows)
    norms = np.linalg.norm(fitted.weights.toarray(), axis=0)
    np.testing.assert_allclose(columns.weights.toarray()[:, 0], rows.toarray()[0] * np.median(norms), rtol=1e-6)
    assert columns.bias.tolist() == pytest.approx([np.median(fitted.bias)])
    margin = ranker.margin_of(ranker.margins([text], 26, [()], columns), np.array([0]), np.array([25]))
    assert margin == pytest.approx(np.median(norms) + np.median(fitted.bias), rel=1e-5)


def test_a_fit_without_label_texts_gives_later_labels_no_weights_as_it_gave_zero_shot_labels_none():
    rng = np.random.default_rng(5)
    fitted = random_ranker(rng)
    ranker = SparseRanker(fitted.weights, fitted.bias, 5, "centroid", {"label_texts": False})
    columns = ranker.label_columns(sp.csr_matrix(np.eye(2, 60, dtype=np.float32)))
    assert columns.labels == 2 and columns.weights.nnz == 0 and columns.bias.tolist() == [0.0, 0.0]


def test_extending_label_columns_adds_blocks_and_builds_the_side_by_side_columns_once_on_first_use(monkeypatch):
    """An append's columns join a view's without a rebuild of the earlier later labels' over the
    whole term space (it ran under the append log's exclusive lock, and once per logged append at
    load): extending keeps blocks and stacks nothing; the weights and biases, built once on first
    use, are exactly the old one-hstack-per-append result."""
    rng = np.random.default_rng(5)
    terms = 200_000  # a wide term space: a stack per append would walk every term row
    blocks = []
    for labels in (3, 1, 0, 1, 2, 1):
        weights = sp.random(terms, labels, density=2e-4, format="csr", dtype=np.float32, random_state=rng)
        weights.sort_indices()
        blocks.append((weights, rng.normal(size=labels).astype(np.float32)))
    expected_weights, expected_bias = blocks[0]
    for weights, bias in blocks[1:]:  # what extending did before: one hstack per append
        if weights.shape[1]:
            expected_weights = sp.hstack([expected_weights, weights], format="csr")
            expected_weights.sort_indices()
            expected_bias = np.concatenate([expected_bias, bias]).astype(np.float32)

    def no_stacking(*args, **kwargs):
        raise AssertionError("extending label columns stacked a matrix")

    monkeypatch.setattr(sp, "hstack", no_stacking)
    monkeypatch.setattr(sp, "vstack", no_stacking)
    columns = LabelColumns(*blocks[0])
    for weights, bias in blocks[1:]:
        columns = columns.extended(LabelColumns(weights, bias))
        assert "weights" not in vars(columns) and "bias" not in vars(columns)  # nothing built yet
    assert len(columns.blocks) == 5 and columns.labels == 8 and columns.terms == terms
    built = columns.weights
    assert columns.weights is built and columns.bias is columns.bias  # built once per view
    assert built.shape == expected_weights.shape and built.dtype == np.float32 and built.has_sorted_indices
    np.testing.assert_array_equal(built.indptr, expected_weights.indptr)
    np.testing.assert_array_equal(built.indices, expected_weights.indices)
    assert built.data.tobytes() == expected_weights.data.tobytes()
    assert columns.bias.dtype == np.float32 and columns.bias.tobytes() == expected_bias.tobytes()


def test_margins_over_extended_label_columns_are_those_over_the_same_columns_in_one_block():
    """Blocks change nothing a batch sees: the margins over columns extended append by append are
    the bits of the margins over the same columns given at once, alone and in a batch."""
    rng = np.random.default_rng(6)
    ranker = random_ranker(rng, labels=25)
    parts = [random_ranker(rng, labels=n) for n in (2, 1, 4)]
    columns = LabelColumns(parts[0].weights, parts[0].bias)
    for part in parts[1:]:
        columns = columns.extended(LabelColumns(part.weights, part.bias))
    whole = LabelColumns(sp.hstack([p.weights for p in parts], format="csr"), np.concatenate([p.bias for p in parts]))
    queries = random_queries(rng, 12)
    got = ranker.margins(queries, 32, [()] * 12, later=columns)
    want = ranker.margins(queries, 32, [()] * 12, later=whole)
    for name in ("indptr", "indices", "data"):
        assert getattr(got.all, name).tobytes() == getattr(want.all, name).tobytes()
        assert getattr(got.top, name).tobytes() == getattr(want.top, name).tobytes()
    assert got.top_ranks.tolist() == want.top_ranks.tolist() and got.bias.tobytes() == want.bias.tobytes()


def dense_ranker(rng, terms=60, labels=25, dim=8, depth=5) -> SparseRanker:
    base = random_ranker(rng, terms, labels, depth)
    D = rng.normal(size=(labels, dim)).astype(np.float32)
    return SparseRanker(base.weights, base.bias, depth, "one_vs_rest", {}, D)


def unit_vectors(rng, n, dim=8) -> np.ndarray:
    V = rng.normal(size=(n, dim)).astype(np.float32)
    return V / np.linalg.norm(V, axis=1, keepdims=True)


def test_dense_weights_add_the_query_vectors_part_and_store_every_fitted_label():
    rng = np.random.default_rng(10)
    ranker = dense_ranker(rng)
    queries, V = random_queries(rng, 9), unit_vectors(rng, 9)
    exclude = [set() for _ in queries]
    exclude[2] = {4, 5}
    margins = ranker.margins(queries, width=30, exclude=exclude, vectors=V)
    expected = dense(queries, 60) @ ranker.weights.toarray() + V @ ranker.dense.T + ranker.bias
    assert margins.all.shape == (9, 30) and np.all(np.diff(margins.all.indptr) == 25)
    for i in range(9):
        got = ranker.margin_of(margins, np.full(25, i), np.arange(25))
        np.testing.assert_allclose(got, expected[i], rtol=1e-5, atol=1e-5)
        start, end = margins.top.indptr[i], margins.top.indptr[i + 1]
        top = margins.top.indices[start:end][np.argsort(margins.top_ranks[start:end])]
        allowed = [label for label in range(25) if label not in exclude[i]]
        assert top.tolist() == sorted(allowed, key=lambda label: (-got[label], label))[: ranker.depth]


def test_a_querys_dense_margins_are_the_same_bits_alone_and_in_any_batch():
    rng = np.random.default_rng(11)
    ranker = dense_ranker(rng, terms=200, labels=300, dim=64)
    queries, V = random_queries(rng, 33, terms=200), unit_vectors(rng, 33, 64)
    together = ranker.margins(queries, 300, [()] * 33, vectors=V)
    for i, query in enumerate(queries):
        alone = ranker.margins([query], 300, [()], vectors=V[i : i + 1])
        row = slice(together.all.indptr[i], together.all.indptr[i + 1])
        assert together.all.data[row].tobytes() == alone.all.data.tobytes()


def test_a_dense_ranker_needs_one_vector_a_query_and_later_labels_have_no_dense_part():
    rng = np.random.default_rng(12)
    ranker = dense_ranker(rng)
    queries = random_queries(rng, 3)
    with pytest.raises(ValueError, match="query vectors"):
        ranker.margins(queries, 25, [()] * 3)
    with pytest.raises(ValueError, match="query vectors"):
        ranker.margins(queries, 25, [()] * 3, vectors=unit_vectors(rng, 3, 7))
    rows = sp.csr_matrix(np.eye(1, 60, 3, dtype=np.float32))
    later = ranker.label_columns(rows)
    V = unit_vectors(rng, 3)
    margins = ranker.margins(queries, 26, [()] * 3, later, V)
    expected = dense(queries, 60) @ later.weights.toarray() + later.bias
    got = [ranker.margin_of(margins, np.array([i]), np.array([25]))[0] for i in range(3)]
    np.testing.assert_allclose(got, expected[:, 0], rtol=1e-5, atol=1e-6)


def test_dense_weights_round_trip_and_are_refused_undeclared_misshapen_or_too_large(tmp_path):
    rng = np.random.default_rng(13)
    ranker = dense_ranker(rng)
    path = tmp_path / "sparse.npz"
    ranker.save(path)
    loaded = SparseRanker.load(path, 60, 25, 5, "one_vs_rest", {}, dense_dim=8)
    assert loaded.dense.tobytes() == ranker.dense.tobytes() and loaded.dense_dim == 8
    with pytest.raises(BundleError, match="does not declare"):
        SparseRanker.load(path, 60, 25, 5, "one_vs_rest", {})
    with pytest.raises(BundleError, match="dense weights"):
        SparseRanker.load(path, 60, 25, 5, "one_vs_rest", {}, dense_dim=9)
    with np.load(path) as z:
        arrays = dict(z)
    for bad in (np.full((25, 8), 1e5, np.float32), np.full((25, 8), np.nan, np.float32), np.full((25, 8), 1e39)):
        arrays["dense"] = bad
        np.savez(path, **arrays)
        with pytest.raises(BundleError, match="magnitude"):
            SparseRanker.load(path, 60, 25, 5, "one_vs_rest", {}, dense_dim=8)
    arrays["dense"] = np.asfortranarray(ranker.dense)  # column by column: read as the same matrix
    np.savez(path, **arrays)
    loaded = SparseRanker.load(path, 60, 25, 5, "one_vs_rest", {}, dense_dim=8)
    assert loaded.dense.tobytes() == ranker.dense.tobytes() and loaded.dense.flags.c_contiguous
