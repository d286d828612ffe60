"""The null encoder (engine.null_encoder): the bundle's real tokenizer and chunking, vectors from a
file keyed by token ids (a text not in it: the first row), a deterministic vector per text without
a file, files of the wrong shape refused; chosen by ``EncoderOptions.backend`` through
``EngineParams`` into a loaded engine, the vetting child included."""

import asyncio

import numpy as np
import pytest

from bundle import TOKENIZER_FILE, BundleError, read_manifest
from engine import EncoderOptions, Engine, EngineParams
from engine.bundle import load_bundle, load_encoder
from engine.encoder import Encoder, OnnxEncoder, TokenizingEncoder
from engine.null_encoder import NullEncoder, read_null_vectors, token_key, write_null_vectors
from engine.search import Predictor

TEXTS = ["libc6: GNU C Library", "python3-numpy: fast arrays", "x y", "a much longer text " * 60, "vim"]


@pytest.fixture(scope="module")
def real(tiny_rae_bundle) -> OnnxEncoder:
    return load_encoder(tiny_rae_bundle)[1]


@pytest.fixture(scope="module")
def vectors_file(real, tmp_path_factory):
    path = tmp_path_factory.mktemp("null") / "vectors.npz"
    write_null_vectors(real, TEXTS, path)
    return path


def null_encoder(bundle, vectors=None, dim=None, **options) -> NullEncoder:
    manifest = read_manifest(bundle)
    return NullEncoder(
        bundle / TOKENIZER_FILE,
        manifest.tokenizer.max_length,
        dim or manifest.dim,
        vectors,
        EncoderOptions(backend="null", null_vectors=vectors, **options),
    )


def test_both_backends_share_the_tokenizing_encoder_and_satisfy_the_protocol(tiny_rae_bundle, real):
    null = null_encoder(tiny_rae_bundle)
    for encoder in (real, null):
        assert isinstance(encoder, TokenizingEncoder)
        assert all(hasattr(encoder, name) for name in Encoder.__annotations__)
        assert all(callable(getattr(encoder, name)) for name in ("tokenize", "run", "encode", "encode_keeping_tokens"))
    assert null.provider == "null" and real.provider == "CPUExecutionProvider"


def test_it_tokenizes_and_chunks_as_the_onnx_encoder(tiny_rae_bundle, real):
    null = null_encoder(tiny_rae_bundle)
    assert null.tokenize(TEXTS) == real.tokenize(TEXTS)
    assert max(len(ids) for ids in null.tokenize(TEXTS)) == read_manifest(tiny_rae_bundle).tokenizer.max_length
    assert null.texts_per_call == real.texts_per_call == 1  # on the CPU: one text per call, as served
    _, _, encodings = null.encode_keeping_tokens(TEXTS)
    assert [e.ids for e in encodings] == real.tokenize(TEXTS)  # the word pieces a lexical fusion reads


def test_vectors_come_from_the_file_and_a_text_not_in_it_gets_the_first(tiny_rae_bundle, real, vectors_file):
    null = null_encoder(tiny_rae_bundle, vectors_file)
    expected, _ = real.encode(TEXTS)
    looked_up, times = null.encode(TEXTS[::-1])  # by the text's tokens, whatever the order or batch
    np.testing.assert_array_equal(looked_up, expected[::-1])
    assert looked_up.dtype == np.float32 and times.tokenize_s > 0
    unknown, _ = null.encode(["not among the texts written", TEXTS[2]])
    np.testing.assert_array_equal(unknown, expected[[0, 2]])


def test_without_a_file_each_text_gets_a_deterministic_unit_vector(tiny_rae_bundle):
    dim = read_manifest(tiny_rae_bundle).dim
    first, _ = null_encoder(tiny_rae_bundle).encode(TEXTS)
    again, _ = null_encoder(tiny_rae_bundle).encode([TEXTS[3], TEXTS[0]])
    assert first.shape == (len(TEXTS), dim)
    np.testing.assert_allclose(np.linalg.norm(first, axis=1), 1.0, atol=1e-6)
    np.testing.assert_array_equal(again, first[[3, 0]])  # the same text, the same vector, in any batch
    assert len({row.tobytes() for row in first}) == len(TEXTS)  # distinct texts, distinct vectors


