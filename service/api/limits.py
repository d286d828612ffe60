"""What one request may ask of any front end, from the environment (``XMCSERVE_MAX_K``…):
anything beyond is a 422 before any work, and the request models
(:mod:`service.api.schemas`) are built from these limits, so the OpenAPI schema documents them.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "XMCSERVE_"


def settings_group(prefix: str = "") -> SettingsConfigDict:
    """The configuration of a settings group whose variables are ``XMCSERVE_<prefix><field>``."""
    return SettingsConfigDict(env_prefix=ENV_PREFIX + prefix, extra="ignore", populate_by_name=True)


class LimitSettings(BaseSettings):
    """What one /predict may ask for; anything beyond is a 422 before any work."""

    model_config = settings_group()

    max_texts_per_request: int = Field(64, ge=1, description="most texts one /predict may carry")
    max_text_bytes: int = Field(2048, ge=1, description="most UTF-8 bytes per text")
    max_k: int = Field(1000, ge=1, description="largest k a request may ask for")
    max_labels_per_response: int = Field(
        10_000, ge=1, description="most labels one /predict may ask for in all (texts x k); 422 beyond"
    )
    max_ef: int = Field(4096, ge=1, description="largest HNSW ef a request may ask for")
    default_k: int = Field(10, ge=1, description="k of a request that gives none")
    max_exclude_per_text: int = Field(1000, ge=0, description="most excluded uids per text")
    max_exclude_total: int = Field(10_000, ge=0, description="most excluded uids in one request")
    max_uid_bytes: int = Field(256, ge=1, description="most UTF-8 bytes of one excluded uid")
    max_body_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="most bytes of any request body, admin included (413 beyond)"
    )
    body_timeout_s: float = Field(10.0, gt=0, description="a request body must arrive within this (408 beyond)")
    request_timeout_ms: int = Field(
        1000, ge=1, description="how long a request may wait in the queue to start (503 + Retry-After beyond)"
    )
    max_append_items: int = Field(1000, ge=1, description="most labels + instances one /admin/append may add")
