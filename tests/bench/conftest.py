import numpy as np
import pytest

from export.build import ExportParams, build_bundle
from xmc.checkpoint import HOLDOUT_FILE
from xmc.data import load_jsonl_split


@pytest.fixture(scope="session")
def memory_and_run(sample_dir, distilbert_dir, tmp_path_factory):
    """A tiny-DistilBERT RAE memory of the whole sample and a run holding 150 of its instances out."""
    train = load_jsonl_split(sample_dir, "trn")
    bundle = tmp_path_factory.mktemp("bundles") / "tiny"
    build_bundle(bundle, train.labels, train, distilbert_dir, ExportParams(dim=16, rae_top_b=50))
    run = tmp_path_factory.mktemp("run")
    held = np.random.default_rng(0).choice(len(train), 150, replace=False)
    (run / HOLDOUT_FILE).write_text("".join(f"{train.uids[r]}\n" for r in held))
    return bundle, run
