"""export.fit measures what it built: on the dev split, the bundle beside the simple baseline
fitted on trn, their difference, a printed table; the baseline is skipped above its label cap."""

import pytest

from engine.offline import load_bundle
from export import fit
from export.baseline import baseline_metrics
from export.evaluate import evaluate_bundle
from xmc.data import first_rows, load_train_and_dev


@pytest.fixture
def cut_splits(monkeypatch):
    """The sample's first 300 training and 80 dev texts: what make fit's report reads."""

    def cut(data, train_split, dev_split):
        train, dev = load_train_and_dev(data, train_split, dev_split)
        return first_rows(train, 300), first_rows(dev, 80)

    monkeypatch.setattr(fit, "load_train_and_dev", cut)
    return cut


def test_the_report_sets_the_bundle_beside_the_baseline_and_their_difference(
    sample_bundle, sample_dir, cut_splits, monkeypatch
):
    monkeypatch.setattr(fit, "BASELINE_MAX_LABELS", 10**6)
    report = fit.measure_fit(sample_dir, sample_bundle, threads=1)
    train, dev = cut_splits(sample_dir, "trn", "dev")
    base, built = report["rows"]["tfidf-ovr-logreg"], report["rows"][sample_bundle.name]
    expected = evaluate_bundle(load_bundle(sample_bundle), dev, train)["metrics"]
    assert {name: built[name] for name in expected} == expected
    assert {k: v for k, v in base.items() if k != "seconds"} == {
        k: v for k, v in baseline_metrics(train, dev).items() if k != "seconds"
    }
    gain = report["rows"][f"{sample_bundle.name} - baseline"]
    assert gain["P@1"] == round(built["P@1"] - base["P@1"], 2) and set(gain) == set(fit.REPORTED)
    table = fit.report_table(report)
    assert "tfidf-ovr-logreg" in table and f"{built['P@1']:6.2f}" in table and "80 instances" in table


def test_above_the_label_cap_the_baseline_is_skipped_with_a_word(sample_bundle, sample_dir, cut_splits, monkeypatch):
    monkeypatch.setattr(fit, "BASELINE_MAX_LABELS", 100)
    report = fit.measure_fit(sample_dir, sample_bundle, threads=1)
    assert list(report["rows"]) == [sample_bundle.name]
    assert "not fitted above 100 labels" in report["notes"][0] and "not fitted" in fit.report_table(report)


def test_the_untrained_rival_is_shipped_only_when_its_held_out_validation_is_better(tmp_path, monkeypatch):
    scores = {"trained": 51.58, "untrained": 50.53}
    monkeypatch.setattr(fit, "fused_validation", lambda bundle: scores[bundle.name])
    shipped = fit.shipped_bundle(tmp_path / "trained", tmp_path / "untrained")
    assert not shipped.untrained_wins and "trained 51.58" in shipped.reason and "the trained one" in shipped.reason
    scores["untrained"] = 52.0
    assert fit.shipped_bundle(tmp_path / "trained", tmp_path / "untrained").untrained_wins
    scores["untrained"] = None  # too few held out to validate: the trained one is kept
    assert not fit.shipped_bundle(tmp_path / "trained", tmp_path / "untrained").untrained_wins


def test_a_fused_bundles_validation_is_its_best_sizes_selection_score(sample_bundle, tmp_path):
    """The score shipped_bundle compares: read from the manifest's size choice (None without one)."""
    assert fit.fused_validation(sample_bundle) is None  # a memory with no fusion


def test_the_fits_report_becomes_the_cards_figures_under_both_protocols():
    report = {
        "split": "dev",
        "rows": {
            "tfidf-ovr-logreg": {"P@1": 40.0, "P@5": 20.0, "seconds": 3.0},
            "mine": {"P@1": 45.0, "P@5": 21.0, "R@100": 90.0, "seconds": 9.0},
            "mine-untrained": {"P@1": 44.0},
            "mine - baseline": {"P@1": 5.0},
        },
        "exclude_before": {"mine": {"P@1": 46.0}, "mine-untrained": {"P@1": 45.0}},
    }
    rows = [(r.system, r.protocol, r.metrics) for r in fit.card_figures(report, "mine", "mine-untrained")]
    untrained = "untrained rival (pretrained encoder, same fusion)"
    assert rows == [
        ("tfidf-ovr-logreg", "peers", {"P@1": 40.0, "P@5": 20.0}),
        ("this bundle", "peers", {"P@1": 45.0, "P@5": 21.0, "R@100": 90.0}),  # seconds are not a figure
        (untrained, "peers", {"P@1": 44.0}),
        ("this bundle", "exclude-before", {"P@1": 46.0}),
        (untrained, "exclude-before", {"P@1": 45.0}),
    ]
