"""The null encoder: the bundle's own tokenizer, then each text's vector looked up instead of
computed, so a benchmark measures everything a request costs but the encoder's model (HTTP,
validation, batching, tokenizing, search, RAE, fusion, serialisation). Chosen by
``EncoderOptions(backend="null")`` (the server's ``XMCSERVE_ENCODER=null``); never for answers
anyone reads.

The vector file (``XMCSERVE_NULL_VECTORS``) is an ``.npz`` of ``keys`` (int64, one per row) and
``vectors`` (float32 ``[rows, dim]`` unit vectors): the vectors the bundle's real encoder gives
the texts a benchmark will send (:func:`write_null_vectors`), keyed by a hash of their token ids
(:func:`token_key`), so the search, aggregation and fusion do the work they do behind the real
encoder. A text not in the file gets the file's first vector (a benchmark whose texts all miss
still searches real queries: it measured the wrong texts, not nothing). With no file, every text
gets a deterministic unit vector drawn from its token ids: the same text, the same vector, in
every process; the answers are meaningless but stable (tests, a smoke run without a vector file).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from engine.encoder import MAX_CHUNK, Encoder, EncoderOptions, TokenizingEncoder, runs_on_cuda

log = logging.getLogger(__name__)

NULL_PROVIDER = "null"
# A vector file's rows may be off unit norm by this much (the check_encoder tolerance of a load).
NORM_TOLERANCE = 1e-3


def token_key(ids) -> int:
    """A text's key in the vector file: a hash of its token ids (a tuple of ints hashes the same
    in every process: no hash randomisation for ints)."""
    return hash(tuple(ids))


def write_null_vectors(encoder: Encoder, texts: list[str], path: Path) -> None:
    """``encoder``'s vectors of ``texts`` (a bundle's real encoder), keyed by their token ids, to ``path``."""
    vectors, _ = encoder.encode(texts)
    keys = np.array([token_key(ids) for ids in encoder.tokenize(texts)], dtype=np.int64)
    np.savez(path, keys=keys, vectors=vectors)


def read_null_vectors(path: Path, dim: int) -> tuple[dict[int, int], np.ndarray]:
    """The vector file at ``path`` as (key → row, ``[rows, dim]`` float32 vectors), checked: both
    arrays present, one key per row, at least one row, ``dim`` wide, finite unit vectors. Raises
    :class:`ValueError` naming the file and what is wrong."""
    where = f"null encoder vector file {path}"
    try:
        npz = np.load(path, allow_pickle=False)
        if not isinstance(npz, np.lib.npyio.NpzFile):
            raise ValueError("a single array")
        with npz:
            keys, vectors = npz["keys"], npz["vectors"]
    except (KeyError, OSError, ValueError) as exc:
        raise ValueError(f"{where}: not an .npz of keys and vectors ({exc})") from None
    if keys.ndim != 1 or not np.issubdtype(keys.dtype, np.integer):
        raise ValueError(f"{where}: keys must be one integer per row, not {keys.dtype} {keys.shape}")
    if vectors.ndim != 2 or len(vectors) != len(keys) or not len(keys):
        raise ValueError(f"{where}: vectors {vectors.shape} for {len(keys)} keys (one row per key, at least one)")
    if vectors.shape[1] != dim:
        raise ValueError(f"{where}: vectors of dimension {vectors.shape[1]}, the bundle's is {dim}")
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=1)
    if not np.all(np.isfinite(vectors)) or not np.allclose(norms, 1.0, atol=NORM_TOLERANCE):
        raise ValueError(f"{where}: not finite unit vectors (norms {norms.min()} to {norms.max()})")
    return {int(key): row for row, key in enumerate(keys)}, vectors


def stand_in_vector(ids, dim: int) -> np.ndarray:
    """The deterministic unit vector of a text's token ids, for a null encoder without a file."""
    rng = np.random.default_rng(token_key(ids) & 0xFFFF_FFFF_FFFF_FFFF)
    vector = rng.standard_normal(dim).astype(np.float32)
    return vector / np.linalg.norm(vector)


class NullEncoder(TokenizingEncoder):
    """Tokenizes like the bundle's encoder (the same tokenizer, max length and chunking) and
    answers each :meth:`run` from a vector file (see the module's docstring).

    ``dim``: the bundle's serving dimension, which the file's vectors must have. Its chunks are
    those the ONNX encoder would make under the same options (one text per call on the CPU,
    :data:`~engine.encoder.MAX_CHUNK` where CUDA would run it), so the per-call work around the
    lookup is the served one; ``texts_per_call`` overrides."""

    provider = NULL_PROVIDER

    def __init__(
        self,
        tokenizer_path: Path,
        max_length: int,
        dim: int,
        vectors: Path | None = None,
        options: EncoderOptions | None = None,
        texts_per_call: int | None = None,
    ):
        super().__init__(tokenizer_path, max_length, options)
        self.dim = dim
        self.vectors_path = vectors
        self._rows, self._vectors = read_null_vectors(vectors, dim) if vectors is not None else ({}, None)
        if texts_per_call is None:
            texts_per_call = MAX_CHUNK if runs_on_cuda(self.options.providers) else 1
        self.texts_per_call = texts_per_call
        found = f"looked up in {vectors} ({len(self._rows)} texts)" if vectors is not None else "drawn from tokens"
        log.warning("null encoder: vectors %s, not computed (for benchmarks: not the model's answers)", found)

    def run(self, token_ids: list[list[int]]) -> np.ndarray:
        """The chunk's vectors from the file (a text not in it: the first row), or drawn from each
        text's token ids without a file."""
        if self._vectors is None:
            return np.stack([stand_in_vector(ids, self.dim) for ids in token_ids])
        return self._vectors[[self._rows.get(token_key(ids), 0) for ids in token_ids]]
