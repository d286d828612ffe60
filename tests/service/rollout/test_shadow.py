import asyncio
import json
import time

import numpy as np
import pytest
from scipy.stats import kendalltau

from service.http.metrics import Metrics
from service.rollout.shadow import ShadowConfig, ShadowLog, ShadowMirror, ShadowRequest, compare, kendall_tau_of_ranks
from service.rollout.shadow_report import NotJson, format_summary, main, read_records, summarise


def metric(metrics: Metrics, name: str, **labels) -> float:
    """A shadow metric's value; every one is labelled with the mirrored variant, A here."""
    return metrics.registry.get_sample_value(name, {"variant": "A", **labels}) or 0.0


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


class FakeWorker:
    """Stands in for the worker process: keeps what it is handed, answers when told."""

    def __init__(self):
        self.copies, self.started, self.closed = [], 0, False
        self.on_result = None

    @property
    def outstanding(self):
        return len(self.copies)

    def start(self):
        self.started += 1

    def submit(self, copy):
        self.copies.append(copy)

    def close(self):
        self.closed = True

    def settle(self, result, copies):
        del self.copies[:copies]
        self.on_result(result)


def mirror(config):
    metrics, worker = Metrics(), FakeWorker()
    return ShadowMirror(config, metrics, "test", worker), worker, metrics


def test_offer_hands_a_copy_with_its_deadline_and_never_blocks():
    shadow, worker, _ = mirror(ShadowConfig(fraction=1.0, timeout_s=2.0))
    before = time.monotonic()
    assert shadow.offer(request(["t1", "t2"]))
    (copy,) = worker.copies
    assert copy.request.texts == ["t1", "t2"]
    assert before + 2.0 <= copy.deadline <= time.monotonic() + 2.0


def test_results_become_metrics():
    shadow, worker, metrics = mirror(ShadowConfig(fraction=1.0))
    for _ in range(3):
        shadow.offer(request())
    samples = [("t1", 5, 1.0, 0.8, 0.01, 0.004), ("t2", 5, 0.5, None, 0.03, -0.002)]
    worker.settle(("compared", 2, [1.0, 0.5], [0.8], [0.01, 0.03], [0.004, -0.002], samples), 2)
    worker.settle(("dropped", "timeout", 1), 1)
    assert metric(metrics, "xmcserve_shadow_compared_texts_total") == 2
    assert metric(metrics, "xmcserve_shadow_overlap_count") == 2
    assert metric(metrics, "xmcserve_shadow_overlap_sum") == 1.5
    assert metric(metrics, "xmcserve_shadow_rank_correlation_count") == 1
    assert metric(metrics, "xmcserve_shadow_score_delta_count") == 2
    assert metric(metrics, "xmcserve_shadow_score_delta_sum") == pytest.approx(0.04)
    assert metric(metrics, "xmcserve_shadow_latency_delta_seconds_count") == 2
    assert metric(metrics, "xmcserve_shadow_latency_delta_seconds_bucket", le="0.0") == 1  # B was faster once
    assert metric(metrics, "xmcserve_shadow_dropped_total", reason="timeout") == 1
    assert shadow.depth == 0
    compared, dropped = shadow.history.since(60)  # and the rollout page's ring has them too
    assert [(c.text, c.overlap, c.kendall_tau) for c in compared] == [("t1", 1.0, 0.8), ("t2", 0.5, None)]
    assert [(reason, copies) for _, reason, copies in dropped] == [("timeout", 1)]


def test_outstanding_copies_are_bounded_and_the_rest_dropped_at_once():
    shadow, worker, metrics = mirror(ShadowConfig(fraction=1.0, queue_size=2))
    accepted = [shadow.offer(request()) for _ in range(6)]
    assert accepted == [True, True, False, False, False, False]
    assert metric(metrics, "xmcserve_shadow_dropped_total", reason="queue_full") == 4
    assert sum(copies for _, reason, copies in shadow.history.since(60)[1] if reason == "queue_full") == 4
    worker.settle(("dropped", "error", 1), 1)  # one settled: room for one more
    assert shadow.offer(request()) and not shadow.offer(request())


def test_sampling_fraction():
    shadow, worker, _ = mirror(ShadowConfig(fraction=0.3, queue_size=10_000))
    accepted = [shadow.offer(request()) for _ in range(4000)]
    assert accepted.count(True) / 4000 == pytest.approx(0.3, abs=0.04)
    assert len(worker.copies) == accepted.count(True)
    shadow, worker, _ = mirror(ShadowConfig(fraction=0.0))
    assert not any(shadow.offer(request()) for _ in range(50)) and worker.started == 0


@pytest.mark.parametrize("seed", range(5))
def test_kendall_tau_of_ranks_matches_scipy(seed):
    ranks = list(np.random.default_rng(seed).permutation(3 + 7 * seed))
    assert kendall_tau_of_ranks(ranks) == pytest.approx(kendalltau(range(len(ranks)), ranks).statistic)
    assert kendall_tau_of_ranks(sorted(ranks)) == 1.0
    assert kendall_tau_of_ranks(sorted(ranks, reverse=True)) == -1.0


def test_turning_the_shadow_on_starts_the_worker_and_stop_closes_it():
    shadow, worker, _ = mirror(ShadowConfig(fraction=0.0))
    shadow.start()  # off: nothing started
    assert worker.started == 0
    shadow.set_fraction(0.5)
    shadow.set_fraction(0.0)
    asyncio.run(shadow.stop())
    assert shadow.config.fraction == 0.0
    assert worker.started == 1 and worker.closed


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
            "score_delta": 0.01,
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
            "score_delta": 0.03,
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
    assert summary["score_delta"] == {"mean": 0.02, "p50": 0.02, "p95": 0.029, "records_with_shared": 2}
    assert "3 mirrored texts" in format_summary(summary) and "mean 0.02" in format_summary(summary)
    assert main([str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["records"] == 3


def test_report_names_a_text_logged_by_digest_by_its_digest(tmp_path):
    row = {"text_sha256": "0123456789abcdef", "overlap": 0.2, "primary_ms": 5, "shadow_ms": 6, "k": 5}
    path = tmp_path / "shadow.jsonl"
    path.write_text(json.dumps(row) + "\n")
    summary = summarise(read_records([path]))
    assert summary["most_disagreeing"][0]["text"] is None
    assert summary["most_disagreeing"][0]["text_sha256"] == "0123456789abcdef"
    assert "text sha256 0123456789abcdef" in format_summary(summary)


def test_a_line_that_is_not_json_is_refused_and_the_report_exits_with_it(tmp_path):
    path = tmp_path / "shadow.jsonl"
    path.write_text('{"overlap": 1.0}\nnot json\n')
    with pytest.raises(NotJson, match=r"shadow.jsonl:2: not JSON"):
        read_records([path])
    with pytest.raises(SystemExit, match=r"shadow.jsonl:2: not JSON"):
        main([str(path)])
