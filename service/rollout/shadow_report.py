"""Summarise shadow comparison logs, to decide whether to promote the candidate.

    python -m service.rollout.shadow_report shadow.jsonl [shadow.jsonl.1 ...] [--worst 10] [--json]

Prints the agreement distribution (overlap@k, Kendall's τ and the score delta on shared labels),
the queries on which the two bundles disagree most, and the shadow-minus-primary latency
percentiles.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

OVERLAP_BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


class NotJson(ValueError):
    """A line of a shadow log that is not JSON; the message names the file and line."""


def read_records(paths: list[Path]) -> list[dict]:
    """Every record of the logs ``paths``, in order (:class:`NotJson` on a line that is not JSON)."""
    records = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise NotJson(f"{path}:{lineno}: not JSON ({exc.msg})") from None
    return records


def summarise(records: list[dict], worst: int = 10) -> dict:
    if not records:
        return {"records": 0}
    overlap = np.array([r["overlap"] for r in records])
    taus = np.array([r["kendall_tau"] for r in records if r.get("kendall_tau") is not None])
    score_deltas = np.array([r["score_delta"] for r in records if r.get("score_delta") is not None])
    delta_ms = np.array([r["shadow_ms"] - r["primary_ms"] for r in records])
    counts, _ = np.histogram(overlap, bins=OVERLAP_BINS)
    disagree = sorted(records, key=lambda r: (r["overlap"], r.get("kendall_tau") or 0.0))[:worst]
    return {
        "records": len(records),
        "overlap": {
            "mean": round(float(overlap.mean()), 4),
            "p10": round(float(np.percentile(overlap, 10)), 4),
            "p50": round(float(np.percentile(overlap, 50)), 4),
            "share_identical_sets": round(float((overlap >= 1.0).mean()), 4),
            "histogram": {
                f"[{lo:.1f},{hi:.1f}{']' if hi == 1.0 else ')'}": int(c)
                for lo, hi, c in zip(OVERLAP_BINS, OVERLAP_BINS[1:], counts, strict=False)
            },
        },
        "kendall_tau": {
            "mean": round(float(taus.mean()), 4) if taus.size else None,
            "p10": round(float(np.percentile(taus, 10)), 4) if taus.size else None,
            "records_with_2plus_shared": int(taus.size),
        },
        "score_delta": {
            "mean": round(float(score_deltas.mean()), 5) if score_deltas.size else None,
            "p50": round(float(np.percentile(score_deltas, 50)), 5) if score_deltas.size else None,
            "p95": round(float(np.percentile(score_deltas, 95)), 5) if score_deltas.size else None,
            "records_with_shared": int(score_deltas.size),
        },
        "latency_delta_ms": {f"p{q}": round(float(np.percentile(delta_ms, q)), 2) for q in (50, 95, 99)},
        "most_disagreeing": [
            {
                "text": r.get("text"),  # logged only with XMCSERVE_SHADOW_LOG_TEXTS
                "text_sha256": r.get("text_sha256"),
                "overlap": r["overlap"],
                "kendall_tau": r.get("kendall_tau"),
                "primary_top": r.get("primary_top", [])[:5],
                "shadow_top": r.get("shadow_top", [])[:5],
            }
            for r in disagree
        ],
    }


def format_summary(summary: dict) -> str:
    if not summary["records"]:
        return "no shadow comparisons in the log"
    o, t, d = summary["overlap"], summary["kendall_tau"], summary["latency_delta_ms"]
    s = summary["score_delta"]
    lines = [
        f"{summary['records']} mirrored texts",
        f"overlap@k   mean {o['mean']:.3f}   p10 {o['p10']:.3f}   p50 {o['p50']:.3f}   "
        f"identical sets {100 * o['share_identical_sets']:.1f}%",
        "  " + "   ".join(f"{bin_}: {count}" for bin_, count in o["histogram"].items()),
        f"kendall tau on shared labels   mean {t['mean']}   p10 {t['p10']}   "
        f"({t['records_with_2plus_shared']} texts with 2+ shared labels)",
        f"|score A - score shadow| on shared labels   mean {s['mean']}   p50 {s['p50']}   p95 {s['p95']}",
        f"latency shadow - primary (ms)   p50 {d['p50']}   p95 {d['p95']}   p99 {d['p99']}",
        "most disagreeing:",
    ]
    for r in summary["most_disagreeing"]:
        named = r["text"][:70] if r["text"] is not None else f"text sha256 {r['text_sha256']}"
        lines.append(f"  overlap {r['overlap']:.2f}  {named}")
        lines.append(f"      A: {', '.join(r['primary_top'])}")
        lines.append(f"      B: {', '.join(r['shadow_top'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "logs", nargs="+", type=Path, help="shadow comparison log files (JSON lines), e.g. a log and its rotated parts"
    )
    parser.add_argument("--worst", type=int, default=10, help="how many of the most disagreeing queries to list")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    try:
        records = read_records(args.logs)
    except NotJson as exc:
        raise SystemExit(str(exc)) from None
    summary = summarise(records, args.worst)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
