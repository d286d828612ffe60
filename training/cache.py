"""Token states of the frozen encoder prefix, computed once per text and reused every step.

With the lower ``k`` layers frozen, their output for a text never changes during training, so
it is computed once (length-sorted batches, no grad) and stored as one flat float16 array of
token rows plus offsets; a training batch gathers and pads its texts' rows. When every layer is
frozen only the mean-pooled vector is kept (one row per text, a "sequence" of length 1, so the
same pooling code applies).

Caches are written under ``cache_dir`` keyed by the encoder weights, the frozen depth, the
tokenizer settings and the texts, so a resumed or repeated run loads instead of recomputing.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from training.encoder_layers import hidden_size, num_layers, prefix_states
from training.unidec import mean_pool

log = logging.getLogger("xmcserve.train.cache")


@dataclass
class TokenStateCache:
    """Per-text token states: rows ``offsets[i]:offsets[i+1]`` of ``states`` belong to text ``i``."""

    offsets: np.ndarray  # (n + 1,) int64
    states: np.ndarray  # (total rows, hidden) float16

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def pooled_only(self) -> bool:
        return len(self.states) == len(self)

    def batch(self, rows: np.ndarray, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Padded ``[B, S, H]`` float32 states and the ``[B, S]`` attention mask of ``rows``."""
        rows = np.asarray(rows, dtype=np.int64)
        starts, ends = self.offsets[rows], self.offsets[rows + 1]
        lengths = ends - starts
        width = int(lengths.max()) if len(rows) else 0
        # one fancy-indexing gather: row j's tokens land at [j, :length_j]
        position = np.arange(width)
        mask = position[None, :] < lengths[:, None]
        source = np.where(mask, starts[:, None] + position[None, :], 0)
        states = torch.from_numpy(self.states[source].astype(np.float32))
        states[~torch.from_numpy(mask)] = 0.0
        return states.to(device), torch.from_numpy(mask.astype(np.int64)).to(device)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, offsets=self.offsets, states=self.states)
        tmp.rename(path)

    @classmethod
    def load(cls, path: Path) -> TokenStateCache:
        with np.load(path) as arrays:
            return cls(offsets=arrays["offsets"], states=arrays["states"])


def token_lengths(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """Tokens per text after truncation (no padding)."""
    plain = Tokenizer.from_str(tokenizer.to_str())
    plain.no_padding()
    return np.array([len(e.ids) for e in plain.encode_batch(texts)], dtype=np.int64)


def length_sorted_batches(lengths: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Row batches in length order, each with at most ``max_tokens`` padded tokens."""
    order = np.argsort(lengths, kind="stable")
    batches, current = [], []
    for row in order:
        if current and (len(current) + 1) * lengths[row] > max_tokens:
            batches.append(np.array(current))
            current = []
        current.append(row)
    if current:
        batches.append(np.array(current))
    return batches


@torch.no_grad()
def build_cache(
    encoder: torch.nn.Module,
    tokenizer: Tokenizer,
    texts: list[str],
    frozen_layers: int,
    max_tokens: int = 8192,
    desc: str = "cache",
) -> TokenStateCache:
    """Run the embeddings + lower ``frozen_layers`` layers over ``texts`` once.

    When ``frozen_layers`` is the whole encoder, stores the mean-pooled output only.
    """
    pooled_only = frozen_layers >= num_layers(encoder)
    lengths = token_lengths(tokenizer, texts)
    rows_per_text = np.ones_like(lengths) if pooled_only else lengths
    offsets = np.concatenate([[0], np.cumsum(rows_per_text)]).astype(np.int64)
    states = np.zeros((int(offsets[-1]), hidden_size(encoder)), dtype=np.float16)
    was_training = encoder.training
    encoder.eval()
    device = next(encoder.parameters()).device  # the GPU path computes the cache on the GPU
    for rows in tqdm(length_sorted_batches(lengths, max_tokens), desc=desc, unit="batch", leave=False):
        encoded = tokenizer.encode_batch([texts[r] for r in rows])
        ids = torch.tensor([e.ids for e in encoded], dtype=torch.long, device=device)
        mask = torch.tensor([e.attention_mask for e in encoded], dtype=torch.long, device=device)
        out = prefix_states(encoder, ids, mask, frozen_layers)
        if pooled_only:
            states[offsets[rows]] = mean_pool(out, mask).float().cpu().numpy().astype(np.float16)
            continue
        out = out.float().cpu().numpy().astype(np.float16)
        for j, row in enumerate(rows):
            states[offsets[row] : offsets[row + 1]] = out[j, : lengths[row]]
    encoder.train(was_training)
    return TokenStateCache(offsets=offsets, states=states)


def cache_key(encoder_dir: Path, frozen_layers: int, tokenizer: Tokenizer, texts: list[str]) -> str:
    digest = hashlib.sha256()
    for weights in sorted(encoder_dir.glob("*.safetensors")) + sorted(encoder_dir.glob("*.bin")):
        digest.update(weights.name.encode())
        digest.update(hashlib.sha256(weights.read_bytes()).digest())
    digest.update(json.dumps({"frozen": frozen_layers, "tokenizer": tokenizer.to_str()}).encode())
    for text in texts:
        digest.update(text.encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def cached_states(
    encoder: torch.nn.Module,
    encoder_dir: Path,
    tokenizer: Tokenizer,
    texts: list[str],
    frozen_layers: int,
    cache_dir: Path | None,
    desc: str,
) -> TokenStateCache:
    """Load the prefix states of ``texts`` from ``cache_dir`` or compute (and store) them."""
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"{desc}-{cache_key(encoder_dir, frozen_layers, tokenizer, texts)}.npz"
        if path.is_file():
            log.info("prefix states of %d %s texts loaded from %s", len(texts), desc, path)
            return TokenStateCache.load(path)
    cache = build_cache(encoder, tokenizer, texts, frozen_layers, desc=desc)
    if path is not None:
        cache.save(path)
    return cache
