"""Train a UniDEC checkpoint (optionally with the RAE-XMC loss) from a YAML config.

    python -m training.train --config training/configs/debian-unidec.yaml [--resume] [--set key=value ...]

Writes ``<out_dir>/checkpoint`` (last epoch) and ``<out_dir>/best`` (best ``select_metric``),
both in the layout ``export.build --checkpoint`` reads, plus ``train_log.jsonl`` (losses and
dev metrics per epoch), ``params.yaml`` and ``state.pt`` (for ``--resume``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from training.params import load_params
from training.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=None, help="YAML file of TrainParams fields")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--resume", action="store_true", help="continue the run in out_dir from its state.pt")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    params = load_params(args.config, args.overrides)
    last = Trainer(params).fit(resume=args.resume)
    print(json.dumps({"out_dir": params.out_dir, **{k: last.get(k) for k in ("epoch", "train_seconds", "dev")}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
