"""export.derive: RAE bundles derived from another without re-encoding."""

import numpy as np
import pytest
import scipy.sparse as sp

from engine.bundle import load_bundle
from export.derive import derive_rae_bundle
from xmc.data import load_jsonl_split


@pytest.fixture(scope="module")
def memory(sample_dir):
    """The tiny_rae_bundle's memory: the first 300 training instances."""
    return load_jsonl_split(sample_dir, "trn").subset(np.arange(300))


def test_derived_rae_bundle_changes_only_the_rae_parameters(tiny_rae_bundle, memory, tmp_path):
    source = load_bundle(tiny_rae_bundle)
    derived_manifest = derive_rae_bundle(tiny_rae_bundle, tmp_path / "d", memory.Y, lam=0.8, tau=0.1)
    derived = load_bundle(tmp_path / "d")  # checksums verified
    assert derived.manifest.rae.lam == 0.8 and derived.manifest.rae.tau == 0.1
    assert derived.manifest.rae.top_b == source.manifest.rae.top_b
    assert derived_manifest.bundle_id != source.bundle_id
    assert derived_manifest.params["derived_from"] == source.bundle_id and derived_manifest.params["rae_lambda"] == 0.8
    assert derived.manifest.files["encoder.onnx"] == source.manifest.files["encoder.onnx"]
    expected = sp.vstack([0.8 * (memory.Y > 0), 0.2 * sp.identity(memory.num_labels)]).tocsr()
    assert derived.values.shape == expected.shape and abs(derived.values - expected).max() < 1e-6  # sparse: 12k x 12k


def test_only_tau_changes_the_id_but_no_file(tiny_rae_bundle, memory, tmp_path):
    source = load_bundle(tiny_rae_bundle)
    only_tau = derive_rae_bundle(tiny_rae_bundle, tmp_path / "t", memory.Y, tau=0.2)
    # same files, still a different bundle (τ is part of what it serves)
    assert only_tau.served_files == source.manifest.served_files and only_tau.bundle_id != source.bundle_id


def test_deriving_the_same_parameters_twice_gives_the_same_id(tiny_rae_bundle, memory, tmp_path):
    first = derive_rae_bundle(tiny_rae_bundle, tmp_path / "a", memory.Y, lam=0.3, mode="split")
    second = derive_rae_bundle(tiny_rae_bundle, tmp_path / "b", memory.Y, lam=0.3, mode="split")
    assert first.bundle_id == second.bundle_id and first.rae.mode == "split"


def test_a_wrong_label_matrix_or_an_existing_target_is_refused(tiny_rae_bundle, memory, tmp_path):
    with pytest.raises(ValueError, match="does not match"):
        derive_rae_bundle(tiny_rae_bundle, tmp_path / "x", memory.Y[:10], lam=0.3)
    derive_rae_bundle(tiny_rae_bundle, tmp_path / "d", memory.Y, lam=0.3)
    with pytest.raises(FileExistsError, match="immutable"):
        derive_rae_bundle(tiny_rae_bundle, tmp_path / "d", memory.Y, lam=0.4)
    assert derive_rae_bundle(tiny_rae_bundle, tmp_path / "d", memory.Y, lam=0.4, force=True).rae.lam == 0.4
    assert not (tmp_path / "x").exists()
