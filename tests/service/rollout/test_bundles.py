"""Two bundles side by side: manifests field by field, whether their scores compare, and the
evaluations stored beside each (split, date, stale when another build was measured)."""

import json
import os

from service.rollout.bundles import flat, manifest_rows, scores_comparable, stored_evaluations

RAE = {
    "bundle_id": "rae-1",
    "index_kind": "rae_memory",
    "dim": 64,
    "rae": {"lam": 0.2, "tau": 0.04},
    "params": {"quantize": "int8"},
    "files": {"encoder.onnx": "ab"},
    "shards": None,
}
LABELS = {"bundle_id": "lab-1", "index_kind": "labels", "dim": 64, "params": {"quantize": "none"}, "files": {}}


def test_manifests_are_compared_field_by_field():
    assert flat({"fusion": {"features": ["p", "freq"]}, "shards": [{"a": 1}, {"a": 2}]}) == {
        "fusion.features": "p, freq",
        "shards": "2 entries",
    }
    rows = {row["field"]: row for row in manifest_rows(RAE, LABELS)}
    assert "files" not in rows  # checksums: always different, said by the bundle id
    assert rows["dim"] == {"field": "dim", "a": 64, "b": 64, "differs": False}
    assert rows["index_kind"]["differs"] and rows["params.quantize"]["differs"]
    assert rows["rae.tau"] == {"field": "rae.tau", "a": 0.04, "b": None, "differs": True}  # A's only


def test_scores_compare_only_between_bundles_that_score_alike():
    same, why = scores_comparable(RAE, {**RAE, "bundle_id": "rae-2"})
    assert same and "RAE memory" in why
    across, why = scores_comparable(RAE, LABELS)
    assert not across and "cosine" in why and "overlap@k" in why
    fused, _ = scores_comparable(RAE, {**RAE, "fusion": {"kind": "lambdarank"}})
    assert not fused
    assert scores_comparable(RAE, None) == (False, "only one bundle is loaded")


def test_evaluations_beside_the_bundle_with_split_date_and_staleness(tmp_path):
    bundle = tmp_path / "default"
    bundle.mkdir()
    metrics = {"P@1": 60.1, "P@5": 30.2, "nDCG@5": 50.0, "PSP@5": 20.0, "R@100": 80.0, "P@3": 40.0}
    current = {"bundle_id": "rae-1", "split": "dev", "evaluated_at": "2026-11-26T05:00:00+00:00", "metrics": metrics}
    (tmp_path / "default-eval-dev.json").write_text(json.dumps(current))
    older = {"bundle_id": "rae-0", "split": "tst", "metrics": {"P@1": 1.0}}
    (tmp_path / "default-eval-tst.json").write_text(json.dumps(older))
    os.utime(tmp_path / "default-eval-tst.json", (0, 0))  # 1970: dated by the file
    (tmp_path / "default-eval-broken.json").write_text("{not json")
    (tmp_path / "other-eval-dev.json").write_text(json.dumps(current))  # another bundle's
    first, second = stored_evaluations(bundle, "rae-1")
    assert (first["split"], first["date"], first["dated_by"], first["stale"]) == (
        "dev",
        "2026-11-26T05:00:00+00:00",
        "evaluated_at",
        False,
    )
    assert list(first["metrics"]) == ["P@1", "P@5", "nDCG@5", "PSP@5", "R@100"]
    assert (second["split"], second["date"], second["dated_by"], second["stale"]) == (
        "tst",
        "1970-01-01T00:00:00+00:00",
        "file date",
        True,
    )
    assert stored_evaluations(tmp_path / "missing", "x") == []
