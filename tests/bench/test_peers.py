"""bench.peers' one-vs-rest baseline fitted in chunks of labels ranks as one OneVsRestClassifier
over every label does, and refuses only a budget too small for one label."""

import numpy as np
import pytest
import scipy.sparse as sp

from bench.peers import DoesNotFit, ovr_logreg


def data(seed: int = 0):
    rng = np.random.default_rng(seed)
    X = sp.random(120, 40, density=0.2, random_state=seed, format="csr", dtype=np.float64)
    dense = (rng.random((120, 11)) < 0.2).astype(np.float32)
    dense[:, 4] = 0  # never positive: left out, as a classifier cannot be fitted to it
    Y = sp.csr_matrix(dense)
    Xt = sp.random(30, 40, density=0.2, random_state=seed + 1, format="csr", dtype=np.float64)
    return X, Y, Xt


def test_chunks_of_labels_rank_as_one_classifier_over_every_label():
    from sklearn.linear_model import LogisticRegression
    from sklearn.multiclass import OneVsRestClassifier

    X, Y, Xt = data()
    seen = np.flatnonzero(np.asarray(Y.sum(axis=0)).ravel() > 0)
    whole = OneVsRestClassifier(LogisticRegression(solver="liblinear", C=10.0)).fit(X, Y[:, seen])
    expected = seen[np.argsort(-whole.decision_function(Xt), axis=1, kind="stable")[:, :6]].tolist()
    three_labels = 3 * X.shape[1] * 8 / 2**30
    assert ovr_logreg(X, Y, Xt, depth=6, threads=1, max_gb=three_labels) == expected
    assert ovr_logreg(X, Y, Xt, depth=6, threads=1) == expected  # one chunk
    one_label = X.shape[1] * 8 / 2**30  # every chunk a single label
    assert ovr_logreg(X, Y, Xt, depth=6, threads=1, max_gb=one_label) == expected
    assert all(4 not in row for row in expected)


def test_a_budget_below_one_label_is_refused():
    X, Y, Xt = data()
    with pytest.raises(DoesNotFit, match="one label's coefficients"):
        ovr_logreg(X, Y, Xt, depth=5, threads=1, max_gb=1e-9)
