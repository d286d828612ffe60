"""bundle.ivfpq_file reads faiss's format without faiss: its constants are faiss's own; the
re-rank vectors are checked as the keys they are."""

import faiss
import numpy as np
import pytest

from bundle.ivfpq_file import METRIC_INNER_PRODUCT, IndexRefused, load_rerank_vectors


def test_the_metric_the_header_records_is_faiss_inner_product():
    assert METRIC_INNER_PRODUCT == faiss.METRIC_INNER_PRODUCT


def test_rerank_vectors_longer_than_unit_vectors_are_refused(tmp_path):
    """Re-rank vectors are the keys (the encoder's unit vectors) as float16: a long one would
    outweigh every other candidate's exact similarity."""
    vectors = np.random.default_rng(0).normal(size=(40, 8)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    np.save(tmp_path / "rerank.npy", vectors.astype(np.float16))
    assert load_rerank_vectors(tmp_path / "rerank.npy", 8, 40).shape == (40, 8)
    vectors[31] *= 100
    np.save(tmp_path / "rerank.npy", vectors.astype(np.float16))
    with pytest.raises(IndexRefused, match="norm is 100"):
        load_rerank_vectors(tmp_path / "rerank.npy", 8, 40)


def test_rerank_vectors_stored_column_by_column_are_refused(tmp_path):
    """A fortran_order file's blocks are columns, not vectors: its norms were measured over the
    wrong values (a long vector could pass, a sound one be refused), so it is refused outright."""
    vectors = np.random.default_rng(1).normal(size=(40, 8)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    np.save(tmp_path / "rerank.npy", np.asfortranarray(vectors.astype(np.float16)))
    with pytest.raises(IndexRefused, match="column by column"):
        load_rerank_vectors(tmp_path / "rerank.npy", 8, 40)
