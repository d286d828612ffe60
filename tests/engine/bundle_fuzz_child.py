"""The child process of the bundle fuzz test (test_bundle_fuzz.py): loads each bundle directory it
is given, as a server loads one (:func:`engine.load_predictor`), and
answers a few queries with it, one JSON line per directory on stdout.

Before each directory it writes ``{"dir": ..., "start": true}``: a load or a query that kills the
process (a signal from native code) is then the one started last without an outcome.

Not a test module: ``python -m tests.engine.bundle_fuzz_child`` reads
``{"dirs": [...], "queries": [...], "exclude": uid}`` on stdin.
"""

from __future__ import annotations

import json
import logging
import sys
import time

import numpy as np


def outcome(path: str, queries: list[str], exclude_uid: str) -> dict:
    from bundle import BundleError
    from engine import load_predictor

    try:
        # the checksums are re-sealed and would match: every check behind them runs as in a server
        predictor = load_predictor(path, verify=False)
    except BundleError as exc:
        return {"outcome": "refused", "message": str(exc)[-300:]}
    except Exception as exc:  # anything else escaped the loader's checks: the test fails on it
        return {"outcome": "error", "error": type(exc).__name__, "message": str(exc)[-300:]}
    view = predictor.view
    try:
        excluded = view.label_ids({exclude_uid})
        plain = predictor.predict(queries, k=10)
        without = predictor.predict(queries, k=10, exclude=[excluded] * len(queries))
    except Exception as exc:
        return {"outcome": "error", "error": f"predict: {type(exc).__name__}", "message": str(exc)[-300:]}
    rankings = [r for p in (plain, without) for r in p.rankings]
    labels = view.num_labels
    return {
        "outcome": "served",
        "excluded": sorted(excluded),
        "ids": [r.ids.tolist() for r in rankings],
        "scores": [r.scores.astype(float).round(5).tolist() for r in rankings],
        "finite": all(bool(np.all(np.isfinite(r.scores))) for r in rankings),
        "ids_valid": all(bool(np.all((r.ids >= 0) & (r.ids < labels))) for r in rankings),
        "exclusion_held": all(not set(r.ids.tolist()) & set(excluded) for r in without.rankings),
    }


def main() -> None:
    logging.disable(logging.CRITICAL)  # the loader's info lines would interleave with the answers
    request = json.load(sys.stdin)
    for path in request["dirs"]:
        print(json.dumps({"dir": path, "start": True}), flush=True)
        started = time.perf_counter()
        record = outcome(path, request["queries"], request["exclude"])
        record["seconds"] = round(time.perf_counter() - started, 3)
        print(json.dumps({"dir": path, **record}), flush=True)


if __name__ == "__main__":
    main()
