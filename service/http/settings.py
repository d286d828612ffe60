"""Server settings from the environment, grouped: every variable starts with ``XMCSERVE_``.

``Settings()`` reads the whole tree; each group is its own ``BaseSettings`` with its own prefix,
so a variable's name is its group's prefix + the field name (``XMCSERVE_MAX_K``,
``XMCSERVE_SHADOW_URL``, ``XMCSERVE_ADMIN_TOKEN``). docs/operations.md has the table of every
variable; ``tests/service/http/test_settings.py`` checks that table against these classes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, FilePath, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings

from engine import BatcherConfig, EncoderOptions, EngineParams, thread_layout
from service.api.limits import LimitSettings, settings_group
from service.rollout import CANDIDATE, PRIMARY
from service.rollout.shadow import ShadowConfig


class BatchingSettings(BaseSettings):
    """The micro-batcher of each variant (defaults measured with bench/serving.py)."""

    model_config = settings_group()

    max_batch_size: int = Field(32, ge=1, description="most texts per micro-batch")
    max_wait_ms: float = Field(
        0.0, ge=0, description="how long a non-full batch waits for more requests (0: take what is queued)"
    )
    max_queue: int = Field(128, ge=1, description="most requests waiting per variant; beyond it 429 + Retry-After")
    batch_workers: int = Field(
        0,
        ge=0,
        description="micro-batches encoded in parallel, each on an encode thread of its own "
        "(0: one per core on CPU, 2 on CUDA)",
    )

    def config(self, workers: int) -> BatcherConfig:
        """The batcher's parameters, with ``batch_workers`` resolved to ``workers``."""
        return BatcherConfig(self.max_batch_size, self.max_wait_ms, self.max_queue, workers)


class RolloutSettings(BaseSettings):
    """The candidate (B) and the share of live traffic it answers."""

    model_config = settings_group()

    candidate_bundle_dir: Path | None = Field(None, description="variant B loaded at start-up (optional)")
    split_b: float = Field(0.0, ge=0.0, le=1.0, description="share of requests routed to B (sticky per X-Request-Key)")
    grafana_url: str | None = Field(
        None, description="Grafana's base URL with the deploy/grafana dashboards; the rollout page links to them"
    )


class ShadowSettings(BaseSettings):
    """Mirroring to a remote shadow (another xmcserve, or anything answering /predict)."""

    model_config = settings_group("SHADOW_")

    url: str | None = Field(None, description="base URL of the shadow; unset: no mirroring")
    fraction: float = Field(0.0, ge=0.0, le=1.0, description="share of A's requests mirrored")
    queue: int = Field(64, ge=1, description="most copies outstanding; more are dropped and counted")
    timeout_ms: float = Field(2000, gt=0, description="a copy not compared this long after A answered is dropped")
    batch_texts: int = Field(
        32, ge=1, description="most texts one shadow call carries (≤ the shadow's XMCSERVE_MAX_TEXTS_PER_REQUEST)"
    )
    log: Path | None = Field(None, description="JSONL comparison log, rotated by size (unset: no log)")
    log_max_bytes: int = Field(10_000_000, ge=1024, description="size at which the log rotates")
    log_backups: int = Field(3, ge=1, description="rotated log files kept")
    log_texts: bool = Field(
        False, description="debugging only: write each mirrored text into the log (otherwise its sha256 prefix only)"
    )

    def config(self) -> ShadowConfig:
        return ShadowConfig(
            fraction=self.fraction if self.url else 0.0,
            queue_size=self.queue,
            timeout_s=self.timeout_ms / 1000,
            batch_texts=self.batch_texts,
            log=self.log,
            log_max_bytes=self.log_max_bytes,
            log_backups=self.log_backups,
            log_texts=self.log_texts,
        )


