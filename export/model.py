"""The torch side of the serving graph: encoder Φ → mean pooling → head blocks → L2 norm → concat."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import AutoModel, AutoTokenizer

from training.checkpoint import ServingHead


def load_encoder(encoder_dir: Path) -> torch.nn.Module:
    # Eager attention exports to plain ONNX ops; the SDPA path does not trace cleanly.
    return AutoModel.from_pretrained(str(encoder_dir), attn_implementation="eager").eval()


def load_fast_tokenizer(encoder_dir: Path, max_length: int) -> Tokenizer:
    """The checkpoint's fast tokenizer, truncating at ``max_length`` and padding to the batch's longest.

    The same object is written into the bundle, so export and service tokenise identically.
    """
    hf_tokenizer = AutoTokenizer.from_pretrained(str(encoder_dir), use_fast=True)
    tokenizer = Tokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_length)
    pad_token = hf_tokenizer.pad_token or "[PAD]"
    pad_id = hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None else 0
    tokenizer.enable_padding(pad_id=pad_id, pad_token=pad_token)
    return tokenizer


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


class PooledEncoder(torch.nn.Module):
    """Φ(x): mean-pooled last hidden state."""

    def __init__(self, encoder: torch.nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return mean_pool(hidden, attention_mask)


class ServingEncoder(torch.nn.Module):
    """The exported graph: ``[batch, seq]`` ids + mask → ``[batch, dim]`` unit vectors."""

    def __init__(self, encoder: torch.nn.Module, head: ServingHead):
        super().__init__()
        self.pooled = PooledEncoder(encoder)
        self.pre_normalize = head.pre_normalize
        self.block_scale = head.block_scale
        self.blocks = torch.nn.ModuleList()
        for block in head.blocks:
            linear = torch.nn.Linear(block.weight.shape[1], block.weight.shape[0])
            with torch.no_grad():
                linear.weight.copy_(torch.from_numpy(np.ascontiguousarray(block.weight, dtype=np.float32)))
                linear.bias.copy_(torch.from_numpy(np.ascontiguousarray(block.bias, dtype=np.float32)))
            self.blocks.append(linear)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.pooled(input_ids, attention_mask)
        if self.pre_normalize:
            x = torch.nn.functional.normalize(x, dim=-1)
        parts = [torch.nn.functional.normalize(block(x), dim=-1) for block in self.blocks]
        return torch.cat(parts, dim=-1) * self.block_scale


def tokenize_batch(tokenizer: Tokenizer, texts: list[str]) -> dict[str, torch.Tensor]:
    encodings = tokenizer.encode_batch(texts)
    return {
        "input_ids": torch.tensor([e.ids for e in encodings], dtype=torch.long),
        "attention_mask": torch.tensor([e.attention_mask for e in encodings], dtype=torch.long),
    }
