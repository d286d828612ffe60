"""Train a UniDEC checkpoint (optionally with the RAE-XMC loss) from a YAML config.

    python -m training.train --config debian-unidec [--resume] [--set key=value ...]

Data-parallel on N processes (GPUs, or CPU processes over gloo; see :mod:`training.distributed`):

    python -m torch.distributed.run --nproc_per_node N -m training.train --config CONFIG

Writes ``<out_dir>/checkpoint`` (last epoch) and ``<out_dir>/best`` (best ``select_metric``),
both in the layout ``export.build --checkpoint`` reads, plus ``train_log.jsonl`` (losses and
dev metrics per epoch), ``params.yaml`` and ``state.pt`` (for ``--resume``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from training.distributed import close_world, init_world
from training.embedder import pick_device
from training.train_params import load_params
from training.trainer import Trainer
from xmc.command import program


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=program("training.train"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="RECIPE",
        help="a YAML file of TrainParams fields, or the name of a shipped recipe (debian-unidec, smoke, ...)",
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override one parameter"
    )
    parser.add_argument("--resume", action="store_true", help="continue the run in out_dir from its state.pt")
    args = parser.parse_args(argv)
    try:
        params = load_params(args.config, args.overrides)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"training.train: {exc}") from None
    world = init_world(pick_device(params.device))
    # one log and one summary per run: the other ranks say only what goes wrong
    level = logging.INFO if world.is_main else logging.WARNING
    logging.basicConfig(level=level, format=f"%(asctime)s rank {world.rank} %(name)s %(message)s")
    try:
        last = Trainer(params, world).fit(resume=args.resume)
    finally:
        close_world(world)
    if world.is_main:
        summary = {k: last.get(k) for k in ("epoch", "train_seconds", "processes", "dev")}
        print(json.dumps({"out_dir": params.out_dir, **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