class LogSettings(BaseSettings):
    """Logs (:mod:`service.observability.logs`); tracing is configured by the standard ``OTEL_*`` variables."""

    model_config = settings_group("LOG_")

    format: Literal["auto", "json", "text"] = Field(
        "auto", description="json (one object a line), text (readable), auto: text on a terminal, else json"
    )
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="lowest level logged")
    access: bool = Field(True, description="one access line per request (route, status, variant, timings)")
    texts: bool = Field(
        False, description="debugging only: put each /predict request's texts in its access line (never otherwise)"
    )

    @field_validator("level", mode="before")
    @classmethod
    def upper_case_level(cls, value):
        return value.upper() if isinstance(value, str) else value


class AdminSettings(BaseSettings):
    """The token-protected /admin/* API."""

    model_config = settings_group("ADMIN_")

    token: SecretStr | None = Field(
        None, description="enables /admin/*; clients send it as X-Admin-Token or Authorization: Bearer"
    )
    bundle_root: Path = Field(
        Path("bundles"),
        validation_alias=AliasChoices("XMCSERVE_BUNDLE_ROOT", "bundle_root"),
        description="admin reloads may only load bundles under this directory",
    )
    append_log_dir: Path | None = Field(
        None,
        validation_alias=AliasChoices("XMCSERVE_APPEND_LOG_DIR", "append_log_dir"),
        description="where appended memory is logged (a log per lineage: a bundle and its compactions, "
        "replayed at load, created by the first append); unset: <bundle dir>.appends/ beside the lineage's "
        "first bundle",
    )

    replay_skip_refused: bool = Field(
        False,
        validation_alias=AliasChoices("XMCSERVE_REPLAY_SKIP_REFUSED", "replay_skip_refused"),
        description="at load, skip a logged append that no longer applies (reported in /info "
        "memory.replay_skipped and xmcserve_replay_skipped_total) instead of refusing the bundle",
    )


class ServerSettings(BaseSettings):
    """The HTTP server (``python -m service.http``): where it listens and the connection limits."""

    model_config = settings_group()

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=1, le=65535, description="port to listen on")
    max_connections: int = Field(
        512, ge=1, description="most open connections and requests in progress; beyond it uvicorn answers 503"
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="a connection whose next request headers do not arrive within this is closed"
    )
    keep_alive_s: int = Field(5, ge=1, description="an idle keep-alive connection is closed after this")
    write_timeout_s: float = Field(
        15.0,
        gt=0,
        description="a response the client stops reading for this long (its send buffer full) is abandoned "
        "and the connection closed, freeing what was buffered",
    )
    max_header_bytes: int = Field(
        16384, ge=1024, description="most bytes of a request's headers (target, names and values); beyond it: 431"
    )
    pipeline_max_requests: int = Field(
        32,
        ge=1,
        description="most requests of one connection parsed ahead of the answer being written (pipelined); "
        "beyond it the connection is not read until answers make room",
    )
    pipeline_max_bytes: int = Field(
        262144,
        ge=1024,
        description="most bytes (headers and bodies) of the requests one connection has parsed ahead of the "
        "answer being written; beyond it the connection is not read until answers make room",
    )
    graceful_shutdown_s: int = Field(
        20, ge=1, description="on SIGTERM, how long requests in progress may finish before the server stops"
    )
    workers: int = Field(
        1,
        ge=1,
        le=256,
        description="server processes on the one port, each a whole server (engine, batchers, event loop) with "
        "one A/B state, one order of appends and one /metrics view between them; a dead one is restarted",
    )
    run_dir: Path | None = Field(
        None,
        description="with XMCSERVE_WORKERS above 1, the directory the workers share (admin changes, metrics); "
        "emptied at start; unset: a new temporary directory",
    )


