"""Every figure the docs state for a result file is that file's value.

Each entry of ``FIGURES`` ties a sentence of a page (README.md, deploy/README.md, docs/, the results'
README) to values of result files in bench/results/: the sentence is written with ``{}`` where the
figures stand, each figure is read from its file (a key path, or a small function of several) and
formatted as the page rounds it, and the sentence so filled must appear in the page (line breaks
count as spaces). A figure changed in a file and not in the page, or in the page and not in the
file, fails here. Every row of the results README's "What holds today" table that names a JSON file
has at least one entry, so a row added there comes with its checks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TODAY, TOP, DEPLOY = "bench/results/README.md", "README.md", "deploy/README.md"


@cache
def result(name: str) -> Any:
    return json.loads((RESULTS / name).read_text())


def lookup(ref: str | tuple) -> Any:
    """``"file.json:a.b.0.c"`` (or ``("file.json", ("a", "b", ...))`` for keys with dots in them):
    that file's value at that key path; an empty path is the whole file."""
    if isinstance(ref, tuple):
        name, keys = ref
    else:
        name, _, path = ref.partition(":")
        keys = path.split(".") if path else []
    value = result(name)
    for key in keys:
        value = value[int(key)] if isinstance(value, list) else value[key]
    return value


@dataclass(frozen=True)
class Value:
    refs: tuple
    fmt: str | Callable[[Any], str]
    combine: Callable[..., Any] | None = None

    def text(self) -> str:
        values = [lookup(ref) for ref in self.refs]
        value = self.combine(*values) if self.combine else values[0]
        return self.fmt(value) if callable(self.fmt) else rounded(value, self.fmt)


FIXED = re.compile(r"^(,?)\.(\d+)f$")


def rounded(value: Any, spec: str) -> str:
    """``format(value, spec)``, but a fixed-point spec rounds half up from the number as the file
    writes it (4404.5 is "4,405", 0.565 "0.57"), as a person rounding it for a page does."""
    match = FIXED.match(spec)
    if not match or isinstance(value, bool) or not isinstance(value, (int, float)):
        return format(value, spec)
    exact = Decimal(repr(value)).quantize(Decimal(1).scaleb(-int(match.group(2))), rounding=ROUND_HALF_UP)
    return format(exact, spec)


def at(ref, fmt: str | Callable = "") -> Value:
    return Value((ref,), fmt)


def of(combine: Callable, *refs, fmt: str | Callable = "") -> Value:
    return Value(refs, fmt, combine)


def met(holds: bool) -> str:
    return "met" if holds else "**missed**"


def pct(share: float) -> str:
    return f"{share * 100:.1f}"


def short_e(value: float) -> str:
    return f"{value:.1e}".replace("e-0", "e-")


def first_number(text: str) -> float:
    return float(re.search(r"\d+(?:\.\d+)?", text).group())


def seconds_after(text: str) -> float:
    """The seconds of a check's "200 after 2.0 s (...)"."""
    return float(re.search(r"after (\d+(?:\.\d+)?) s", text).group(1))


def best_peer(systems: dict, metric: str) -> float:
    """The best classic peer's ``metric`` among a quality file's rows (ours start xmcserve/minilm)."""
    return max(row[metric] for name, row in systems.items() if not name.startswith(("xmcserve", "minilm")))


@dataclass(frozen=True)
class Figure:
    page: str
    text: str
    values: tuple[Value, ...]

    def rendered(self) -> str:
        return self.text.format(*(value.text() for value in self.values))


def F(page: str, text: str, *values: Value) -> Figure:
    return Figure(page, text, values)


S, W, WN = "serving.json", "serving-workers.json", "serving-workers-null-encoder.json"
INF, NE67, FLOORS = (
    "serving-infinity-peer-idle.json",
    "serving-null-encoder-issue67.json",
    "serving-null-encoder-floors-idle.json",
)
DEB, QD, FMS = "eval-debian-unidec-fused-sparse-dev.json", "quality-debian-dev.json", "fusion-models-sparse.json"
COOK, COOKP, GUT = (
    "eval-cooking-fit-tst.json",
    "peers-cooking-stackexchange-tst.json",
    "quality-gutenberg-subjects-dev.json",
)
OL, UNREAD, INT8 = "overload.json", "unread-answers.json", "int8-methods.json"
DYN, FP32 = "variants.int8 dynamic, one text per call", "variants.fp32, one text per call"
OL150, OL150T = "phases.150% default deadline", "phases.150% timeout_ms=100"
IMG, PQM, TEN = "deploy-images.json", "ann-compressed-pq-m.json", "ten-million.json"
SERVE_COST = "serving_cost.bundles/debian-unidec"
SERVE_COST_ALONE = "serving_cost.bundles/debian-unidec-nosparse"


def search_row(b: int, ef: int, key: str) -> Value:
    return of(
        lambda rows: next(r for r in rows if (r["top_b"], r["ef"]) == (b, ef))[key],
        "search-params-full-memory.json:rows",
        fmt=".2f",
    )


def image(name: str, key: str = "size_mb") -> tuple:
    return (IMG, ("images", name, key))


