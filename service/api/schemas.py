"""Request and response models of the HTTP API (both front ends serve it).

The request model is built from the settings, so the limits the service enforces are the
limits its OpenAPI schema documents.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Annotated, Literal

import numpy as np
import orjson
from fastapi import FastAPI, Response
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from bundle import Manifest
from engine import MAX_LABELS_PER_INSTANCE, AppendBatch, MemoryView

if TYPE_CHECKING:
    from engine import Ranking
from service.api.limits import LimitSettings

try:
    SERVICE_VERSION = version("xmcserve")
except PackageNotFoundError:  # running from a source tree that is not installed
    SERVICE_VERSION = "0+unknown"

EXAMPLE_SINGLE = {"text": "python3-numpy: Fast array facility to the Python 3 language", "k": 5}
EXAMPLE_BATCH = {
    "texts": [
        "libssl-dev: Secure Sockets Layer toolkit - development files",
        "vim-gtk3: Vi IMproved - enhanced vi editor",
    ],
    "k": 10,
    "ef": 300,
    "exclude": [["libssl-dev"], ["vim-gtk3"]],
}


class PredictRequestBase(BaseModel):
    """Fields shared by every settings-specific request model (see :func:`build_predict_request`)."""

    def all_texts(self) -> list[str]:
        return [self.text] if self.text is not None else list(self.texts)

    def text_count(self) -> int:
        """``len(self.all_texts())`` without building the list (the checks below ask it often)."""
        return 1 if self.text is not None else len(self.texts)

    def exclusions(self) -> list[list[str]]:
        """One list of excluded label uids per text; a flat list is one object shared by all
        texts (never copied per text: 64 copies of a large list were 64 times its memory)."""
        n = self.text_count()
        if not self.exclude:
            return [[]] * n
        if isinstance(self.exclude[0], list):
            return self.exclude
        return [self.exclude] * n


def utf8_size(value: str, what: str) -> int:
    """Bytes of ``value`` as UTF-8; a string that has none (a lone surrogate from a ``\\ud800``
    JSON escape) is a validation error, not a crash later."""
    try:
        return len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid Unicode (it contains a lone surrogate)") from None


def text_checker(max_bytes: int):
    """A validator: a non-blank text of at most ``max_bytes`` UTF-8 bytes."""

    def check_text(value: str) -> str:
        size = utf8_size(value, "text")
        if not value.strip():
            raise ValueError("text is empty or whitespace only")
        if size > max_bytes:
            raise ValueError(f"text is {size} bytes of UTF-8; the limit is {max_bytes}")
        return value

    return check_text


def build_predict_request(limits: LimitSettings) -> type[PredictRequestBase]:
    max_bytes = limits.max_text_bytes
    check_text = text_checker(max_bytes)

    def check_exclude(exclude: list[str] | list[list[str]]) -> None:
        lists = exclude if exclude and isinstance(exclude[0], list) else [exclude]
        total = 0
        for i, uids in enumerate(lists):
            where = f"exclude[{i}]" if lists is exclude else "exclude"
            if len(uids) > limits.max_exclude_per_text:
                raise ValueError(f"{where} has {len(uids)} uids; the limit per text is {limits.max_exclude_per_text}")
            total += len(uids)
            for uid in uids:
                if utf8_size(uid, f"a uid in {where}") > limits.max_uid_bytes:
                    raise ValueError(f"a uid in {where} is over {limits.max_uid_bytes} bytes of UTF-8")
        if total > limits.max_exclude_total:
            raise ValueError(f"'exclude' has {total} uids in all; the limit is {limits.max_exclude_total}")

    class PredictRequest(PredictRequestBase):
        """Give exactly one of ``text`` or ``texts``."""

        model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [EXAMPLE_SINGLE, EXAMPLE_BATCH]})

        text: str | None = Field(None, description=f"one text (at most {max_bytes} UTF-8 bytes)")
        texts: list[str] | None = Field(
            None,
            min_length=1,
            max_length=limits.max_texts_per_request,
            description=f"several texts, at most {limits.max_texts_per_request}, answered in order",
        )
        k: int = Field(
            limits.default_k,
            ge=1,
            le=limits.max_k,
            description=f"labels to return per text (texts x k at most {limits.max_labels_per_response})",
        )
        ef: int | None = Field(
            None, ge=1, le=limits.max_ef, description="HNSW search breadth; default: the bundle's ef"
        )
        variant: Literal["A", "B"] | None = Field(
            None,
            description="force a variant (an operator's test: needs the admin token in X-Admin-Token); "
            "default: routed by the A/B split",
        )
        exclude: list[str] | list[list[str]] = Field(
            default_factory=list,
            max_length=max(limits.max_exclude_total, limits.max_texts_per_request),
            description="label uids never to return (e.g. the query's own item): one list for all texts, "
            f"or one list per text; at most {limits.max_exclude_per_text} per text, "
            f"{limits.max_exclude_total} in all, {limits.max_uid_bytes} UTF-8 bytes each",
        )
        timeout_ms: int | None = Field(
            None,
            ge=1,
            le=limits.request_timeout_ms,
            description="how long the request may wait to start; past it: 503 with Retry-After "
            f"(default and most: {limits.request_timeout_ms})",
        )

        @field_validator("text")
        @classmethod
        def _text_ok(cls, value: str | None) -> str | None:
            return None if value is None else check_text(value)

        @field_validator("texts")
        @classmethod
        def _texts_ok(cls, values: list[str] | None) -> list[str] | None:
            if values is None:
                return None
            for i, value in enumerate(values):
                try:
                    check_text(value)
                except ValueError as exc:
                    raise ValueError(f"texts[{i}]: {exc}") from None
            return values

        @field_validator("exclude")
        @classmethod
        def _exclude_ok(cls, exclude: list[str] | list[list[str]]) -> list[str] | list[list[str]]:
            check_exclude(exclude)
            return exclude

        @model_validator(mode="after")
        def _one_input(self) -> PredictRequest:
            if (self.text is None) == (self.texts is None):
                raise ValueError("give exactly one of 'text' or 'texts'")
            count = self.text_count()
            labels = count * self.k
            if labels > limits.max_labels_per_response:
                raise ValueError(
                    f"{count} texts x k {self.k} = {labels} labels; the limit per response is "
                    f"{limits.max_labels_per_response} (XMCSERVE_MAX_LABELS_PER_RESPONSE): ask for fewer texts or a "
                    "smaller k"
                )
            if self.exclude and isinstance(self.exclude[0], list) and len(self.exclude) != count:
                raise ValueError(
                    f"'exclude' has {len(self.exclude)} lists for {count} texts; "
                    "give one list per text or a single flat list"
                )
            return self

    return PredictRequest


def request_body_openapi(model: type[BaseModel]) -> dict:
    """A route's ``openapi_extra`` documenting ``model`` as its JSON body, for a route that
    decodes the body itself (:func:`service.api.body_guards.decode_body`); the schema goes into the
    components with :func:`document_models`."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def document_models(app: FastAPI, *models: type[BaseModel]) -> None:
    """Add ``models``' JSON schemas to ``app``'s OpenAPI components (FastAPI caches the schema
    it builds, and these go into it once)."""
    build = app.openapi

    def openapi() -> dict:
        schema = build()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in models:
            if model.__name__ not in components:
                model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
        return schema

    app.openapi = openapi


