"""FastAPI app factory: ``uvicorn service.http.app:create_app --factory``.

A thin front end over the engine (:class:`engine.Engine`: the variants, their batchers, loading
and swapping bundles, appends, readiness) and the shadow mirror (:mod:`service.rollout`): it
translates HTTP into the engine's calls and its answers and errors into responses.

The lifespan loads and verifies the primary bundle named by ``XMCSERVE_BUNDLE_DIR`` (a bundle
that fails verification stops start-up with the reason), the optional candidate (a bad candidate
is logged and skipped: it never takes the primary down) and the shadow mirror; ``/readyz`` turns
200 once the primary is loaded and warmed.
"""

# No `from __future__ import annotations` here: FastAPI must resolve the locally built
# request model from the endpoint annotation at runtime.
import asyncio
import functools
import logging
import os
import signal
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.routing import request_response

from bundle import BundleError
from engine import (
    BatchAnswer,
    BatcherStoppedError,
    DeadlineExceededError,
    MemoryBusy,
    QueueFullError,
    VariantUnavailable,
)
from service.api.body_guards import decode_body, validation_error
from service.api.docs import add_api_docs
from service.api.front_door import FrontDoorMiddleware
from service.api.schemas import (
    SERVICE_VERSION,
    PredictResponse,
    build_predict_request,
    document_models,
    predict_response_off_loop,
    request_body_openapi,
)
from service.http.admin import add_admin_routes, follow_group, require_admin
from service.http.disconnect import EXTENSION as CLIENT_GONE
from service.http.disconnect import ClientGone
from service.http.group import FOLLOW_INTERVAL_S, START_RETRY_S, Routing, WorkerGroup, alive
from service.http.guards import LoadShed
from service.http.metrics import SAMPLE_INTERVAL_S, Metrics, RequestObserver
from service.http.rollout_page import add_rollout_routes
from service.http.settings import Settings
from service.http.state import ServingState, build_engine, refused_fields
from service.observability.logs import resolved_format
from service.observability.requests import AccessLog
from service.observability.tracing import Tracing
from service.rollout import CANDIDATE, PRIMARY
from service.rollout.live import LiveTraffic
from service.rollout.shadow import ShadowMirror, ShadowRequest, ranked
from service.rollout.shadow_worker import ShadowWorker

log = logging.getLogger("xmcserve")


async def to_response(answer: BatchAnswer, variant: str, k: int) -> Response:
    """The engine's answer as the API's JSON: serialised here, off the loop when large."""
    bundle = answer.predictor.bundle
    return await predict_response_off_loop(bundle.manifest, variant, k, answer.ef, answer.rankings, answer.view)


async def until_disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def answer_unless_gone(request: Request, submitted) -> BatchAnswer | None:
    """The batcher's answer, or None when the client went away first: the request is then
    cancelled, which takes it out of the queue if it has not started (TEI's queue does the same).
    One watcher task a request; the answer is awaited in the request's own task."""
    task = asyncio.current_task()
    watch = asyncio.ensure_future(until_disconnected(request))
    waiting, gone = True, False

    def on_disconnect(watched: asyncio.Future) -> None:
        nonlocal gone
        # a callback scheduled before the answer came must not cancel what the request does next
        if waiting and not watched.cancelled() and watched.exception() is None:
            gone = True
            task.cancel()

    watch.add_done_callback(on_disconnect)
    try:
        return await submitted
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()  # the cancel was ours: the request ends with its 499, not as cancelled
        return None
    finally:
        waiting = False
        watch.cancel()


async def answer_unless_disconnected(client_gone: ClientGone, submitted) -> BatchAnswer | None:
    """:func:`answer_unless_gone` with the server's signal that the client left
    (:mod:`service.http.disconnect`) instead of a watcher task: the request is cancelled from the
    protocol's callback, which takes it out of the queue if it has not started."""
    task = asyncio.current_task()
    gone = False

    def on_gone() -> None:
        nonlocal gone
        gone = True
        task.cancel()

    client_gone.add(on_gone)
    try:
        return await submitted
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()  # the cancel was ours: the request ends with its 499, not as cancelled
        return None
    finally:
        client_gone.discard(on_gone)  # called back no more once the answer (or the error) is in


def build_shadow(settings: Settings, metrics: Metrics) -> ShadowMirror:
    """The mirror to ``XMCSERVE_SHADOW_URL`` (off without one) and its worker process."""
    config, url = settings.shadow.config(), settings.shadow.url or ""
    return ShadowMirror(config, metrics, url, ShadowWorker(config, url))


