"""FastAPI app factory: ``uvicorn service.app:create_app --factory``.

The lifespan loads and verifies the primary bundle named by ``XMCSERVE_BUNDLE_DIR`` (a bundle
that fails verification stops start-up with the reason), the optional candidate (a bad candidate
is logged and skipped: it never takes the primary down) and the shadow mirror; ``/readyz`` turns
200 once the primary is loaded and warmed.
"""

# No `from __future__ import annotations` here: FastAPI must resolve the locally built
# request model from the endpoint annotation at runtime.
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import asdict
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.admin import ServingState, add_admin_routes, load_predictor
from service.batcher import BatchAnswer, BatcherConfig, BatcherStoppedError, QueueFullError
from service.bundle import BundleError
from service.cpu_priority import parse_cpus, yield_cpu_process
from service.metrics import Metrics
from service.primary_gate import PrimaryActivity
from service.schemas import PredictResponse, build_predict_request
from service.settings import Settings
from service.shadow import ShadowConfig, ShadowMirror, ShadowRequest, ranked
from service.shadow_worker import ShadowWorker, WorkerSpec
from service.variants import CANDIDATE, PRIMARY, Variants

log = logging.getLogger("xmcserve")

try:
    SERVICE_VERSION = version("xmcserve")
except PackageNotFoundError:  # running from a source tree that is not installed
    SERVICE_VERSION = "0+unknown"


class RequestMetricsMiddleware:
    """Latency histogram by route template (not raw path: bounded label cardinality), status and
    the variant that answered (``-`` for endpoints that do not predict); every request also counts
    in ``activity``, which the in-process shadow yields to."""

    def __init__(self, app, metrics: Metrics, activity: PrimaryActivity):
        self.app = app
        self.metrics = metrics
        self.activity = activity

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
        self.activity.enter()
        try:
            await self.app(scope, receive, send_with_status)
        finally:
            self.activity.leave()
            self.metrics.in_flight.dec()
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            variant = scope.get("state", {}).get("variant", "-")
            self.metrics.request_seconds.labels(
                endpoint=endpoint, method=scope["method"], status=str(status), variant=variant
            ).observe(time.perf_counter() - start)


def to_response(answer: BatchAnswer, variant: str, k: int, ef: int) -> Response:
    """The PredictResponse JSON, serialised directly: FastAPI would otherwise validate the ~k
    label objects of every answer again (the model stays the documented response schema)."""
    bundle = answer.predictor.bundle
    uids, texts = bundle.label_uids, bundle.label_texts
    results = [
        {
            "labels": [
                {"id": i, "uid": uids[i], "text": texts[i], "score": s}
                for i, s in zip(ranking.ids.tolist(), ranking.scores.tolist(), strict=True)
            ]
        }
        for ranking in answer.rankings
    ]
    body = {
        "bundle_id": bundle.bundle_id,
        "variant": variant,
        "index_kind": bundle.manifest.index_kind,
        "k": k,
        "ef": ef,
        "results": results,
    }
    return Response(json.dumps(body, ensure_ascii=False, allow_nan=False), media_type="application/json")


