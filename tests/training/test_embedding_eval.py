import numpy as np

from training.embedding_eval import exact_top, rank_labels


def test_exact_top_is_best_first():
    queries = np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    keys = np.array([[0.9, 0.1], [0.1, 0.9], [0.5, 0.5]], dtype=np.float32)
    ids, sims = exact_top(queries, keys, depth=2)
    assert ids.tolist() == [[0, 2], [1, 2]]
    np.testing.assert_allclose(sims, [[0.9, 0.5], [0.9, 0.5]])


def test_rank_labels_removes_each_querys_excluded_labels_before_the_cut():
    queries = np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    labels = np.array([[0.9, 0.1], [0.1, 0.9], [0.5, 0.5]], dtype=np.float32)
    ranked = rank_labels(queries, labels, k=2, exclude=[{0}, set()])
    # query 0 loses its best label 0: its next two move up
    assert ranked.tolist() == [[2, 1], [1, 2]]
