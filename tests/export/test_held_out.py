"""export.held_out: a held-out instance is searched as if the memory lacked the hidden keys
(and its own), fetched wider when a search comes short."""

import numpy as np

from export.held_out import leave_one_out, search_without


class OrderedMemory:
    """A stand-in predictor whose every query's nearest keys are 0, 1, 2, … of ``keys`` keys, and
    which records how many it was asked for."""

    def __init__(self, keys: int):
        self.view = type("View", (), {"num_keys": keys})()
        self.asked: list[int] = []

    def knn(self, vectors, n, ef):
        self.asked.append(n)
        ids = np.arange(self.view.num_keys)[:n]
        keys = np.tile(np.pad(ids, (0, n - len(ids)), constant_values=-1), (len(vectors), 1))
        return keys, np.where(keys >= 0, 1.0 - keys / 1000, 0.0).astype(np.float32), 0


def test_a_search_without_hidden_keys_returns_the_next_nearest_and_fetches_wider_when_short():
    memory = OrderedMemory(200)
    hidden = np.arange(0, 60, 2)  # every other one of the 60 nearest: many more than their share
    keys, sims = search_without(memory, np.zeros((2, 4)), 20, np.array([1, 3]), hidden)
    nearest = [k for k in range(200) if k % 2 or k >= 60]
    assert keys.tolist() == [[k for k in nearest if k != 1][:20], [k for k in nearest if k != 3][:20]]
    np.testing.assert_allclose(sims, 1.0 - keys / 1000, rtol=1e-6)
    assert len(memory.asked) > 1 and memory.asked == sorted(memory.asked)  # fetched again, wider
    few = OrderedMemory(25)  # fewer keys left than asked for: padded, after one fetch of the whole memory
    keys, _ = search_without(few, np.zeros((1, 4)), 20, None, np.arange(10))
    assert keys.tolist() == [list(range(10, 25)) + [-1] * 5] and few.asked[-1] == 25


def test_leave_one_out_drops_only_each_rows_own_key():
    keys = np.array([[5, 7, 9, 11], [3, 4, 8, 6]])
    sims = np.array([[0.9, 0.8, 0.7, 0.6], [0.5, 0.4, 0.3, 0.2]], dtype=np.float32)
    kept_keys, kept_sims = leave_one_out(keys, sims, np.array([7, 1]))
    assert kept_keys.tolist() == [[5, 9, 11], [3, 4, 8]]  # a row without its own key loses its last
    np.testing.assert_allclose(kept_sims, [[0.9, 0.7, 0.6], [0.5, 0.4, 0.3]])
