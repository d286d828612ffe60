"""The UniDEC model (Kharbanda et al., WWW 2025, §3): a shared encoder Φ with mean pooling and
two heads,

* dual-encoder head  ``N(g1(Φ(x)))``, applied to queries and to label texts alike;
* classifier head    ``g2(Φ(x))``, scored against a learned label table Ψ ∈ R^{L×d}
  (not normalised in training; normalised at serving, §3.4),

plus the torch helpers that export shares (encoder and tokenizer loading, mean pooling).

Serving vector (what export writes into the ONNX graph, see :class:`ServingHead`):
query ``[N(g1(Φ(x))) ⊕ N(g2(Φ(x)))] / √2``, label ``[N(g1(Φ(z_l))) ⊕ N(Ψ_l)] / √2``, so one
inner-product search scores (cos_DE + cos_CLF) / 2.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import AutoModel, AutoTokenizer

from training.encoder_layers import num_layers, prefix_states, run_layers
from xmc.checkpoint import ENCODER_SUBDIR, HeadBlock, ServingHead, fit_pca_head

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "modules.json",
    "sentence_bert_config.json",
)


def load_encoder(encoder_dir: Path, attn_implementation: str = "eager") -> torch.nn.Module:
    # Eager attention exports to plain ONNX ops (the SDPA path does not trace cleanly); training
    # may ask for "sdpa".
    return AutoModel.from_pretrained(str(encoder_dir), attn_implementation=attn_implementation).eval()


def load_fast_tokenizer(encoder_dir: Path, max_length: int) -> Tokenizer:
    """The checkpoint's fast tokenizer, truncating at ``max_length`` and padding to the batch's longest.

    The same object is written into the bundle, so training, export and service tokenise identically.
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


def tokenize_batch(tokenizer: Tokenizer, texts: list[str]) -> dict[str, torch.Tensor]:
    encodings = tokenizer.encode_batch(texts)
    return {
        "input_ids": torch.tensor([e.ids for e in encodings], dtype=torch.long),
        "attention_mask": torch.tensor([e.attention_mask for e in encodings], dtype=torch.long),
    }


def linear_from_block(block: HeadBlock) -> torch.nn.Linear:
    linear = torch.nn.Linear(block.weight.shape[1], block.weight.shape[0])
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(np.ascontiguousarray(block.weight, dtype=np.float32)))
        linear.bias.copy_(torch.from_numpy(np.ascontiguousarray(block.bias, dtype=np.float32)))
    return linear


def block_from_linear(name: str, linear: torch.nn.Linear) -> HeadBlock:
    return HeadBlock(
        name, linear.weight.detach().float().cpu().numpy().copy(), linear.bias.detach().float().cpu().numpy().copy()
    )


