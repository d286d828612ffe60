"""bench.lib.null_encoder chooses the null encoder by its settings (XMCSERVE_ENCODER=null), for the
block and then the environment as it was; over an engine without the setting (a baseline checkout)
it patches OnnxEncoder.run with the same lookup, keyed as engine.null_encoder keys it."""

import os

import numpy as np
import pytest

import bench.lib.null_encoder as null
from engine import EncoderOptions
from engine.bundle import load_encoder
from engine.null_encoder import token_key
from engine.offline import NullEncoder, OnnxEncoder

TEXTS = ["libc6: GNU C Library", "python3-numpy: fast arrays", "x y"]


@pytest.fixture(scope="module")
def vectors(tiny_rae_bundle, tmp_path_factory):
    path = tmp_path_factory.mktemp("null") / "vectors.npz"
    null.write_vectors(tiny_rae_bundle, TEXTS, path)
    return path


def test_the_settings_choose_the_null_encoder_for_the_block_only(tiny_rae_bundle, vectors, monkeypatch):
    from service.http.settings import Settings

    assert null.engine_has_null_backend()
    monkeypatch.setenv("XMCSERVE_NULL_VECTORS", "left as it was")
    real_run = OnnxEncoder.run
    with null.selected(vectors):
        options = Settings(bundle_dir=tiny_rae_bundle).encoder_options()
        assert (options.backend, options.null_vectors) == ("null", vectors.resolve())
        assert OnnxEncoder.run is real_run  # chosen, not patched
        encoder = load_encoder(tiny_rae_bundle, options)[1]
        assert isinstance(encoder, NullEncoder)
    assert os.environ["XMCSERVE_NULL_VECTORS"] == "left as it was" and "XMCSERVE_ENCODER" not in os.environ


def test_written_vectors_are_the_real_encoders_whatever_the_environment_asks_for(tiny_rae_bundle, vectors, tmp_path):
    with null.selected(vectors):  # a benchmark writes its file with the null encoder chosen for its servers
        null.write_vectors(tiny_rae_bundle, TEXTS, again := tmp_path / "again.npz")
    real, _ = load_encoder(tiny_rae_bundle)[1].encode(TEXTS)
    np.testing.assert_array_equal(np.load(again)["vectors"], real)


def test_over_an_engine_without_the_setting_the_session_call_is_patched_then_restored(
    tiny_rae_bundle, vectors, monkeypatch
):
    """The legacy fallback looks vectors up as the null encoder does (the same key, the first row
    for a text not in the file), and leaves OnnxEncoder as it was after the block."""
    monkeypatch.setattr(null, "engine_has_null_backend", lambda: False)
    real_run = OnnxEncoder.run
    unknown = [*TEXTS, "a text not written"]
    by_setting, _ = load_encoder(tiny_rae_bundle, EncoderOptions(backend="null", null_vectors=vectors))[1].encode(
        unknown
    )
    with null.selected(vectors):
        assert "XMCSERVE_ENCODER" not in os.environ
        encoder = load_encoder(tiny_rae_bundle)[1]
        assert isinstance(encoder, OnnxEncoder) and OnnxEncoder.run is not real_run
        patched, _ = encoder.encode(unknown)
    assert OnnxEncoder.run is real_run
    np.testing.assert_array_equal(patched, by_setting)
    ids = encoder.tokenize(TEXTS)
    assert [null.legacy_token_key(i) for i in ids] == [token_key(i) for i in ids]
