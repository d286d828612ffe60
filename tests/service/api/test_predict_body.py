"""An answer's JSON put together from pieces is, byte for byte, what orjson makes of the
response as one object (the schema's field order, no spaces), for every kind of label text and
score, with the label fragments made fresh or taken from the cache."""

from types import SimpleNamespace

import numpy as np
import orjson
import pytest

from bundle.labels import StringColumn
from engine import Ranking
from service.api import schemas
from service.api.schemas import predict_body

STRANGE = ["plain", 'quote " and \\ backslash', "tab\tnew\nline", "é ü 中文 🙂", "\x00\x1f control", "</script>", ""]


def as_one_object(manifest, variant, k, ef, rankings, view) -> bytes:
    """The reference: the response built as Python objects and dumped by orjson at once."""
    results = [
        {
            "labels": [
                {"id": i, "uid": view.label_uids[i], "text": view.label_texts[i], "score": s}
                for i, s in zip(r.ids.tolist(), r.scores.tolist(), strict=True)
            ]
        }
        for r in rankings
    ]
    body = {"bundle_id": manifest.bundle_id, "variant": variant, "index_kind": manifest.index_kind}
    return orjson.dumps({**body, "k": k, "ef": ef, "results": results})


def view_of(uids, texts, column: bool):
    if column:
        return SimpleNamespace(label_uids=StringColumn.of(uids), label_texts=StringColumn.of(texts))
    return SimpleNamespace(label_uids=list(uids), label_texts=list(texts))


@pytest.mark.parametrize("column", [True, False])
def test_the_pieces_make_the_same_bytes_as_one_dump(column):
    rng = np.random.default_rng(7)
    n = 300
    uids = [f"uid-{i}-{STRANGE[i % len(STRANGE)]}" for i in range(n)]
    texts = [STRANGE[(i * 3) % len(STRANGE)] * (i % 4) for i in range(n)]
    view = view_of(uids, texts, column)
    manifest = SimpleNamespace(bundle_id='b-"1"', index_kind="rae_memory")
    for trial in range(40):
        texts_n, k = int(rng.integers(1, 6)), int(rng.integers(0, 12))
        dtype = np.float32 if trial % 2 else np.float64
        rankings = []
        for _ in range(texts_n):
            size = int(rng.integers(0, k + 1))
            scores = rng.normal(size=size) * 10.0 ** rng.integers(-30, 30, size=size)
            scores[: size // 3] = rng.random(size // 3)
            rankings.append(Ranking(ids=rng.integers(0, n, size), scores=scores.astype(dtype)))
        expected = as_one_object(manifest, "B", k, 321, rankings, view)
        assert predict_body(manifest, "B", k, 321, rankings, view) == expected  # fragments made
        assert predict_body(manifest, "B", k, 321, rankings, view) == expected  # fragments reused


def test_a_full_cache_starts_again_and_still_answers_right(monkeypatch):
    monkeypatch.setattr(schemas, "MAX_LABEL_FRAGMENTS", 3)
    view = view_of([f"u{i}" for i in range(10)], [f"t{i}" for i in range(10)], column=True)
    manifest = SimpleNamespace(bundle_id="b", index_kind="labels")
    rankings = [Ranking(ids=np.arange(10), scores=np.linspace(1, 0, 10, dtype=np.float32))]
    for _ in range(2):
        assert predict_body(manifest, "A", 10, 5, rankings, view) == as_one_object(manifest, "A", 10, 5, rankings, view)
    assert len(schemas.label_fragments(view)) <= 3


def test_a_score_that_is_not_finite_is_refused():
    view = view_of(["a"], ["b"], column=True)
    manifest = SimpleNamespace(bundle_id="b", index_kind="labels")
    with pytest.raises(ValueError, match="not a finite number"):
        predict_body(manifest, "A", 1, 5, [Ranking(ids=np.array([0]), scores=np.array([np.nan]))], view)
