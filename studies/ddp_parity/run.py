"""Data-parallel training against one process: the smoke configuration with MiniLM, trained once
by one process and once by ``torchrun --nproc_per_node N`` (gloo on the CPU, NCCL on GPUs).

    python -m studies.ddp_parity [--nproc 2] [--out bench/results/ddp-parity.json]

Dropout is switched off in a copy of the encoder (with dropout the ranks draw other masks than
one process does, by design); everything else is the smoke configuration on the same draw of
the sample. Two runs of each: one epoch (the same batches by construction) and ``--epochs``
(from epoch 2 on, clusters and negatives are computed from vectors that differ in the last
bits, so a near tie can put a query in another batch and the runs drift apart like two GPU
runs do). Reported per epoch: the loss, the mean pool size (equal when the batches are), the
RAE dev metrics, samples/s; after each run: the largest and 99th-percentile absolute difference
of every trained weight.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file

from xmc.checkpoint import LOG_FILE, default_encoder_dir
from xmc.results import machine, write_result

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "training" / "configs" / "smoke.yaml"
DROPOUT_KEYS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout")


def encoder_without_dropout(out: Path) -> Path:
    shutil.copytree(default_encoder_dir(), out)
    config = json.loads((out / "config.json").read_text())
    config.update({key: 0.0 for key in DROPOUT_KEYS if key in config})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def train(launcher: list[str], overrides: dict, out_dir: Path) -> float:
    values = {**overrides, "out_dir": out_dir}
    sets = [f"--set={k}={v}" for k, v in values.items()]
    command = [*launcher, "-m", "training.train", "--config", str(SMOKE), *sets]
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, timeout=3600)
    return time.perf_counter() - started


def weight_differences(one: Path, many: Path) -> dict:
    """Max and 99th-percentile |Δ| of every trained head array and encoder tensor that changed."""
    rows = {}
    heads = np.load(one / "checkpoint" / "head.npz"), np.load(many / "checkpoint" / "head.npz")
    encoders = (load_file(run / "checkpoint" / "encoder" / "model.safetensors") for run in (one, many))
    base = load_file(default_encoder_dir() / "model.safetensors")
    pairs = {name: (heads[0][name], heads[1][name]) for name in heads[0].files}
    first, second = encoders
    pairs |= {name: (w, second[name]) for name, w in first.items() if not np.array_equal(w, base.get(name, w + 1))}
    for name, (a, b) in pairs.items():
        diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
        rows[name] = {"max_abs_diff": float(diff.max()), "p99_abs_diff": float(np.quantile(diff, 0.99))}
    return rows


def epochs(run: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run / LOG_FILE).read_text().splitlines()]
    keep = ("epoch", "loss", "mean_pool_size", "samples_per_second", "epoch_seconds", "processes")
    return [{k: line.get(k) for k in keep} | {"rae": line["dev"].get("rae")} for line in lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="processes of the data-parallel run")
    parser.add_argument("--epochs", type=int, default=2, help="epochs of the longer run (the other runs one)")
    parser.add_argument("--n-trn", type=int, default=1000, help="training instances drawn from the sample")
    parser.add_argument("--n-dev", type=int, default=300, help="dev instances drawn from the sample")
    parser.add_argument("--out", type=Path, default=Path("bench/results/ddp-parity.json"), help="JSON result")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="xmcserve-ddp-") as tmp_name:
        tmp = Path(tmp_name)
        draw = [sys.executable, str(ROOT / "data" / "make_sample.py"), "--src", str(ROOT / "data" / "debian-sample")]
        sizes = ["--n-trn", str(args.n_trn), "--n-dev", str(args.n_dev)]
        subprocess.run([*draw, "--out", str(tmp / "data"), *sizes], check=True)
        encoder = encoder_without_dropout(tmp / "encoder")
        overrides = {"data_dir": tmp / "data", "encoder_dir": encoder, "cache_dir": tmp / "cache"}
        train([sys.executable], overrides | {"epochs": 1}, tmp / "warm")  # builds the prefix cache both runs load
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
        runs = {}
        for length in sorted({1, args.epochs}):
            one, many = tmp / f"one-{length}", tmp / f"many-{length}"
            one_seconds = train([sys.executable], overrides | {"epochs": length}, one)
            many_seconds = train(torchrun, overrides | {"epochs": length}, many)
            runs[f"epochs_{length}"] = {
                "one_process": {"wall_seconds": round(one_seconds, 1), "epochs": epochs(one)},
                f"{args.nproc}_processes": {"wall_seconds": round(many_seconds, 1), "epochs": epochs(many)},
                "weights": weight_differences(one, many),
            }
        result = {
            "config": "training/configs/smoke.yaml, MiniLM without dropout",
            "instances": {"train": args.n_trn, "dev": args.n_dev},
            "machine": machine(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            **runs,
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
