"""Tune the inference-time RAE parameters (λ, τ, b) of a trained run on the dev split.

    python -m training.sweep --run runs/debian-unidec [--checkpoint checkpoint|best] \\
        [--lambdas 0.3,0.5,0.7] [--taus 0.03,0.05] [--top-b 100,200]

Loads the run's exported checkpoint (``checkpoint/``, the last epoch, as ``--resume`` would
continue from; or ``best/``) through :class:`training.embedder.Embedder` with the run's own
params and prefix caches, computes the dev, label and memory vectors once, and ranks every
combination by exact search (seconds each). For choosing what to export; the numbers to report
come from the exported bundle through ``export.evaluate``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
from pathlib import Path

from bundle import build_values
from training.embedder import Embedder, pick_device
from training.embedding_eval import DevVectors, rank_rae
from training.train_params import TrainParams, load_params
from xmc.checkpoint import PARAMS_FILE, default_encoder_dir
from xmc.data import XMCDataset, load_train_and_dev
from xmc.metrics import score_ranking


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def run_vectors(params: TrainParams, checkpoint: Path, train: XMCDataset, dev: XMCDataset) -> DevVectors:
    """The served dev, label and training-instance vectors of ``checkpoint``."""
    base_encoder_dir = Path(params.encoder_dir) if params.encoder_dir else default_encoder_dir()
    embedder = Embedder.from_checkpoint(checkpoint, params, base_encoder_dir, pick_device(params.device))
    return embedder.dev_vectors(
        embedder.side(dev.texts, "dev"),
        embedder.side(train.labels.texts, "labels"),
        embedder.side(train.texts, "train"),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--run", type=Path, required=True, help="training run directory: its params file and checkpoints"
    )
    parser.add_argument("--checkpoint", default="checkpoint", help="the run's checkpoint to sweep: checkpoint | best")
    parser.add_argument(
        "--lambdas",
        default="0.3,0.5,0.7",
        help="comma list of λ values to try: weight of the training-instance memory against the labels",
    )
    parser.add_argument("--taus", default="0.03,0.04,0.06", help="comma list of softmax temperatures τ to try")
    parser.add_argument(
        "--top-b", default="100,200,400", help="comma list of b values to try: memory keys retrieved per query"
    )
    parser.add_argument("--modes", default="joint,split", help="RAE weighting modes (engine.rae)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    params = load_params(args.run / PARAMS_FILE, [f"out_dir={args.run}"])
    train, dev = load_train_and_dev(
        params.data_dir, params.train_split, params.dev_split, params.max_train, params.max_dev
    )
    if dev is None:
        parser.error(f"{args.run / PARAMS_FILE}: the run has no dev split to sweep on")
    vectors = run_vectors(params, args.run / args.checkpoint, train, dev)
    query, memory = vectors.query, vectors.memory
    exclude = dev.filter_sets()
    rows = []
    grid = itertools.product(
        args.modes.split(","), floats(args.lambdas), floats(args.taus), [int(b) for b in args.top_b.split(",")]
    )
    for mode, lam, tau, top_b in grid:
        values = build_values(train.Y, lam)
        ranked = rank_rae(query, memory, values, len(train), tau, top_b, params.eval_k, exclude, mode)
        scores = score_ranking(ranked, dev, train)
        rows.append({"mode": mode, "lambda": lam, "tau": tau, "top_b": top_b, **scores})
        print(json.dumps(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
