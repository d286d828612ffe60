"""Service settings from the environment (prefix ``XMCSERVE_``), e.g. ``XMCSERVE_BUNDLE_DIR``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.cpu_priority import CpuPriority, parse_cpus
from service.encoder import EncoderOptions


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="XMCSERVE_", extra="ignore")

    bundle_dir: Path = Field(Path("bundles/default"), description="bundle served at start-up")
    providers: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="ONNX Runtime execution provider: auto = CUDA when available, else CPU"
    )
    intra_op_threads: int = Field(0, ge=0, description="ONNX Runtime intra-op threads; 0 = one per core")
    verify_checksums: bool = Field(True, description="sha256-check every bundle file before serving it")

    # Micro-batching and ONNX Runtime threading (defaults measured with bench/serving.py).
    max_batch_size: int = Field(32, ge=1, description="most texts per micro-batch")
    max_wait_ms: float = Field(0.0, ge=0, description="how long a non-full batch waits for more requests")
    max_queue: int = Field(128, ge=1, description="most requests waiting; beyond it: 429 with Retry-After")
    batch_workers: int = Field(1, ge=1, description="micro-batches computed in parallel")
    call_cost_tokens: float = Field(
        16.0,
        ge=0,
        description="fixed cost of one ONNX call in token-equivalents; sets how a batch is split "
        "into length-sorted chunks",
    )
    max_chunk: int = Field(64, ge=1, description="most texts in one ONNX call")
    allow_spinning: bool | None = Field(
        None,
        description="ONNX Runtime intra-op threads spin while waiting for work. Unset: spin unless "
        "this server holds a candidate bundle at start-up or runs idle-class — spinning threads "
        "take the cores an in-process shadow or B would compute on",
    )

    max_texts_per_request: int = Field(64, ge=1, description="most texts one /predict may carry")
    max_text_bytes: int = Field(2048, ge=1, description="most UTF-8 bytes per text")
    max_k: int = Field(1000, ge=1, description="largest k a request may ask for")
    max_ef: int = Field(4096, ge=1, description="largest HNSW ef a request may ask for")
    default_k: int = Field(10, ge=1)

    # A/B, shadow and admin (see README, "Shipping a new bundle").
    bundle_root: Path = Field(Path("bundles"), description="admin reloads may only load bundles under this dir")
    candidate_bundle_dir: Path | None = Field(None, description="variant B loaded at start-up (optional)")
    split_b: float = Field(0.0, ge=0.0, le=1.0, description="share of requests routed to B (sticky per key)")
    shadow_fraction: float = Field(0.0, ge=0.0, le=1.0, description="share of A's requests mirrored to the shadow")
    shadow_url: str | None = Field(None, description="remote xmcserve as shadow; default: the in-process B")
    shadow_queue: int = Field(64, ge=1, description="most mirrored requests waiting; more are dropped")
    shadow_timeout_ms: float = Field(2000, gt=0, description="a later shadow answer is dropped")
    shadow_workers: int = Field(4, ge=1, description="shadow calls in flight at once")
    shadow_batch_texts: int = Field(
        32, ge=1, description="most texts one shadow call carries (≤ a remote shadow's MAX_TEXTS_PER_REQUEST)"
    )
    shadow_batch_wait_ms: float = Field(
        100,
        ge=0,
        description="how long a shadow call waits for more copies: each call streams B's weights once, "
        "and that memory traffic slows A even from other cores",
    )
    shadow_cpus: str | None = Field(
        None,
        description="cores the shadow worker process runs on, e.g. '2-3' (Linux): the in-process B's "
        "compute, or a remote shadow's calls and comparisons; unset: the cores this server runs on",
    )
    shadow_yield: bool | None = Field(
        None,
        description="the in-process shadow computes only while this server has no request in flight, "
        "and aborts its ONNX call when one arrives (false: whenever the idle CPU class lets it). "
        "Unset: yield, unless shadow_cpus gives the shadow cores of its own",
    )
    shadow_max_texts_per_s: float = Field(
        0.0,
        ge=0,
        description="most texts per second the in-process shadow starts to compute (0 = no cap): each "
        "of its units can leave A's next request on cold caches",
    )
    shadow_abort_backoff_max_ms: float = Field(
        1000,
        ge=0,
        description="after an in-process shadow unit is aborted by a request, the next waits a back-off "
        "doubling from 10 ms up to this (0 = none); a finished unit clears it",
    )
    shadow_log: Path | None = Field(None, description="JSONL comparison log (rotated by size)")
    shadow_log_max_bytes: int = Field(10_000_000, ge=1024)
    shadow_log_backups: int = Field(3, ge=1, description="rotated files kept (logging rotates only with ≥ 1)")
    admin_token: SecretStr | None = Field(None, description="enables /admin/*; send as X-Admin-Token")

    cpu_priority: CpuPriority = Field(
        "normal",
        description="idle: this server computes only on cores nothing else wants (Linux SCHED_IDLE), "
        "for a shadow server sharing a host with the primary",
    )

    log_level: str = "info"

    @field_validator("shadow_cpus")
    @classmethod
    def _cpu_list(cls, value: str | None) -> str | None:
        parse_cpus(value)  # a malformed list fails at start-up, not in the shadow's child
        return value

    def shadow_yields(self) -> bool:
        """Whether the in-process shadow yields to this server's requests: ``shadow_yield`` when
        set, else only while it shares this server's cores."""
        return self.shadow_yield if self.shadow_yield is not None else not self.shadow_cpus

    def spinning(self) -> bool:
        """Whether ONNX Runtime threads spin: ``allow_spinning`` when set, else on for a lone
        primary (lower tail at high load, bench/results/README.md) and off beside a candidate."""
        if self.cpu_priority == "idle":
            return False  # an idle-class server spinning would only burn the cycles it is given
        if self.allow_spinning is not None:
            return self.allow_spinning
        # A's spinning threads keep the cores B's idle-class lane would compute on: at half of
        # A's peak the lane fell behind (7-89 % of copies compared, none dropped without
        # spinning) and A's p99 with mirroring on read x1.27 instead of x0.97 (bench/results).
        return self.candidate_bundle_dir is None

    def encoder_options(self) -> EncoderOptions:
        return EncoderOptions(
            providers=self.providers,
            intra_op_threads=self.intra_op_threads,
            call_cost_tokens=self.call_cost_tokens,
            max_chunk=self.max_chunk,
            allow_spinning=self.spinning(),
        )