def least_wait(app: FastAPI) -> float | None:
    """The shortest expected queue wait of the variants that can answer (None before start-up)."""
    state: ServingState | None = app.state.serving
    return state.engine.expected_wait_s() if state is not None else None


async def follow_changes(state: ServingState) -> None:
    """A group's worker: apply the admin changes the other workers make, as they make them. One
    that cannot be applied stops this worker (SIGTERM: it drains and exits), and the supervisor
    starts a new one, which loads the state the whole admin log leaves before it serves."""
    while True:
        await asyncio.sleep(FOLLOW_INTERVAL_S)
        try:
            await follow_group(state)
        except Exception:
            log.critical("stopping this worker: it could not apply the group's admin change", exc_info=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if state.group.failed is not None:  # reported by the group's follow (its log line, its answer)
            log.critical("stopping this worker: it could not apply the group's admin change %s", state.group.failed)
            os.kill(os.getpid(), signal.SIGTERM)
            return


async def install_routing(state: ServingState, routing: Routing, logged_candidate: bool = False) -> None:
    """Load the bundles ``routing`` names into their slots: A, A's previous and B, then the split
    and the shadow share. A start fails without A, and without a B that the group's admin log
    named (``logged_candidate``: the others serve it, so a worker without it would split traffic
    differently); the settings' own B (as ever) and A's previous are served without when refused:
    what this worker answers is the group's, only its rollback target is missing.

    Each is vetted first in the memory-capped child a reload uses: a bundle that would crash the
    loader, or make it allocate without bound (a compressed file that inflates past the cap),
    costs that child, not this process, which in a group stays up serving beside the others
    (and a supervisor restarting a worker that crashes at start would crash it again and again).
    A group vets each bundle once for all its workers: the others wait for that child's verdict.

    A load that finds its lineage's append log held past the read wait (another worker's writer:
    a brief hold, not a refusal) is tried again for a while (:attr:`ServingState.busy_retry`)
    before it fails the start, for any of the three: it is no verdict on the bundle, and a worker
    that went without a bundle the others serve would answer unlike them."""
    engine, busy = state.engine, state.busy_retry
    try:
        primary = await engine.load(Path(routing.primary), busy=busy)
    except BundleError as exc:
        log.error(
            "bundle %s refused, not starting: %s",
            routing.primary,
            exc,
            extra=refused_fields(PRIMARY, Path(routing.primary), exc),
        )
        raise
    if routing.previous is not None:
        try:
            previous = await engine.load(Path(routing.previous), busy=busy)
            state.install(PRIMARY, previous, routing.previous, at_start=True)
        except BundleError as exc:
            log.error(
                "A's previous bundle refused, serving with no rollback target: %s",
                exc,
                extra=refused_fields(PRIMARY, Path(routing.previous), exc),
            )
    state.install(PRIMARY, primary, routing.primary, at_start=True)  # the previous one, if any, becomes A's previous
    if routing.candidate is not None:
        try:
            # one from the log was vetted by the worker that reloaded it: once a group, as below
            candidate = await engine.load(Path(routing.candidate), busy=busy)
            state.install(CANDIDATE, candidate, routing.candidate, at_start=True)
        except BundleError as exc:
            log.error(
                "candidate bundle refused, %s: %s",
                "not starting" if logged_candidate else "serving A only",
                exc,
                extra=refused_fields(CANDIDATE, Path(routing.candidate), exc),
            )
            if logged_candidate:
                raise
    engine.set_split(routing.split_b)
    if routing.shadow_fraction is not None and state.shadow is not None:
        state.shadow.set_fraction(routing.shadow_fraction)


async def sample_gauges(metrics: Metrics) -> None:
    while True:
        metrics.sample_tracked()
        await asyncio.sleep(SAMPLE_INTERVAL_S)


def create_app(
    settings: Settings | None = None, tracing: Tracing | None = None, group: WorkerGroup | None = None
) -> FastAPI:
    """``tracing``: None reads the ``OTEL_*`` environment (off unless an exporter is configured).
    ``group``: the worker processes this one serves beside (:mod:`service.http.group`); None for a
    server of one process."""
    settings = settings or Settings()
    tracing = tracing if tracing is not None else Tracing.from_environment("xmcserve")
    metrics = Metrics(group.metrics_dir if group is not None else None)
    PredictRequest = build_predict_request(settings.limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine = build_engine(settings, metrics, group)
        for name in engine.variants:
            metrics.track(metrics.queue_depth.labels(variant=name), lambda name=name: engine.queue_depth(name))
            in_flight = metrics.batches_in_flight.labels(variant=name)
            metrics.track(in_flight, lambda name=name: engine.in_flight_batches(name))
            # counters exported at 0 from the start, so a rate() has a series before the first event
            metrics.rejected.labels(variant=name)
            metrics.predicted_texts.labels(variant=name)
            metrics.start_at_zero(name)
        live = LiveTraffic(metrics.merged(metrics.request_seconds))
        state = ServingState(settings, metrics, engine, live=live, group=group)
        state.shadow = build_shadow(settings, metrics)
        # sources are absolute: /admin/state turns them into paths /admin/reload takes
        candidate_dir = settings.rollout.candidate_bundle_dir
        start = Routing(
            primary=str(settings.bundle_dir.resolve()),
            candidate=str(candidate_dir.resolve()) if candidate_dir else None,
            split_b=settings.rollout.split_b,
        )
        try:
            # a group's worker: the state the admin changes so far leave (none for the first), then
            # the changes logged while it loaded, before it says how far it got
            routing = start.replay(group.take_log()) if group is not None else start
            await install_routing(state, routing, logged_candidate=routing.candidate != start.candidate)
            if group is not None:
                await follow_group(state)
        except Exception:
            if group is not None:  # the supervisor restarts a worker at once: not in a busy loop
                log.critical("worker %d cannot start; exiting in %.0f s", os.getpid(), START_RETRY_S)
                await asyncio.sleep(START_RETRY_S)
            raise
        background = [asyncio.create_task(state.live.run())]  # the rollout page's live figures per variant
        if group is not None:
            metrics.forget_dead(alive)  # a killed worker's gauges (this one may be its replacement)
            group.acknowledge()  # then the others' changes as they make them
            background += [asyncio.create_task(follow_changes(state)), asyncio.create_task(sample_gauges(metrics))]
        engine.start()
        state.shadow.start()
        app.state.serving = state
        predictor = engine.predictor(PRIMARY)
        log.info(
            "serving bundle %s on %s",
            predictor.bundle.bundle_id,
            predictor.bundle.encoder.provider,
            extra={"event": "serving", "bundle_id": predictor.bundle.bundle_id, "tracing": tracing.enabled},
        )
        if state.shadow.target:
            log.info(
                "mirroring %.0f%% of A's requests to shadow %s",
                100 * state.shadow.config.fraction,
                state.shadow.target,
                extra={
                    "event": "shadow_configured",
                    "target": state.shadow.target,
                    "fraction": state.shadow.config.fraction,
                },
            )
        yield
        queued = sum(engine.queue_depth(name) for name in engine.variants)
        log.info("shutting down: draining %d queued requests", queued, extra={"event": "shutdown", "queued": queued})
        for task in background:
            task.cancel()
        if group is not None:
            group.withdraw()  # admin calls stop waiting for this worker
        await state.shadow.stop()
        await engine.stop()
        metrics.retire()
        app.state.serving = None
        tracing.shutdown()
        log.info("stopped", extra={"event": "stopped"})

    app = FastAPI(
        title="xmcserve",
        version=SERVICE_VERSION,
        description="Extreme multi-label classification: the k most relevant labels for a short text.",
        lifespan=lifespan,
        exception_handlers={RequestValidationError: validation_error},
        docs_url=None,  # served by add_api_docs from local assets, not a CDN
        redoc_url=None,
        # Spans come from Tracing (the OpenTelemetry instrumentation, when configured): FastAPI's
        # own would double them, and its per-request check of the global providers is not free.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.serving = None
    limits = settings.limits
    paths = functools.cache(lambda: frozenset(route.path for route in app.routes))
    app.add_middleware(
        FrontDoorMiddleware,
        max_body_bytes=limits.max_body_bytes,
        body_timeout_s=limits.body_timeout_s,
        access_log=AccessLog(readable=resolved_format(settings.log.format) == "text") if settings.log.access else None,
        tracing=tracing,
        shed=LoadShed(
            expected_wait=lambda: least_wait(app),
            deadline_s=limits.request_timeout_ms / 1000,
            on_shed=lambda: metrics.dropped_requests.labels(variant="-", reason="deadline").inc(),
        ),
        observer=RequestObserver(metrics, endpoints=paths),  # counts refusals too
    )
    tracing.instrument(app)  # the instrumentation's span wraps everything, the middlewares above included

    @app.post("/predict", response_model=PredictResponse, openapi_extra=request_body_openapi(PredictRequest))
    async def predict(request: Request) -> Response:
        body = decode_body(PredictRequest, await request.body(), request.headers.get("content-type"))
        state: ServingState | None = request.app.state.serving
        if state is None:
            return JSONResponse({"detail": "no bundle loaded yet"}, status_code=503)
        if body.variant is not None:
            try:
                require_admin(request)  # forcing the unvetted candidate is an operator's decision
            except HTTPException as exc:
                return JSONResponse({"detail": f"forcing a variant needs the admin token: {exc.detail}"}, 403)
        engine = state.engine
        try:
            variant = engine.choose(request.headers.get("x-request-key"), body.variant)
        except VariantUnavailable as exc:
            return JSONResponse({"detail": str(exc)}, status_code=409)
        texts = body.all_texts()
        request.state.variant = variant
        request.state.bundle_id = engine.bundle_id(variant)
        request.state.texts, request.state.k = len(texts), body.k
        if settings.log.texts:
            request.state.request_texts = texts
        started = time.perf_counter()
        timeout_s = (body.timeout_ms or settings.limits.request_timeout_ms) / 1000
        submitted = engine.predict(variant, texts, body.k, body.ef, body.exclude, timeout_s)
        client_gone = request.scope.get("extensions", {}).get(CLIENT_GONE)
        try:
            if client_gone is not None:  # the server's own signal, no watcher task
                answer = await answer_unless_disconnected(client_gone, submitted)
            else:
                answer = await answer_unless_gone(request, submitted)
        except (QueueFullError, DeadlineExceededError, MemoryBusy) as exc:  # MemoryBusy: a group's log held
            if isinstance(exc, QueueFullError):
                metrics.rejected.labels(variant=variant).inc()
            status = 429 if isinstance(exc, QueueFullError) else 503
            return JSONResponse({"detail": str(exc)}, status, headers={"Retry-After": str(exc.retry_after_s)})
        except BatcherStoppedError as exc:
            return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": "1"})
        if answer is None:  # nobody is listening; 499 is what nginx logs for it
            return Response(status_code=499)
        resumed = time.perf_counter()
        metrics.child(metrics.stage_seconds, "queue", variant).observe(answer.queue_wait_s)
        request.state.queue_ms = round(answer.queue_wait_s * 1000, 3)
        request.state.bundle_id = answer.predictor.bundle.bundle_id  # the bundle that answered
        metrics.child(metrics.predicted_texts, variant).inc(len(texts))
        # The shadow copy (its uid lists built per label) only when mirroring is on at all.
        mirroring = state.shadow.config.fraction > 0
        if mirroring and variant == PRIMARY and request.headers.get("x-shadow") is None:
            state.shadow.offer(
                ShadowRequest(
                    texts,
                    body.k,
                    body.ef,
                    body.exclusions(),
                    ranked(answer.rankings, answer.view.label_uids),
                    time.perf_counter() - started,
                    variant,
                    request.state.request_id,
                    tracing.headers().get("traceparent"),
                )
            )
        response = await to_response(answer, variant, body.k)
        tracing.batch_answered(answer, resumed, variant)  # the request's queue wait, batch stages and respond
        return response

    # The endpoint reads its own body and returns its own Response, so FastAPI's handler around it
    # (solving the dependencies of a `request` parameter, which builds the query parameters and
    # cookies, and two exit stacks) was only work on the event loop per request: the route keeps
    # FastAPI's matching, its scope["route"] and its documentation, and runs the endpoint as
    # Starlette runs one (its errors rendered by the same exception handlers).
    predict_route = next(r for r in app.router.routes if isinstance(r, APIRoute) and r.path == "/predict")
    predict_route.app = request_response(predict)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> Response:
        state: ServingState | None = request.app.state.serving
        if state is None or not state.engine.ready:
            return JSONResponse({"ready": False}, status_code=503)
        return JSONResponse({"ready": True, "bundle_id": state.engine.bundle_id(PRIMARY)})

    @app.get("/info")
    async def info(request: Request) -> Response:
        state: ServingState | None = request.app.state.serving
        if state is None:
            return JSONResponse({"detail": "no bundle loaded yet"}, status_code=503)
        primary = state.engine.predictor(PRIMARY).bundle
        return JSONResponse(
            {
                "service_version": SERVICE_VERSION,
                "bundle_path": str(primary.path),
                "execution_provider": primary.encoder.provider,
                "ort_spinning": primary.encoder.options.allow_spinning,
                "limits": settings.limits.model_dump(),
                "routing": state.describe(),
                "worker": state.worker(),
                "manifest": primary.manifest.model_dump(mode="json"),
                "card": primary.card.model_dump(mode="json") if primary.card is not None else None,
            }
        )

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    add_admin_routes(app)
    add_rollout_routes(app)
    document_models(app, PredictRequest)
    add_api_docs(app)
    return app
