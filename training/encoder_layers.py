"""Run a Hugging Face encoder in two parts: a frozen prefix (embeddings + lower layers) whose
token states are computed once and cached, and a trainable suffix run every step.

This is what makes UniDEC training fit a 2-core CPU: with the lower ``k`` of MiniLM's 6 layers
frozen, a training step costs only the upper layers' forward and backward, and the prefix runs
once per text for the whole run (:mod:`training.cache`).

Works for BERT-like models (``model.encoder.layer``: BERT, MiniLM, RoBERTa) and DistilBERT
(``model.transformer.layer``); each layer is called as ``layer(hidden, attention_mask)``, with
the attention mask built by transformers' own ``create_bidirectional_mask`` so that it matches
whatever attention implementation the model was loaded with.
"""

from __future__ import annotations

import torch

# transformers 5.0 added create_bidirectional_mask and 5.2 named its argument inputs_embeds (as
# called below): hence the transformers>=5.2 floor in pyproject.toml
from transformers.masking_utils import create_bidirectional_mask


def transformer_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's stack of transformer layers, bottom first."""
    for path in ("encoder.layer", "transformer.layer"):
        node = model
        for attr in path.split("."):
            node = getattr(node, attr, None)
            if node is None:
                break
        if isinstance(node, torch.nn.ModuleList):
            return node
    raise ValueError(f"{type(model).__name__}: no encoder.layer or transformer.layer stack")


def num_layers(model: torch.nn.Module) -> int:
    return len(transformer_layers(model))


def hidden_size(model: torch.nn.Module) -> int:
    config = model.config
    return getattr(config, "hidden_size", None) or config.dim


def embed(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Token + position (+ type) embeddings, layer-normed: the input of layer 0."""
    return model.embeddings(input_ids=input_ids)


def run_layers(
    model: torch.nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor, start: int, stop: int | None = None
) -> torch.Tensor:
    """Apply layers ``start:stop`` to token states ``hidden`` ([batch, seq, H])."""
    layers = transformer_layers(model)[start:stop]
    if len(layers) == 0:
        return hidden
    mask = create_bidirectional_mask(config=model.config, inputs_embeds=hidden, attention_mask=attention_mask)
    for layer in layers:
        hidden = layer(hidden, mask)
        if isinstance(hidden, tuple):  # older transformers layers return (hidden, ...)
            hidden = hidden[0]
    return hidden


def prefix_states(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, frozen: int
) -> torch.Tensor:
    """Token states after the embeddings and the lower ``frozen`` layers."""
    return run_layers(model, embed(model, input_ids), attention_mask, 0, frozen)


def freeze_prefix(model: torch.nn.Module, frozen: int) -> list[torch.nn.Parameter]:
    """Freeze the embeddings and the lower ``frozen`` layers; return the trainable parameters."""
    layers = transformer_layers(model)
    if not 0 <= frozen <= len(layers):
        raise ValueError(f"frozen layers must be in [0, {len(layers)}], got {frozen}")
    for p in model.parameters():
        p.requires_grad_(False)
    trainable = [p for layer in layers[frozen:] for p in layer.parameters()]
    if frozen == 0:
        trainable += list(model.embeddings.parameters())
    for p in trainable:
        p.requires_grad_(True)
    return trainable
