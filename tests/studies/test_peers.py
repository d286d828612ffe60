"""studies.peers: ``--keep`` runs only the systems its result lacks, each row is written as measured,
the one-vs-rest progress is kept beside the result, and fastText chooses its settings on dev (the
one-vs-rest baseline itself: tests/export/test_baseline.py)."""

import json

import numpy as np
import pytest
import scipy.sparse as sp

from studies.peers import run as peers


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


def test_the_one_vs_rest_row_is_export_baselines_the_row_make_fit_reports(sample_dir, tmp_path, monkeypatch):
    """studies.peers' tfidf-ovr-logreg row and make fit's baseline row (export.baseline) are one
    computation: on a cut of the sample, the same metrics."""
    from export.baseline import baseline_metrics
    from xmc.data import first_rows

    original = peers.load_jsonl_split

    def cut(path, split, **kwargs):
        return first_rows(original(path, split, **kwargs), 300 if split == "trn" else 80)

    monkeypatch.setattr(peers, "load_jsonl_split", cut)
    out = tmp_path / "peers.json"
    peers.main(["--data", str(sample_dir), "--systems", "tfidf-ovr-logreg", "--k", "10", "--out", str(out)])
    row = json.loads(out.read_text())["tfidf-ovr-logreg"]
    train = cut(sample_dir, "trn")
    expected = baseline_metrics(train, cut(sample_dir, "dev", labels=train.labels), k=10)
    assert {name: row[name] for name in expected if name != "seconds"} == {
        name: value for name, value in expected.items() if name != "seconds"
    }
