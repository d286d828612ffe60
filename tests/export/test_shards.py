"""Sharded bundles (export.build --shards N): one HNSW file (and value rows) per contiguous key
range, searched shard by shard and merged by the single server: the same answers as the unsharded
bundle under exact search, recall against exact search with HNSW, and every bundle operation
(derive, append, compact) on them."""

import httpx
import numpy as np
import pytest
from pydantic import ValidationError

from bundle.manifest import Manifest
from engine import AppendBatch, load_predictor
from engine.index import ShardedIndex
from engine.offline import exact_rankings, recall_with_label_ties
from export.build import ExportParams, build_bundle
from export.compact import compact_bundle
from export.derive import derive_rae_bundle
from loadtest.localserver import start_server, stop_server

TINY_RAE = {"dim": 16, "max_train": 300, "rae_top_b": 50}


@pytest.fixture(scope="module")
def sharded_rae(sample_train, distilbert_dir, tmp_path_factory):
    """The tiny_rae_bundle's inputs, in 3 shards."""
    out = tmp_path_factory.mktemp("sharded") / "rae-3"
    build_bundle(out, sample_train.labels, sample_train, distilbert_dir, ExportParams(**TINY_RAE, shards=3))
    return out


def same_answers(a, b, queries, **options):
    exhaustive = a.view.num_keys
    left, right = a.predict(queries, 10, ef=exhaustive, **options), b.predict(queries, 10, ef=exhaustive, **options)
    for x, y in zip(left.rankings, right.rankings, strict=True):
        np.testing.assert_allclose(x.scores, y.scores, rtol=1e-5, atol=1e-6)
        # the same labels with the same scores; only labels whose scores tie (to float rounding:
        # the shards' keys are summed in another order) may swap places
        score_x, score_y = (
            dict(zip(x.ids.tolist(), x.scores, strict=True)),
            dict(zip(y.ids.tolist(), y.scores, strict=True)),
        )
        for label in score_x.keys() & score_y.keys():
            assert score_x[label] == pytest.approx(score_y[label], rel=1e-5, abs=1e-6)
        for label in score_x.keys() ^ score_y.keys():  # in one top 10 only: a tie at the cut
            assert score_x.get(label, score_y.get(label)) == pytest.approx(x.scores[-1], rel=1e-5, abs=1e-6)
        tied = np.isclose(x.scores[:, None], x.scores[None, :], rtol=1e-5, atol=1e-6).sum(axis=1) > 1
        assert [i for i, t in zip(x.ids.tolist(), tied, strict=True) if not t] == [
            i for i, t in zip(y.ids.tolist(), tied, strict=True) if not t
        ]


def test_a_sharded_rae_bundle_answers_as_the_unsharded_one(sharded_rae, tiny_rae_bundle, queries):
    sharded, whole = load_predictor(sharded_rae), load_predictor(tiny_rae_bundle)
    manifest = sharded.bundle.manifest
    assert isinstance(sharded.bundle.index, ShardedIndex) and len(manifest.shards) == 3
    assert [s.first_key for s in manifest.shards] == [0, 4126, 8252]
    assert sum(s.keys for s in manifest.shards) == manifest.counts.memory_rows == 12378
    assert {s.index for s in manifest.shards} | {s.values for s in manifest.shards} <= set(manifest.files)
    assert "index.hnsw" not in manifest.files and "values.npz" not in manifest.files
    same_answers(sharded, whole, queries)
    exclude = [sharded.view.label_ids(["libc6", "python3"])] * len(queries)
    same_answers(sharded, whole, queries, exclude=exclude)


def test_hnsw_on_shards_keeps_recall_against_exact_search(sharded_rae, queries):
    sharded = load_predictor(sharded_rae)
    vectors, _ = sharded.bundle.encoder.encode(queries)
    served = [r.ids for r in sharded.search(vectors, 10).rankings]
    recall = recall_with_label_ties(exact_rankings(sharded.bundle, vectors, 20), served, 10)
    assert recall >= 0.99


def test_a_sharded_label_index_answers_as_the_unsharded_one(
    bundle_root, sample_train, distilbert_dir, tmp_path, queries
):
    out = tmp_path / "labels-2"
    build_bundle(out, sample_train.labels, None, distilbert_dir, ExportParams(index_kind="labels", dim=16, shards=2))
    same_answers(load_predictor(out), load_predictor(bundle_root / "tiny-labels"), queries)


