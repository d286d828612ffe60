"""A tiny-DistilBERT RAE memory of a training split and a run holding some of its instances out:
what a fusion is fitted on, built alike by the tests of export.fuse and of the benchmarks."""

from pathlib import Path

import numpy as np

from export.build import ExportParams, build_bundle
from xmc.checkpoint import HOLDOUT_FILE
from xmc.data import XMCDataset


def memory_and_run(train: XMCDataset, distilbert_dir: Path, tmp_path_factory, name: str, held: int = 150):
    """(bundle, run): the memory of every instance of ``train`` (16-d, top b 50) and a run
    directory whose holdout file names ``held`` of them (seeded)."""
    bundle = tmp_path_factory.mktemp("bundles") / name
    build_bundle(bundle, train.labels, train, distilbert_dir, ExportParams(dim=16, rae_top_b=50))
    run = tmp_path_factory.mktemp("run")
    rows = np.random.default_rng(0).choice(len(train), held, replace=False)
    (run / HOLDOUT_FILE).write_text("".join(f"{train.uids[r]}\n" for r in rows))
    return bundle, run
