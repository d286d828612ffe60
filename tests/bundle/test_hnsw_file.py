"""bundle.hnsw_file: hnswlib's format checked on its own (the bundle tests corrupt whole
bundles; here a file is written by hnswlib and checked against what a manifest would say)."""

import hnswlib
import numpy as np
import pytest

from bundle.hnsw_file import HNSW_HEADER, HnswFileRefused, check_index_body, check_index_header


@pytest.fixture
def index_file(tmp_path):
    index = hnswlib.Index(space="ip", dim=8)
    index.init_index(max_elements=20, M=4, ef_construction=20, random_seed=0)
    vectors = np.random.default_rng(0).normal(size=(20, 8)).astype(np.float32)
    index.add_items(vectors / np.linalg.norm(vectors, axis=1, keepdims=True), np.arange(20))  # the encoder's
    path = tmp_path / "index.hnsw"
    index.save_index(str(path))
    return path


def test_a_file_hnswlib_wrote_passes(index_file):
    check_index_header(index_file, dim=8, expected_m=4, keys=20)
    check_index_body(index_file, first_key=0, keys=20)


@pytest.mark.parametrize(
    ("dim", "m", "keys", "problem"),
    [(16, 4, 20, "not 16-d float32"), (8, 8, 20, "not 8"), (8, 4, 21, "holds 20 keys, manifest says 21")],
)
def test_a_header_that_disagrees_with_the_manifest_is_refused(index_file, dim, m, keys, problem):
    with pytest.raises(HnswFileRefused, match=problem):
        check_index_header(index_file, dim=dim, expected_m=m, keys=keys)


def test_labels_other_than_the_key_ids_are_refused(index_file):
    with pytest.raises(HnswFileRefused, match="not the key ids 5..24"):
        check_index_body(index_file, first_key=5, keys=20)


def test_a_vector_longer_than_a_unit_vector_is_refused(tmp_path):
    """Keys are the encoder's unit vectors: a finite but long one would outweigh every other
    key's similarity, and a long enough one overflow it and the softmax over it to inf."""
    index = hnswlib.Index(space="ip", dim=8)
    index.init_index(max_elements=20, M=4, ef_construction=20, random_seed=0)
    vectors = np.random.default_rng(0).normal(size=(20, 8)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    vectors[7] *= 100
    index.add_items(vectors, np.arange(20))
    index.save_index(str(tmp_path / "index.hnsw"))
    with pytest.raises(HnswFileRefused, match="a vector's norm is 100"):
        check_index_body(tmp_path / "index.hnsw", first_key=0, keys=20)


@pytest.mark.parametrize(
    ("word", "value", "problem"),
    [(0, 1 << 40, "level-0 data at offset"), (11, 1e300, "level multiplier"), (12, 1 << 40, "ef_construction")],
    ids=["offset-level0", "multiplier", "ef-construction"],
)
def test_header_fields_hnswlib_trusts_are_checked(index_file, word, value, problem):
    """Fields the manifest says nothing of, still what hnswlib writes: an offsetLevel0 of 2^40
    passed every other check and segfaulted hnswlib's loadIndex."""
    fields = list(HNSW_HEADER.unpack_from(index_file.read_bytes()))
    fields[word] = value
    index_file.write_bytes(HNSW_HEADER.pack(*fields) + index_file.read_bytes()[HNSW_HEADER.size :])
    with pytest.raises(HnswFileRefused, match=problem):
        check_index_header(index_file, dim=8, expected_m=4, keys=20)