def test_vector_files_of_the_wrong_shape_are_refused(tiny_rae_bundle, vectors_file, tmp_path):
    dim = read_manifest(tiny_rae_bundle).dim
    keys, vectors = read_null_vectors(vectors_file, dim)
    assert len(keys) == len(TEXTS) and vectors.shape == (len(TEXTS), dim)
    with pytest.raises(ValueError, match=f"dimension {dim}, the bundle's is {dim + 1}"):
        null_encoder(tiny_rae_bundle, vectors_file, dim=dim + 1)
    cases = {
        "not-unit": ({"keys": np.arange(2), "vectors": np.full((2, dim), 2.0, np.float32)}, "not finite unit vectors"),
        "no-keys": ({"vectors": np.eye(2, dim, dtype=np.float32)}, "not an .npz of keys and vectors"),
        "short": ({"keys": np.arange(3), "vectors": np.eye(2, dim, dtype=np.float32)}, "one row per key"),
        "empty": ({"keys": np.arange(0), "vectors": np.zeros((0, dim), np.float32)}, "at least one"),
        "float-keys": ({"keys": np.zeros(2), "vectors": np.eye(2, dim, dtype=np.float32)}, "one integer per row"),
    }
    for name, (arrays, reason) in cases.items():
        np.savez(path := tmp_path / f"{name}.npz", **arrays)
        with pytest.raises(ValueError, match=reason):
            read_null_vectors(path, dim)
    np.save(tmp_path / "one.npy", np.eye(2, dim))
    with pytest.raises(ValueError, match="not an .npz"):
        read_null_vectors(tmp_path / "one.npy", dim)
    # loading a bundle with a file of another width is the bundle's refusal, naming the file
    np.savez(other := tmp_path / "wide.npz", keys=np.arange(1), vectors=np.eye(1, dim + 1, dtype=np.float32))
    with pytest.raises(BundleError, match="wide.npz: vectors of dimension"):
        load_encoder(tiny_rae_bundle, EncoderOptions(backend="null", null_vectors=other))


def test_options_refuse_an_unknown_backend_and_vectors_without_the_null_one(vectors_file):
    with pytest.raises(ValueError, match="unknown encoder backend 'tpu'"):
        EncoderOptions(backend="tpu")
    with pytest.raises(ValueError, match="given for the onnx encoder backend"):
        EncoderOptions(null_vectors=vectors_file)


def test_the_key_is_a_hash_of_the_token_ids():
    assert token_key([101, 7592, 102]) == token_key((101, 7592, 102)) != token_key([101, 102])


def test_engine_params_choose_the_null_encoder_for_the_vetting_child_and_the_loaded_bundle(
    tiny_rae_bundle, vectors_file, tmp_path
):
    """Loaded by an engine (vetted in a child first): the null encoder, and since its vectors are
    the real encoder's, the same rankings as the bundle served for real."""
    options = EncoderOptions(providers="cpu", backend="null", null_vectors=vectors_file)
    engine = Engine(EngineParams(encoder=options, append_log_dir=tmp_path / "appends"))
    predictor = asyncio.run(engine.load(tiny_rae_bundle, vet=True))
    assert isinstance(predictor.bundle.encoder, NullEncoder) and predictor.bundle.encoder.options is options
    served = load_bundle(tiny_rae_bundle)
    assert isinstance(served.encoder, OnnxEncoder)
    real = Predictor(served).predict(TEXTS, k=5)
    null = predictor.predict(TEXTS, k=5)
    for a, b in zip(real.rankings, null.rankings, strict=True):
        np.testing.assert_array_equal(a.ids, b.ids)
