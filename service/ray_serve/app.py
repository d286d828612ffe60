"""The deployments (encoder, one per shard, ingress) and :func:`build_app`, the Serve builder.

Answers equal the single server's: the ingress asks every shard for the same number of nearest
keys at the same ef as :meth:`~engine.memory.Memory.knn` does, merges them in the same
order (distance, then key id) and ranks them with the same function. The value rows of an RAE
memory travel with the shards' answers, so no process holds all of V.

Failure and load, as the ingress answers them (never a 500, never a hang):

* a part (the encoder or a shard) with no replica that answers before the request's deadline
  (``timeout_ms``, default ``XMCSERVE_REQUEST_TIMEOUT_MS``, bounds the encode and the fan-out)
  → ``503`` with ``Retry-After``, naming the part. Answers are never partial: a result missing a
  shard could silently lack the best labels.
* a call silent past ``attempt_timeout_ms`` (a replica on a lost node, not yet declared dead)
  → hedged: another send while the first runs (and one more after another such wait), the
  first answer wins, hedges at most ``hedge_fraction`` of a part's calls; a replica found lost
  → sent again, for as long as the deadline allows (:mod:`service.ray_serve.calls`).
* every send carries the time left to the request's deadline; a replica drops what expired
  while it queued instead of computing an answer nobody waits for.
* a full queue: the ingress's own (``max_queued_requests``, answered by Serve's proxy) or a
  part's → ``503`` with ``Retry-After``.
* a part whose replica serves another bundle than the ingress's (every answer carries the
  bundle id; during a rolling update some replicas are on each) → sent again, so that a replica
  on the ingress's bundle answers; ``503`` when none does before the deadline.
"""

# No `from __future__ import annotations`: FastAPI must see the locally built request model.
import asyncio
import logging
import time
from pathlib import Path
from typing import Literal

import numpy as np
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, FilePath, model_validator
from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.util import metrics as ray_metrics

from bundle import BundleError, read_manifest, shard_list
from engine import EncoderOptions, Ranking
from engine.distributed import Coordinator, EncoderPart, ShardAnswer, ShardPart, ShardQuery
from service.api.body_guards import validation_error
from service.api.docs import add_api_docs
from service.api.front_door import FrontDoorMiddleware
from service.api.limits import LimitSettings
from service.api.schemas import SERVICE_VERSION, PredictResponse, build_predict_request, predict_response_off_loop
from service.observability.logs import REQUEST_ID
from service.observability.requests import AccessLog
from service.observability.tracing import Tracing
from service.ray_serve.calls import HEDGE_FRACTION, CallContext, PartCaller, PartUnavailable, split_expired, time_left

log = logging.getLogger("xmcserve.ray")

# /readyz runs a real query through every part, answered within this.
READY_TIMEOUT_S = 2.0
RETRY_AFTER_S = 1
# Serve replaces a replica whose check_health (a real encode or search) fails or hangs. A
# replica being stopped gets 5 s to finish its calls (Serve's default is 20): every call is
# bounded by its request's deadline, XMCSERVE_REQUEST_TIMEOUT_MS (1 s by default).
LIFECYCLE = {"health_check_period_s": 10, "health_check_timeout_s": 30, "graceful_shutdown_timeout_s": 5}
STAGE_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]


