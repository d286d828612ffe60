"""bench.peers' one-vs-rest baseline solves scikit-learn's liblinear logistic regression, ranks the
same in chunks of labels and in worker processes as in one, and refuses only a budget too small for
one label; ``--keep`` runs only the systems its result lacks."""

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
        with peers.ovr_context(X, Y, Xt):
            dual = peers.ovr_scores(seen)
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
    state, saved, save, stops = tmp_path / "ovr.npz", [], peers.save_ovr, [6]

    class Killed(Exception):
        pass

    def save_then_stop(state, problem, next_label, *rest):
        save(state, problem, next_label, *rest)
        saved.append(next_label)
        if next_label in stops:  # stopped once, right after its second chunk was saved
            stops.remove(next_label)
            raise Killed

    monkeypatch.setattr(peers, "save_ovr", save_then_stop)
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


def test_keep_saves_the_one_vs_rest_progress_beside_the_result_until_its_row_is_written(
    sample_dir, tmp_path, monkeypatch
):
    """The fit itself is faked (the resume is tested above): what measure hands it, and keeps."""
    calls = []

    def featurize(train, dev):
        return sp.csr_matrix((len(train), 1)), sp.csr_matrix((len(dev), 1))

    def fit(X, Y, Xt, depth, threads, max_gb, state=None, timing=None):
        calls.append(state)
        if state is not None:
            state.write_bytes(b"progress")  # as a chunk's save would
        timing["fit_seconds"] = 1234.0  # a resumed fit's seconds include the runs before
        return [[0, 1, 2]] * Xt.shape[0]

    monkeypatch.setattr(peers, "ovr_logreg", fit)
    monkeypatch.setattr(peers, "SYSTEMS", {"tfidf-ovr-logreg": (featurize, fit, "one-vs-rest")})
    out = tmp_path / "peers.json"
    args = ["--data", str(sample_dir), "--systems", "tfidf-ovr-logreg", "--out", str(out)]
    assert peers.main([*args, "--keep"]) == 0
    state = peers.ovr_state(out, "dev")
    assert calls == [state] and state.parent == out.parent and not state.exists()  # gone: the row holds it
    assert json.loads(out.read_text())["tfidf-ovr-logreg"]["train_seconds"] >= 1234.0
    assert peers.main(args) == 0 and calls == [state, None]  # without --keep: nothing saved to resume


class FakeFastText:
    """What fasttext_supervised reads of a fastText model: predict's labels, best first."""

    def __init__(self, ranking: list[int]):
        self.ranking = ranking

    def predict(self, texts, k, threshold):
        return [[f"__label__{j}" for j in self.ranking[:k]] for _ in texts], [[0.5] * k for _ in texts]


def test_fasttext_chooses_on_dev_records_a_diverged_point_and_ranks_the_scored_split(sample_dir, tmp_path, monkeypatch):
    """The fit is faked (fastText is only in the peers venv): the grid, its failures and what measure
    hands it. The point with lr 0.5 ranks dev's most frequent label first and must be chosen."""
    from xmc.data import load_jsonl_split

    dev = load_jsonl_split(sample_dir, "dev")
    top = int(np.asarray(dev.Y.sum(axis=0)).ravel().argmax())
    fits, tuned_on = [], []

    def fit(texts, Y, threads, epoch, lr, **fixed):
        fits.append((epoch, lr, threads, fixed["loss"], fixed["wordNgrams"]))
        if lr == 1.0:
            raise RuntimeError("Encountered NaN.")
        return FakeFastText([top, top + 1] if lr == 0.5 else [top + 1, top + 2])

    real = peers.fasttext_supervised

    def spy(X, Y, Xt, depth, threads, tuning=None, info=None):
        tuned_on.append(len(tuning[1]))
        return real(X, Y, Xt, depth, threads, tuning=tuning, info=info)

    monkeypatch.setattr(peers, "fasttext_fit", fit)
    monkeypatch.setattr(peers, "fasttext_supervised", spy)
    monkeypatch.setattr(peers, "SYSTEMS", {"fasttext-supervised": (peers.fasttext_texts, spy, "fastText")})
    out = tmp_path / "peers.json"
    # scored on trn, tuned on dev: measure hands the dev split whatever split is scored
    assert peers.main(["--data", str(sample_dir), "--split", "trn", "--out", str(out), "--threads", "1"]) == 0
    row = json.loads(out.read_text())["fasttext-supervised"]
    assert tuned_on == [len(dev)]
    grid = peers.FASTTEXT_GRID
    assert len(fits) == len(grid["epoch"]) * len(grid["lr"]) and {f[2:] for f in fits} == {(1, "ova", 2)}
    failed = [(p["epoch"], p["lr"]) for p in row["grid_on_dev"] if p.get("failed") == "Encountered NaN."]
    assert failed == [(epoch, 1.0) for epoch in grid["epoch"]]
    assert row["chosen"]["lr"] == 0.5 and row["chosen"]["epoch"] == grid["epoch"][0]  # ties: the earlier point
    assert row["fixed"] == peers.FASTTEXT_FIXED and 0 <= row["P@1"] <= 100


def test_fasttext_texts_split_punctuation_off_and_lower_case():
    assert peers.fasttext_text("How do I (quickly) dice ONIONS?") == "how do i ( quickly ) dice onions ?"
