"""Bundle bodies, not only headers and checksums: a re-signed file whose arrays index out of
range is refused with the file and the reason before hnswlib or scipy read it (in the vetting
child too), rather than crashing a search or answering garbage on the rows a query touches."""

import json

import numpy as np
import pytest
import scipy.sparse as sp

from bundle import BundleError
from bundle.hnsw_file import HNSW_HEADER
from bundle.manifest import INDEX_FILE, LEXICAL_FILE, MANIFEST_FILE, VALUES_FILE, FusionParams, sha256_file
from engine.bundle import load_bundle, load_shard_key_terms
from engine.loading import vet_in_child


def resign(path, name):
    """Put the file's new checksum in the manifest, as a careless or hostile exporter would."""
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    manifest["files"][name] = sha256_file(path / name)
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))


def rewrite_csr(path, name, change):
    with np.load(path / name) as npz:
        arrays = dict(npz)
    change(arrays)
    np.savez_compressed(path / name, **arrays)
    resign(path, name)


def test_a_column_index_outside_the_value_matrix_is_refused(bundle_copy):
    def out_of_range(arrays):
        arrays["indices"][len(arrays["indices"]) // 2] = 10**6

    rewrite_csr(bundle_copy, VALUES_FILE, out_of_range)
    with pytest.raises(BundleError, match=f"{VALUES_FILE}: value matrix refused: column index 1000000 outside"):
        load_bundle(bundle_copy)


def test_a_decreasing_indptr_is_refused(bundle_copy):
    def decreasing(arrays):
        arrays["indptr"][5] = arrays["indptr"][6] + 1

    rewrite_csr(bundle_copy, VALUES_FILE, decreasing)
    with pytest.raises(BundleError, match=f"{VALUES_FILE}: value matrix refused: indptr is not"):
        load_bundle(bundle_copy)


def test_a_value_matrix_of_another_shape_is_refused(bundle_copy):
    rewrite_csr(bundle_copy, VALUES_FILE, lambda arrays: arrays.update(shape=arrays["shape"] + [0, 1]))
    with pytest.raises(BundleError, match=f"{VALUES_FILE}: value matrix refused: shape"):
        load_bundle(bundle_copy)


def index_elements(path):
    """The HNSW file's bytes and a writable (count, bytes per element) view of its elements."""
    data = bytearray((path / INDEX_FILE).read_bytes())
    fields = HNSW_HEADER.unpack_from(data)
    count, per_element = fields[2], fields[3]
    elements = np.frombuffer(data, dtype=np.uint8, count=count * per_element, offset=HNSW_HEADER.size)
    return data, elements.reshape(count, per_element), fields


def test_a_level0_link_to_no_element_is_refused(bundle_copy):
    data, elements, fields = index_elements(bundle_copy)
    elements[3, 4:8] = np.frombuffer(np.uint32(10**6).tobytes(), dtype=np.uint8)  # element 3's first neighbour
    (bundle_copy / INDEX_FILE).write_bytes(bytes(data))
    resign(bundle_copy, INDEX_FILE)
    with pytest.raises(BundleError, match=f"{INDEX_FILE}: HNSW body refused: a level-0 link names element 1000000"):
        load_bundle(bundle_copy)


def test_a_label_outside_the_key_range_is_refused(bundle_copy):
    data, elements, fields = index_elements(bundle_copy)
    label_offset = fields[4]
    elements[7, label_offset : label_offset + 8] = np.frombuffer(np.uint64(10**9).tobytes(), dtype=np.uint8)
    (bundle_copy / INDEX_FILE).write_bytes(bytes(data))
    resign(bundle_copy, INDEX_FILE)
    with pytest.raises(BundleError, match=f"{INDEX_FILE}: HNSW body refused: its labels are not the key ids"):
        load_bundle(bundle_copy)


def upper_levels(data, fields):
    """(element, offset of its level-1 list) of the elements with upper levels, and the elements without."""
    count, per_element = fields[2], fields[3]
    offset, upper, ground = HNSW_HEADER.size + count * per_element, [], []
    for element in range(count):
        size = int.from_bytes(data[offset : offset + 4], "little")
        offset += 4
        (upper if size else ground).append((element, offset))
        offset += size
    return upper, [element for element, _ in ground]


@pytest.mark.parametrize("target", ["no element", "a level-0 element"])
def test_an_upper_level_link_to_no_element_or_one_below_its_level_is_refused(bundle_copy, target):
    data, _, fields = index_elements(bundle_copy)
    upper, ground = upper_levels(data, fields)
    element, offset = next((e, o) for e, o in upper if int.from_bytes(data[o : o + 2], "little"))  # has links
    named = fields[2] + 5 if target == "no element" else ground[0]
    data[offset + 4 : offset + 8] = np.uint32(named).tobytes()  # its first level-1 neighbour
    (bundle_copy / INDEX_FILE).write_bytes(bytes(data))
    resign(bundle_copy, INDEX_FILE)
    reason = f"names element {named} of" if target == "no element" else "names an element below that level"
    with pytest.raises(BundleError, match=f"HNSW body refused: a level-1 link of element {element} {reason}"):
        load_bundle(bundle_copy)


def test_the_vetting_child_refuses_a_damaged_body_with_the_file_and_reason(bundle_copy):
    rewrite_csr(bundle_copy, VALUES_FILE, lambda arrays: arrays["indices"].__setitem__(0, -1))
    with pytest.raises(BundleError, match=f"{VALUES_FILE}: value matrix refused: column index -1 outside"):
        vet_in_child(bundle_copy)


def test_key_terms_narrower_than_the_fusions_term_space_are_refused(tiny_rae_bundle, tmp_path):
    manifest = load_bundle(tiny_rae_bundle).manifest
    fusion = FusionParams(
        model="fusion.onnx", features=["p"], depth=0, fitted_on="trn", queries=1, pairs=1, lexical=[LEXICAL_FILE]
    )
    manifest = manifest.model_copy(update={"fusion": fusion})
    keys = manifest.counts.memory_rows
    np.savez(tmp_path / fusion.file, idf=np.ones(50, dtype=np.float32))
    rows = sp.csr_matrix(np.eye(keys, 40, dtype=np.float32))
    sp.save_npz(tmp_path / LEXICAL_FILE, rows)
    with pytest.raises(BundleError, match=rf"{LEXICAL_FILE}: key term matrix refused: shape \({keys}, 40\)"):
        load_shard_key_terms(tmp_path, manifest, 0)
    sp.save_npz(tmp_path / LEXICAL_FILE, sp.csr_matrix(np.eye(keys, 50, dtype=np.float32)))
    assert load_shard_key_terms(tmp_path, manifest, 0).rows.shape == (keys, 50)
