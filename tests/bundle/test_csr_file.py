"""bundle.csr_file: a CSR file is checked as the service computes with it: offsets as signed
64-bit integers (an unsigned indptr whose difference wraps is refused), values once cast to
float32, every member's declared size before it is inflated."""

import io
import zipfile

import numpy as np
import pytest
import scipy.sparse as sp

from bundle import BundleError, load_csr

SHAPE = (6, 5)


def matrix() -> sp.csr_matrix:
    dense = np.zeros(SHAPE, dtype=np.float32)
    dense[0, 1], dense[2, 0], dense[2, 4], dense[3, 3], dense[5, 2] = 0.5, 0.25, 1.0, 0.75, 0.125
    return sp.csr_matrix(dense)


def write(path, **change):
    m = matrix()
    arrays = {"format": np.array("csr"), "shape": np.array(m.shape), "indptr": m.indptr, "indices": m.indices}
    arrays |= {"data": m.data} | change
    np.savez_compressed(path, **arrays)
    return path


def test_a_sound_file_loads_as_float32(tmp_path):
    loaded = load_csr(write(tmp_path / "m.npz"), SHAPE, "test matrix")
    assert loaded.dtype == np.float32 and (loaded != matrix()).nnz == 0


def test_an_unsigned_indptr_is_checked_as_signed_offsets(tmp_path):
    """np.diff of a uint64 indptr wraps: a spike never looks like a decrease, and scipy's C++ reads
    the offsets as signed (the reported crash: a segfault in _sparsetools on the first product)."""
    indptr = matrix().indptr.astype(np.uint64)
    spiked = indptr.copy()
    spiked[3] = 10**12  # then back down to indptr[4]: a decrease, invisible to np.diff in uint64
    assert not np.any(np.diff(spiked) < 0)
    with pytest.raises(BundleError, match="non-decreasing"):
        load_csr(write(tmp_path / "spike.npz", indptr=spiked), SHAPE, "test matrix")
    beyond = indptr.copy()
    beyond[3] = np.iinfo(np.uint64).max
    with pytest.raises(BundleError, match="beyond"):
        load_csr(write(tmp_path / "beyond.npz", indptr=beyond), SHAPE, "test matrix")
    # an unsigned indptr that holds is served
    assert load_csr(write(tmp_path / "ok.npz", indptr=indptr), SHAPE, "test matrix").nnz == 5


def test_values_are_checked_finite_as_float32(tmp_path):
    data = matrix().data.astype(np.float64)
    data[2] = 1e39  # finite as stored, inf as served
    with pytest.raises(BundleError, match="not finite as float32"):
        load_csr(write(tmp_path / "big.npz", data=data), SHAPE, "test matrix")


def test_values_outside_the_range_given_are_refused(tmp_path):
    data = matrix().data.copy()
    data[0] = 1.5
    with pytest.raises(BundleError, match=r"outside 0.0..1.0"):
        load_csr(write(tmp_path / "m.npz", data=data), SHAPE, "test matrix", (0.0, 1.0))


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"indices": np.array([1, 0, 4, 3, 5], dtype=np.int32)}, "column index 5 outside"),
        ({"indices": np.array([1, 0, -1, 3, 2], dtype=np.int64)}, "column index -1 outside"),
        ({"indptr": np.array([0, 1, 1, 3, 4, 4, 6])}, "offsets from 0 to 5"),
        ({"indptr": np.array([1, 1, 1, 3, 4, 4, 5])}, "offsets from 0 to 5"),
        ({"indptr": np.array([0, 1, 3, 4, 5])}, "offsets from 0 to 5"),
        ({"indices": np.array([1.0, 0, 4, 3, 2])}, "not a 1-d integer array"),
        ({"data": np.array([1, 2, 3, 4, 5], dtype=complex)}, "not a 1-d array of real numbers"),
        ({"data": np.ones(4, dtype=np.float32)}, "one per column index"),
        ({"format": np.array("csc")}, "not csr"),
        ({"shape": np.array([6, 6])}, "expected"),
    ],
    ids=[
        "index-past-the-columns",
        "negative-index",
        "indptr-past-nnz",
        "indptr-not-from-0",
        "indptr-short",
        "float-indices",
        "complex-data",
        "data-short",
        "csc",
        "another-shape",
    ],
)
def test_a_broken_structure_is_refused(tmp_path, change, fragment):
    with pytest.raises(BundleError, match=fragment):
        load_csr(write(tmp_path / "m.npz", **change), SHAPE, "test matrix")


def test_a_member_declaring_more_than_the_matrix_holds_is_refused_before_it_is_inflated(tmp_path):
    """The .npy header of ``indices`` declares 10^13 values (80 TB): refused from the header,
    never allocated (the old loader asked numpy for them)."""
    path = write(tmp_path / "m.npz")
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<i8", "fortran_order": False, "shape": (10**13,)})
    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    members["indices.npy"] = np.lib.format.MAGIC_PREFIX + b"\x01\x00" + header.getvalue()[8:] + b"\x00" * 64
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    with pytest.raises(BundleError, match="more than a 6 x 5 CSR matrix holds"):
        load_csr(path, SHAPE, "test matrix")


def test_a_file_that_is_not_an_npz_is_refused(tmp_path):
    (tmp_path / "m.npz").write_bytes(b"not a zip file at all")
    with pytest.raises(BundleError, match="cannot load test matrix"):
        load_csr(tmp_path / "m.npz", SHAPE, "test matrix")


def test_a_data_member_longer_than_the_indices_is_refused_from_its_header(tmp_path):
    """``data`` declares 25 values for 5 column indices (within what a 6 x 5 matrix holds): refused
    from the header, before inflating it (its bytes are not even there to read)."""
    path = write(tmp_path / "m.npz")
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (25,)})
    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    members["data.npy"] = np.lib.format.MAGIC_PREFIX + b"\x01\x00" + header.getvalue()[8:]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    with pytest.raises(BundleError, match="data is not 5 real numbers"):
        load_csr(path, SHAPE, "test matrix")
