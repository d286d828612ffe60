"""bench.peers' one-vs-rest baseline fitted in chunks of labels ranks as one OneVsRestClassifier
over every label does, and refuses only a budget too small for one label; ``--keep`` runs only the
systems its result lacks."""

import json

import numpy as np
import pytest
import scipy.sparse as sp

from bench import peers
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


def test_keep_runs_only_the_systems_the_result_lacks_and_writes_them_in_order(sample_dir, tmp_path, monkeypatch):
    ran = []

    def system(name: str):
        def featurize(train, dev):
            return sp.csr_matrix((len(train), 1)), sp.csr_matrix((len(dev), 1))

        def model(X, Y, Xt, depth, threads):
            ran.append(name)
            return [[0, 1, 2]] * Xt.shape[0]

        return featurize, model, f"system {name}"

    monkeypatch.setattr(peers, "SYSTEMS", {name: system(name) for name in ("a", "b", "c")})
    out = tmp_path / "peers.json"
    kept = {"b": {"P@1": 12.5, "notes": "measured before"}}
    out.write_text(json.dumps(kept))
    assert peers.main(["--data", str(sample_dir), "--systems", "c,a,b", "--out", str(out), "--keep"]) == 0
    rows = json.loads(out.read_text())
    assert ran == ["c", "a"] and list(rows) == ["a", "b", "c"] and rows["b"] == kept["b"]
    assert rows["a"]["notes"].startswith("system a; ") and 0 <= rows["a"]["P@1"] <= 100
    peers.main(["--data", str(sample_dir), "--systems", "a,b,c", "--out", str(out), "--keep"])
    assert ran == ["c", "a"]  # nothing lacking, nothing run
    peers.main(["--data", str(sample_dir), "--systems", "b", "--out", str(out)])
    assert ran == ["c", "a", "b"] and list(json.loads(out.read_text())) == ["b"]  # without --keep: anew
    with pytest.raises(SystemExit):  # a typo is refused before the file is touched
        peers.main(["--data", str(sample_dir), "--systems", "b,d", "--out", str(out)])
    assert list(json.loads(out.read_text())) == ["b"]


def test_each_row_is_written_as_measured_and_a_skipped_one_is_tried_again(sample_dir, tmp_path, monkeypatch):
    def featurize(train, dev):
        return sp.csr_matrix((len(train), 1)), sp.csr_matrix((len(dev), 1))

    def ranks(X, Y, Xt, depth, threads):
        return [[0, 1]] * Xt.shape[0]

    def fails(X, Y, Xt, depth, threads):
        raise RuntimeError("killed half-way")

    systems = {"a": (featurize, ranks, "A"), "b": (featurize, fails, "B")}
    monkeypatch.setattr(peers, "SYSTEMS", systems)
    out = tmp_path / "peers.json"
    out.write_text(json.dumps({"a": {"skipped": "did not fit then", "notes": "A"}}))
    with pytest.raises(RuntimeError, match="killed"):
        peers.main(["--data", str(sample_dir), "--systems", "a,b", "--out", str(out), "--keep"])
    rows = json.loads(out.read_text())
    assert list(rows) == ["a"] and "skipped" not in rows["a"]  # measured again, and kept though b failed
