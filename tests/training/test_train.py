"""The smoke configuration end to end: train on the sample, resume, export, serve the same vectors."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.bundle import load_bundle
from engine.search import Predictor
from export.build import ExportParams, build_bundle
from training.embedder import TextSide
from training.sweep import main as sweep_main
from training.sweep import run_vectors
from training.train import main as train_main
from training.train_params import load_params
from training.trainer import STATE_FILE, Trainer
from xmc.checkpoint import HOLDOUT_FILE, LOG_FILE, ServingHead, load_checkpoint
from xmc.data import LabelSpace, load_jsonl_split

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "training" / "configs" / "smoke.yaml"


def smoke_params(tmp: Path, data_dir: Path, **overrides):
    values = [f"data_dir={data_dir}", f"out_dir={tmp / 'run'}", f"cache_dir={tmp / 'cache'}"]
    return load_params(SMOKE, values + [f"{k}={v}" for k, v in overrides.items()])


@pytest.fixture(scope="module")
def mini_sample(tmp_path_factory) -> Path:
    """The smoke configuration's 1,000 + 300 instances drawn from the shipped sample with only
    the labels they use (4,361 of 12,078): the run exercises the same code on a third of the
    label encoding, which is most of its time."""
    out = tmp_path_factory.mktemp("mini-sample")
    command = [sys.executable, str(ROOT / "data" / "make_sample.py"), "--src", str(ROOT / "data" / "debian-sample")]
    subprocess.run([*command, "--out", str(out), "--n-trn", "1000", "--n-dev", "300"], check=True, timeout=120)
    return out


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, mini_sample):
    tmp = tmp_path_factory.mktemp("smoke")
    params = smoke_params(tmp, mini_sample, holdout=50)
    trainer = Trainer(params)
    trainer.fit()
    shutil.copytree(Path(params.out_dir) / "checkpoint", tmp / "epoch2")  # the resume test moves on
    return tmp, params, trainer


def read_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / LOG_FILE).read_text().splitlines()]


def test_smoke_run_logs_losses_and_dev_metrics_per_epoch(smoke_run):
    tmp, params, _ = smoke_run
    start, *lines = read_log(Path(params.out_dir))
    # epoch 0 is the starting point: pretrained encoder, PCA heads, Ψ from the label texts
    assert start["epoch"] == 0 and set(start["dev"]) == {"de+clf", "de", "clf", "rae"} and "loss" not in start
    assert [x["epoch"] for x in lines] == [1, 2]
    for line in lines:
        assert math.isfinite(line["loss"]) and line["loss"] > 0
        assert {"de_q2l", "clf_q2l", "de_l2q"} <= set(line)
        assert set(line["dev"]) == {"de+clf", "de", "clf", "rae"}
        assert line["samples_per_second"] > 0 and line["mean_pool_size"] > params.batch_size
    assert lines[1]["loss"] < lines[0]["loss"]
    # the trained RAE memory on 1,000 instances is a real ranker, not noise (random P@1 ≈ 0)
    assert lines[-1]["dev"]["rae"]["P@1"] > 30


def test_held_out_instances_are_listed_and_never_trained_on(smoke_run, mini_sample):
    tmp, params, trainer = smoke_run
    held = (Path(params.out_dir) / HOLDOUT_FILE).read_text().split()
    assert len(held) == 50 and len(trainer.train) == 1000 - 50
    assert not set(held) & set(trainer.train.uids)
    assert set(held) <= set(load_jsonl_split(mini_sample, "trn").uids)


def test_checkpoint_layout_is_what_export_reads(smoke_run):
    _, params, trainer = smoke_run
    for name in ("checkpoint", "best"):
        ckpt = load_checkpoint(Path(params.out_dir) / name)
        assert ckpt.head is not None and ckpt.head.label_table.shape == (trainer.train.num_labels, params.clf_dim)
        assert [b.name for b in ckpt.head.blocks] == ["g1_de", "g2_clf"] and ckpt.head.dim == 64
        assert (ckpt.encoder_dir / "tokenizer.json").is_file()
    assert (Path(params.out_dir) / STATE_FILE).is_file()


def test_sweep_embeds_the_checkpoint_as_training_did_without_a_trainer(smoke_run, capsys):
    tmp, params, trainer = smoke_run
    # the epoch-2 vectors the trainer evaluated last, against the epoch-2 checkpoint reloaded
    trained = trainer.embedder.dev_vectors(trainer.dev_queries, trainer.labels, trainer.queries)
    swept = run_vectors(params, tmp / "epoch2", trainer.train, trainer.dev)
    for name in ("query", "label", "train"):
        np.testing.assert_allclose(getattr(swept, name), getattr(trained, name), atol=1e-5)
    assert swept.de_dim == trained.de_dim == params.de_dim
    # the sweep's row for the run's own RAE settings is the trainer's epoch-2 dev score
    grid = ["--lambdas", str(params.rae_lambda), "--taus", str(params.rae_tau), "--top-b", str(params.rae_top_b)]
    assert sweep_main(["--run", params.out_dir, "--checkpoint", str(tmp / "epoch2"), *grid, "--modes", "joint"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    epoch2 = next(line for line in read_log(Path(params.out_dir)) if line["epoch"] == 2)
    assert row["P@1"] == pytest.approx(epoch2["dev"]["rae"]["P@1"], abs=0.5)


def test_resume_continues_from_the_saved_epoch(smoke_run):
    tmp, params, trainer = smoke_run
    before = trainer.model.psi.detach().clone()
    overrides = [f"--set={x}" for x in overrides_of(params, epochs=3)]
    assert train_main(["--config", str(SMOKE), "--resume", *overrides]) == 0
    lines = read_log(Path(params.out_dir))
    assert [x["epoch"] for x in lines] == [0, 1, 2, 3]
    resumed = ServingHead.load(Path(params.out_dir) / "checkpoint")
    assert resumed.extra["epoch"] == 3 and not np.allclose(resumed.label_table, before.numpy())


def overrides_of(params, **changes) -> list[str]:
    values = {"data_dir": params.data_dir, "out_dir": params.out_dir, "cache_dir": params.cache_dir, **changes}
    return [f"{k}={v}" for k, v in values.items()]


def test_exported_bundle_serves_the_trained_vectors(smoke_run):
    tmp, params, trainer = smoke_run
    out = tmp / "bundle"
    # the first 500 labels: Ψ rows are matched by uid, and encoding all of them adds nothing here
    labels = LabelSpace(trainer.train.labels.uids[:500], trainer.train.labels.texts[:500])
    build_bundle(out, labels, None, tmp / "epoch2", ExportParams(index_kind="labels"))
    bundle = load_bundle(out)
    assert bundle.manifest.source.head == "unidec" and bundle.manifest.dim == 64
    # The ONNX graph computes [N(g1(Φ(x))) ⊕ N(g2(Φ(x)))]/√2 as training does. Only texts that
    # training does not truncate (at params.max_length tokens; the bundle truncates at 128).
    candidates = list(trainer.dev.texts[:200])
    encoded = trainer.tokenizer.encode_batch(candidates)
    texts = [t for t, e in zip(candidates, encoded, strict=True) if sum(e.attention_mask) < params.max_length][:16]
    assert len(texts) == 16
    served, _ = bundle.encoder.encode(texts)
    np.testing.assert_allclose(served, trainer.embedder.serving_vectors(TextSide(texts, None)), atol=2e-4)
    # the label side is N(g1(Φ(z_l))) ⊕ N(Ψ_l)
    stored = np.asarray(bundle.index.vectors([0, 1, 2]))
    psi = trainer.model.psi.detach().numpy()[:3]
    np.testing.assert_allclose(stored[:, 32:], psi / np.linalg.norm(psi, axis=1, keepdims=True) / np.sqrt(2), atol=1e-5)
    # and the served ranking agrees with the exact in-training ranking of the same vectors
    ranked = Predictor(bundle).predict(texts, 5).rankings
    scores = served @ np.asarray(bundle.index.vectors(range(bundle.manifest.counts.labels))).T
    for ranking, row in zip(ranked, scores, strict=True):
        assert len(set(ranking.ids.tolist()) & set(np.argsort(-row)[:5].tolist())) >= 4
