import math

import numpy as np
import pytest
import scipy.sparse as sp

from xmc.metrics import (
    Segments,
    compute_all,
    drop_excluded,
    hits_matrix,
    inverse_propensity,
    macro_f1_at_k,
    ndcg_at_k,
    precision_at_k,
    psp_at_k,
    recall_at_k,
)

# Two instances over 5 labels.
#   instance 0: positives {0, 2}; ranking 2, 1, 0
#   instance 1: positives {4};    ranking 3, 4, -1 (only two labels returned)
Y = sp.csr_matrix(np.array([[1, 0, 1, 0, 0], [0, 0, 0, 0, 1]], dtype=np.float32))
RANKED = np.array([[2, 1, 0], [3, 4, -1]])


def test_hits():
    assert hits_matrix(RANKED, Y).tolist() == [[True, False, True], [False, True, False]]


def test_precision_recall_by_hand():
    hits = hits_matrix(RANKED, Y)
    assert precision_at_k(hits, 1) == pytest.approx((1 + 0) / 2)
    assert precision_at_k(hits, 3) == pytest.approx((2 / 3 + 1 / 3) / 2)
    assert recall_at_k(hits, Y, 1) == pytest.approx((1 / 2 + 0) / 2)
    assert recall_at_k(hits, Y, 3) == pytest.approx((2 / 2 + 1 / 1) / 2)


def test_ndcg_by_hand():
    hits = hits_matrix(RANKED, Y)
    # instance 0: DCG@3 = 1 + 1/log2(4) = 1.5; IDCG (2 positives) = 1 + 1/log2(3)
    # instance 1: DCG@3 = 1/log2(3);          IDCG (1 positive)  = 1
    expected = (1.5 / (1 + 1 / math.log2(3)) + 1 / math.log2(3)) / 2
    assert ndcg_at_k(hits, Y, 3) == pytest.approx(expected)
    assert ndcg_at_k(hits, Y, 1) == pytest.approx((1 + 0) / 2)


def test_inverse_propensity_formula():
    freq = np.array([0, 1, 10])
    n, a, b = 100, 0.55, 1.5
    c = (math.log(n) - 1) * (b + 1) ** a
    expected = [1 + c * (f + b) ** (-a) for f in freq]
    np.testing.assert_allclose(inverse_propensity(freq, n, a, b), expected)
    # rarer labels weigh more
    assert np.all(np.diff(inverse_propensity(freq, n)) < 0)


def test_psp_by_hand():
    inv = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    hits = hits_matrix(RANKED, Y)
    # @1: gained = inv[2] (instance 0) + 0 = 3; best = max(inv[0], inv[2]) + inv[4] = 3 + 5
    assert psp_at_k(RANKED, hits, Y, inv, 1) == pytest.approx(3 / 8)
    # @3: gained = 3 + 1 + 5; best = (3 + 1) + 5
    assert psp_at_k(RANKED, hits, Y, inv, 3) == pytest.approx(9 / 9)


def test_macro_f1_by_segment_by_hand():
    hits = hits_matrix(RANKED, Y)
    train_freq = np.array([500, 50, 5, 5, 0])  # label 0 head, 1 torso, 2-4 tail
    f1 = macro_f1_at_k(RANKED, hits, Y, train_freq, 3, Segments(10, 100))
    # label 0: TP 1, predicted 1, positives 1 -> 1.0 (head)
    # label 1: no positive in the split -> not averaged: torso has no member
    # label 2: TP 1, predicted 1, positives 1 -> 1.0; label 4: TP 1, pred 1, pos 1 -> 1.0;
    # label 3 has no positive -> skipped
    assert f1["head"] == pytest.approx(1.0)
    assert math.isnan(f1["torso"])
    assert f1["tail"] == pytest.approx(1.0)
    # @1: label 0 not in top-1 -> F1 0; label 2 TP 1 -> 1; label 4 missed -> 0
    f1_at_1 = macro_f1_at_k(RANKED, hits, Y, train_freq, 1, Segments(10, 100))
    assert f1_at_1["head"] == 0.0
    assert f1_at_1["tail"] == pytest.approx((1.0 + 0.0) / 2)


def test_compute_all_reports_percentages():
    out = compute_all(RANKED, Y, np.array([5, 5, 5, 5, 5]), 10, ks=(1, 3), recall_ks=(3,))
    assert out["P@1"] == pytest.approx(50.0)
    assert out["R@3"] == pytest.approx(100.0)
    assert set(out) >= {"P@1", "P@3", "nDCG@1", "PSP@3", "R@3", "F1@5/head", "F1@5/tail"}


def test_drop_excluded_pads_short_rows_with_minus_one():
    ranked = drop_excluded([[4, 7], [1, 2, 3]], [{7}, {2}], k=3)
    assert ranked.tolist() == [[4, -1, -1], [1, 3, -1]]