class AppArgs(BaseModel):
    """The arguments of :func:`build_app`: ``serve run service.ray_serve:build_app key=value``
    or ``args:`` in a Serve config. Replica counts, queue limits and resources of each
    deployment can also be overridden by name in the config's ``deployments:`` section."""

    model_config = ConfigDict(extra="forbid")

    bundle_dir: Path = Field(description="the bundle (sharded or not), at this path on every node")
    encoder_replicas: int = Field(1, ge=1, description="replicas of the encoder")
    shard_replicas: int = Field(1, ge=1, description="replicas of each shard (2+: a shard outlives a lost node)")
    ingress_replicas: int = Field(1, ge=1, description="replicas of the HTTP ingress")
    encoder_cpus: float = Field(1.0, gt=0, description="CPUs per encoder replica (its ONNX Runtime threads)")
    shard_cpus: float = Field(1.0, ge=0, description="CPUs per shard replica (its index search threads)")
    ingress_cpus: float = Field(0.5, ge=0, description="CPUs per ingress replica")
    shard_resources: dict[str, float] = Field(
        default_factory=dict,
        description='custom Ray resources per shard replica, e.g. {"shard_host": 1} to keep shards on the nodes '
        "that offer it (a KubeRay worker group with rayStartParams resources)",
    )
    ingress_max_ongoing_requests: int = Field(64, ge=1, description="requests one ingress replica works on at once")
    ingress_max_queued_requests: int = Field(
        256, ge=1, description="requests waiting for an ingress replica; beyond it Serve's proxy answers 503"
    )
    max_batch_texts: int = Field(64, ge=1, description="most texts per encoder batch and queries per shard batch")
    batch_wait_ms: float = Field(
        0.0,
        ge=0,
        description="how long a batch waits for more requests (0: take what is queued; under load requests "
        "queue while a batch computes, so batches still fill)",
    )
    shard_max_replicas_per_node: int | None = Field(
        None, ge=1, description="most replicas of one shard on one node (1: each replica on its own node)"
    )
    attempt_timeout_ms: float = Field(
        300.0,
        gt=0,
        description="a call to the encoder or a shard unanswered this long is hedged: sent once more while the "
        "first runs, the first answer wins (a replica on a lost node is silent until the node is declared dead)",
    )
    hedge_fraction: float = Field(
        HEDGE_FRACTION,
        ge=0,
        le=1,
        description="hedges the ingress may send to a part, as a share of its calls to it (with up to 10 saved "
        "for a burst): under overload hedging does not multiply the load",
    )
    verify: bool = Field(True, description="check the sha256 of every bundle file a replica reads")
    encoder: Literal["onnx", "null"] = Field(
        "onnx",
        description="the encoder replicas' backend: onnx, or for benchmarks null (the bundle's tokenizer, then "
        "the vector looked up in null_vectors), as the single server's XMCSERVE_ENCODER",
    )
    null_vectors: FilePath | None = Field(
        None, description="with encoder=null, its vector file, at this path on every node (unset: drawn vectors)"
    )

    @model_validator(mode="after")
    def null_vectors_need_the_null_encoder(self):
        if self.null_vectors is not None and self.encoder != "null":
            raise ValueError(f"null_vectors ({self.null_vectors}) is read only with encoder=null, not {self.encoder}")
        return self


def request_ids(contexts: list[CallContext | None]) -> list[str]:
    return [c.request_id for c in contexts if c is not None]


def threads_for(cpus: float) -> int:
    return max(1, int(cpus))


class ExpiredWork:
    """Requests a replica dropped because their deadline passed while they queued."""

    def __init__(self, part: str):
        self.counter = ray_metrics.Counter(
            "xmcserve_expired_work_total",
            description="requests a replica dropped unstarted, their deadline passed",
            tag_keys=("part",),
        )
        self.part = part

    def inc(self, count: int) -> None:
        self.counter.inc(count, tags={"part": self.part})


@serve.deployment(name="encoder", max_ongoing_requests=128, max_queued_requests=512, **LIFECYCLE)
class Encoder:
    """The bundle's encoder: a request's texts → unit vectors, requests batched together."""

    def __init__(
        self,
        bundle_dir: str,
        cpus: float,
        max_batch_texts: int,
        batch_wait_s: float,
        verify: bool,
        backend: str = "onnx",
        null_vectors: str | None = None,
    ):
        # not spinning: the cores are shared with the other replicas, which spinning threads starve
        options = EncoderOptions(
            intra_op_threads=threads_for(cpus),
            allow_spinning=False,
            backend=backend,
            null_vectors=Path(null_vectors) if null_vectors else None,
        )
        self.encoder = EncoderPart(bundle_dir, options, verify)
        self.bundle_id = self.encoder.bundle_id
        self.tracing = Tracing.from_environment("xmcserve-encoder")
        self.encode_batch.set_max_batch_size(max_batch_texts)
        self.encode_batch.set_batch_wait_timeout_s(batch_wait_s)
        self.expired = ExpiredWork("encoder")

    async def encode(
        self, texts: list[str], timeout_s: float, context: CallContext | None = None
    ) -> tuple[str, np.ndarray | None]:
        """The texts' vectors, stamped with the bundle id; None when ``timeout_s`` (the caller's
        time left) passed before their batch ran. ``context``: the request's id and trace."""
        return await self.encode_batch((texts, time.monotonic() + timeout_s), context)

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.0, batch_size_fn=lambda r: sum(len(t) for t, _ in r))
    async def encode_batch(
        self, requests: list[tuple[list[str], float]], contexts: list[CallContext | None]
    ) -> list[tuple[str, np.ndarray | None]]:
        """Each live request's vectors, stamped with the bundle id; expired ones get None."""
        positions, live = split_expired(requests, time.monotonic())
        out: list[tuple[str, np.ndarray | None]] = [(self.bundle_id, None)] * len(requests)
        if len(live) < len(requests):
            self.expired.inc(len(requests) - len(live))
        if log.isEnabledFor(logging.DEBUG):  # the id list is built per batch: only when it is logged
            log.debug(
                "encode: %d requests %s, %d expired", len(requests), request_ids(contexts), len(requests) - len(live)
            )
        if live:
            with self.tracing.part_span("encode", [c.trace_headers for c in contexts if c is not None]):
                vectors = await asyncio.to_thread(self.encoder.encode, [text for texts in live for text in texts])
            for i, part in zip(positions, np.split(vectors, np.cumsum([len(t) for t in live])[:-1]), strict=True):
                out[i] = (self.bundle_id, part)
        return out

    def check_health(self) -> None:
        """A real encode: finite unit vectors, or the replica is replaced."""
        self.encoder.check()


