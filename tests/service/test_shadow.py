import asyncio
import json

import numpy as np
import pytest
from scipy.stats import kendalltau

from service.metrics import Metrics
from service.shadow import ShadowConfig, ShadowLog, ShadowMirror, ShadowRequest, compare, kendall_tau_of_ranks
from service.shadow_report import format_summary, main, read_records, summarise


def metric(metrics: Metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_compare_by_hand():
    a = [("x", 0.9), ("y", 0.8), ("z", 0.7), ("w", 0.6)]
    b = [("y", 0.85), ("x", 0.8), ("q", 0.5), ("z", 0.4)]
    out = compare(a, b, k=4)
    assert out["overlap"] == 0.75 and out["shared"] == 3
    # shared x, y, z: ranks A (0, 1, 2), B (1, 0, 3): concordant pairs (x,z), (y,z), discordant (x,y)
    assert out["kendall_tau"] == pytest.approx(1 / 3)
    assert out["score_delta"] == pytest.approx((0.1 + 0.05 + 0.3) / 3)
    assert compare(a, [("q", 1.0)], 4) == {"overlap": 0.0, "kendall_tau": None, "score_delta": None, "shared": 0}


def request(texts=("a",)) -> ShadowRequest:
    texts = list(texts)
    return ShadowRequest(texts, 2, None, [[] for _ in texts], [[("x", 1.0), ("y", 0.5)] for _ in texts], 0.01, "A")


def run_mirror(call, config, offers, settle_s=0.3, shadow_log=None):
    metrics = Metrics()

    async def scenario():
        mirror = ShadowMirror(call, config, metrics, "test", shadow_log)
        mirror.start()
        accepted = [mirror.offer(r) for r in offers]
        await asyncio.sleep(settle_s)
        await mirror.stop()
        return accepted

    return asyncio.run(scenario()), metrics


def test_mirrored_requests_are_compared_and_logged(tmp_path):
    async def agree(req):
        return [[("x", 0.9), ("z", 0.4)] for _ in req.texts]

    log = ShadowLog(tmp_path / "shadow.jsonl", 1_000_000, 1)
    accepted, metrics = run_mirror(agree, ShadowConfig(fraction=1.0), [request(["t1", "t2"])], shadow_log=log)
    assert accepted == [True]
    assert metric(metrics, "xmcserve_shadow_compared_texts_total") == 2
    assert metric(metrics, "xmcserve_shadow_overlap_count") == 2
    lines = [json.loads(x) for x in (tmp_path / "shadow.jsonl").read_text().splitlines()]
    assert [x["text"] for x in lines] == ["t1", "t2"] and lines[0]["overlap"] == 0.5
    assert lines[0]["primary_top"] == ["x", "y"] and lines[0]["shadow_top"] == ["x", "z"]


def test_waiting_copies_share_calls_and_answers_go_back_to_their_texts(tmp_path):
    calls = []

    async def echo(req):  # each text's answer names the text, so a mix-up shows in the log
        calls.append((len(req.texts), req.k))
        return [[(text, 1.0)] for text in req.texts]

    offers = [request([f"t{i}"]) for i in range(10)] + [request(["u0", "u1"])]
    offers[-1].k = 5  # another k: never in the same call as k = 2
    log = ShadowLog(tmp_path / "shadow.jsonl", 1_000_000, 1)
    config = ShadowConfig(fraction=1.0, batch_texts=4, batch_wait_s=0.01)
    accepted, metrics = run_mirror(echo, config, offers, shadow_log=log)
    assert all(accepted) and metric(metrics, "xmcserve_shadow_compared_texts_total") == 12
    assert sorted(calls) == [(2, 2), (2, 5), (4, 2), (4, 2)]
    lines = [json.loads(x) for x in (tmp_path / "shadow.jsonl").read_text().splitlines()]
    assert len(lines) == 12 and all(x["shadow_top"] == [x["text"]] for x in lines)


def test_a_failed_call_counts_every_copy_it_carried():
    async def dead(req):
        raise ConnectionError("refused")

    _, metrics = run_mirror(dead, ShadowConfig(fraction=1.0, batch_texts=8), [request()] * 5, settle_s=0.1)
    assert metric(metrics, "xmcserve_shadow_dropped_total", reason="error") == 5


def test_a_full_queue_drops_without_waiting():
    async def never(req):
        await asyncio.sleep(10)

    config = ShadowConfig(fraction=1.0, queue_size=2, workers=1, timeout_s=5)
    accepted, metrics = run_mirror(never, config, [request() for _ in range(6)], settle_s=0.05)
    # one taken by the worker, two queued, the rest dropped at once
    assert accepted.count(True) in (2, 3) and accepted.count(False) >= 3
    assert metric(metrics, "xmcserve_shadow_dropped_total", reason="queue_full") >= 3


def test_slow_and_dead_shadows_are_counted_not_raised():
    async def slow(req):
        await asyncio.sleep(5)

    async def dead(req):
        raise ConnectionError("refused")

    _, slow_metrics = run_mirror(slow, ShadowConfig(fraction=1.0, timeout_s=0.05), [request()], settle_s=0.3)
    assert metric(slow_metrics, "xmcserve_shadow_dropped_total", reason="timeout") == 1
    _, dead_metrics = run_mirror(dead, ShadowConfig(fraction=1.0), [request()], settle_s=0.1)
    assert metric(dead_metrics, "xmcserve_shadow_dropped_total", reason="error") == 1


def test_sampling_fraction():
    async def agree(req):
        return req.primary

    accepted, _ = run_mirror(agree, ShadowConfig(fraction=0.3, queue_size=10_000), [request()] * 4000, settle_s=0.5)
    assert accepted.count(True) / 4000 == pytest.approx(0.3, abs=0.04)
    accepted, _ = run_mirror(agree, ShadowConfig(fraction=0.0), [request()] * 50)
    assert not any(accepted)


@pytest.mark.parametrize("seed", range(5))
def test_kendall_tau_of_ranks_matches_scipy(seed):
    ranks = list(np.random.default_rng(seed).permutation(3 + 7 * seed))
    assert kendall_tau_of_ranks(ranks) == pytest.approx(kendalltau(range(len(ranks)), ranks).statistic)
    assert kendall_tau_of_ranks(sorted(ranks)) == 1.0
    assert kendall_tau_of_ranks(sorted(ranks, reverse=True)) == -1.0


def test_turning_the_shadow_on_warms_it_once():
    warmed = []

    async def scenario():
        mirror = ShadowMirror(lambda r: None, ShadowConfig(fraction=0.0), Metrics(), "t", warm=lambda: warmed.append(1))
        mirror.start()
        mirror.set_fraction(0.5)
        mirror.set_fraction(1.0)  # already on: no second warm-up
        mirror.set_fraction(0.0)
        await mirror.stop()
        return mirror.config.fraction

    assert asyncio.run(scenario()) == 0.0
    assert warmed == [1]


def test_log_rotation_bounds_disk_use(tmp_path):
    log = ShadowLog(tmp_path / "s.jsonl", max_bytes=2000, backups=2)
    for i in range(500):
        log.write({"i": i, "pad": "x" * 50})
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["s.jsonl", "s.jsonl.1", "s.jsonl.2"]
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= 3 * 2000 + 200


def test_report_summarises_agreement_and_worst_queries(tmp_path, capsys):
    path = tmp_path / "shadow.jsonl"
    rows = [
        {
            "text": "good",
            "overlap": 1.0,
            "kendall_tau": 1.0,
            "primary_ms": 5,
            "shadow_ms": 6,
            "primary_top": ["a"],
            "shadow_top": ["a"],
        },
        {
            "text": "bad",
            "overlap": 0.1,
            "kendall_tau": None,
            "primary_ms": 5,
            "shadow_ms": 15,
            "primary_top": ["a"],
            "shadow_top": ["b"],
        },
        {
            "text": "mid",
            "overlap": 0.5,
            "kendall_tau": 0.2,
            "primary_ms": 5,
            "shadow_ms": 7,
            "primary_top": ["a"],
            "shadow_top": ["a"],
        },
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarise(read_records([path]), worst=2)
    assert summary["records"] == 3
    assert summary["overlap"]["mean"] == pytest.approx(1.6 / 3, abs=1e-4)
    assert summary["overlap"]["share_identical_sets"] == pytest.approx(1 / 3, abs=1e-4)
    assert [r["text"] for r in summary["most_disagreeing"]] == ["bad", "mid"]
    assert summary["kendall_tau"]["records_with_2plus_shared"] == 2
    assert summary["latency_delta_ms"]["p50"] == 2.0
    assert "3 mirrored texts" in format_summary(summary)
    assert main([str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["records"] == 3
