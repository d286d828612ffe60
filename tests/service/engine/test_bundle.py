"""Bundle verification: every kind of damage is refused with a message naming it."""

import json
import shutil

import pytest

from bench.localserver import start_server
from service.engine.bundle import BundleError, load_bundle
from service.engine.manifest import INDEX_FILE, LABELS_FILE, MANIFEST_FILE, VALUES_FILE


@pytest.fixture
def bundle_copy(tiny_rae_bundle, tmp_path):
    target = tmp_path / "bundle"
    shutil.copytree(tiny_rae_bundle, target)
    return target


def edit_manifest(path, change):
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    change(manifest)
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_a_good_bundle_loads(tiny_rae_bundle):
    bundle = load_bundle(tiny_rae_bundle)
    assert bundle.manifest.index_kind == "rae_memory"
    assert bundle.values.shape == (bundle.manifest.counts.memory_rows, bundle.manifest.counts.labels)
    assert bundle.num_train_keys == 300


def test_flipped_byte_fails_the_checksum(bundle_copy):
    data = bytearray((bundle_copy / LABELS_FILE).read_bytes())
    data[10] ^= 0x01
    (bundle_copy / LABELS_FILE).write_bytes(bytes(data))
    with pytest.raises(BundleError, match=f"checksum mismatch for {LABELS_FILE}"):
        load_bundle(bundle_copy)


def test_missing_file(bundle_copy):
    (bundle_copy / INDEX_FILE).unlink()
    with pytest.raises(BundleError, match=f"missing file {INDEX_FILE}"):
        load_bundle(bundle_copy)


def test_required_file_absent_from_manifest(bundle_copy):
    edit_manifest(bundle_copy, lambda m: m["files"].pop(VALUES_FILE))
    with pytest.raises(BundleError, match=f"no checksum for required file {VALUES_FILE}"):
        load_bundle(bundle_copy)


def test_invalid_manifest(bundle_copy):
    (bundle_copy / MANIFEST_FILE).write_text("{ not json")
    with pytest.raises(BundleError, match="invalid manifest"):
        load_bundle(bundle_copy)


def test_unknown_schema_version(bundle_copy):
    edit_manifest(bundle_copy, lambda m: m.update(schema_version=99))
    with pytest.raises(BundleError, match="schema version 99"):
        load_bundle(bundle_copy)


def test_shape_mismatch_is_caught_even_without_checksums(bundle_copy):
    edit_manifest(bundle_copy, lambda m: m["counts"].update(memory_rows=m["counts"]["memory_rows"] + 1))
    with pytest.raises(BundleError, match="index holds"):
        load_bundle(bundle_copy, verify=False)


def test_wrong_dimension_is_caught(bundle_copy):
    edit_manifest(bundle_copy, lambda m: m.update(dim=32))
    with pytest.raises(BundleError):
        load_bundle(bundle_copy, verify=False)


def test_not_a_bundle(tmp_path):
    with pytest.raises(BundleError, match="no manifest.json"):
        load_bundle(tmp_path)


def test_server_refuses_to_start_on_a_corrupt_bundle(bundle_copy, tmp_path):
    (bundle_copy / VALUES_FILE).write_bytes(b"garbage")
    with pytest.raises(RuntimeError, match="checksum mismatch for values.npz"):
        start_server(bundle_copy, tmp_path / "server.log", timeout_s=60)
