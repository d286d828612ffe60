"""Tune the inference-time RAE parameters (λ, τ, b) of a trained run on the dev split.

    python -m training.sweep --run runs/debian-unidec [--lambdas 0.3,0.5,0.7] [--taus 0.03,0.05] [--top-b 100,200]

Loads the run's state (as ``--resume`` does), computes the dev, label and memory vectors once,
and ranks every combination by exact search (seconds each). For choosing what to export; the
numbers to report come from the exported bundle through ``training.evaluate``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
from pathlib import Path

from service.engine.rae import build_values
from training.embedding_eval import rank_rae, score_ranking
from training.params import load_params
from training.trainer import PARAMS_FILE, Trainer


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--lambdas", default="0.3,0.5,0.7")
    parser.add_argument("--taus", default="0.03,0.04,0.06")
    parser.add_argument("--top-b", default="100,200,400")
    parser.add_argument("--modes", default="joint,split", help="RAE weighting modes (service.engine.rae)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    params = load_params(args.run / PARAMS_FILE, [f"out_dir={args.run}"])
    trainer = Trainer(params)
    trainer.resume()
    vectors = trainer.dev_vectors()
    query, memory = vectors.query, vectors.memory
    exclude = trainer.dev.filter_sets()
    rows = []
    grid = itertools.product(
        args.modes.split(","), floats(args.lambdas), floats(args.taus), [int(b) for b in args.top_b.split(",")]
    )
    for mode, lam, tau, top_b in grid:
        values = build_values(trainer.train.Y, lam)
        ranked = rank_rae(query, memory, values, len(trainer.train), tau, top_b, params.eval_k, exclude, mode)
        scores = score_ranking(ranked, trainer.dev, trainer.train)
        rows.append({"mode": mode, "lambda": lam, "tau": tau, "top_b": top_b, **scores})
        print(json.dumps(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
