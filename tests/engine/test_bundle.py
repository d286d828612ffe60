"""Bundle verification: every kind of damage is refused with a message naming it."""

import json
import shutil

import pytest

from bundle import BundleError
from bundle.manifest import INDEX_FILE, LABELS_FILE, MANIFEST_FILE, VALUES_FILE
from engine.bundle import load_bundle
from loadtest.localserver import start_server


def edit_manifest(path, change):
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    change(manifest)
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_a_good_bundle_loads(tiny_rae_bundle):
    bundle = load_bundle(tiny_rae_bundle)
    assert bundle.manifest.index_kind == "rae_memory"
    assert bundle.values.shape == (bundle.manifest.counts.memory_rows, bundle.manifest.counts.labels)
    assert bundle.manifest.counts.train_instances == 300


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
    with pytest.raises(BundleError, match="holds [0-9]+ keys, manifest says"):
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


def rewrite_index_header(path, **fields):
    """Change header fields of the bundle's HNSW file and re-sign it, as a careless or hostile
    exporter would: the checksums match, only the header lies."""
    from bundle.hnsw_file import HNSW_HEADER
    from bundle.manifest import sha256_file

    names = ("level0", "max_elements", "count", "per_element", "label_offset", "data_offset", "max_level",
             "entry", "max_m", "max_m0", "m", "mult", "ef_construction")  # fmt: skip
    data = bytearray((path / INDEX_FILE).read_bytes())
    header = dict(zip(names, HNSW_HEADER.unpack_from(data), strict=True)) | fields
    HNSW_HEADER.pack_into(data, 0, *(header[name] for name in names))
    (path / INDEX_FILE).write_bytes(bytes(data))
    edit_manifest(path, lambda m: m["files"].__setitem__(INDEX_FILE, sha256_file(path / INDEX_FILE)))


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"max_elements": 2**27}, "declares room for 134217728 elements"),
        ({"count": 10}, "holds 10 keys"),
        ({"m": 64, "max_m": 64, "max_m0": 128}, "M 64/64/128"),
        ({"per_element": 10**6}, "bytes per element"),
        ({"entry": 10**9}, "entry point"),
    ],
)
def test_an_index_header_that_lies_is_refused_before_hnswlib_reads_it(bundle_copy, fields, fragment):
    rewrite_index_header(bundle_copy, **fields)
    with pytest.raises(BundleError, match=fragment):
        load_bundle(bundle_copy)


def test_a_labels_file_naming_a_uid_twice_is_refused_with_both_rows(bundle_copy):
    """Re-signed, so only the content is wrong: label 17 takes label 3's uid. Served, the uid
    would name label 3 alone and an exclusion of it would leave label 17."""
    from bundle.manifest import sha256_file

    lines = [json.loads(line) for line in (bundle_copy / LABELS_FILE).read_text().splitlines()]
    uid = lines[3]["uid"]
    lines[17]["uid"] = uid
    (bundle_copy / LABELS_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    edit_manifest(bundle_copy, lambda m: m["files"].__setitem__(LABELS_FILE, sha256_file(bundle_copy / LABELS_FILE)))
    with pytest.raises(BundleError, match=f"{LABELS_FILE}: label uid '{uid}' at rows 3 and 17"):
        load_bundle(bundle_copy)


def test_a_truncated_index_is_refused(bundle_copy):
    data = (bundle_copy / INDEX_FILE).read_bytes()
    (bundle_copy / INDEX_FILE).write_bytes(data[: len(data) // 3])
    with pytest.raises(BundleError, match="too short"):
        load_bundle(bundle_copy, verify=False)


@pytest.mark.parametrize("name", ["../outside.txt", "/etc/passwd", "sub/../../x"])
def test_manifest_file_names_stay_inside_the_bundle(bundle_copy, name):
    edit_manifest(bundle_copy, lambda m: m["files"].__setitem__(name, "0" * 64))
    with pytest.raises(BundleError, match="leads outside the bundle directory"):
        load_bundle(bundle_copy, verify=False)


def test_a_symlink_out_of_the_bundle_is_refused(bundle_copy, tmp_path):
    outside = tmp_path / "elsewhere.jsonl"
    shutil.copy(bundle_copy / LABELS_FILE, outside)
    (bundle_copy / LABELS_FILE).unlink()
    (bundle_copy / LABELS_FILE).symlink_to(outside)
    with pytest.raises(BundleError, match="leads outside"):
        load_bundle(bundle_copy)


def test_vetting_in_a_child_accepts_a_good_bundle_and_reports_a_bad_one(tiny_rae_bundle, bundle_copy):
    from engine.loading import vet_in_child

    vet_in_child(tiny_rae_bundle, memory_limit_bytes=2 << 30)
    rewrite_index_header(bundle_copy, count=10)
    with pytest.raises(BundleError, match="holds 10 keys"):
        vet_in_child(bundle_copy)


def test_a_loader_that_needs_more_memory_than_allowed_is_refused_not_fatal(tiny_rae_bundle):
    from engine.loading import vet_in_child

    with pytest.raises(BundleError, match="MiB allowed|died|cannot be loaded"):
        vet_in_child(tiny_rae_bundle, memory_limit_bytes=64 << 20)  # less than the interpreter needs
