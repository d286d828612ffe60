import numpy as np
import pytest
import scipy.sparse as sp

from bundle import build_values
from engine.rae import ValueRows, aggregate, labels_of_keys, softmax, top_k_of_row

# Memory: 2 training instances over 3 labels, then the 3 label keys (ids 2, 3, 4).
Y_TRAIN = sp.csr_matrix(np.array([[1, 1, 0], [0, 1, 1]], dtype=np.float32))
LAM, TAU = 0.5, 0.1


def rae(keys, sims, V, num_train, tau, top_b, excluded, mode="joint"):
    """aggregate() over a bundle-shaped memory: [instances ; labels], no appended rows."""
    return aggregate(keys, sims, labels_of_keys(keys, num_train), ValueRows(V), tau, top_b, excluded, mode)


def dense_reference(keys, sims, lam, tau, excluded=()):
    V = np.vstack([lam * Y_TRAIN.toarray(), (1 - lam) * np.eye(3)])
    keep = [i for i, key in enumerate(keys) if not (key >= 2 and key - 2 in excluded)]
    w = np.exp(np.asarray(sims)[keep] / tau)
    w /= w.sum()
    scores = w @ V[np.asarray(keys)[keep]]
    scores[list(excluded)] = 0
    return scores


def test_build_values_is_lambda_y_over_identity():
    V = build_values(Y_TRAIN, LAM).toarray()
    np.testing.assert_allclose(V, np.vstack([0.5 * Y_TRAIN.toarray(), 0.5 * np.eye(3)]))


def test_aggregate_matches_dense_softmax_times_values():
    keys = np.array([[2, 0, 4, 1], [3, 1, 0, 2]])
    sims = np.array([[0.9, 0.8, 0.5, 0.1], [0.95, 0.7, 0.6, 0.2]], dtype=np.float32)
    scores = rae(keys, sims, build_values(Y_TRAIN, LAM), 2, TAU, 4, [(), ()]).toarray()
    for i in range(2):
        np.testing.assert_allclose(scores[i], dense_reference(keys[i], sims[i], LAM, TAU), rtol=1e-5)


def test_excluded_label_key_is_removed_before_the_softmax():
    # Key 2 (label 0) is the query's own item with similarity 1.0; excluded, it must not take
    # the softmax mass: the remaining keys share all of it.
    keys = np.array([[2, 0, 1]])
    sims = np.array([[1.0, 0.8, 0.7]], dtype=np.float32)
    V = build_values(Y_TRAIN, LAM)
    scores = rae(keys, sims, V, 2, TAU, 3, [{0}]).toarray()[0]
    np.testing.assert_allclose(scores, dense_reference(keys[0], sims[0], LAM, TAU, excluded=(0,)), rtol=1e-5)
    assert scores[0] == 0.0
    # label 1 is positive for both remaining instances: weight 1 * λ
    assert scores[1] == pytest.approx(LAM, rel=1e-5)
    # Filtering only the output would have left far smaller scores (the same-item key took the mass).
    output_only = rae(keys, sims, V, 2, TAU, 3, [()]).toarray()[0]
    assert output_only[1] < 0.5 * scores[1]


def test_top_b_keeps_the_best_keys_after_exclusion():
    keys = np.array([[2, 0, 1, 3]])
    sims = np.array([[1.0, 0.9, 0.1, 0.05]], dtype=np.float32)
    scores = rae(keys, sims, build_values(Y_TRAIN, LAM), 2, TAU, 1, [{0}]).toarray()[0]
    # with key 2 gone, b=1 keeps only instance 0 (labels 0 and 1), label 0 then zeroed as excluded
    np.testing.assert_allclose(scores, [0.0, LAM, 0.0], rtol=1e-5)


def test_top_k_of_row_orders_by_score_then_id():
    row = sp.csr_matrix(np.array([[0.1, 0.5, 0.0, 0.5, 0.3]], dtype=np.float32))
    ids, scores = top_k_of_row(row, 0, 3)
    assert ids.tolist() == [1, 3, 4]
    np.testing.assert_allclose(scores, [0.5, 0.5, 0.3])
    ids, _ = top_k_of_row(row, 0, 10)
    assert ids.tolist() == [1, 3, 4, 0]


def test_softmax_is_stable_for_sharp_temperatures():
    w = softmax(np.array([1.0, 0.99, -1.0]), 0.001)
    assert np.isfinite(w).all() and w.sum() == pytest.approx(1.0)


def test_split_mode_gives_the_instance_memory_exactly_lambda_of_the_mass():
    keys = np.array([[2, 0, 4, 1]])  # label 0, instance 0, label 2, instance 1
    sims = np.array([[0.9, 0.8, 0.5, 0.1]], dtype=np.float32)
    lam = 0.7
    scores = rae(keys, sims, build_values(Y_TRAIN, lam), 2, TAU, 4, [()], mode="split").toarray()[0]
    inst = softmax(np.array([0.8, 0.1]), TAU)  # instances 0, 1
    labels = softmax(np.array([0.9, 0.5]), TAU)  # label keys 0, 2
    expected = lam * (inst @ Y_TRAIN.toarray()) + (1 - lam) * np.array([labels[0], 0.0, labels[1]])
    np.testing.assert_allclose(scores, expected, rtol=1e-5)
    assert scores.sum() == pytest.approx(lam * (inst @ Y_TRAIN.toarray()).sum() + (1 - lam))
    # with only label keys retrieved, split mode is the label softmax alone
    only_labels = rae(keys[:, [0, 2]], sims[:, [0, 2]], build_values(Y_TRAIN, lam), 2, TAU, 4, [()], "split")
    np.testing.assert_allclose(only_labels.toarray()[0], (1 - lam) * np.array([labels[0], 0, labels[1]]), rtol=1e-5)


def test_appended_value_rows_score_like_one_stacked_matrix():
    """Rows appended to a memory (a new label column among them) weigh exactly as if the value
    matrix had been built with them."""
    base = build_values(Y_TRAIN, LAM)  # 5 rows x 3 labels
    appended = sp.csr_matrix(np.array([[0, 0, 0, 1 - LAM], [LAM, 0, 0, LAM]], dtype=np.float32))  # label 3, an instance
    values = ValueRows(base).extended(appended)
    stacked = sp.vstack([sp.hstack([base, sp.csr_matrix((5, 1))]), appended]).tocsr()
    W = sp.csr_matrix(np.array([[0.2, 0, 0.3, 0, 0, 0.4, 0.1], [0, 0.5, 0, 0, 0.5, 0, 0]], dtype=np.float32))
    assert values.num_rows == 7 and values.num_labels == 4
    np.testing.assert_allclose(values.weigh(W).toarray(), (W @ stacked).toarray(), rtol=1e-6)


def test_row_labels_gathers_the_label_ids_of_base_and_appended_rows():
    base = sp.csr_matrix(np.array([[1, 0, 1], [0, 0, 0], [0, 1, 0]], dtype=np.float32))
    values = ValueRows(base).extended(sp.csr_matrix(np.array([[0, 0, 0, 1], [1, 1, 0, 0]], dtype=np.float32)))
    rows = np.array([4, 0, 1, 3, 2, 0])
    labels, counts = values.row_labels(rows)
    assert counts.tolist() == [2, 2, 0, 1, 1, 2]
    assert labels.tolist() == [0, 1, 0, 2, 3, 1, 0, 2]
    assert [x.tolist() for x in values.row_labels(np.zeros(0, dtype=np.int64))] == [[], []]
