"""The embedder: the serving vectors are the model's ServingHead over Φ, and a saved checkpoint
reloads to the same vectors (what training.sweep relies on) without a Trainer."""

from pathlib import Path

import numpy as np
import pytest
import torch

from training.embedder import Embedder, TextSide
from training.train_params import TrainParams
from training.unidec import UniDEC, load_encoder, load_fast_tokenizer
from xmc.checkpoint import ServingHead

TEXTS = [
    "python3-numpy: Fast array facility to the Python 3 language",
    "libc6: GNU C Library: Shared libraries",
    "a",
    "golang-github-stretchr-testify-dev: Sacred extension to the Go testing package (library)",
    "vim: Vi IMproved - enhanced vi editor",
    "emacs: GNU Emacs editor (metapackage)",
    "curl: command line tool for transferring data with URL syntax",
    "git: fast, scalable, distributed revision control system",
    "openssh-server: secure shell (SSH) server, for secure access from remote machines",
    "postgresql: object-relational SQL database (supported version)",
]


@pytest.fixture
def params(distilbert_dir, tmp_path) -> TrainParams:
    # tiny DistilBERT: 2 layers, the lower one frozen and cached
    return TrainParams(
        encoder_dir=str(distilbert_dir),
        frozen_layers=1,
        max_length=32,
        de_dim=4,
        clf_dim=3,
        cache_dir=str(tmp_path / "cache"),
        attention="eager",
    )


@pytest.fixture
def embedder(params, distilbert_dir) -> Embedder:
    torch.manual_seed(0)
    encoder = load_encoder(distilbert_dir, params.attention)
    model = UniDEC.with_placeholder_heads(encoder, params.frozen_layers, pre_normalize=False)
    tokenizer = load_fast_tokenizer(distilbert_dir, params.max_length)
    built = Embedder(model, tokenizer, torch.device("cpu"), Path(params.cache_dir), distilbert_dir)
    queries, labels = built.side(TEXTS[:6], "train"), built.side(TEXTS[4:], "labels")
    model.init_heads_by_pca(built.pooled(queries), built.pooled(labels), params.de_dim, params.clf_dim)
    return built


def test_serving_vectors_are_the_serving_head_over_pooled_vectors(embedder):
    side = embedder.side(TEXTS, "dev")
    head = embedder.model.serving_head()
    pooled = embedder.pooled(side)
    np.testing.assert_array_equal(embedder.serving_vectors(side), head.query_vectors(pooled))
    labels = embedder.side(TEXTS[4:], "labels")
    np.testing.assert_array_equal(
        embedder.serving_vectors(labels, labels=True), head.label_vectors(embedder.pooled(labels))
    )
    assert embedder.serving_vectors(side).shape == (len(TEXTS), 4 + 3)
    np.testing.assert_allclose(np.linalg.norm(embedder.serving_vectors(side), axis=1), 1.0, atol=1e-5)
    de_only = embedder.serving_vectors(side, blocks=["g1_de"])
    np.testing.assert_allclose(de_only, head.select(["g1_de"]).query_vectors(pooled))


def test_cached_and_uncached_sides_pool_alike(embedder):
    cached = embedder.side(TEXTS, "dev")
    assert cached.cache is not None
    np.testing.assert_allclose(embedder.pooled(cached), embedder.pooled(TextSide(TEXTS, None)), atol=2e-3)


def test_named_sides_are_memoised_until_forget(embedder):
    side = embedder.side(TEXTS, "dev")
    first = embedder.pooled(side)
    assert embedder.pooled(side) is first
    assert embedder.pooled(TextSide(TEXTS, side.cache)) is not first  # unnamed: never memoised
    embedder.forget()
    again = embedder.pooled(side)
    assert again is not first
    np.testing.assert_array_equal(again, first)


def test_an_empty_row_set_pools_to_an_empty_batch(embedder):
    pooled = embedder.pooled_batch(embedder.side(TEXTS, "dev"), np.zeros(0, dtype=np.int64))
    assert pooled.shape == (0, 32)


def test_a_saved_checkpoint_reloads_to_the_same_vectors_and_reuses_the_prefix_cache(
    embedder, params, distilbert_dir, tmp_path
):
    with torch.no_grad():
        embedder.model.psi.add_(0.5)  # a "trained" Ψ, not the initial g2 of the label texts
    embedder.model.save_checkpoint(tmp_path / "checkpoint", distilbert_dir)
    original = embedder.side(TEXTS, "dev")
    cache_files = sorted(Path(params.cache_dir).iterdir())
    reloaded = Embedder.from_checkpoint(tmp_path / "checkpoint", params, distilbert_dir, torch.device("cpu"))
    assert reloaded.tokenizer.to_str() == embedder.tokenizer.to_str()
    loaded = reloaded.side(TEXTS, "dev")
    assert sorted(Path(params.cache_dir).iterdir()) == cache_files  # the run's prefix states, found again
    np.testing.assert_allclose(reloaded.serving_vectors(loaded), embedder.serving_vectors(original), atol=1e-6)
    labels = reloaded.side(TEXTS[4:], "labels")
    np.testing.assert_allclose(
        reloaded.serving_vectors(labels, labels=True),
        embedder.serving_vectors(embedder.side(TEXTS[4:], "labels"), labels=True),
        atol=1e-6,
    )
    assert ServingHead.load(tmp_path / "checkpoint").kind == "unidec"


def test_a_checkpoint_without_a_trained_head_is_refused(params, distilbert_dir):
    with pytest.raises(ValueError, match="no trained head"):
        Embedder.from_checkpoint(distilbert_dir, params, distilbert_dir, torch.device("cpu"))