@serve.deployment(max_ongoing_requests=128, max_queued_requests=512, **LIFECYCLE)
class Shard:
    """One shard of the bundle: the nearest keys of a batch of queries, with their value rows."""

    def __init__(self, bundle_dir: str, number: int, cpus: float, max_batch: int, batch_wait_s: float, verify: bool):
        self.shard = ShardPart(bundle_dir, number, verify, search_threads=threads_for(cpus))
        self.bundle_id = self.shard.bundle_id
        self.number = number
        self.tracing = Tracing.from_environment("xmcserve-shard")
        self.search_batch.set_max_batch_size(max_batch)
        self.search_batch.set_batch_wait_timeout_s(batch_wait_s)
        self.expired = ExpiredWork(f"shard-{number}")

    async def search(
        self, query: ShardQuery, timeout_s: float, context: CallContext | None = None
    ) -> tuple[str, ShardAnswer | None]:
        """The query's nearest keys, stamped with the bundle id; None when ``timeout_s`` (the
        caller's time left) passed before its batch ran. ``context``: the request's id and trace."""
        return await self.search_batch((query, time.monotonic() + timeout_s), context)

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.0, batch_size_fn=lambda r: sum(len(q.vectors) for q, _ in r))
    async def search_batch(
        self, requests: list[tuple[ShardQuery, float]], contexts: list[CallContext | None]
    ) -> list[tuple[str, ShardAnswer | None]]:
        """Each live request's nearest keys (as if searched alone), stamped with the bundle id;
        expired ones get None."""
        positions, live = split_expired(requests, time.monotonic())
        out: list[tuple[str, ShardAnswer | None]] = [(self.bundle_id, None)] * len(requests)
        if len(live) < len(requests):
            self.expired.inc(len(requests) - len(live))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("shard %d: %d requests %s", self.number, len(requests), request_ids(contexts))
        if live:
            traces = [c.trace_headers for c in contexts if c is not None]
            with self.tracing.part_span("search", traces, {"xmcserve.shard": self.number}):
                answers = await asyncio.to_thread(self.shard.search_many, live)
            for i, answer in zip(positions, answers, strict=True):
                out[i] = (self.bundle_id, answer)
        return out

    def check_health(self) -> None:
        """A real query (this shard's first key's own vector) answered with keys of this shard."""
        self.shard.check()


class IngressMetrics:
    """Series exported through Ray's metrics agent on every node's metrics export port, where
    Ray prefixes them with ``ray_`` (``ray_xmcserve_predictions_total``…), beside Serve's own
    per-deployment request counts and latencies."""

    def __init__(self) -> None:
        self.predictions = ray_metrics.Counter(
            "xmcserve_predictions_total", description="/predict answers by outcome", tag_keys=("outcome",)
        )
        self.part_failures = ray_metrics.Counter(
            "xmcserve_part_failures_total",
            description="calls to the encoder or a shard that failed, by part and reason",
            tag_keys=("part", "reason"),
        )
        self.stage_seconds = ray_metrics.Histogram(
            "xmcserve_stage_seconds",
            description="seconds per stage of a /predict (encode, fanout, rank)",
            boundaries=STAGE_BUCKETS_S,
            tag_keys=("stage",),
        )


