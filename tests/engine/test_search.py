"""engine.search: the exclusions both front ends map to label ids, and the one ranking
entry (rank_batch), whose fused ranking scores the feature rows fusion_candidates gives."""

from types import SimpleNamespace

import numpy as np
import pytest
import scipy.sparse as sp

from bundle.manifest import RaeParams
from engine.fusion import FEATURES, ScoreFusion
from engine.memory import base_view
from engine.rae import ValueRows
from engine.search import FusionRows, Neighbours, excluded_label_ids, fusion_candidates, rank_batch

VIEW = base_view(["a", "b", "c"], ["A", "B", "C"], 3, None)


def test_one_list_for_all_texts_is_mapped_once_and_shared():
    per_text = excluded_label_ids(VIEW, ["c", "a", "unknown"], 3)
    assert per_text == [{0, 2}] * 3
    assert per_text[0] is per_text[2]


def test_one_list_per_text_maps_each():
    assert excluded_label_ids(VIEW, [["b"], [], ("a", "c")], 3) == [{1}, set(), {0, 2}]


def test_no_exclusions_exclude_nothing():
    assert excluded_label_ids(VIEW, [], 2) == [set(), set()]


def rae_memory():
    """Two instances (labels {0, 1} and {1, 2}) then four label keys, as a bundle's manifest and
    value rows would give them to rank_batch."""
    Y = sp.csr_matrix(np.array([[1, 1, 0, 0], [0, 1, 1, 0]], dtype=np.float32))
    V = sp.vstack([0.6 * Y, 0.4 * sp.identity(4, dtype=np.float32, format="csr")]).tocsr()
    manifest = SimpleNamespace(index_kind="rae_memory", rae=RaeParams(lam=0.6, tau=0.1, top_b=4, mode="joint"))
    keys = np.array([[0, 3, 1, 5], [2, 1, 4, 0]])
    sims = np.array([[0.9, 0.8, 0.7, 0.2], [0.95, 0.6, 0.5, 0.4]], dtype=np.float32)
    labels = np.array([[-1, 1, -1, 3], [0, -1, 2, -1]])
    return manifest, Neighbours(keys, sims, labels, ValueRows(V), None, ef=0)


def test_the_feature_rows_are_what_the_fused_ranking_scores():
    """fusion_candidates' feature rows (what export.fuse fits on), scored by a model and added to p̂,
    are the fused ranking's scores: the fit and the service compute φ alike."""
    manifest, found = rae_memory()
    exclude = [(), {2}]
    log_frequency = np.log1p(np.array([1.0, 2.0, 1.0, 0.0]))
    rows = fusion_candidates(manifest, found, exclude, ScoreFusion(None, log_frequency))
    assert isinstance(rows, FusionRows) and rows.features.shape == (rows.candidates.nnz, len(FEATURES))
    assert 2 not in rows.candidates[1].indices  # an excluded label is no candidate
    model = SimpleNamespace(predict=lambda X: 10.0 * X[:, FEATURES.index("label_retrieved")])
    rankings = rank_batch(manifest, found, [3, 3], exclude, ScoreFusion(model, log_frequency))
    expected = rows.candidates.copy()
    expected.data = expected.data + model.predict(rows.features)
    for i, ranking in enumerate(rankings):
        row = expected[i]
        best = np.argsort(-row.data, kind="stable")[:3]
        assert sorted(ranking.ids.tolist()) == sorted(row.indices[best].tolist())
        np.testing.assert_allclose(np.sort(ranking.scores), np.sort(row.data[best]), rtol=1e-6)


def test_a_label_index_ranks_the_keys_labels_and_has_no_feature_rows():
    manifest = SimpleNamespace(index_kind="labels", rae=None)
    found = Neighbours(np.array([[2, 0, 1]]), np.array([[0.9, 0.5, 0.1]]), np.array([[2, 0, 1]]), None, None, ef=0)
    (ranking,) = rank_batch(manifest, found, [2], [{0}])
    assert ranking.ids.tolist() == [2, 1]
    with pytest.raises(ValueError, match="no feature rows"):
        fusion_candidates(manifest, found, [()], ScoreFusion(None, np.zeros(3)))
