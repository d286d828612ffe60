"""The frozen-prefix cache must reproduce the full encoder exactly (up to float16 storage)."""

import numpy as np
import pytest
import torch

from training.cache import TokenStateCache, build_cache, cached_states, length_sorted_batches, token_lengths
from training.encoder_layers import freeze_prefix, num_layers, prefix_states, run_layers
from training.unidec import load_encoder, load_fast_tokenizer, mean_pool, tokenize_batch
from xmc.checkpoint import default_encoder_dir

TEXTS = [
    "python3-numpy: Fast array facility to the Python 3 language",
    "libc6: GNU C Library: Shared libraries",
    "a",
    "golang-github-stretchr-testify-dev: Sacred extension to the Go testing package (library)",
]


@pytest.fixture(scope="module", params=["minilm", "distilbert"])
def encoder_and_tokenizer(request, distilbert_dir):
    directory = default_encoder_dir() if request.param == "minilm" else distilbert_dir
    return directory, load_encoder(directory, "sdpa"), load_fast_tokenizer(directory, 32)


def test_prefix_then_rest_equals_the_whole_encoder(encoder_and_tokenizer):
    _, encoder, tokenizer = encoder_and_tokenizer
    batch = tokenize_batch(tokenizer, TEXTS)
    with torch.no_grad():
        full = encoder(**batch).last_hidden_state
        for frozen in range(num_layers(encoder) + 1):
            states = prefix_states(encoder, batch["input_ids"], batch["attention_mask"], frozen)
            rest = run_layers(encoder, states, batch["attention_mask"], frozen)
            mask = batch["attention_mask"].bool()
            torch.testing.assert_close(rest[mask], full[mask], atol=1e-5, rtol=1e-4)


def test_cache_batches_reproduce_the_states(encoder_and_tokenizer, tmp_path):
    directory, encoder, tokenizer = encoder_and_tokenizer
    frozen = num_layers(encoder) - 1
    cache = build_cache(encoder, tokenizer, TEXTS, frozen, max_tokens=40)
    assert len(cache) == len(TEXTS) and not cache.pooled_only
    rows = np.array([3, 0, 2])
    states, mask = cache.batch(rows)
    reference = tokenize_batch(tokenizer, [TEXTS[r] for r in rows])
    assert torch.equal(mask, reference["attention_mask"])
    with torch.no_grad():
        expected = prefix_states(encoder, reference["input_ids"], reference["attention_mask"], frozen)
    keep = mask.bool()
    torch.testing.assert_close(states[keep], expected[keep], atol=2e-2, rtol=2e-3)  # float16 storage
    assert (states[~keep] == 0).all()
    # stored and reloaded under a key of encoder + depth + tokenizer + texts
    first = cached_states(encoder, directory, tokenizer, TEXTS, frozen, tmp_path, "t")
    again = cached_states(encoder, directory, tokenizer, TEXTS, frozen, tmp_path, "t")
    assert np.array_equal(first.states, again.states) and len(list(tmp_path.glob("t-*.npz"))) == 1
    cached_states(encoder, directory, tokenizer, TEXTS[:2], frozen, tmp_path, "t")
    assert len(list(tmp_path.glob("t-*.npz"))) == 2


def test_fully_frozen_cache_keeps_pooled_vectors(encoder_and_tokenizer):
    _, encoder, tokenizer = encoder_and_tokenizer
    cache = build_cache(encoder, tokenizer, TEXTS, num_layers(encoder))
    assert cache.pooled_only
    batch = tokenize_batch(tokenizer, TEXTS)
    with torch.no_grad():
        pooled = mean_pool(encoder(**batch).last_hidden_state, batch["attention_mask"])
    states, mask = cache.batch(np.arange(len(TEXTS)))
    np.testing.assert_allclose(mean_pool(states, mask).numpy(), pooled.numpy(), atol=2e-3, rtol=1e-2)


def test_freeze_prefix_leaves_only_upper_layers_trainable(encoder_and_tokenizer):
    directory, _, _ = encoder_and_tokenizer
    encoder = load_encoder(directory)
    depth = num_layers(encoder)
    trainable = freeze_prefix(encoder, depth - 1)
    assert trainable and all(p.requires_grad for p in trainable)
    assert sum(p.requires_grad for p in encoder.parameters()) == len(trainable)
    assert not any(p.requires_grad for p in encoder.embeddings.parameters())
    assert freeze_prefix(encoder, depth) == []
    with pytest.raises(ValueError):
        freeze_prefix(encoder, depth + 1)


def test_length_sorted_batches_respect_the_token_budget():
    lengths = np.array([5, 30, 2, 30, 7, 9])
    batches = length_sorted_batches(lengths, max_tokens=40)
    assert sorted(np.concatenate(batches).tolist()) == list(range(6))
    assert all(len(b) * lengths[b].max() <= 40 or len(b) == 1 for b in batches)


def test_token_lengths_ignore_padding():
    tokenizer = load_fast_tokenizer(default_encoder_dir(), 8)
    lengths = token_lengths(tokenizer, ["a", "a b c d e f g h i j k"])
    assert lengths.tolist() == [3, 8]  # [CLS] a [SEP]; truncated at 8


def test_cache_roundtrip(tmp_path):
    cache = TokenStateCache(offsets=np.array([0, 2, 3]), states=np.arange(9, dtype=np.float16).reshape(3, 3))
    cache.save(tmp_path / "c.npz")
    loaded = TokenStateCache.load(tmp_path / "c.npz")
    assert np.array_equal(loaded.states, cache.states) and np.array_equal(loaded.offsets, cache.offsets)
