"""The rollout page (``GET /rollout``) and the admin endpoints only it needs.

The page is a static HTML shell with a small script (``static/rollout.{html,js,css}``): it holds
no serving state, so it reveals nothing by itself. The operator enters the admin token on it; the
script keeps it in the tab's memory and sends it as ``X-Admin-Token`` to the admin API:

- ``POST /admin/compare``: the same texts answered by A and by B, side by side, with each side's
  latency and bundle id and the agreement the shadow measures (the same :func:`compare`);
- ``GET /admin/agreement``: the shadow's recent comparisons and drops (the mirror's bounded ring,
  :mod:`service.rollout.agreement`) and the texts where A and B disagreed most;
- ``GET /admin/bundles``: the bundles under the bundle root, for a reload of B;
- ``GET /admin/manifests``: A's, B's and the shadow's manifests field by field, whether their
  scores are comparable (:mod:`service.rollout.bundles`), the offline evaluations stored beside
  A's and B's bundles, and the Grafana dashboards' links when ``XMCSERVE_GRAFANA_URL`` is set;
- ``GET /admin/live``: each variant's /predict QPS, p50/p99 and failed share over a window, from
  the server's own request histogram (:mod:`service.rollout.live`);
- and the existing ``/admin/state``, ``/admin/config``, ``/admin/reload``, ``/admin/promote``,
  ``/admin/rollback``.

With no admin token configured the page is not served (404), as the admin API is off. The page
costs /predict nothing: it only calls admin endpoints, and only while it is open.
"""

# No `from __future__ import annotations`: FastAPI must resolve the per-app request model from the
# endpoint's annotation at runtime.
import json
import time
from pathlib import Path

import httpx
from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.responses import FileResponse
from pydantic import Field

from bundle import MANIFEST_FILE
from engine import BatcherStoppedError, DeadlineExceededError, Engine, QueueFullError
from service.api.schemas import build_predict_request
from service.http.admin import require_admin, serving_state
from service.rollout import CANDIDATE, PRIMARY
from service.rollout.bundles import manifest_rows, scores_comparable, scoring, stored_evaluations
from service.rollout.shadow import compare, ranked

STATIC = Path(__file__).resolve().parent / "static"
# The page's own files; nothing else may be fetched or run (no CDN, no inline script).
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
MAX_WORST = 50
# The shadow's manifest is read from its /info; a shadow that does not answer this fast is reported so.
SHADOW_INFO_TIMEOUT_S = 2.0
# The dashboards in deploy/grafana (their uids), linked from the page when Grafana's URL is set.
DASHBOARDS = {"xmcserve": "server, variants and shadow", "xmcserve-ray": "Ray Serve front end"}


def admin_enabled(request: Request) -> bool:
    token = request.app.state.settings.admin.token
    return token is not None and bool(token.get_secret_value())


def page_file(name: str, media_type: str):
    async def serve(request: Request) -> Response:
        if not admin_enabled(request):
            raise HTTPException(404, "the rollout page is off: the admin API is disabled (set XMCSERVE_ADMIN_TOKEN)")
        return FileResponse(STATIC / name, media_type=media_type, headers=SECURITY_HEADERS)

    return serve


async def answer_side(
    engine: Engine, variant: str, texts: list[str], k: int, ef: int | None, exclude, timeout_s: float
) -> dict:
    """One variant's answers to the texts, or why there are none."""
    if engine.predictor(variant) is None:
        return {"variant": variant, "bundle_id": None, "error": f"variant {variant} has no bundle loaded"}
    started = time.perf_counter()
    try:
        answer = await engine.predict(variant, texts, k, ef, exclude, timeout_s)
    except (QueueFullError, DeadlineExceededError, BatcherStoppedError) as exc:
        return {"variant": variant, "bundle_id": engine.bundle_id(variant), "error": str(exc)}
    seconds = time.perf_counter() - started
    view = answer.view
    return {
        "variant": variant,
        "bundle_id": answer.predictor.bundle.bundle_id,
        "manifest": answer.predictor.bundle.manifest.model_dump(mode="json"),
        "latency_ms": round(seconds * 1000, 3),
        "ranked": ranked(answer.rankings, view.label_uids),
        "label_text": {view.label_uids[i]: view.label_texts[i] for r in answer.rankings for i in r.ids.tolist()},
    }