class Settings(BaseSettings):
    """The whole server configuration: the bundle and its runtime, then one group per concern."""

    model_config = settings_group()

    bundle_dir: Path = Field(Path("bundles/default"), description="bundle served at start-up")
    providers: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="ONNX Runtime provider: auto (CUDA when available, else CPU), cpu, cuda (or fail)"
    )
    intra_op_threads: int = Field(
        0, ge=0, description="ONNX Runtime threads per encoder call (0: the cores shared out over the batch workers)"
    )
    verify_checksums: bool = Field(True, description="sha256-check every bundle file before serving it")
    encoder: Literal["onnx", "null"] = Field(
        "onnx",
        description="what computes a query's vector: onnx (the bundle's encoder), or for benchmarks null "
        "(the bundle's tokenizer, then the vector looked up in XMCSERVE_NULL_VECTORS: everything but the "
        "encoder's model; never for real answers)",
    )
    null_vectors: FilePath | None = Field(
        None,
        description="with XMCSERVE_ENCODER=null, the .npz of the texts' vectors keyed by their token ids "
        "(bench.lib.null_encoder writes it; a text not in it gets its first vector); unset: a deterministic "
        "vector drawn from each text's tokens",
    )

    limits: LimitSettings = Field(default_factory=LimitSettings)
    batching: BatchingSettings = Field(default_factory=BatchingSettings)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    shadow: ShadowSettings = Field(default_factory=ShadowSettings)
    admin: AdminSettings = Field(default_factory=AdminSettings)
    log: LogSettings = Field(default_factory=LogSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)

    @model_validator(mode="after")
    def null_vectors_need_the_null_encoder(self):
        if self.null_vectors is not None and self.encoder != "null":
            raise ValueError(
                f"XMCSERVE_NULL_VECTORS ({self.null_vectors}) is read only with XMCSERVE_ENCODER=null, "
                f"not {self.encoder}"
            )
        return self

    def engine_params(self) -> EngineParams:
        """What the engine is told of these settings: how it loads, verifies and serves bundles."""
        return EngineParams(
            encoder=self.encoder_options(),
            batcher=self.batcher_config(),
            verify_checksums=self.verify_checksums,
            append_log_dir=self.admin.append_log_dir,
            replay_skip_refused=self.admin.replay_skip_refused,
            variants=(PRIMARY, CANDIDATE),
        )

    def thread_layout(self) -> tuple[int, int]:
        """(batch workers, intra-op threads) with the defaults resolved (:func:`thread_layout`)."""
        return thread_layout(self.batching.batch_workers, self.intra_op_threads, self.providers, self.server.workers)

    def batcher_config(self) -> BatcherConfig:
        return self.batching.config(self.thread_layout()[0])

    def encoder_options(self) -> EncoderOptions:
        # Spinning intra-op threads cut single-call latency but keep their cores busy: beside a
        # candidate the two variants' pools would spin against each other.
        return EncoderOptions(
            providers=self.providers,
            intra_op_threads=self.thread_layout()[1],
            allow_spinning=self.rollout.candidate_bundle_dir is None,
            backend=self.encoder,
            # absolute: the vetting child and a group's workers resolve it alike
            null_vectors=self.null_vectors.resolve() if self.null_vectors is not None else None,
        )


GROUPS: dict[str, type[BaseSettings]] = {
    "": Settings,
    "limits": LimitSettings,
    "batching": BatchingSettings,
    "rollout": RolloutSettings,
    "shadow": ShadowSettings,
    "admin": AdminSettings,
    "log": LogSettings,
    "server": ServerSettings,
}


def environment_variables() -> dict[str, str]:
    """Every variable the server reads → its description (the documented table is checked against this)."""
    out = {}
    for cls in GROUPS.values():
        prefix = cls.model_config["env_prefix"]
        for name, field in cls.model_fields.items():
            if isinstance(field.default_factory, type) and issubclass(field.default_factory, BaseSettings):
                continue  # a group, not a variable
            alias = field.validation_alias
            env = alias.choices[0] if isinstance(alias, AliasChoices) else (prefix + name).upper()
            out[env] = field.description or ""
    return out