class LabelScore(BaseModel):
    id: int = Field(description="label id in the bundle")
    uid: str
    text: str
    score: float


class TextResult(BaseModel):
    labels: list[LabelScore] = Field(description="best first")


class PredictResponse(BaseModel):
    bundle_id: str
    variant: str = Field(description="A (primary) or B (candidate): which bundle answered")
    index_kind: str
    k: int
    ef: int
    results: list[TextResult] = Field(description="one per input text, in order")


# Answers with more labels than this are serialised on a worker thread: building and encoding a
# label object costs ~5 µs, so 64 texts x k 1000 held the event loop (every other request) for
# ~0.3 s; below it the thread hop (~0.1 ms) costs more than it frees.
INLINE_LABELS = 256


async def predict_response_off_loop(
    manifest: Manifest, variant: str, k: int, ef: int, rankings: Sequence[Ranking], view: MemoryView
) -> Response:
    """:func:`predict_response`, on a worker thread when the answer is large."""
    if sum(len(ranking.ids) for ranking in rankings) <= INLINE_LABELS:
        return predict_response(manifest, variant, k, ef, rankings, view)
    return await asyncio.to_thread(predict_response, manifest, variant, k, ef, rankings, view)


def json_response(body: bytes) -> Response:
    """An answer whose JSON is already serialised."""
    return Response(body, media_type="application/json")


def predict_response(
    manifest: Manifest, variant: str, k: int, ef: int, rankings: Sequence[Ranking], view: MemoryView
) -> Response:
    """A :class:`PredictResponse` as JSON (:func:`predict_body`)."""
    return json_response(predict_body(manifest, variant, k, ef, rankings, view))


def predict_body(
    manifest: Manifest, variant: str, k: int, ef: int, rankings: Sequence[Ranking], view: MemoryView
) -> bytes:
    """A :class:`PredictResponse`'s JSON, serialised directly by orjson: FastAPI would otherwise
    validate the ~k label objects of every answer again (the model stays the documented schema).
    ``view``: the labels the rankings' ids refer to.

    The bytes are what ``orjson.dumps`` makes of the response as one object, put together from
    pieces: each label's JSON up to its score is made once per label table
    (:func:`label_fragments`), the scores are dumped as one list per text, and the rest is joined
    as orjson joins it (no spaces, keys in order)."""
    uids, texts = view.label_uids, view.label_texts
    fragments = label_fragments(view)
    results = []
    for ranking in rankings:
        if not np.isfinite(ranking.scores).all():  # orjson would write null; JSON has no NaN
            raise ValueError("a ranking has a score that is not a finite number")
        ids = ranking.ids.tolist()
        if not ids:
            results.append(b'{"labels":[]}')
            continue
        scores = orjson.dumps(ranking.scores.tolist())[1:-1].split(b",")  # a float's JSON has no comma
        labels = []
        for i, score in zip(ids, scores, strict=True):
            head = fragments.get(i)
            if head is None:
                if len(fragments) >= MAX_LABEL_FRAGMENTS:
                    fragments.clear()
                head = fragments[i] = b'{"id":%d,"uid":%b,"text":%b,"score":' % (
                    i,
                    orjson.dumps(uids[i]),
                    orjson.dumps(texts[i]),
                )
            labels.append(head + score)
        results.append(b'{"labels":[' + b"},".join(labels) + b"}]}")
    head = {"bundle_id": manifest.bundle_id, "variant": variant, "index_kind": manifest.index_kind, "k": k, "ef": ef}
    return orjson.dumps(head)[:-1] + b',"results":[' + b",".join(results) + b"]}"


