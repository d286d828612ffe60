"""Φ and the serving vectors of a UniDEC model: the one definition, in training, of what an
exported bundle serves.

The pooled vector Φ(x) comes from the frozen-prefix cache (:mod:`training.cache`) when the run
freezes layers, else from token ids through the whole encoder; the serving vector is the
model's :class:`~xmc.checkpoint.ServingHead` applied to it, the same head export writes
into the ONNX graph. Training (mining, the loss's pooled batches), the per-epoch dev check and
:mod:`training.sweep` all embed through an :class:`Embedder`, so none of them can drift from
what the service searches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from training.cache import TokenStateCache, cached_states, length_sorted_batches
from training.distributed import World
from training.embedding_eval import DevVectors
from training.encoder_layers import hidden_size
from training.train_params import TrainParams
from training.unidec import UniDEC, load_encoder, load_fast_tokenizer
from xmc.checkpoint import load_checkpoint


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class TextSide:
    """The texts of one side (training queries, labels, dev queries) and their cached prefix."""

    texts: list[str]
    cache: TokenStateCache | None
    name: str = ""  # set for a run's own sides (train, labels, dev): their vectors are memoised


class Embedder:
    """Pooled (Φ) and serving vectors of texts under one UniDEC model.

    Args:
        model: the model; its heads may be replaced in place (initialisation, training steps).
        tokenizer: the checkpoint's fast tokenizer (truncating at the run's ``max_length``).
        device: where the encoder runs.
        cache_dir: where frozen-prefix states are stored (``None``: kept in memory only).
        prefix_weights_dir: the encoder directory the prefix caches are keyed by. Training never
            changes the frozen prefix, so a trained checkpoint keys its caches by the base
            encoder's weights and finds the states its training run stored.
        world: the run's processes (:mod:`training.distributed`): a full pass over a side
            (:meth:`pooled`) encodes this rank's share and gathers the others'; every rank must
            then call it in the same order.
    """

    def __init__(
        self,
        model: UniDEC,
        tokenizer: Tokenizer,
        device: torch.device,
        cache_dir: Path | None = None,
        prefix_weights_dir: Path | None = None,
        world: World | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.cache_dir = cache_dir
        self.prefix_weights_dir = prefix_weights_dir
        self.world = world or World(device=device)
        self._memo: dict[str, np.ndarray] = {}

    @classmethod
    def from_checkpoint(
        cls, directory: Path, params: TrainParams, base_encoder_dir: Path, device: torch.device
    ) -> Embedder:
        """The trained model a run wrote (``<out_dir>/checkpoint`` or ``best``), set up as the
        run's ``params`` trained it: same frozen depth, truncation, attention and prefix caches."""
        checkpoint = load_checkpoint(directory)
        if checkpoint.head is None:
            raise ValueError(f"{directory}: no trained head (head.json)")
        encoder = load_encoder(checkpoint.encoder_dir, params.attention).to(device)
        model = UniDEC.from_serving_head(encoder, checkpoint.head, params.frozen_layers).to(device)
        tokenizer = load_fast_tokenizer(checkpoint.encoder_dir, params.max_length)
        cache_dir = Path(params.cache_dir) if params.cache_dir else None
        return cls(model, tokenizer, device, cache_dir, base_encoder_dir)

    # ----------------------------------------------------------------- texts
    def side(self, texts: list[str], name: str = "") -> TextSide:
        """A side of texts, with its frozen-prefix states when the model freezes layers (computed
        once, or loaded from ``cache_dir``); ``name`` also names the cache file."""
        frozen = self.model.frozen_layers
        if frozen == 0:
            return TextSide(texts, None, name)
        weights_dir = self.prefix_weights_dir
        cache = cached_states(self.model.encoder, weights_dir, self.tokenizer, texts, frozen, self.cache_dir, name)
        return TextSide(texts, cache, name)

    # ----------------------------------------------------------------- pooled vectors
    def autocast(self):
        """bf16 on CUDA (the GPU recipe); full precision on the CPU, where bf16 is slower."""
        enabled = self.device.type == "cuda"
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def pooled_batch(self, side: TextSide, rows: np.ndarray, max_tokens: int = 8192) -> torch.Tensor:
        """Φ of ``rows`` of one side, in ``rows`` order, with grad. The rows run in length-sorted
        chunks so that little padding is computed: a label pool mixes 5- and 60-token titles."""
        if len(rows) == 0:  # a batch whose queries have no usable label (see PslBatcher)
            return torch.zeros(0, hidden_size(self.model.encoder), device=self.device)
        lengths = np.diff(side.cache.offsets)[rows] if side.cache is not None else self._token_lengths(side, rows)
        chunks = length_sorted_batches(lengths, max_tokens)
        parts = [self._pooled_chunk(side, rows[chunk]) for chunk in chunks]
        pooled = torch.cat(parts)
        order = torch.from_numpy(np.argsort(np.concatenate(chunks), kind="stable")).to(pooled.device)
        return pooled[order]

    def _token_lengths(self, side: TextSide, rows: np.ndarray) -> np.ndarray:
        # the attention mask, not len(ids): the tokenizer pads to the longest text of the call
        return np.array([sum(e.attention_mask) for e in self.tokenizer.encode_batch([side.texts[r] for r in rows])])

    def _pooled_chunk(self, side: TextSide, rows: np.ndarray) -> torch.Tensor:
        if side.cache is not None:
            states, mask = side.cache.batch(rows, self.device)
            return self.model.pooled_from_states(states, mask)
        encoded = self.tokenizer.encode_batch([side.texts[r] for r in rows])
        ids = torch.tensor([e.ids for e in encoded], dtype=torch.long, device=self.device)
        mask = torch.tensor([e.attention_mask for e in encoded], dtype=torch.long, device=self.device)
        return self.model.pooled_from_tokens(ids, mask)

    def pooled(self, side: TextSide) -> np.ndarray:
        """Φ of every text of a side, as float32 numpy. A named side's vectors are memoised until
        :meth:`forget`: the encoder changes only with an optimiser step, so initialisation, the
        end-of-epoch evaluation and the next refresh share one pass."""
        if not side.name:
            return self._pooled_all(side)
        if side.name not in self._memo:
            self._memo[side.name] = self._pooled_all(side)
        return self._memo[side.name]

    def forget(self) -> None:
        """Drop the memoised vectors: call after every change of the encoder's weights."""
        self._memo = {}

    @torch.no_grad()
    def _pooled_all(self, side: TextSide, block: int = 4096) -> np.ndarray:
        if side.cache is not None and side.cache.pooled_only:
            # every layer frozen: the cache already holds Φ before its (optional) normalisation
            vectors = torch.from_numpy(side.cache.states.astype(np.float32))
            return self.model._finish(vectors).numpy()
        was_training = self.model.training
        self.model.eval()
        rows = self.world.share(np.arange(len(side.texts)))
        parts = [np.zeros((0, hidden_size(self.model.encoder)), dtype=np.float32)]
        for start in range(0, len(rows), block):
            with self.autocast():
                pooled = self.pooled_batch(side, rows[start : start + block], 16384)
            parts.append(pooled.float().cpu().numpy())
        self.model.train(was_training)
        return self.world.gather_array(np.concatenate(parts), len(side.texts))

    # ----------------------------------------------------------------- serving vectors
    def serving_vectors(self, side: TextSide, labels: bool = False, blocks: list[str] | None = None) -> np.ndarray:
        """What the exported bundle would serve for a side's texts: ``[N(g1(Φ)) ⊕ N(g2(Φ))]/√2``,
        or ``[N(g1(Φ)) ⊕ N(Ψ)]/√2`` for ``labels``; ``blocks`` restricts the head (e.g. ``["g1_de"]``)."""
        head = self.model.serving_head()
        if blocks is not None:
            head = head.select(blocks)
        pooled = self.pooled(side)
        return head.label_vectors(pooled) if labels else head.query_vectors(pooled)

    def dev_vectors(self, dev_queries: TextSide, labels: TextSide, train_queries: TextSide) -> DevVectors:
        """Serving vectors of the dev queries, the labels and the RAE memory (train + labels)."""
        return DevVectors(
            query=self.serving_vectors(dev_queries),
            label=self.serving_vectors(labels, labels=True),
            train=self.serving_vectors(train_queries),
            de_dim=self.model.g1.out_features,
        )