def build_shadow(settings: Settings, metrics: Metrics, variants: Variants, activity: PrimaryActivity) -> ShadowMirror:
    """The mirror and its worker process: the remote at ``shadow_url``, else the in-process B,
    computed in the worker's idle-class process while this server is quiet (service.shadow_worker)."""
    config = ShadowConfig(
        fraction=settings.shadow_fraction,
        queue_size=settings.shadow_queue,
        timeout_s=settings.shadow_timeout_ms / 1000,
        workers=settings.shadow_workers,
        batch_texts=settings.shadow_batch_texts,
        batch_wait_s=settings.shadow_batch_wait_ms / 1000,
        yield_to_primary=settings.shadow_yields(),
        max_texts_per_s=settings.shadow_max_texts_per_s,
        abort_backoff_max_s=settings.shadow_abort_backoff_max_ms / 1000,
    )
    log_spec = (
        {
            "path": str(settings.shadow_log),
            "max_bytes": settings.shadow_log_max_bytes,
            "backups": settings.shadow_log_backups,
        }
        if settings.shadow_log
        else None
    )
    target = settings.shadow_url or "B"
    spec = WorkerSpec(
        config=asdict(config),
        remote_url=settings.shadow_url,
        encoder=asdict(settings.encoder_options()),
        verify=settings.verify_checksums,
        log=log_spec,
        target=target,
        cpus=sorted(cpus) if (cpus := parse_cpus(settings.shadow_cpus)) else None,
    )
    worker = ShadowWorker(spec, activity if config.yield_to_primary else None)
    candidate = None if settings.shadow_url else (lambda: variants[CANDIDATE].predictor)
    return ShadowMirror(config, metrics, target, worker, candidate)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()
    activity = PrimaryActivity()
    PredictRequest = build_predict_request(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Every thread so far, and by inheritance the ones ONNX Runtime and the batchers start.
        app.state.cpu_priority = yield_cpu_process() if settings.cpu_priority == "idle" else "normal"
        config = BatcherConfig(
            settings.max_batch_size, settings.max_wait_ms, settings.max_queue, settings.batch_workers
        )
        variants = Variants.create(config, metrics.batch_observer)
        variants.split_b = settings.split_b
        for name, slot in variants.slots.items():
            metrics.queue_depth.labels(variant=name).set_function(lambda slot=slot: slot.batcher.depth)
            metrics.batches_in_flight.labels(variant=name).set_function(
                lambda slot=slot: slot.batcher.in_flight_batches
            )
            # counters exported at 0 from the start, so a rate() has a series before the first event
            metrics.rejected.labels(variant=name)
            metrics.predicted_texts.labels(variant=name)
        state = ServingState(settings, metrics, variants)
        predictor = await load_predictor(settings.bundle_dir, settings)
        state.install(PRIMARY, predictor, str(settings.bundle_dir))
        if settings.candidate_bundle_dir:
            try:
                state.install(
                    CANDIDATE,
                    await load_predictor(settings.candidate_bundle_dir, settings),
                    str(settings.candidate_bundle_dir),
                )
            except BundleError as exc:
                log.error("candidate bundle refused, serving A only: %s", exc)
        variants.start()
        state.shadow = build_shadow(settings, metrics, variants, activity)
        state.shadow.start()
        app.state.serving = state
        log.info("serving bundle %s on %s", predictor.bundle.bundle_id, predictor.bundle.encoder.provider)
        yield
        await state.shadow.stop()
        await variants.stop()
        app.state.serving = None

    app = FastAPI(
        title="xmcserve",
        version=SERVICE_VERSION,
        description="Extreme multi-label classification: the k most relevant labels for a short text.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.serving = None
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics, activity=activity)

    @app.post("/predict", response_model=PredictResponse)
    async def predict(body: PredictRequest, request: Request) -> Response:  # type: ignore[valid-type]
        state: ServingState | None = request.app.state.serving
        if state is None:
            return JSONResponse({"detail": "no bundle loaded yet"}, status_code=503)
        try:
            slot = state.variants.choose(request.headers.get("x-request-key"), body.variant)
        except LookupError as exc:
            return JSONResponse({"detail": str(exc)}, status_code=409)
        request.state.variant = slot.name
        texts = body.all_texts()
        started = time.perf_counter()
        try:
            answer = await slot.batcher.submit(texts, body.k, body.ef, body.exclusions())
        except QueueFullError as exc:
            metrics.rejected.labels(variant=slot.name).inc()
            return JSONResponse({"detail": str(exc)}, status_code=429, headers={"Retry-After": str(exc.retry_after_s)})
        except BatcherStoppedError as exc:
            return JSONResponse({"detail": str(exc)}, status_code=503)
        metrics.stage_seconds.labels(stage="queue", variant=slot.name).observe(answer.queue_wait_s)
        metrics.predicted_texts.labels(variant=slot.name).inc(len(texts))
        # The shadow copy (its uid lists built per label) only when mirroring is on at all.
        mirroring = state.shadow.config.fraction > 0
        if mirroring and slot.name == PRIMARY and request.headers.get("x-shadow") is None:
            state.shadow.offer(
                ShadowRequest(
                    texts,
                    body.k,
                    body.ef,
                    body.exclusions(),
                    ranked(answer.rankings, answer.predictor.bundle.label_uids),
                    time.perf_counter() - started,
                    slot.name,
                )
            )
        return to_response(answer, slot.name, body.k, body.ef or answer.predictor.default_ef)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> Response:
        state: ServingState | None = request.app.state.serving
        if state is None or not state.variants[PRIMARY].ready:
            return JSONResponse({"ready": False}, status_code=503)
        return JSONResponse({"ready": True, "bundle_id": state.variants[PRIMARY].bundle_id})

    @app.get("/info")
    async def info(request: Request) -> Response:
        state: ServingState | None = request.app.state.serving
        if state is None:
            return JSONResponse({"detail": "no bundle loaded yet"}, status_code=503)
        primary = state.variants[PRIMARY].predictor.bundle
        return JSONResponse(
            {
                "service_version": SERVICE_VERSION,
                "bundle_path": str(primary.path),
                "execution_provider": primary.encoder.provider,
                "cpu_priority": request.app.state.cpu_priority,
                "ort_spinning": settings.spinning(),
                "limits": {
                    "max_texts_per_request": settings.max_texts_per_request,
                    "max_text_bytes": settings.max_text_bytes,
                    "max_k": settings.max_k,
                    "max_ef": settings.max_ef,
                },
                "routing": state.describe(),
                "manifest": primary.manifest.model_dump(mode="json"),
            }
        )

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    add_admin_routes(app)
    return app