FIGURES = [
    # -- bench/results/README.md, "What holds today", row by row --------------------------------------
    F(
        TODAY,
        "peak {} q/s ({}× the naive server), idle p50 {} ms, p99 at 70 % of peak {} ms, recall@10 {}",
        at(f"{S}:peak_qps", ".1f"),
        at(f"{S}:ratios.peak_over_naive", ".2f"),
        at(f"{S}:idle_p50_ms", ".2f"),
        at(f"{S}:p99_ms_at_70pct_peak", ".1f"),
        at(f"{S}:recall_at_10", ".4f"),
    ),
    F(
        TODAY,
        "**missed** ({}×); met ({}); **missed** ({}×)",
        at(f"{S}:ratios.peak_over_encoder_b32", ".3f"),
        at(f"{S}:ratios.p99_at_70pct_over_full_batch", ".2f"),
        at(f"{S}:ratios.idle_p50_over_encoder_b1_ms", ".2f"),
    ),
    F(
        TODAY,
        "peak {} against {} q/s ({}×); null encoder {} against {} q/s ({}×) | 2 processes do not lose against 1 | {} |",
        at(f"{W}:median.2.peak_qps", ".1f"),
        at(f"{W}:median.1.peak_qps", ".1f"),
        at(f"{W}:ratio_to_first.2.peak_qps", ".3f"),
        at(f"{WN}:median.2.peak_qps", ",.1f"),
        at(f"{WN}:median.1.peak_qps", ",.1f"),
        at(f"{WN}:ratio_to_first.2.peak_qps", ".3f"),
        of(
            lambda a, b: a >= 1 and b >= 1, f"{W}:ratio_to_first.2.peak_qps", f"{WN}:ratio_to_first.2.peak_qps", fmt=met
        ),
    ),
    F(
        TODAY,
        "one process: peak {} q/s, idle p50 {} ms, null encoder {} q/s; 12 workers of one core over the GPU: {} q/s",
        at("gpu.json:summary.peak_qps", ",.0f"),
        at("gpu.json:summary.idle_p50_ms", ".2f"),
        at("gpu.json:summary.null_encoder_peak_qps", ",.0f"),
        at("gpu-h200-workers-cuda-1core.json:summary.scaling_peak_qps.12", ",.0f"),
    ),
    F(
        TODAY,
        "peak {}× infinity's ({} against {} q/s), idle p50 {}×, peak RSS {}× | peak ≥ the peer's | {} ({} of 2 rounds)",
        at(f"{INF}:ratios.median_peak_over_peer", ".2f"),
        at(f"{INF}:xmcserve.median_peak_qps", ".1f"),
        at(f"{INF}:infinity.median_peak_qps", ".1f"),
        at(f"{INF}:ratios.median_idle_p50_over_peer", ".2f"),
        at(f"{INF}:ratios.peak_rss_over_peer", ".3f"),
        at(f"{INF}:target.peak_at_least_peer", met),
        at(f"{INF}:target.rounds_with_peak_at_least_peer", "d"),
    ),
    F(
        TODAY,
        "{} µs of CPU a request, {} of them over a bare ASGI app (12-02); {}× 081918c's CPU in one run (11-26);"
        " peak {}× 58e5ef8's (11-27)",
        at(f"{NE67}:median_cpu_us_per_request.this", ",.0f"),
        at(f"{NE67}:machinery_cpu_us_per_request.this.over_floor_asgi.median", ",.0f"),
        at(f"{S}:non_encoder.cpu_per_request_this_over_baseline", ".2f"),
        of(lambda a, b: a / b, f"{FLOORS}:median_peak_qps.this", f"{FLOORS}:median_peak_qps.baseline", fmt=".2f"),
    ),
    F(
        TODAY,
        "peak ≥ 2× the older commit's | **missed** ({}) |",
        of(
            lambda over_floor, ratio, this, base: (
                "all three" if over_floor > 600 and ratio > 0.5 and this / base < 2 else "?"
            ),
            f"{NE67}:machinery_cpu_us_per_request.this.over_floor_asgi.median",
            f"{S}:non_encoder.cpu_per_request_this_over_baseline",
            f"{FLOORS}:median_peak_qps.this",
            f"{FLOORS}:median_peak_qps.baseline",
        ),
    ),
    F(
        TODAY,
        "loaded at {} q/s: ONNX {} % of the samples, asyncio / HTTP / other {} %; idle, in process: encode {} of {} ms;"
        " over HTTP p50 {} ms",
        at("server-stage-profile.json:rps", ".0f"),
        at("server-stage-profile.json:stages.onnx_run", pct),
        at("server-stage-profile.json:stages.http_asyncio_other", pct),
        at("idle-latency.json:in_process_stage_median_ms.encode", ".2f"),
        at("idle-latency.json:in_process_total_ms.back_to_back", ".2f"),
        at("idle-latency.json:http_ms.p50", ".2f"),
    ),
    F(
        TODAY,
        "only `{}` refusals (p50 {} ms); accepted p99 {} ms ({}× the idle p50), {} ms with `timeout_ms` 100 ({}×);"
        " 16 clients not reading {} MiB answers: {} MiB held without a write timeout, {} with a 1 s one",
        of(
            lambda a, b: "/".join(sorted({*a, *b})),
            f"{OL}:{OL150}.refused_share_by_status",
            f"{OL}:{OL150T}.refused_share_by_status",
        ),
        at(f"{OL}:{OL150}.refusal_server_ms_p50", ".2f"),
        at(f"{OL}:{OL150}.accepted_p99_ms", ",.0f"),
        at(f"{OL}:ratios.accepted_p99_over_idle_p50 at 150% default deadline", ".0f"),
        at(f"{OL}:{OL150T}.accepted_p99_ms", ".0f"),
        at(f"{OL}:ratios.accepted_p99_over_idle_p50 at 150% timeout_ms=100", ".1f"),
        of(lambda b: b >> 20, f"{UNREAD}:answer_bytes", fmt="d"),
        at(f"{UNREAD}:runs.0.after_s.4.buffered_mib", ".1f"),
        at(f"{UNREAD}:runs.1.after_s.4.buffered_mib", ".0f"),
    ),
    F(
        TODAY,
        "accepted p99 ≤ {}× the idle p50 | {}; {} |",
        at(f"{OL}:targets.accepted_p99_over_idle_p50_max", "d"),
        at(f"{OL}:targets.refusals_only_429_503", met),
        of(lambda tails: all(tails.values()), f"{OL}:targets.met_tail", fmt=met),
    ),
    F(
        TODAY,
        "{} dev answers a bundle alone and in random batches, {} ({} bundles); int8 one text a call: {} texts/s at"
        " batch 32"
        " against fp32's {}, P@5 {} → {} | int8 costs ≤ 0.3 P@5 | {} |",
        at("batch-invariance.json:bundles.bundles/default.compared", ",d"),
        of(
            lambda rows: "none moved" if all(r["holds"] and r["other_labels"] == 0 for r in rows.values()) else "?",
            "batch-invariance.json:bundles",
        ),
        of(len, "batch-invariance.json:bundles", fmt="d"),
        at(f"{INT8}:{DYN}.encoder_texts_per_s_2x1_threads.32", ".1f"),
        at(f"{INT8}:{FP32}.encoder_texts_per_s_2x1_threads.32", ".1f"),
        at(f"{INT8}:{FP32}.metrics_filter_after.P@5", ".2f"),
        at(f"{INT8}:{DYN}.metrics_filter_after.P@5", ".2f"),
        of(
            lambda a, b: a - b <= 0.3,
            f"{INT8}:{FP32}.metrics_filter_after.P@5",
            f"{INT8}:{DYN}.metrics_filter_after.P@5",
            fmt=met,
        ),
    ),
    F(
        TODAY,
        "P@1 / P@5 / PSP@5 / R@100 {} / {} / {} / {}; the best peer, TF-IDF + one-vs-rest LR, {} / {} P@1 / P@5;"
        " serving cost {}× the batched q/s, {}× the idle p50",
        *(at(f"{DEB}:metrics.{m}", ".2f") for m in ("P@1", "P@5", "PSP@5", "R@100")),
        at(f"{QD}:systems.tfidf-ovr-logreg.P@1", ".2f"),
        at(f"{QD}:systems.tfidf-ovr-logreg.P@5", ".2f"),
        of(
            lambda a, b: a / b,
            f"{FMS}:{SERVE_COST}.batched_queries_per_second",
            f"{FMS}:{SERVE_COST_ALONE}.batched_queries_per_second",
            fmt=".2f",
        ),
        of(lambda a, b: a / b, f"{FMS}:{SERVE_COST}.idle_p50_ms", f"{FMS}:{SERVE_COST_ALONE}.idle_p50_ms", fmt=".2f"),
    ),
    F(
        TODAY,
        "met (by {} queries); met (+{}, +{})",
        of(lambda p, n: int((p - 80) / 100 * n), f"{DEB}:metrics.P@1", f"{DEB}:instances", fmt="d"),
        of(lambda m, s: m - best_peer(s, "P@1"), f"{DEB}:metrics.P@1", f"{QD}:systems", fmt=".2f"),
        of(lambda m, s: m - best_peer(s, "P@5"), f"{DEB}:metrics.P@5", f"{QD}:systems", fmt=".2f"),
    ),
    F(
        TODAY,
        "`make fit`: {} / {} / {} / {}; the best peers {} P@1 (Annif's ensemble), {} P@5 (TF-IDF + one-vs-rest LR)"
        " | +2 P@1 and +0.5 P@5 over the best peer | met (+{}, +{})",
        *(at(f"{COOK}:metrics.{m}", ".2f") for m in ("P@1", "P@5", "PSP@5", "R@100")),
        at(f"{COOKP}:annif-ensemble.P@1", ".2f"),
        at(f"{COOKP}:tfidf-ovr-logreg.P@5", ".2f"),
        of(lambda m, s: m - best_peer(s, "P@1"), f"{COOK}:metrics.P@1", f"{COOKP}:", fmt=".2f"),
        of(lambda m, s: m - best_peer(s, "P@5"), f"{COOK}:metrics.P@5", f"{COOKP}:", fmt=".2f"),
    ),
    F(
        TODAY,
        "`make fit`: {} / {} / {} / {}; the best peer, Omikuji Bonsai, {} / {} P@1 / P@5"
        " | +2 P@1 and +0.5 P@5 over the best peer | met (+{}, +{})",
        *(at(f"{GUT}:systems.xmcserve-fit.{m}", ".2f") for m in ("P@1", "P@5", "PSP@5", "R@100")),
        at(f"{GUT}:systems.omikuji-bonsai.P@1", ".2f"),
        at(f"{GUT}:systems.omikuji-bonsai.P@5", ".2f"),
        of(lambda m, s: m - best_peer(s, "P@1"), f"{GUT}:systems.xmcserve-fit.P@1", f"{GUT}:systems", fmt=".2f"),
        of(lambda m, s: m - best_peer(s, "P@5"), f"{GUT}:systems.xmcserve-fit.P@5", f"{GUT}:systems", fmt=".2f"),
    ),
    F(
        TODAY,
        "Debian-Related dev, exclude before: {} / {} / {} / {}",
        *(
            at(f"{QD}:systems.xmcserve-unidec-gpu-rae-64d.exclude_before.{m}", ".2f")
            for m in ("P@1", "P@5", "PSP@5", "R@100")
        ),
    ),
    F(
        TODAY,
        "relevant labels among the candidates {} → {} % with the sparse ranker's top 100 and label texts"
        " (validation P@1 {} → {}); a label index as a source: built, {}",
        at("candidate-sources-debian.json:variants.memory.relevant_among_candidates", ".1f"),
        at("candidate-sources-debian.json:variants.memory+sparse+labels@100.relevant_among_candidates", ".1f"),
        at("candidate-sources-debian.json:variants.memory.validation.filter_after.P@1", ".2f"),
        at("candidate-sources-debian.json:variants.memory+sparse+labels@100.validation.filter_after.P@1", ".2f"),
        of(
            lambda chosen: "not chosen" if "keys" not in chosen else "chosen",
            "candidate-sources-debian-pretrained.json:chosen",
        ),
    ),
    F(
        TODAY,
        "LambdaMART {} over the union, chosen on {} held-out instances among models of at most {} ms a query:"
        " validation P@1 / P@5 {} / {}, {} ms; held-out against dev pairs: AUC {}",
        of(lambda chosen: chosen.split("@")[0].split("-")[1].replace("x", "×"), f"{FMS}:chosen"),
        at(f"{FMS}:held_out_instances", ",d"),
        at(f"{FMS}:max_model_ms", "g"),
        of(lambda d: d["candidates"][d["chosen"]]["validation"]["filter_after"]["P@1"], f"{FMS}:", fmt=".2f"),
        of(lambda d: d["candidates"][d["chosen"]]["validation"]["filter_after"]["P@5"], f"{FMS}:", fmt=".2f"),
        of(lambda d: d["candidates"][d["chosen"]]["onnx_ms_per_query"], f"{FMS}:", fmt=".3f"),
        at("fusion-shift.json:relevant_pairs.auc", ".3f"),
    ),
    F(
        TODAY,
        "LambdaMART 60×15: {}× the unfused batched q/s ({} against {}), idle aggregate stage {} ms"
        " | ≥ 0.85× the batched q/s; ≤ 2 ms idle | {} |",
        of(
            lambda a, b: a / b,
            "fusion-cost.json:summary.lambdarank-60x15.batched_queries_per_second",
            "fusion-cost.json:summary.none.batched_queries_per_second",
            fmt=".2f",
        ),
        at("fusion-cost.json:summary.lambdarank-60x15.batched_queries_per_second", ".1f"),
        at("fusion-cost.json:summary.none.batched_queries_per_second", ".1f"),
        at("fusion-cost.json:summary.lambdarank-60x15.stage_median_ms.aggregate", ".2f"),
        of(
            lambda d: (
                d["lambdarank-60x15"]["batched_queries_per_second"] / d["none"]["batched_queries_per_second"] >= 0.85
                and d["lambdarank-60x15"]["stage_median_ms"]["aggregate"] <= 2
            ),
            "fusion-cost.json:summary",
            fmt=met,
        ),
    ),
    F(
        TODAY,
        "a batch of {} searches: single tree {} ms, {}-tree GBDT {} ms, LambdaMART {} ms; parity with the fitting"
        " library ≤ {}",
        at("fusion-onnx-parity.json:batch_searches", "d"),
        of(lambda us: us / 1000, "fusion-onnx-parity.json:median_us_per_batch.onnx-tree", fmt=".2f"),
        at("fusion-onnx-parity.json:boosted_trees", "d"),
        of(lambda us: us / 1000, "fusion-onnx-parity.json:median_us_per_batch.onnx-gbdt", fmt=".0f"),
        of(lambda us: us / 1000, "fusion-onnx-parity.json:median_us_per_batch.onnx-lambdarank", fmt=".0f"),
        of(lambda parity: max(parity.values()), "fusion-onnx-parity.json:parity_max_abs_vs_library", fmt=short_e),
    ),
    F(
        TODAY,
        "b 100 → 300 at ef 100: P@1 {} → {} for {} → {} ms a query",
        search_row(100, 100, "P@1"),
        search_row(300, 100, "P@1"),
        search_row(100, 100, "search_ms_per_query"),
        search_row(300, 100, "search_ms_per_query"),
    ),
    F(
        TODAY,
        "10^6 keys: {} B a label at recall@10 {} (hnswlib {} B); the trained bundle reindexed: P@1 / P@5 {} / {}"
        " against hnswlib's {} / {} | recall@10 ≥ {} | {} |",
        at(f"{PQM}:sets.synthetic-1000000.methods.ivfpq64-fp16.bytes_per_label", ".1f"),
        at(f"{PQM}:sets.synthetic-1000000.methods.ivfpq64-fp16.recall_at_10", ".3f"),
        at("ann-compressed.json:sets.synthetic-1000000.methods.hnswlib.bytes_per_label", ".1f"),
        at("eval-debian-unidec-ivfpq-dev.json:metrics.P@1", ".2f"),
        at("eval-debian-unidec-ivfpq-dev.json:metrics.P@5", ".2f"),
        at("eval-debian-unidec-hnswlib-dev.json:metrics.P@1", ".2f"),
        at("eval-debian-unidec-hnswlib-dev.json:metrics.P@5", ".2f"),
        at(f"{PQM}:target_recall", "g"),
        at(f"{PQM}:sets.synthetic-1000000.methods.ivfpq64-fp16.reaches_target", met),
    ),
    F(
        TODAY,
        "build {} min, {} B a label, ready in {} s, peak {} GiB, one at a time p50 / p99 {} / {} ms, recall@10 {};"
        " a 6.25 M-label shard: {} B a label, recall@10 {} at {} cells, p50 {} ms | the seven targets in"
        " `ten-million.json`"
        " | met ({}) |",
        at(f"{TEN}:targets.build_minutes.value", ".1f"),
        at(f"{TEN}:targets.index_bytes_per_label.value", ".1f"),
        at(f"{TEN}:targets.seconds_to_ready.value", ".1f"),
        at(f"{TEN}:targets.server_rss_gib.value", ".2f"),
        at(f"{TEN}:targets.single_p50_ms.value", ".2f"),
        at(f"{TEN}:targets.single_p99_ms.value", ".2f"),
        at(f"{TEN}:targets.recall_at_10.value", ".4f"),
        at("shard-replica.json:index_bytes_per_label", ".1f"),
        at("shard-replica.json:replica.recall_at_10", ".3f"),
        at("shard-replica.json:replica.nprobe", "d"),
        at("shard-replica.json:replica.single.p50_ms", ".2f"),
        of(lambda t: "all seven" if len(t) == 7 and all(v["met"] for v in t.values()) else "?", f"{TEN}:targets"),
    ),
    F(
        TODAY,
        "recall@10 {} at ef 50, {} B a label, built in {} s | recall@10 ≥ {} | {} |",
        at("ann-scale.json:1000000.by_ef.50.recall_at_10", ".4f"),
        at("ann-scale.json:1000000.bytes_per_label", ".1f"),
        at("ann-scale.json:1000000.build_seconds", ".0f"),
        at("ann-scale.json:target_recall", "g"),
        of(
            lambda r, t: r >= t, "ann-scale.json:1000000.by_ef.50.recall_at_10", "ann-scale.json:target_recall", fmt=met
        ),
    ),
    F(
        TODAY,
        "one at a time p50 {} / {} / {} ms on 1 / 2 / 4 shards against the single server's {} ms ({}× to {}×)"
        " | p50 ≤ 1.25× the single server's | {} |",
        *(at(f"ray-scale.json:ray.{n}.one_at_a_time.p50_ms", ".1f") for n in (1, 2, 4)),
        at("ray-scale.json:single.one_at_a_time.p50_ms", ".2f"),
        at("ray-scale.json:ray_over_single_p50.1", ".2f"),
        at("ray-scale.json:ray_over_single_p50.4", ".2f"),
        of(lambda ratios: min(ratios.values()) <= 1.25, "ray-scale.json:ray_over_single_p50", fmt=met),
    ),
    F(
        TODAY,
        "generate {} s, train {} s ({} s with fused AdamW), export {} s, ready in {} s at {} GiB, p50 {} ms",
        at("million-e2e.json:stages.generate.seconds", ".0f"),
        at("million-e2e.json:stages.train.seconds", ".0f"),
        at("million-train-fused-adamw.json:stage.seconds", ".0f"),
        at("million-e2e.json:stages.export.seconds", ".0f"),
        at("million-e2e.json:stages.serve.seconds_to_ready", ".1f"),
        at("million-e2e.json:stages.serve.peak_rss_gib", ".2f"),
        at("million-e2e.json:stages.serve.p50_ms", ".2f"),
    ),
    F(
        TODAY,
        "A's p99 ×{} [{}, {}], A's CPU a request ×{}; {} reloads under load, {} failed requests | A's p99 within 10 %"
        " | {} |",
        at("ab-shadow-own-cores.json:remote_shadow.p99_ratio", ".3f"),
        at("ab-shadow-own-cores.json:remote_shadow.p99_ratio_90pct_interval.0", ".3f"),
        at("ab-shadow-own-cores.json:remote_shadow.p99_ratio_90pct_interval.1", ".3f"),
        at("ab-shadow-own-cores.json:remote_shadow.primary_cpu_per_request_ratio", ".3f"),
        at("ab-shadow-own-cores.json:reload_loop.reloads", "d"),
        at("ab-shadow-own-cores.json:reload_loop.failed_requests", "d"),
        at("ab-shadow-own-cores.json:remote_shadow.within_10pct", met),
    ),
    F(
        TODAY,
        "JSON access logs: throughput ×{}; every request traced: ×{}; the agreement ring {} µs a compared text",
        of(lambda loss: 1 - loss, "observability-cost.json:median_throughput_loss.json_logs", fmt=".2f"),
        of(lambda loss: 1 - loss, "observability-cost.json:median_throughput_loss.json_logs_and_tracing", fmt=".2f"),
        at("rollout-ring.json:ring_append_us_per_text", ".2f"),
    ),
    F(
        TODAY,
        "{} durable appends/s ({} ms a commit) against {} with the fsync left out",
        at("append-durability.json:variants.durable.appends_per_s", ".0f"),
        at("append-durability.json:variants.durable.commit_ms", ".1f"),
        at("append-durability.json:variants.no-fsync.appends_per_s", ",.0f"),
    ),
    F(
        TODAY,
        "the other half's P@1 {} → {} (default bundle); `/predict` p99 {} → {} ms during the appends, {} refused",
        at("live-memory.json:results.0.half_b_before.filter_after.P@1", ".2f"),
        at("live-memory.json:results.0.half_b_after.filter_after.P@1", ".2f"),
        at("live-memory.json:results.0.predict_alone.p99_ms", ".0f"),
        at("live-memory.json:results.0.predict_during_appends.p99_ms", ".0f"),
        at("live-memory.json:results.0.predict_during_appends.non_200", "d"),
    ),
    F(
        TODAY,
        "export speed ({}) | memory encoding {} texts/s with ONNX on the CPU against {} with torch",
        of(lambda gpu: "no GPU" if gpu is None else gpu, "export-speed.json:gpu"),
        at("export-speed.json:encode_texts_per_s.onnx_cpu", ".1f"),
        at("export-speed.json:encode_texts_per_s.torch_cpu", ".1f"),
    ),
    F(
        TODAY,
        "`make serve`'s venv {} MB, installed in {} s; images: serving {} MB, train {} MB, CUDA {} MB and Ray {} MB",
        at(f"{IMG}:host_venv.serve_venv_mb", ",d"),
        at(f"{IMG}:host_venv.install_seconds", "d"),
        at(image("xmcserve-serve:0.1.0"), ",.0f"),
        at(image("xmcserve-train:0.1.0"), ",.0f"),
        at(image("xmcserve-serve-gpu:0.1.0"), ",.0f"),
        at(image("xmcserve-ray:0.1.0"), ",.0f"),
    ),
    F(
        TODAY,
        "loss {} against {} after one epoch, dev P@1 {} both",
        at("ddp-parity.json:epochs_1.one_process.epochs.1.loss", ".5f"),
        at("ddp-parity.json:epochs_1.2_processes.epochs.1.loss", ".5f"),
        of(
            lambda a, b: f"{a:.1f}" if a == b else "?",
            "ddp-parity.json:epochs_1.one_process.epochs.1.rae.P@1",
            "ddp-parity.json:epochs_1.2_processes.epochs.1.rae.P@1",
        ),
    ),
    # -- README.md: the headline figures --------------------------------------------------------------
    F(
        TOP,
        "P@1 {}, P@5 {}, PSP@5 {}, R@100 {} (Omikuji Bonsai: {} / {} / {} / {}; TF-IDF + one-vs-rest logistic"
        " regression"
        " {} / {} / {} / {}); {}× the batched q/s and {}× the idle p50",
        *(at(f"{DEB}:metrics.{m}", ".2f") for m in ("P@1", "P@5", "PSP@5", "R@100")),
        *(at(f"{QD}:systems.omikuji-bonsai.{m}", ".2f") for m in ("P@1", "P@5", "PSP@5", "R@100")),
        *(at(f"{QD}:systems.tfidf-ovr-logreg.{m}", ".2f") for m in ("P@1", "P@5", "PSP@5", "R@100")),
        of(
            lambda a, b: a / b,
            f"{FMS}:{SERVE_COST}.batched_queries_per_second",
            f"{FMS}:{SERVE_COST_ALONE}.batched_queries_per_second",
            fmt=".2f",
        ),
        of(lambda a, b: a / b, f"{FMS}:{SERVE_COST}.idle_p50_ms", f"{FMS}:{SERVE_COST_ALONE}.idle_p50_ms", fmt=".2f"),
    ),
    F(
        TOP,
        "P@1 {}, P@5 {}, PSP@5 {}, R@100 {} (Omikuji Bonsai, the best peer: {} / {} / {} / {};"
        " TF-IDF + one-vs-rest logistic regression {} / {} / {} / {})",
        *(at(f"{GUT}:systems.xmcserve-fit.{m}", ".2f") for m in ("P@1", "P@5", "PSP@5", "R@100")),
        *(at(f"{GUT}:systems.omikuji-bonsai.{m}", ".2f") for m in ("P@1", "P@5", "PSP@5", "R@100")),
        *(at(f"{GUT}:systems.tfidf-ovr-logreg.{m}", ".2f") for m in ("P@1", "P@5", "PSP@5", "R@100")),
    ),
    F(
        TOP,
        "| serving, default bundle | peak {} q/s ({}× a naive server), idle p50 {} ms, p99 at 70 % of peak {} ms, {}"
        " refused,"
        " HNSW recall@10 {}; answers identical alone and in any batch. Targets: peak ≥ 0.9× the encoder alone"
        " **missed**"
        " ({}×), idle p50 ≤ 1.5× a batch-1 encoder call **missed** ({}×), p99 at 70 % ≤ 2 full-batch times met ({}) |",
        at(f"{S}:peak_qps", ".1f"),
        at(f"{S}:ratios.peak_over_naive", ".2f"),
        at(f"{S}:idle_p50_ms", ".2f"),
        at(f"{S}:p99_ms_at_70pct_peak", ".1f"),
        at(f"{S}:ratios.refused_fraction_at_70pct", ".0f"),
        at(f"{S}:recall_at_10", ".4f"),
        at(f"{S}:ratios.peak_over_encoder_b32", ".3f"),
        at(f"{S}:ratios.idle_p50_over_encoder_b1_ms", ".2f"),
        at(f"{S}:ratios.p99_at_70pct_over_full_batch", ".2f"),
    ),
    F(
        TOP,
        "{} q/s batched, idle p50 {} ms; the fusion over the memory's candidates alone {} q/s, {} ms in the same run",
        at(f"{FMS}:{SERVE_COST}.batched_queries_per_second", ".1f"),
        at(f"{FMS}:{SERVE_COST}.idle_p50_ms", ".2f"),
        at(f"{FMS}:{SERVE_COST_ALONE}.batched_queries_per_second", ".1f"),
        at(f"{FMS}:{SERVE_COST_ALONE}.idle_p50_ms", ".2f"),
    ),
    F(
        TOP,
        "P@1 {}, P@5 {}, PSP@5 {}, R@100 {} (Annif 1.4's tuned ensemble: {} / {} / {} / {};"
        " TF-IDF + one-vs-rest logistic regression {} / {} / {} / {})",
        *(at(f"{COOK}:metrics.{m}", ".2f") for m in ("P@1", "P@5", "PSP@5", "R@100")),
        *(at(f"{COOKP}:annif-ensemble.{m}", ".2f") for m in ("P@1", "P@5", "PSP@5", "R@100")),
        *(at(f"{COOKP}:tfidf-ovr-logreg.{m}", ".2f") for m in ("P@1", "P@5", "PSP@5", "R@100")),
    ),
    F(
        TOP,
        "accepted p99 {} s (default 1 s deadline), {} s with `timeout_ms` 100",
        of(lambda ms: ms / 1000, f"{OL}:{OL150}.accepted_p99_ms", fmt=".2f"),
        of(lambda ms: ms / 1000, f"{OL}:{OL150T}.accepted_p99_ms", fmt=".2f"),
    ),
    F(
        TOP,
        "appending half of dev lifts the other half's P@1 {} → {}; {} instances/s",
        at("live-memory.json:results.0.half_b_before.filter_after.P@1", ".1f"),
        at("live-memory.json:results.0.half_b_after.filter_after.P@1", ".1f"),
        at("live-memory.json:results.0.in_process_instances_per_s", ".0f"),
    ),
    F(
        TOP,
        "recall@10 {} at ef 50, {} at ef 300; {} B per label",
        at("ann-scale.json:1000000.by_ef.50.recall_at_10", ".4f"),
        at("ann-scale.json:1000000.by_ef.300.recall_at_10", ".1f"),
        at("ann-scale.json:1000000.bytes_per_label", ".0f"),
    ),
    F(
        TOP,
        "generate {} s, train {} s, export {} s, serve p50 {} ms, evaluate {} s",
        at("million-e2e.json:stages.generate.seconds", ".0f"),
        at("million-e2e.json:stages.train.seconds", ".0f"),
        at("million-e2e.json:stages.export.seconds", ".0f"),
        at("million-e2e.json:stages.serve.p50_ms", ".1f"),
        at("million-e2e.json:stages.evaluate.seconds", ".0f"),
    ),
    F(
        TOP,
        "`make serve`'s measured {} GB (torch's CPU build {} GB of it), `make test`'s {} GB",
        of(lambda mb: mb / 1000, f"{IMG}:host_venv.serve_venv_mb", fmt=".1f"),
        of(lambda mb: mb / 1000, f"{IMG}:host_venv.largest_in_serve_venv_mb.torch", fmt=".2f"),
        of(lambda mb: mb / 1000, f"{IMG}:host_venv.dev_venv_mb", fmt=".1f"),
    ),
    # -- deploy/README.md: the images and the checks --------------------------------------------------
    *(
        F(DEPLOY, f"| {row} | {{}} MB | {{}} ", at(image(name), ",.0f"), at(image(name, "build_seconds"), ".0f"))
        for row, name in [
            ("`xmcserve-serve:0.1.0`", "xmcserve-serve:0.1.0"),
            ("`xmcserve-loadtest:0.1.0`", "xmcserve-loadtest:0.1.0"),
            (
                "`xmcserve-train:0.1.0` (torch 2.13.0 CPU, transformers, ONNX Runtime, LightGBM and its libgomp1, the"
                " offline MiniLM)",
                "xmcserve-train:0.1.0",
            ),
            (
                "`xmcserve-serve-gpu:0.1.0`, **on a stand-in base** (Debian bookworm, no CUDA; `onnxruntime-gpu`"
                " 1.31.1)",
                "xmcserve-serve-gpu:0.1.0",
            ),
            (
                "`xmcserve-ray:0.1.0`, **on a stand-in base** (Python 3.11 + `ray[serve]==2.60.0`, 802 MB)",
                "xmcserve-ray:0.1.0",
            ),
            (
                "`xmcserve-serve:0.1.0` before `bundle/` was copied in, after main gained the observability"
                " dependencies (2026-11-25)",
                "xmcserve-serve:0.1.0 (after merging main)",
            ),
        ]
    ),
    F(
        DEPLOY,
        "(2026-11-25) | {} MB ({} MB over its base) | {} ",
        at(image("xmcserve-train:0.1.0 (before merging main)"), ",.0f"),
        at(image("xmcserve-train:0.1.0 (before merging main)", "size_over_base_mb"), ",d"),
        at(image("xmcserve-train:0.1.0 (before merging main)", "build_seconds"), ".0f"),
    ),
    F(
        DEPLOY,
        "`make image-check` on the serving image of 2026-11-27 (bundle `{}` mounted read-only, root filesystem"
        " read-only):"
        " `/readyz` 200 after {} s; `/predict` answered (top label `apache2` for a question on a static IP address);"
        " `/metrics` answered with {} `xmcserve_*` families; the image's `HEALTHCHECK` command exits 0 inside the"
        " container;"
        " no torch, no compiler, uid 10001; `stop -t 30` under 4 clients' load: exit status {} after {} s, {} requests"
        " answered, {} refused once the listener had closed, none lost.",
        of(lambda body: re.search(r"rae-memory-64d-\w+", body).group(), f"{IMG}:image_check.checks./predict"),
        of(seconds_after, f"{IMG}:image_check.checks./readyz", fmt=".1f"),
        of(first_number, f"{IMG}:image_check.checks./metrics", fmt=".0f"),
        of(lambda d: json.loads(d)["exit_code"], f"{IMG}:image_check.checks.SIGTERM drain", fmt="d"),
        of(lambda d: json.loads(d)["stop_seconds"], f"{IMG}:image_check.checks.SIGTERM drain", fmt=".2f"),
        of(lambda d: json.loads(d)["answers"]["200"], f"{IMG}:image_check.checks.SIGTERM drain", fmt="d"),
        of(lambda d: json.loads(d)["answers"]["refused"], f"{IMG}:image_check.checks.SIGTERM drain", fmt="d"),
    ),
    F(
        DEPLOY,
        "(A build of 2026-11-25 passed the same check with bundle `{}`: ready after {} s, stopped after {} s, {}"
        " answered,"
        " none lost.)",
        of(
            lambda body: re.search(r"rae-memory-64d-\w+", body).group(),
            f"{IMG}:before_merge.image_check.checks./predict",
        ),
        of(seconds_after, f"{IMG}:before_merge.image_check.checks./readyz", fmt=".1f"),
        of(lambda d: json.loads(d)["stop_seconds"], f"{IMG}:before_merge.image_check.checks.SIGTERM drain", fmt=".2f"),
        of(lambda d: json.loads(d)["answers"]["200"], f"{IMG}:before_merge.image_check.checks.SIGTERM drain", fmt="d"),
    ),
    F(
        DEPLOY,
        "built the default bundle in {} s ({} s with the container's start), exit {}, bundle `{}` ({} labels, encoder"
        " parity"
        " {}); the image before the merge built the same bundle in {} s",
        at(f"{IMG}:train_image_run.export_build_seconds", ".0f"),
        at(f"{IMG}:train_image_run.container_seconds", "d"),
        at(f"{IMG}:train_image_run.exit_code", "d"),
        at(f"{IMG}:train_image_run.bundle_id"),
        of(lambda n: f"{n:,}".replace(",", " "), f"{IMG}:train_image_run.counts.labels"),
        at(f"{IMG}:train_image_run.parity.max_abs_diff", short_e),
        at(f"{IMG}:train_image_run_before_merging_main.export_build_seconds", ".0f"),
    ),
    F(
        DEPLOY,
        "it passed the same checks as the CPU image (ready after {} s, drained in {} s, none lost)",
        of(seconds_after, (IMG, ("image_check xmcserve-serve-gpu:0.1.0", "checks", "/readyz")), fmt=".1f"),
        of(
            lambda d: json.loads(d)["stop_seconds"],
            (IMG, ("image_check xmcserve-serve-gpu:0.1.0", "checks", "SIGTERM drain")),
            fmt=".2f",
        ),
    ),
    F(
        DEPLOY,
        "answered `/readyz` 200 after {} s and a `/predict` (top label `apache2`); `serve run` exited {}",
        at(f"{IMG}:ray_image_run.readyz_200_after_s", "d"),
        of(lambda text: text.replace(",", ""), f"{IMG}:ray_image_run.serve_run_exit"),
    ),
    *(F(DEPLOY, "{}", at(f"{IMG}:compose_check.locust.table.{line}")) for line in range(7)),
    F(
        DEPLOY,
        "Prometheus: both targets up; {} texts answered by `api`, {} received by `shadow` and {} compared by `api`",
        at(f"{IMG}:compose_check.prometheus.api_texts", ".0f"),
        at(f"{IMG}:compose_check.prometheus.shadow_texts", ".0f"),
        at(f"{IMG}:compose_check.prometheus.compared_texts", ".0f"),
    ),
    F(
        DEPLOY,
        "`api` exit {} after {} s, `shadow` after {} s. Earlier runs on the first image: one passed (p99 {} ms, {}"
        " requests/s)",
        at(f"{IMG}:compose_check.stop.api.exit_code", "d"),
        at(f"{IMG}:compose_check.stop.api.stop_seconds", "g"),
        at(f"{IMG}:compose_check.stop.shadow.stop_seconds", "g"),
        of(lambda line: line.split()[5], f"{IMG}:before_merge.compose_check.locust.table.4"),
        of(lambda line: line.split()[2], f"{IMG}:before_merge.compose_check.locust.table.4"),
    ),
    F(
        DEPLOY,
        "missed the SLO at p99 {} ms",
        of(lambda text: re.search(r"p99 (\d+) ms", text).group(1), f"{IMG}:compose_check_earlier_run.locust"),
    ),
    # -- docs/ ---------------------------------------------------------------------------------------
    F(
        "docs/operations.md",
        "one process with all the cores and the CUDA provider peaks at {} q/s, its own CPU work the limit; 4 workers of"
        " 3 cores each over the same GPU answer {} q/s and 12 of one core {}.",
        at("gpu.json:summary.peak_qps", ",.0f"),
        at("gpu-h200-workers-cuda-3cores.json:summary.scaling_peak_qps.4", ",.0f"),
        at("gpu-h200-workers-cuda-1core.json:summary.scaling_peak_qps.12", ",.0f"),
    ),
    F(
        "docs/operations.md",
        "On the CPU provider 8 workers of one core answered {}× one.",
        of(lambda q: q["8"] / q["1"], "gpu.json:summary.scaling_peak_qps", fmt=".2f"),
    ),
]


