import numpy as np
import scipy.sparse as sp

from training.batching import (
    PslBatcher,
    balanced_clusters,
    cluster_batches,
    curriculum_cluster_size,
    mine_hard_negatives,
    without_own_labels,
)


def test_balanced_clusters_cover_every_row_once_and_group_neighbours():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(8, 16))
    x = np.repeat(centres, 50, axis=0) + 0.05 * rng.normal(size=(400, 16))
    clusters = balanced_clusters(x, 50, rng)
    rows = np.concatenate(clusters)
    assert sorted(rows.tolist()) == list(range(400))
    assert max(len(c) for c in clusters) <= 50 and min(len(c) for c in clusters) >= 25
    # each cluster is (almost) one of the planted groups
    purity = np.mean([np.bincount(c // 50).max() / len(c) for c in clusters])
    assert purity > 0.9


def test_cluster_size_one_is_a_random_permutation():
    clusters = balanced_clusters(np.zeros((10, 3)), 1, np.random.default_rng(0))
    assert sorted(np.concatenate(clusters).tolist()) == list(range(10))


def test_batches_and_curriculum():
    clusters = [np.array([0, 1]), np.array([2, 3]), np.array([4])]
    batches = cluster_batches(clusters, 2, np.random.default_rng(0))
    assert sorted(np.concatenate(batches).tolist()) == [0, 1, 2, 3, 4]
    assert [curriculum_cluster_size(e, 4, 32, 2) for e in range(10)] == [4, 4, 8, 8, 16, 16, 32, 32, 32, 32]
    assert curriculum_cluster_size(0, 4, 32, 0) == 32


def toy_labels():
    #       labels: 0 1 2 3 4 5
    Y = sp.csr_matrix(
        np.array(
            [
                [1, 1, 1, 0, 0, 0],
                [0, 1, 0, 1, 0, 0],
                [0, 0, 0, 0, 1, 0],
            ],
            dtype=np.float32,
        )
    )
    own = [{5}, set(), {3}]  # instance 0 is label 5; instance 2 is label 3
    return Y, own


def test_psl_batch_masks():
    Y, own = toy_labels()
    batcher = PslBatcher(Y, own, positives_per_query=1, negatives_per_query=1, rng=np.random.default_rng(0))
    batcher.hard_negatives = [np.array([5, 4]), np.array([0]), np.array([3, 0])]
    batch = batcher.make(np.array([0, 1, 2]))
    pool = batch.pool.tolist()
    assert len(set(pool)) == len(pool)
    for i, q in enumerate([0, 1, 2]):
        truth = set(Y[q].indices.tolist())
        assert {pool[j] for j in np.flatnonzero(batch.positives[i])} == truth & set(pool)
        assert {pool[j] for j in np.flatnonzero(batch.ignore[i])} == own[q] & set(pool)
        assert not (batch.positives[i] & batch.ignore[i]).any()
    # every query has at least its one sampled positive in the pool
    assert batch.positives.any(axis=1).all()
    assert batch.related.tolist() == [[True, True, False], [True, True, False], [False, False, True]]


def test_psl_samples_at_most_beta_positives_per_query():
    Y, own = toy_labels()
    batcher = PslBatcher(Y, own, positives_per_query=2, negatives_per_query=0, rng=np.random.default_rng(1))
    for _ in range(20):
        batch = batcher.make(np.array([0]))
        assert len(batch.pool) == 2 and batch.positives.all()


def test_mined_negatives_skip_positives_and_own_item():
    rng = np.random.default_rng(0)
    labels = rng.normal(size=(30, 8)).astype(np.float32)
    labels /= np.linalg.norm(labels, axis=1, keepdims=True)
    queries = labels[:3] + 0.01  # each query sits on its own label 0, 1, 2
    Y = sp.csr_matrix((np.ones(3), ([0, 1, 2], [10, 11, 12])), shape=(3, 30))
    own = [{0}, {1}, {2}]
    mined = mine_hard_negatives(queries, labels, Y, own, per_query=5)
    for i in range(3):
        assert len(mined[i]) == 5
        assert i not in mined[i] and 10 + i not in mined[i]


def test_own_label_that_is_also_a_target_is_neither_positive_nor_sampled():
    """The filter file says instance 0 *is* label 1 and instance 1 *is* label 2, and both are
    also among their targets: they must be ignored only, never positives (a masked-out positive
    is an unbounded loss term). Instance 1 is left without a positive."""
    Y = sp.csr_matrix(np.array([[1, 1, 0], [0, 0, 1], [0, 1, 0]], dtype=np.float32))
    own = [{1}, {2}, set()]
    batcher = PslBatcher(Y, own, positives_per_query=5, negatives_per_query=0, rng=np.random.default_rng(0))
    assert set(batcher.sample_positives(0).tolist()) == {0}
    assert batcher.sample_positives(1).size == 0
    batch = batcher.make(np.array([0, 1, 2]))
    assert batch.pool.tolist() == [0, 1]  # label 1 comes in as instance 2's positive
    assert batch.positives.tolist() == [[True, False], [False, False], [False, True]]
    assert batch.ignore.tolist() == [[False, True], [False, False], [False, False]]
    assert not (batch.positives & batch.ignore).any()
    # instances 0 and 2 share label 1 in the data: still related (not RAE negatives of each other)
    assert batch.related[0, 2] and batch.related[2, 0]


def test_a_batch_of_queries_without_usable_labels_has_an_empty_pool():
    Y = sp.csr_matrix(np.array([[0, 1]], dtype=np.float32))
    batcher = PslBatcher(Y, [{1}], positives_per_query=2, negatives_per_query=0, rng=np.random.default_rng(0))
    batch = batcher.make(np.array([0]))
    assert batch.pool.size == 0 and batch.positives.shape == (1, 0) and batch.ignore.shape == (1, 0)


def test_without_own_labels_keeps_the_other_entries_in_order():
    Y = sp.csr_matrix((np.ones(4, dtype=np.float32), np.array([3, 0, 2, 1]), np.array([0, 3, 4])), shape=(2, 4))
    targets = without_own_labels(Y, [{0}, {1}])
    assert targets.indices.tolist() == [3, 2] and targets.indptr.tolist() == [0, 2, 2]
    assert Y.nnz == 4  # the input is not modified