def test_appends_derive_and_compaction_work_on_shards(sharded_rae, sample_train, tmp_path, queries):
    memory_Y = sample_train.subset(np.arange(300)).Y
    derive_rae_bundle(sharded_rae, tmp_path / "lam", memory_Y, lam=0.8)
    derived = load_predictor(tmp_path / "lam")
    assert derived.bundle.manifest.rae.lam == 0.8 and len(derived.bundle.manifest.shards) == 3
    assert derived.bundle.values[5000].data.tolist() == [pytest.approx(0.2)]  # a label row, (1 − λ)·e
    grown = load_predictor(sharded_rae, appends_dir=tmp_path / "appends")
    grown.append(AppendBatch(labels=[("zz-new", "zz-new: a new label")], instances=[("zz-tool: new", ["zz-new"])]))
    assert [grown.view.label_uids[i] for i in grown.predict(["zz-tool: new"], 1).rankings[0].ids] == ["zz-new"]
    manifest = compact_bundle(sharded_rae, tmp_path / "compacted", appends_dir=tmp_path / "appends")
    assert len(manifest.shards) == 3 and manifest.counts.memory_rows == grown.view.num_keys
    same_answers(load_predictor(tmp_path / "compacted"), grown, [*queries[:10], "zz-tool: new"])


def test_shards_must_cover_the_keys_contiguously(tiny_rae_bundle):
    fields = Manifest.model_validate_json((tiny_rae_bundle / "manifest.json").read_text()).model_dump()
    rows = fields["counts"]["memory_rows"]
    shards = [
        {"index": "a", "values": "va", "first_key": 0, "keys": 10},
        {"index": "b", "values": "vb", "first_key": 10},
    ]
    Manifest(**(fields | {"shards": [shards[0], shards[1] | {"keys": rows - 10}]}))
    with pytest.raises(ValidationError, match="contiguous"):
        Manifest(**(fields | {"shards": [shards[0], shards[1] | {"first_key": 11, "keys": rows - 11}]}))
    with pytest.raises(ValidationError, match="memory_rows"):
        Manifest(**(fields | {"shards": [shards[0], shards[1] | {"keys": rows}]}))
    with pytest.raises(ValidationError, match="value rows"):
        Manifest(**(fields | {"shards": [shards[0] | {"values": None}, shards[1] | {"keys": rows - 10}]}))


def test_the_http_server_serves_a_sharded_bundle(sharded_rae, queries, tmp_path):
    expected = load_predictor(sharded_rae).predict(queries[:5], 5)
    server = start_server(sharded_rae, tmp_path / "sharded.log")
    try:
        r = httpx.post(f"{server.url}/predict", json={"texts": queries[:5], "k": 5}, timeout=60)
        info = httpx.get(f"{server.url}/info", timeout=30).json()
    finally:
        stop_server(server)
    assert r.status_code == 200 and len(info["manifest"]["shards"]) == 3
    served = [[label["id"] for label in result["labels"]] for result in r.json()["results"]]
    assert served == [ranking.ids.tolist() for ranking in expected.rankings]


def test_a_failed_append_retried_on_shards_leaves_no_key_hidden(sharded_rae, tmp_path, monkeypatch):
    from engine import memory as memory_module
    from tests.engine.test_memory import FailingIndex

    grown = load_predictor(sharded_rae, appends_dir=tmp_path / "appends")
    sharded = grown.memory.index
    monkeypatch.setattr(memory_module, "APPEND_CHUNK", 1)
    monkeypatch.setattr(grown.memory, "index", FailingIndex(sharded, fail_at=2))
    batch = AppendBatch(labels=[("zz-new", "zz-new: a new label")], instances=[("zz-tool: new", ["zz-new"])])
    with pytest.raises(MemoryError):
        grown.append(batch)
    monkeypatch.setattr(grown.memory, "index", sharded)
    grown.append(batch)  # re-adds the key the failed attempt left behind
    assert not sharded.hidden  # every key of the published append is searchable
    assert [grown.view.label_uids[i] for i in grown.predict(["zz-tool: new"], 1).rankings[0].ids] == ["zz-new"]


def test_the_distributed_parts_called_in_process_answer_as_the_single_predictor(sharded_rae, queries):
    """What each Ray deployment does with its part (engine.distributed), without Ray: the
    coordinator's query to every shard, their answers merged and ranked, equal the single
    process's rankings to the last bit, exclusions included; the parts' health checks pass."""
    from engine.distributed import Coordinator, EncoderPart, ShardPart

    single = load_predictor(sharded_rae)
    encoder = EncoderPart(sharded_rae)
    shards = [ShardPart(sharded_rae, number) for number in range(3)]
    coordinator = Coordinator(sharded_rae)
    assert {encoder.bundle_id, coordinator.bundle_id} | {s.bundle_id for s in shards} == {single.bundle.bundle_id}
    exclude = coordinator.excluded(["libc6", "python3"], len(queries))
    query = coordinator.query(queries, encoder.encode(queries), 10, None, exclude)
    rankings, ef = coordinator.rank(query, [shard.search_many([query])[0] for shard in shards], 10, exclude)
    expected = single.predict(queries, 10, exclude=exclude)
    assert ef == expected.ef
    for got, want in zip(rankings, expected.rankings, strict=True):
        assert got.ids.tolist() == want.ids.tolist() and got.scores.tolist() == want.scores.tolist()
    encoder.check()
    for shard in shards:
        shard.check()
