"""Gandalf (training.gandalf): label texts as queries with co-occurrence soft targets, and a run
that trains on them."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from training.batching import PslBatcher
from training.gandalf import label_points
from training.train_params import load_params
from training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]

# 4 instances, 4 labels: {0, 1}, {0, 1, 2}, {0}, {2}; label 3 is never positive
Y = sp.csr_matrix(np.array([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 1, 0]], dtype=np.float32))


def test_soft_targets_are_conditional_co_occurrence_above_the_threshold():
    # Ĝ: G00 = 3, G11 = 2, G22 = 2, G01 = 2, G02 = 1, G12 = 1; point j's target i is Ĝ_ij / Ĝ_jj
    points = label_points(Y, threshold=0.1)
    assert points.labels.tolist() == [0, 1, 2]  # label 3 co-occurs with nothing: no point
    expected = [[0, 2 / 3, 1 / 3, 0], [1, 0, 1 / 2, 0], [1 / 2, 1 / 2, 0, 0]]  # own label: not a target
    np.testing.assert_allclose(points.targets.toarray(), expected, rtol=1e-6)
    strict = label_points(Y, threshold=0.4)
    np.testing.assert_allclose(strict.targets.toarray()[0], [0, 2 / 3, 0, 0], rtol=1e-6)


def test_the_batcher_hands_soft_targets_to_the_losses_as_weights():
    points = label_points(Y, threshold=0.1)
    rows = sp.vstack([Y, points.targets]).tocsr()
    own = [set(), set(), set(), set()] + [{int(j)} for j in points.labels]
    batcher = PslBatcher(rows, own, 5, 0, np.random.default_rng(0), soft_targets=True)
    batch = batcher.make(np.array([0, 4]))  # instance 0 and the point of label 0
    assert batch.positives.dtype == np.float32
    weights = dict(zip(batch.pool.tolist(), batch.positives[1].tolist(), strict=True))
    assert weights[1] == pytest.approx(2 / 3) and weights[2] == pytest.approx(1 / 3)
    assert batch.ignore[1, batch.pool.tolist().index(0)]  # the point's own label: neither
    hard = PslBatcher(Y, own[:4], 5, 0, np.random.default_rng(0))
    assert hard.make(np.array([0, 1])).positives.dtype == bool  # without Gandalf: as before


def test_a_run_trains_on_instances_then_label_points(distilbert_dir, tmp_path):
    command = [sys.executable, str(ROOT / "data" / "make_sample.py"), "--src", str(ROOT / "data" / "debian-sample")]
    subprocess.run([*command, "--out", str(tmp_path / "data"), "--n-trn", "300", "--n-dev", "60"], check=True)
    overrides = {
        "data_dir": tmp_path / "data",
        "encoder_dir": distilbert_dir,
        "frozen_layers": 1,
        "max_length": 32,
        "batch_size": 64,
        "epochs": 1,
        "gandalf": True,
        "out_dir": tmp_path / "run",
        "cache_dir": tmp_path / "cache",
    }
    trainer = Trainer(load_params(None, [f"{k}={v}" for k, v in overrides.items()]))
    instances, points = len(trainer.train), len(trainer.points)
    assert points > 100 and trainer.batcher.Y.shape[0] == instances + points
    last = trainer.fit()
    assert last["batches"] == -(-(instances + points) // 64) and np.isfinite(last["loss"])
    # a point's query vector is its label's text encoded as a query
    row = instances + 3
    trainer.model.eval()  # no dropout: the two passes must agree
    label = trainer.points.labels[3]
    pooled = trainer.forward.pooled_queries(trainer.queries, trainer.labels, np.array([0, row]))
    direct = trainer.embedder.pooled_batch(trainer.labels, np.array([label]))
    np.testing.assert_allclose(pooled[1].detach().numpy(), direct[0].detach().numpy(), atol=1e-6)