class UniDEC(torch.nn.Module):
    """Φ + g1 (DE) + g2 (CLF) + Ψ. Lower ``frozen_layers`` of Φ may be frozen and their token
    states cached (:mod:`training.cache`); :meth:`pooled_from_states` then runs only the rest.

    Args:
        encoder: a Hugging Face encoder (BERT-like or DistilBERT).
        g1: DE head, hidden → d_DE.
        g2: CLF head, hidden → d_CLF.
        label_table: initial Ψ, [L, d_CLF].
        frozen_layers: lower transformer layers (and the embeddings) that get no gradient.
        pre_normalize: L2-normalise Φ(x) before the heads (sentence-transformers models such
            as all-MiniLM-L6-v2 are trained with a normalised output).
    """

    def __init__(
        self,
        encoder: torch.nn.Module,
        g1: torch.nn.Linear,
        g2: torch.nn.Linear,
        label_table: torch.Tensor,
        frozen_layers: int,
        pre_normalize: bool,
    ):
        super().__init__()
        self.encoder = encoder
        self.g1 = g1
        self.g2 = g2
        self.label_uids: list[str] | None = None  # the uid of each Ψ row, saved with the head
        self.psi = torch.nn.Parameter(label_table.detach().clone().float())
        self.frozen_layers = frozen_layers
        self.pre_normalize = pre_normalize

    @classmethod
    def with_placeholder_heads(cls, encoder: torch.nn.Module, frozen_layers: int, pre_normalize: bool) -> UniDEC:
        """Φ with 1×1 stand-ins for g1, g2 and Ψ: pooling runs only Φ, so Φ of the texts can be
        computed for :meth:`init_heads_by_pca` before the heads exist."""
        placeholder_g1, placeholder_g2 = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
        return cls(encoder, placeholder_g1, placeholder_g2, torch.zeros(1, 1), frozen_layers, pre_normalize)

    def init_heads_by_pca(
        self, pooled_queries: np.ndarray, pooled_labels: np.ndarray, de_dim: int, clf_dim: int
    ) -> None:
        """g1 and g2 start as the PCA projection export uses for untrained encoders; Ψ starts as
        g2 of the labels' own text, so every label (tail and zero-shot too) starts meaningful."""
        pca = fit_pca_head(np.concatenate([pooled_queries, pooled_labels]), max(de_dim, clf_dim), False)
        block = pca.blocks[0]
        self.g1 = linear_from_block(HeadBlock("g1", block.weight[:de_dim], block.bias[:de_dim]))
        self.g2 = linear_from_block(HeadBlock("g2", block.weight[:clf_dim], block.bias[:clf_dim]))
        with torch.no_grad():
            psi = self.g2(torch.from_numpy(pooled_labels))
        self.psi = torch.nn.Parameter(psi.float())

    @classmethod
    def from_serving_head(cls, encoder: torch.nn.Module, head: ServingHead, frozen_layers: int) -> UniDEC:
        """The model behind a trained checkpoint's head: the inverse of :meth:`serving_head`."""
        names = [b.name for b in head.blocks]
        if names != ["g1_de", "g2_clf"] or head.label_table is None or head.label_table_block != 1:
            raise ValueError(f"not a UniDEC head: blocks {names}, label table block {head.label_table_block}")
        g1, g2 = (linear_from_block(b) for b in head.blocks)
        model = cls(encoder, g1, g2, torch.from_numpy(head.label_table), frozen_layers, head.pre_normalize)
        model.label_uids = head.label_uids
        return model

    @property
    def trains_encoder(self) -> bool:
        return self.frozen_layers < num_layers(self.encoder)

    def _finish(self, pooled: torch.Tensor) -> torch.Tensor:
        return F.normalize(pooled, dim=-1) if self.pre_normalize else pooled

    def pooled_from_states(self, states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Φ(x) from cached token states after the frozen layers ([B, S, H] + [B, S] mask)."""
        hidden = run_layers(self.encoder, states, attention_mask, self.frozen_layers)
        return self._finish(mean_pool(hidden, attention_mask))

    def pooled_from_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Φ(x) from token ids through the whole encoder (the path without a cache)."""
        states = prefix_states(self.encoder, input_ids, attention_mask, self.frozen_layers)
        return self.pooled_from_states(states, attention_mask)

    def de(self, pooled: torch.Tensor) -> torch.Tensor:
        """N(g1(Φ(x))): the dual-encoder embedding of a query or a label text."""
        return F.normalize(self.g1(pooled), dim=-1)

    def clf(self, pooled: torch.Tensor) -> torch.Tensor:
        """g2(Φ(x)): the classifier-side query embedding (scored against Ψ)."""
        return self.g2(pooled)

    def serving_head(self) -> ServingHead:
        return ServingHead(
            blocks=[block_from_linear("g1_de", self.g1), block_from_linear("g2_clf", self.g2)],
            pre_normalize=self.pre_normalize,
            label_table=self.psi.detach().float().cpu().numpy().copy(),
            label_table_block=1,
            label_uids=self.label_uids,
            kind="unidec",
        )

    def save_checkpoint(self, directory: Path, tokenizer_dir: Path, extra: dict | None = None) -> None:
        """Write the checkpoint layout export reads: ``encoder/`` (HF dir + tokenizer files) and
        the serving head (g1, g2, Ψ) as ``head.npz`` + ``head.json``."""
        directory.mkdir(parents=True, exist_ok=True)
        encoder_dir = directory / ENCODER_SUBDIR
        self.encoder.save_pretrained(encoder_dir)
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy(tokenizer_dir / name, encoder_dir / name)
        head = self.serving_head()
        head.extra = extra or {}
        head.save(directory)
