"""export.sparse_fit: one-vs-rest logistic regression (liblinear) ranks each label's own texts
first and learns a bias, and with dense vectors learns the labels a dense direction carries (D,
scaled back to the raw vector); the centroid fit is each label's unit mean (its own text added), so a zero-shot
label has weights; ``auto`` picks by the label count; small weights are pruned."""

import numpy as np
import pytest
import scipy.sparse as sp

from engine.sparse import SparseRanker
from export.sparse_fit import SparseFitParams, fit_sparse_ranker


def unit_rows(M: np.ndarray) -> sp.csr_matrix:
    return sp.csr_matrix((M / np.maximum(np.linalg.norm(M, axis=1, keepdims=True), 1e-12)).astype(np.float32))


@pytest.fixture
def toy():
    """Three labels, each owning two terms its texts always have, plus shared noise terms."""
    rng = np.random.default_rng(0)
    n, terms = 90, 12
    labels = rng.integers(0, 3, n)
    X = rng.random((n, terms)) * (rng.random((n, terms)) < 0.2)
    X[np.arange(n), 2 * labels] += 1.0
    X[np.arange(n), 2 * labels + 1] += 1.0
    Y = sp.csr_matrix((np.ones(n), (np.arange(n), labels)), shape=(n, 4))  # label 3: no instance
    label_rows = unit_rows(_label_text_rows(terms))
    return unit_rows(X), Y, label_rows, labels


def _label_text_rows(terms: int) -> np.ndarray:
    rows = np.zeros((4, terms))
    for label in range(4):
        rows[label, 2 * label] = 1.0
    return rows


def test_one_vs_rest_ranks_each_labels_own_texts_first(toy):
    X, Y, label_rows, labels = toy
    fit = fit_sparse_ranker(X, Y, label_rows, SparseFitParams(method="one_vs_rest", prune=0.0, dense_weight=0))
    assert fit.kind == "one_vs_rest" and fit.weights.shape == (12, 4) and fit.dense is None
    margins = (X @ fit.weights).toarray() + fit.bias
    assert (margins[:, :3].argmax(axis=1) == labels).mean() == 1.0
    assert fit.bias[3] < fit.bias[:3].min()  # the zero-shot label: one positive text against 90 negatives


def test_dense_vectors_carry_the_labels_the_terms_do_not_and_d_reads_the_raw_vector(toy):
    """Labels told apart by the dense vectors alone (the terms are noise): the fit learns D, and a
    margin computed as served (x·W + v·D + b, v unscaled) ranks each text's label first; the same
    fit at another dense_weight serves the same margins' order, D being scaled back."""
    X, Y, label_rows, labels = toy
    rng = np.random.default_rng(1)
    noise = unit_rows(rng.random(X.shape) * (rng.random(X.shape) < 0.3))
    directions = np.eye(4, 8, dtype=np.float32)
    V = directions[labels] + 0.1 * rng.standard_normal((len(labels), 8)).astype(np.float32)
    V /= np.linalg.norm(V, axis=1, keepdims=True)
    for weight in (1.0, 2.0):
        params = SparseFitParams(method="one_vs_rest", prune=0.0, dense_weight=weight)
        fit = fit_sparse_ranker(noise, Y, label_rows, params, V, directions)
        assert fit.dense.shape == (4, 8) and fit.dense.dtype == np.float32 and fit.dense.flags.c_contiguous
        margins = (noise @ fit.weights).toarray() + V @ fit.dense.T + fit.bias
        assert (margins[:, :3].argmax(axis=1) == labels).mean() == 1.0
    terms_only = fit_sparse_ranker(noise, Y, label_rows, SparseFitParams(method="one_vs_rest", dense_weight=0))
    by_terms = (noise @ terms_only.weights).toarray()[:, :3] + terms_only.bias[:3]
    assert (by_terms.argmax(axis=1) == labels).mean() < 0.9


def test_a_dense_fit_without_the_vectors_is_refused(toy):
    X, Y, label_rows, _ = toy
    with pytest.raises(ValueError, match="dense vectors"):
        fit_sparse_ranker(X, Y, label_rows, SparseFitParams(method="one_vs_rest"))
    with pytest.raises(ValueError, match="one dense vector a text"):
        fit_sparse_ranker(X, Y, None, SparseFitParams(method="one_vs_rest", label_texts=False), np.zeros((3, 8)))


def test_the_centroid_is_each_labels_unit_mean_with_its_own_text(toy):
    X, Y, label_rows, _ = toy
    params = SparseFitParams(method="centroid", prune=0.0, label_weight=0.5)
    fit = fit_sparse_ranker(X, Y, label_rows, params)
    W = fit.weights.toarray()
    mean = (Y.T @ X).toarray()[0]
    expected = mean / np.linalg.norm(mean) + 0.5 * label_rows.toarray()[0]
    np.testing.assert_allclose(W[:, 0], expected / np.linalg.norm(expected), rtol=1e-5)
    assert W[6, 3] > 0 and np.all(fit.bias == 0)  # the zero-shot label: its own text's term


def test_auto_picks_one_vs_rest_for_small_label_sets_and_pruning_drops_small_weights(toy):
    X, Y, label_rows, _ = toy
    assert SparseFitParams(one_vs_rest_max_labels=4).kind(4) == "one_vs_rest"
    assert SparseFitParams(one_vs_rest_max_labels=3).kind(4) == "centroid"
    fit = fit_sparse_ranker(X, Y, label_rows, SparseFitParams(method="centroid", prune=0.3))
    assert fit.weights.nnz and np.all(np.abs(fit.weights.data) >= 0.3)


def test_a_later_labels_column_is_the_one_the_centroid_fit_gives_a_zero_shot_label(toy):
    """The runtime gives a label appended after export the column the fit gave label 3, which no
    instance carries, from the same text row: one code, the same bits."""
    X, Y, label_rows, _ = toy
    params = SparseFitParams(method="centroid", prune=0.3)
    fit = fit_sparse_ranker(X, Y, label_rows, params)
    ranker = SparseRanker(fit.weights, fit.bias, 2, fit.kind, params.as_dict())
    columns = ranker.label_columns(label_rows[3:4])
    assert (columns.weights != fit.weights[:, 3]).nnz == 0 and columns.weights.nnz
    assert columns.weights.data.tobytes() == fit.weights[:, 3].tocsr().data.tobytes()
    assert columns.bias.tolist() == [0.0] == fit.bias[3:].tolist()
