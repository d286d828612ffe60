"""export.baseline: the one-vs-rest baseline solves scikit-learn's liblinear logistic regression,
ranks the same in chunks of labels and in worker processes as in one, goes on from its last saved
chunk, and refuses only a budget too small for one label."""

import numpy as np
import pytest
import scipy.sparse as sp

from export import baseline
from export.baseline import DoesNotFit, ovr_logreg


def data(seed: int = 0):
    rng = np.random.default_rng(seed)
    X = sp.random(120, 40, density=0.2, random_state=seed, format="csr", dtype=np.float64)
    dense = (rng.random((120, 11)) < 0.2).astype(np.float32)
    dense[:, 4] = 0  # never positive: left out, as a classifier cannot be fitted to it
    Y = sp.csr_matrix(dense)
    Xt = sp.random(30, 40, density=0.2, random_state=seed + 1, format="csr", dtype=np.float64)
    return X, Y, Xt


def labels_budget(labels: int, X, Xt) -> float:
    """``--ovr-max-gb`` that holds exactly ``labels`` labels' coefficients and scores."""
    return labels * (X.shape[1] + Xt.shape[0]) * 8 / 2**30


def test_each_label_solves_scikit_learns_liblinear_logistic_regression():
    from sklearn.linear_model import LogisticRegression
    from sklearn.multiclass import OneVsRestClassifier

    for seed in range(3):
        X, Y, Xt = data(seed)
        seen = np.flatnonzero(np.asarray(Y.sum(axis=0)).ravel() > 0)
        primal = OneVsRestClassifier(LogisticRegression(solver="liblinear", C=10.0)).fit(X, Y[:, seen])
        with baseline.ovr_context(X, Y, Xt):
            dual = baseline.ovr_scores(seen)
        expected = primal.decision_function(Xt)
        # the same objective to the dual solver's tolerance: within 0.04-0.07 of the primal's values
        # (mean magnitude 2.5) on these seeds, on AVX2 and AVX-512 alike; a wrong sign, bias or label
        # is off by whole units
        assert np.abs(dual - expected).max() < 0.3


def test_chunks_of_labels_and_worker_processes_rank_as_one_run_over_every_label():
    X, Y, Xt = data()
    whole = ovr_logreg(X, Y, Xt, depth=6, threads=1)  # one chunk
    assert ovr_logreg(X, Y, Xt, depth=6, threads=1, max_gb=labels_budget(3, X, Xt)) == whole
    assert ovr_logreg(X, Y, Xt, depth=6, threads=1, max_gb=labels_budget(1, X, Xt)) == whole
    assert ovr_logreg(X, Y, Xt, depth=6, threads=2, max_gb=labels_budget(3, X, Xt)) == whole
    assert all(4 not in row for row in whole)  # never positive: never fitted, never ranked


def test_a_stopped_fit_goes_on_from_its_last_saved_chunk_and_ranks_as_one_run(tmp_path, monkeypatch):
    X, Y, Xt = data()
    three_labels = labels_budget(3, X, Xt)  # 10 fitted labels: chunks end at 3, 6, 9, 10
    expected = ovr_logreg(X, Y, Xt, depth=6, threads=1, max_gb=three_labels)
    state, saved, save, stops = tmp_path / "ovr.npz", [], baseline.save_ovr, [6]

    class Killed(Exception):
        pass

    def save_then_stop(state, problem, next_label, *rest):
        save(state, problem, next_label, *rest)
        saved.append(next_label)
        if next_label in stops:  # stopped once, right after its second chunk was saved
            stops.remove(next_label)
            raise Killed

    monkeypatch.setattr(baseline, "save_ovr", save_then_stop)
    with pytest.raises(Killed):
        ovr_logreg(X, Y, Xt, depth=6, threads=1, max_gb=three_labels, state=state)
    with np.load(state) as kept:
        before = float(kept["seconds"])
    timing: dict = {}
    assert ovr_logreg(X, Y, Xt, depth=6, threads=1, max_gb=three_labels, state=state, timing=timing) == expected
    assert saved == [3, 6, 9, 10]  # the second run fitted only the chunks after the sixth label
    assert timing["fit_seconds"] >= before > 0
    # a state of another problem (another depth) is not resumed: the fit starts afresh
    saved.clear()
    assert ovr_logreg(X, Y, Xt, depth=5, threads=1, max_gb=three_labels, state=state) == [r[:5] for r in expected]
    assert saved == [3, 6, 9, 10]
    # nor one of the same shapes whose labels are numbered otherwise (two label columns swapped)
    stops.append(6)
    with pytest.raises(Killed):
        ovr_logreg(X, Y, Xt, depth=6, threads=1, max_gb=three_labels, state=state)
    swapped = Y[:, [1, 0, *range(2, Y.shape[1])]].tocsr()
    saved.clear()
    again = ovr_logreg(X, swapped, Xt, depth=6, threads=1, max_gb=three_labels, state=state)
    assert saved == [3, 6, 9, 10] and again == ovr_logreg(X, swapped, Xt, depth=6, threads=1)
    # and a state that cannot be read is a fresh start, not a failure
    state.write_bytes(b"not an npz")
    saved.clear()
    assert ovr_logreg(X, Y, Xt, depth=6, threads=1, max_gb=three_labels, state=state) == expected
    assert saved == [3, 6, 9, 10]


def test_a_budget_below_one_label_is_refused():
    X, Y, Xt = data()
    with pytest.raises(DoesNotFit, match="one label's coefficients and scores"):
        ovr_logreg(X, Y, Xt, depth=5, threads=1, max_gb=1e-9)


def test_baseline_metrics_rank_k_plus_the_filters_and_score_under_the_peers_protocol(sample_dir):
    """On the sample's first 300 training texts and 80 dev texts: every filter label is dropped
    before the top k, and the row has the peers' columns and its seconds."""
    from xmc.data import first_rows, load_jsonl_split

    train = first_rows(load_jsonl_split(sample_dir, "trn"), 300)
    dev = first_rows(load_jsonl_split(sample_dir, "dev", labels=train.labels), 80)
    row = baseline.baseline_metrics(train, dev, k=10)
    assert {"P@1", "P@5", "PSP@5", "R@10", "seconds"} <= set(row)
    assert 0 < row["P@1"] <= 100 and row["R@10"] >= row["P@1"] / 10