def side_by_side(a: dict, b: dict, k: int, n_texts: int) -> dict:
    """Both sides' labels per text (text, score, shared with the other side) and their agreement;
    the mean score delta only where the two bundles score alike (``scores``: whether, and why)."""
    sides, agreement = {}, []
    comparable, why = scores_comparable(a.get("manifest"), b.get("manifest"))
    for side, other in ((a, b), (b, a)):
        out = {key: side.get(key) for key in ("variant", "bundle_id", "latency_ms", "error")}
        out["scoring"] = scoring(side["manifest"]) if side.get("manifest") else None
        if "ranked" in side:
            out["results"] = []
            for i, labels in enumerate(side["ranked"]):
                theirs = {uid for uid, _ in other["ranked"][i]} if "ranked" in other else set()
                out["results"].append(
                    [
                        {"uid": uid, "text": side["label_text"][uid], "score": score, "shared": uid in theirs}
                        for uid, score in labels
                    ]
                )
        sides[side["variant"]] = out
    if "ranked" in a and "ranked" in b:
        agreement = [compare(a["ranked"][i], b["ranked"][i], k) for i in range(n_texts)]
        if not comparable:
            agreement = [{**row, "score_delta": None} for row in agreement]
    return {"k": k, "sides": sides, "agreement": agreement, "scores": {"comparable": comparable, "why": why}}


def bundles_under(root: Path) -> list[dict]:
    """The bundle dirs directly under ``root`` (a manifest is all that is read; a reload verifies)."""
    if not root.is_dir():
        return []
    out = []
    for path in sorted(p for p in root.iterdir() if (p / MANIFEST_FILE).is_file()):
        try:
            bundle_id = json.loads((path / MANIFEST_FILE).read_text())["bundle_id"]
        except (OSError, ValueError, KeyError, TypeError):
            bundle_id = None
        out.append({"name": path.name, "bundle_id": bundle_id})
    return out


def variant_bundle(predictor) -> dict | None:
    """A loaded variant's bundle: id, manifest, how it scores, the evaluations stored beside it."""
    if predictor is None:
        return None
    bundle = predictor.bundle
    manifest = bundle.manifest.model_dump(mode="json")
    return {
        "bundle_id": bundle.bundle_id,
        "path": str(bundle.path),
        "scoring": scoring(manifest),
        "manifest": manifest,
        "evaluations": stored_evaluations(Path(bundle.path), bundle.bundle_id),
    }