# Labels whose JSON fragment a label table keeps at most (about 150 bytes each); past it they are
# made again as they are answered.
MAX_LABEL_FRAGMENTS = 200_000
# Each label table's fragments, by the identity of its uid column (held weakly: a bundle
# unloaded takes its fragments with it). A label's uid and text never change once an answer can
# name it (a live memory only appends labels), so a fragment made once stays right.
_fragments: dict[int, tuple[weakref.ref, dict[int, bytes]]] = {}


def label_fragments(view: MemoryView) -> dict[int, bytes]:
    """Label id -> its JSON object up to its score (``{"id":…,"uid":…,"text":…,"score":``), for
    ``view``'s label table; made as labels are answered, from any thread (a dict's get and set
    are atomic, and two threads that make the same fragment make the same bytes)."""
    uids = view.label_uids
    entry = _fragments.get(id(uids))
    if entry is not None and entry[0]() is uids:
        return entry[1]
    try:
        ref = weakref.ref(uids)
    except TypeError:  # a plain list (a test's view): nothing to key a cache by
        return {}
    for key, (other, _) in list(_fragments.items()):
        if other() is None:
            _fragments.pop(key, None)
    fragments: dict[int, bytes] = {}
    _fragments[id(uids)] = (ref, fragments)
    return fragments


class ReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    variant: Literal["A", "B"] = Field(description="slot to load the bundle into")
    bundle: str = Field(description="bundle dir, relative to the configured bundle root")


class ConfigUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    split_b: float | None = Field(None, ge=0.0, le=1.0, description="share of requests routed to B")
    shadow_fraction: float | None = Field(None, ge=0.0, le=1.0, description="share of A's requests mirrored")


EXAMPLE_APPEND = {
    "labels": [{"uid": "python3-newlib", "text": "python3-newlib: a library released after the bundle was built"}],
    "instances": [{"text": "python3-newtool: a tool that uses the new library", "labels": ["python3-newlib", "libc6"]}],
    "append_id": "2026-11-23-batch-1",
}


def build_append_request(limits: LimitSettings) -> type[BaseModel]:
    """The body of ``POST /admin/append``, with the service's text and uid limits."""
    check_text = text_checker(limits.max_text_bytes)

    def check_uid(uid: str) -> str:
        size = utf8_size(uid, "uid")
        if not uid.strip():
            raise ValueError("uid is empty or whitespace only")
        if size > limits.max_uid_bytes:
            raise ValueError(f"uid is {size} bytes of UTF-8; the limit is {limits.max_uid_bytes}")
        return uid

    Text = Annotated[str, AfterValidator(check_text)]
    Uid = Annotated[str, AfterValidator(check_uid)]

    class NewLabel(BaseModel):
        model_config = ConfigDict(extra="forbid")
        uid: Uid = Field(description="a uid the memory does not hold yet")
        text: Text = Field(description="the label's text, encoded by the bundle's encoder")

    class NewInstance(BaseModel):
        model_config = ConfigDict(extra="forbid")
        text: Text = Field(description="the instance's text, encoded by the bundle's encoder")
        labels: list[Uid] = Field(
            min_length=1,
            max_length=MAX_LABELS_PER_INSTANCE,
            description="its label uids: known ones, or ones this call adds",
        )

    class AppendRequest(BaseModel):
        """New labels and training instances for a variant's memory (RAE memory: both; a label
        index: labels only); applied all together or not at all."""

        model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [EXAMPLE_APPEND]})
        variant: Literal["A", "B"] = Field("A", description="whose memory grows")
        labels: list[NewLabel] = Field(default_factory=list, max_length=limits.max_append_items)
        instances: list[NewInstance] = Field(default_factory=list, max_length=limits.max_append_items)
        append_id: str | None = Field(
            None,
            max_length=200,
            description="idempotency key: an append with an id already applied is not applied again",
        )

        @model_validator(mode="after")
        def _bounded(self) -> AppendRequest:
            items = len(self.labels) + len(self.instances)
            if items == 0:
                raise ValueError("nothing to append: give labels and/or instances")
            if items > limits.max_append_items:
                raise ValueError(f"{items} labels and instances; at most {limits.max_append_items} per call")
            return self

        def batch(self) -> AppendBatch:
            return AppendBatch(
                labels=[(label.uid, label.text) for label in self.labels],
                instances=[(instance.text, list(instance.labels)) for instance in self.instances],
                append_id=self.append_id,
            )

    return AppendRequest
