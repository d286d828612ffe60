"""Service settings from the environment (prefix ``XMCSERVE_``), e.g. ``XMCSERVE_BUNDLE_DIR``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

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
    allow_spinning: bool = Field(True, description="ONNX Runtime intra-op threads spin while waiting for work")

    max_texts_per_request: int = Field(64, ge=1, description="most texts one /predict may carry")
    max_text_bytes: int = Field(2048, ge=1, description="most UTF-8 bytes per text")
    max_k: int = Field(1000, ge=1, description="largest k a request may ask for")
    max_ef: int = Field(4096, ge=1, description="largest HNSW ef a request may ask for")
    default_k: int = Field(10, ge=1)

    log_level: str = "info"

    def encoder_options(self) -> EncoderOptions:
        return EncoderOptions(
            providers=self.providers,
            intra_op_threads=self.intra_op_threads,
            call_cost_tokens=self.call_cost_tokens,
            max_chunk=self.max_chunk,
            allow_spinning=self.allow_spinning,
        )