async def shadow_bundle(target: str | None) -> dict | None:
    """The shadow's bundle as its /info tells it, or why it cannot be read."""
    if not target:
        return None
    try:
        async with httpx.AsyncClient(timeout=SHADOW_INFO_TIMEOUT_S) as client:
            response = await client.get(f"{target.rstrip('/')}/info")
            response.raise_for_status()
            manifest = response.json()["manifest"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        return {"target": target, "error": f"the shadow's /info did not answer with a manifest: {exc}"}
    return {
        "target": target,
        "bundle_id": manifest.get("bundle_id"),
        "scoring": scoring(manifest),
        "manifest": manifest,
        "evaluations": None,  # stored beside the shadow's bundle, on its own machine
    }


def pair(a: dict | None, other: dict | None, name: str) -> dict | None:
    if a is None or other is None or "manifest" not in other:
        return None
    comparable, why = scores_comparable(a["manifest"], other["manifest"], ("A", name))
    return {"rows": manifest_rows(a["manifest"], other["manifest"]), "scores_comparable": comparable, "why": why}


def dashboard_links(grafana_url: str | None) -> list[dict]:
    if not grafana_url:
        return []
    base = grafana_url.rstrip("/")
    return [{"title": title, "uid": uid, "url": f"{base}/d/{uid}/{uid}"} for uid, title in DASHBOARDS.items()]


def add_rollout_routes(app: FastAPI) -> None:
    guarded = [Depends(require_admin)]
    settings = app.state.settings
    PredictRequest = build_predict_request(settings.limits)

    class CompareRequest(PredictRequest):  # type: ignore[valid-type, misc]
        """The texts, k, ef and exclusions of a /predict request, answered by A and by B."""

        variant: None = Field(None, description="not used: both variants answer")

    for path, name, media_type in (
        ("/rollout", "rollout.html", "text/html; charset=utf-8"),
        ("/rollout/rollout.js", "rollout.js", "text/javascript; charset=utf-8"),
        ("/rollout/rollout.css", "rollout.css", "text/css; charset=utf-8"),
    ):
        app.get(path, include_in_schema=False)(page_file(name, media_type))

    @app.post("/admin/compare", dependencies=guarded)
    async def compare_variants(body: CompareRequest, request: Request) -> dict:
        """A's and B's answers to the same texts, their latencies and their agreement (overlap@k,
        Kendall's τ of the shared labels, mean score delta), computed as the shadow computes it.
        Neither side's answer is counted as traffic nor mirrored."""
        state = serving_state(request)
        texts, exclude = body.all_texts(), body.exclude
        timeout_s = (body.timeout_ms or settings.limits.request_timeout_ms) / 1000
        a = await answer_side(state.engine, PRIMARY, texts, body.k, body.ef, exclude, timeout_s)
        b = await answer_side(state.engine, CANDIDATE, texts, body.k, body.ef, exclude, timeout_s)
        return {"texts": texts, **side_by_side(a, b, body.k, len(texts))}

    @app.get("/admin/agreement", dependencies=guarded)
    async def agreement(
        request: Request,
        window_s: float = Query(900.0, gt=0, le=86400, description="how far back, in seconds"),
        worst: int = Query(10, ge=0, le=MAX_WORST, description="how many of the most disagreeing texts"),
    ) -> dict:
        """The shadow's comparisons and drops of the last ``window_s`` seconds, from the mirror's
        in-memory ring of the last comparisons, and the texts where A and B disagreed most."""
        state = serving_state(request)
        shadow = state.shadow
        if shadow is None:
            raise HTTPException(503, "service not started")
        compared, dropped = shadow.history.since(window_s)
        return {
            "now": time.time(),
            "window_s": window_s,
            "capacity": shadow.history.capacity,
            "shadow": {"target": shadow.target or None, "fraction": shadow.config.fraction},
            "compared": [[c.ts, c.overlap, c.kendall_tau, c.score_delta, c.latency_delta_s * 1000] for c in compared],
            "dropped": dropped,
            "worst": [
                {"ts": c.ts, "text": c.text, "k": c.k, "overlap": c.overlap, "kendall_tau": c.kendall_tau}
                for c in shadow.history.worst(compared, worst)
            ],
        }

    @app.get("/admin/manifests", dependencies=guarded)
    async def manifests(request: Request) -> dict:
        """A's, B's and the shadow's bundles (manifest, how they score, the evaluations stored
        beside them), A against each of the others field by field with whether their scores are
        comparable, and links to the Grafana dashboards when their URL is configured."""
        state = serving_state(request)
        a, b = variant_bundle(state.engine.predictor(PRIMARY)), variant_bundle(state.engine.predictor(CANDIDATE))
        shadow = await shadow_bundle(state.shadow.target if state.shadow else None)
        return {
            "variants": {"A": a, "B": b, "shadow": shadow},
            "against_a": {"B": pair(a, b, "B"), "shadow": pair(a, shadow, "the shadow")},
            "dashboards": dashboard_links(settings.rollout.grafana_url),
        }

    @app.get("/admin/live", dependencies=guarded)
    async def live(
        request: Request,
        window_s: float = Query(300.0, gt=0, le=3600, description="how far back, in seconds"),
    ) -> dict:
        """Each variant's /predict answers over the last ``window_s`` seconds (requests, QPS,
        p50/p99 in ms, the share not answered 200) and per sampling interval, from the server's
        own request histogram; and the split they ran under."""
        state = serving_state(request)
        if state.live is None:
            raise HTTPException(503, "service not started")
        return {**state.live.report(window_s), "split_b": state.engine.split_b}

    @app.get("/admin/bundles", dependencies=guarded)
    async def bundles(request: Request) -> dict:
        """The bundles under ``XMCSERVE_BUNDLE_ROOT`` a reload may name, with their bundle ids."""
        state = serving_state(request)
        return {"bundles": bundles_under(state.settings.admin.bundle_root)}