@serve.deployment(name="ingress", max_ongoing_requests=64, max_queued_requests=256, **LIFECYCLE)
@serve.ingress()
class Ingress:
    """The HTTP API of the single server over the encoder and the shards."""

    def __init__(
        self,
        encoder: DeploymentHandle,
        shards: list[DeploymentHandle],
        bundle_dir: str,
        verify: bool,
        attempt_timeout_s: float,
        max_batch_texts: int,
        hedge_fraction: float = HEDGE_FRACTION,
    ):
        self.coordinator = Coordinator(bundle_dir, verify)
        self.manifest = self.coordinator.manifest
        self.encoder, self.shards = encoder, shards
        self.bundle_dir = bundle_dir
        self.max_batch_texts = max_batch_texts
        self.limits = LimitSettings()
        self.metrics = IngressMetrics()
        self.caller = PartCaller(attempt_timeout_s, self.count_failure, hedge_fraction)
        self.tracing = Tracing.from_environment("xmcserve-ray-ingress")

    def count_failure(self, part: str, reason: str) -> None:
        self.metrics.part_failures.inc(tags={"part": part, "reason": reason})

    def __serve_build_asgi_app__(self) -> FastAPI:
        return ingress_app(self)

    async def predict(
        self,
        texts: list[str],
        k: int,
        ef: int | None,
        exclude: list[set[int]],
        timeout_s: float,
        context: CallContext | None = None,
    ) -> tuple[list[Ranking], int]:
        """Rankings and the ef they ran at; :class:`PartUnavailable` past the deadline. A request
        larger than a batch goes in batch-sized pieces, side by side. ``context`` goes with every
        part call (request id, trace headers)."""
        deadline = time.monotonic() + timeout_s
        size = self.max_batch_texts
        pieces = await asyncio.gather(
            *(
                self.predict_piece(texts[i : i + size], k, ef, exclude[i : i + size], deadline, context)
                for i in range(0, len(texts), size)
            )
        )
        return [ranking for rankings, _ in pieces for ranking in rankings], max(ef for _, ef in pieces)

    async def predict_piece(
        self,
        texts: list[str],
        k: int,
        ef: int | None,
        exclude: list[set[int]],
        deadline: float,
        context: CallContext | None = None,
    ) -> tuple[list[Ranking], int]:
        """Encode, ask every shard the coordinator's query, merge and rank their answers."""
        started = time.perf_counter()
        vectors = await self.ask(
            "encoder", lambda: self.encoder.encode.remote(texts, time_left(deadline), context), deadline
        )
        encoded = time.perf_counter()
        query = self.coordinator.query(texts, vectors, k, ef, exclude)
        answers = await self.fan_out(query, deadline, context)
        searched = time.perf_counter()
        rankings, ran_at = self.coordinator.rank(query, answers, k, exclude)
        for stage, seconds in (("encode", encoded - started), ("fanout", searched - encoded)):
            self.metrics.stage_seconds.observe(seconds, tags={"stage": stage})
        self.metrics.stage_seconds.observe(time.perf_counter() - searched, tags={"stage": "rank"})
        return rankings, ran_at

    async def fan_out(
        self, query: ShardQuery, deadline: float, context: CallContext | None = None
    ) -> list[ShardAnswer]:
        calls = [
            asyncio.ensure_future(
                self.ask(
                    f"shard-{i}", lambda shard=shard: shard.search.remote(query, time_left(deadline), context), deadline
                )
            )
            for i, shard in enumerate(self.shards)
        ]
        try:
            return await asyncio.gather(*calls)
        finally:  # one shard failed or the client left: the others' work is wasted, stop it
            for call in calls:
                call.cancel()

    async def ask(self, part: str, send, deadline: float):
        """A part's answer (:class:`~service.ray_serve.calls.PartCaller`) from a replica on this
        ingress's bundle: replicas load the bundle from a path, and one restarted after the files
        there changed (a rolling update) serves another; its answer is sent again, to another
        replica."""
        bundle_id = self.manifest.bundle_id
        accept = lambda answer: answer[0] == bundle_id  # noqa: E731
        _, answer = await self.caller.call(part, send, deadline, accept, f"another bundle than {bundle_id}")
        if answer is None:  # the replica found the deadline passed before it started: so has ours
            self.count_failure(part, "timeout")
            raise PartUnavailable(f"no answer from {part} within the request's deadline")
        return answer

    def describe(self) -> dict:
        return {
            "service_version": SERVICE_VERSION,
            "serving": "ray_serve",
            "bundle_path": self.bundle_dir,
            "shards": len(self.shards),
            "limits": self.limits.model_dump(),
            "manifest": self.manifest.model_dump(mode="json"),
        }


