"""What the rollout page puts side by side about two bundles: their manifests field by field, whether
their scores can be compared at all, and the offline quality stored beside each.

Scores are comparable only between bundles that score alike: an RAE memory's p̂ is a mixture of
label votes (0..1, summing over labels), a labels index's is the cosine of query and label
embeddings, and a score fusion adds a learned term to p̂; a "mean |score Δ|" across those measures
the scales, not the models (docs/rollout.md). Ranks compare across kinds: overlap@k, Kendall's τ.

Offline quality is the JSON ``make evaluate`` (``export.evaluate --out``) writes beside a bundle
directory, ``<dir>-eval-<split>.json``: shown with its split and date, and marked stale when it
measured another build than the one loaded (its ``bundle_id`` differs).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

EVALUATION_GLOB = "{name}-eval-*.json"
# The headline metrics, in the order the page shows them (filter after ranking: the peers' protocol).
HEADLINE = ("P@1", "P@5", "nDCG@5", "PSP@5", "R@10", "R@100")
# Fields that always differ (a content hash per file) or repeat the rows above in another form.
SKIPPED = {"files", "schema_version"}


def flat(value, prefix: str = "") -> dict[str, object]:
    """A manifest as ``{"rae.tau": 0.04, ...}``; lists of scalars joined, lists of objects counted."""
    if isinstance(value, dict):
        out: dict[str, object] = {}
        for key, item in value.items():
            if not prefix and key in SKIPPED:
                continue
            out.update(flat(item, f"{prefix}{key}."))
        return out
    key = prefix[:-1]
    if isinstance(value, list):
        if all(not isinstance(item, (dict, list)) for item in value):
            return {key: ", ".join(map(str, value))}
        return {key: f"{len(value)} entries"}
    return {key: value}


def manifest_rows(a: dict | None, b: dict | None) -> list[dict]:
    """One row per field of either manifest: both values and whether they differ (a field only one
    bundle has, such as ``fusion.*``, differs)."""
    left, right = flat(a or {}), flat(b or {})
    keys = list(left) + [key for key in right if key not in left]
    return [
        {"field": key, "a": left.get(key), "b": right.get(key), "differs": left.get(key) != right.get(key)}
        for key in keys
    ]


def scoring(manifest: dict) -> str:
    """How a bundle's scores are made, in words."""
    kind = manifest.get("index_kind")
    if kind == "rae_memory":
        fusion = manifest.get("fusion")
        if fusion:
            return f"RAE memory p̂ fused with a {fusion.get('kind', 'tree')} model (p̂ + T(φ))"
        return "RAE memory p̂ (softmax-weighted label votes)"
    if kind == "labels":
        return "cosine of query and label embeddings"
    return f"{kind} scores"


def scores_comparable(a: dict | None, b: dict | None, names: tuple[str, str] = ("A", "B")) -> tuple[bool, str]:
    """Whether score differences between the two bundles (called ``names``) mean anything, and why (not)."""
    if not a or not b:
        return False, "only one bundle is loaded"
    how_a, how_b = scoring(a), scoring(b)
    if how_a == how_b:
        return True, f"both score by {how_a}"
    return False, (
        f"{names[0]} scores by {how_a}, {names[1]} by {how_b}: their scales differ; "
        "compare the rankings (overlap@k, τ) instead"
    )


def evaluation_date(result: dict, path: Path) -> tuple[str, str]:
    """(ISO date, where it came from): the result's own ``evaluated_at``, else the file's mtime."""
    if result.get("evaluated_at"):
        return str(result["evaluated_at"]), "evaluated_at"
    mtime = datetime.datetime.fromtimestamp(path.stat().st_mtime, tz=datetime.timezone.utc)
    return mtime.isoformat(timespec="seconds"), "file date"


def stored_evaluations(bundle_dir: Path, bundle_id: str | None) -> list[dict]:
    """The evaluations beside ``bundle_dir`` (newest first), each with its split, date, headline
    metrics and whether it measured the loaded build."""
    bundle_dir = Path(bundle_dir)
    found = []
    for path in bundle_dir.parent.glob(EVALUATION_GLOB.format(name=bundle_dir.name)):
        try:
            result = json.loads(path.read_text())
            metrics = result["metrics"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not an evaluation result: nothing to show
        date, dated_by = evaluation_date(result, path)
        found.append(
            {
                "file": path.name,
                "split": result.get("split"),
                "data": result.get("data"),
                "instances": result.get("instances"),
                "date": date,
                "dated_by": dated_by,
                "bundle_id": result.get("bundle_id"),
                "stale": result.get("bundle_id") != bundle_id,
                "metrics": {name: metrics[name] for name in HEADLINE if name in metrics},
            }
        )
    return sorted(found, key=lambda item: item["date"], reverse=True)
