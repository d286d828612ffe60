"""The torch side of the serving graph: encoder Φ → mean pooling → head blocks → L2 norm → concat."""

from __future__ import annotations

import torch

from training.unidec import linear_from_block, load_encoder, load_fast_tokenizer, mean_pool, tokenize_batch
from xmc.checkpoint import ServingHead

__all__ = ["PooledEncoder", "ServingEncoder", "load_encoder", "load_fast_tokenizer", "tokenize_batch"]


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
        self.blocks = torch.nn.ModuleList(linear_from_block(block) for block in head.blocks)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.pooled(input_ids, attention_mask)
        if self.pre_normalize:
            x = torch.nn.functional.normalize(x, dim=-1)
        parts = [torch.nn.functional.normalize(block(x), dim=-1) for block in self.blocks]
        return torch.cat(parts, dim=-1) * self.block_scale