def unavailable(exc: PartUnavailable) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})


def ingress_app(ingress: Ingress) -> FastAPI:
    """The routes of the single server's API that a stateless, sharded deployment has."""
    limits = ingress.limits
    PredictRequest = build_predict_request(limits)
    app = FastAPI(
        title="xmcserve (Ray Serve)",
        version=SERVICE_VERSION,
        description="Extreme multi-label classification: the k most relevant labels for a short text.",
        exception_handlers={RequestValidationError: validation_error},
        docs_url=None,  # served by add_api_docs from local assets, not a CDN
        redoc_url=None,
    )
    add_api_docs(app)
    # Ray's workers log through Ray's own handlers: the access line takes their format
    app.add_middleware(
        FrontDoorMiddleware,
        max_body_bytes=limits.max_body_bytes,
        body_timeout_s=limits.body_timeout_s,
        access_log=AccessLog(),
        tracing=ingress.tracing,
    )
    ingress.tracing.instrument(app)

    @app.post("/predict", response_model=PredictResponse)
    async def predict(body: PredictRequest, request: Request) -> Response:  # type: ignore[valid-type]
        texts = body.all_texts()
        request.state.variant, request.state.bundle_id = "A", ingress.manifest.bundle_id
        request.state.texts, request.state.k = len(texts), body.k
        if body.variant == "B":
            return JSONResponse({"detail": "this deployment serves one bundle (A); no candidate B"}, status_code=409)
        exclude = ingress.coordinator.excluded(body.exclude, len(texts))
        timeout_s = (body.timeout_ms or limits.request_timeout_ms) / 1000
        context = CallContext(REQUEST_ID.get(), ingress.tracing.headers())
        try:
            rankings, ef = await ingress.predict(texts, body.k, body.ef, exclude, timeout_s, context)
        except PartUnavailable as exc:
            ingress.metrics.predictions.inc(tags={"outcome": "unavailable"})
            return unavailable(exc)
        ingress.metrics.predictions.inc(tags={"outcome": "ok"})
        return await predict_response_off_loop(ingress.manifest, "A", body.k, ef, rankings, ingress.coordinator.view)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        """Ready when a real query goes through the encoder and every shard."""
        try:
            await ingress.predict(["readiness probe"], 1, None, [set()], READY_TIMEOUT_S)
        except PartUnavailable as exc:
            return JSONResponse({"ready": False, "detail": str(exc)}, status_code=503)
        return JSONResponse({"ready": True, "bundle_id": ingress.manifest.bundle_id})

    @app.get("/info")
    async def info() -> dict:
        return ingress.describe()

    return app


def build_app(args: dict) -> serve.Application:
    """The application for one bundle: ``serve run service.ray_serve:build_app bundle_dir=…``."""
    params = AppArgs.model_validate(args)
    bundle = str(params.bundle_dir.resolve())
    try:
        manifest = read_manifest(Path(bundle))
    except BundleError as exc:
        raise ValueError(str(exc)) from None
    batch_wait_s = params.batch_wait_ms / 1000
    encoder = Encoder.options(
        num_replicas=params.encoder_replicas, ray_actor_options={"num_cpus": params.encoder_cpus}
    ).bind(
        bundle,
        params.encoder_cpus,
        params.max_batch_texts,
        batch_wait_s,
        params.verify,
        params.encoder,
        str(params.null_vectors.resolve()) if params.null_vectors else None,
    )
    per_node = params.shard_max_replicas_per_node
    placement = {"max_replicas_per_node": per_node} if per_node else {}
    shards = [
        Shard.options(
            name=f"shard-{i}",
            num_replicas=params.shard_replicas,
            ray_actor_options={"num_cpus": params.shard_cpus, "resources": params.shard_resources},
            **placement,
        ).bind(bundle, i, params.shard_cpus, params.max_batch_texts, batch_wait_s, params.verify)
        for i in range(len(shard_list(manifest)))
    ]
    return Ingress.options(
        num_replicas=params.ingress_replicas,
        ray_actor_options={"num_cpus": params.ingress_cpus},
        max_ongoing_requests=params.ingress_max_ongoing_requests,
        max_queued_requests=params.ingress_max_queued_requests,
    ).bind(
        encoder,
        shards,
        bundle,
        params.verify,
        params.attempt_timeout_ms / 1000,
        params.max_batch_texts,
        params.hedge_fraction,
    )
