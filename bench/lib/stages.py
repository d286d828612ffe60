"""The stages of the end-to-end benches (bench.million_e2e, bench.ten_million): each a process run
to completion with its wall seconds and peak memory, what they read of a synthetic data set, and
the random small encoder they train or export."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def run_stage(name: str, command: list[str], log_dir: Path) -> dict:
    """Run one stage to completion; its wall seconds and peak RSS (GiB, largest process of it)."""
    started = time.perf_counter()
    with open(log_dir / f"{name}.log", "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - started
    if process.returncode != 0:
        raise RuntimeError(f"stage {name} failed ({process.returncode}); see {log_dir / f'{name}.log'}")
    # ru_maxrss is in KiB on Linux
    return {"seconds": round(seconds, 1), "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2)}


def tst_titles(data: Path, count: int) -> list[str]:
    with gzip.open(data / "tst.json.gz", "rt", encoding="utf-8") as fh:
        return [json.loads(line)["title"] for _, line in zip(range(count), fh, strict=False)]


def random_encoder(out: Path, layers: int, seed: int) -> Path:
    """A ``layers``-layer, 64-wide BERT with random weights and the MiniLM tokenizer."""
    import torch
    from transformers import BertConfig, BertModel

    from xmc.checkpoint import default_encoder_dir

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=128
    )
    BertModel(config).save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(default_encoder_dir() / name, out / name)
    return out
