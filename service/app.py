"""FastAPI app factory: ``uvicorn service.app:create_app --factory``.

The lifespan loads and verifies the bundle named by ``XMCSERVE_BUNDLE_DIR`` (a bundle that
fails verification stops start-up with the reason); ``/readyz`` turns 200 once it is loaded
and warmed.
"""

# No `from __future__ import annotations` here: FastAPI must resolve the locally built
# request model from the endpoint annotation at runtime.
import json
import logging
import time
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

import anyio
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.batcher import BatcherConfig, BatcherStoppedError, MicroBatcher, QueueFullError
from service.bundle import Bundle, load_bundle
from service.metrics import Metrics
from service.schemas import PredictResponse, build_predict_request
from service.search import Predictor, Ranking
from service.settings import Settings

log = logging.getLogger("xmcserve")

try:
    SERVICE_VERSION = version("xmcserve")
except PackageNotFoundError:  # running from a source tree that is not installed
    SERVICE_VERSION = "0+unknown"


class RequestMetricsMiddleware:
    """Latency histogram by route template (not raw path: bounded label cardinality) and status."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_with_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        start = time.perf_counter()
        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_with_status)
        finally:
            self.metrics.in_flight.dec()
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            self.metrics.request_seconds.labels(endpoint=endpoint, method=scope["method"], status=str(status)).observe(
                time.perf_counter() - start
            )


def to_response(bundle: Bundle, rankings: list[Ranking], k: int, ef: int) -> Response:
    """The PredictResponse JSON, serialised directly: FastAPI would otherwise validate the ~k
    label objects of every answer again (the model stays the documented response schema)."""
    uids, texts = bundle.label_uids, bundle.label_texts
    results = [
        {
            "labels": [
                {"id": i, "uid": uids[i], "text": texts[i], "score": s}
                for i, s in zip(ranking.ids.tolist(), ranking.scores.tolist(), strict=True)
            ]
        }
        for ranking in rankings
    ]
    body = {
        "bundle_id": bundle.bundle_id,
        "index_kind": bundle.manifest.index_kind,
        "k": k,
        "ef": ef,
        "results": results,
    }
    return Response(json.dumps(body, ensure_ascii=False, allow_nan=False), media_type="application/json")


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()
    PredictRequest = build_predict_request(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        bundle = await anyio.to_thread.run_sync(
            lambda: load_bundle(settings.bundle_dir, settings.encoder_options(), verify=settings.verify_checksums)
        )
        app.state.predictor = Predictor(bundle)
        batcher = MicroBatcher(
            lambda: app.state.predictor,
            BatcherConfig(settings.max_batch_size, settings.max_wait_ms, settings.max_queue, settings.batch_workers),
            on_batch_done=lambda texts, times: metrics.observe_batch(texts, times.as_dict()),
        )
        metrics.queue_depth.set_function(lambda: batcher.depth)
        metrics.batches_in_flight.set_function(lambda: batcher.in_flight_batches)
        batcher.start()
        app.state.batcher = batcher
        metrics.bundle_info.info(
            {
                "bundle_id": bundle.bundle_id,
                "index_kind": bundle.manifest.index_kind,
                "provider": bundle.encoder.provider,
                "dim": str(bundle.manifest.dim),
            }
        )
        log.info("serving bundle %s on %s", bundle.bundle_id, bundle.encoder.provider)
        yield
        await batcher.stop()
        app.state.predictor = None

    app = FastAPI(
        title="xmcserve",
        version=SERVICE_VERSION,
        description="Extreme multi-label classification: the k most relevant labels for a short text.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.predictor = None
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)

    @app.post("/predict", response_model=PredictResponse)
    async def predict(body: PredictRequest, request: Request) -> Response:  # type: ignore[valid-type]
        predictor: Predictor | None = request.app.state.predictor
        if predictor is None:
            return JSONResponse({"detail": "no bundle loaded yet"}, status_code=503)
        texts = body.all_texts()
        exclude = [predictor.bundle.label_ids(uids) for uids in body.exclusions()]
        try:
            answer = await request.app.state.batcher.submit(texts, body.k, body.ef, exclude)
        except QueueFullError as exc:
            metrics.rejected.inc()
            return JSONResponse({"detail": str(exc)}, status_code=429, headers={"Retry-After": str(exc.retry_after_s)})
        except BatcherStoppedError as exc:
            return JSONResponse({"detail": str(exc)}, status_code=503)
        metrics.stage_seconds.labels(stage="queue").observe(answer.queue_wait_s)
        metrics.predicted_texts.inc(len(texts))
        ef = body.ef or answer.predictor.default_ef
        return to_response(answer.predictor.bundle, answer.rankings, body.k, ef)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> Response:
        predictor: Predictor | None = request.app.state.predictor
        if predictor is None:
            return JSONResponse({"ready": False}, status_code=503)
        return JSONResponse({"ready": True, "bundle_id": predictor.bundle.bundle_id})

    @app.get("/info")
    async def info(request: Request) -> Response:
        predictor: Predictor | None = request.app.state.predictor
        if predictor is None:
            return JSONResponse({"detail": "no bundle loaded yet"}, status_code=503)
        bundle = predictor.bundle
        return JSONResponse(
            {
                "service_version": SERVICE_VERSION,
                "bundle_path": str(bundle.path),
                "execution_provider": bundle.encoder.provider,
                "limits": {
                    "max_texts_per_request": settings.max_texts_per_request,
                    "max_text_bytes": settings.max_text_bytes,
                    "max_k": settings.max_k,
                    "max_ef": settings.max_ef,
                },
                "manifest": bundle.manifest.model_dump(mode="json"),
            }
        )

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