def one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize("figure", FIGURES, ids=lambda f: f"{f.page}: {f.text[:60]}")
def test_each_figure_a_page_states_is_its_result_files_value(figure):
    page = one_line((ROOT / figure.page).read_text())
    assert one_line(figure.rendered()) in page


def today_rows() -> list[str]:
    text = (ROOT / TODAY).read_text()
    section = text[
        text.index("\n## What holds today\n") : text.index("\n## ", text.index("\n## What holds today\n") + 1)
    ]
    return [
        line for line in section.splitlines() if line.startswith("| ") and not line.startswith(("| benchmark", "| ---"))
    ]


def test_what_holds_today_fits_a_screen():
    text = (ROOT / TODAY).read_text()
    start = text.index("\n## What holds today\n")
    section = text[start + 1 : text.index("\n## ", start + 1)]
    assert len(section.splitlines()) <= 40 and len(today_rows()) <= 32


def test_every_row_of_what_holds_today_with_a_json_file_has_its_figures_checked():
    checked = [one_line(f.rendered()) for f in FIGURES if f.page == TODAY]
    unchecked = [
        row.split(" | ")[0].strip("| ")
        for row in today_rows()
        if ".json" in row and not any(text in one_line(row) for text in checked)
    ]
    assert unchecked == []


def test_the_check_reads_the_page_and_the_file():
    figure = F(TODAY, "peak {} q/s", at(f"{S}:peak_qps", ".1f"))
    assert figure.rendered() == f"peak {result(S)['peak_qps']:.1f} q/s"
    assert F(TODAY, "{}", at(f"{S}:ratios.peak_over_naive", met)).rendered() == "met"
    assert F(TODAY, "{}", at(f"{S}:recall_at_10", lambda v: "x")).rendered() == "x"
