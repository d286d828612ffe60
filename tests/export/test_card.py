"""Every bundle is written with its card (card.json + README.md), listed with their checksums
and left out of the bundle id: recording figures keeps the id; a changed, oversized or malformed
card is refused at load; a bundle from before cards loads without one."""

import json

import pytest

from bundle import (
    CARD_FILE,
    CARD_README_FILE,
    MANIFEST_FILE,
    MAX_CARD_BYTES,
    BundleError,
    Figures,
    content_id,
    read_manifest,
)
from engine.offline import load_bundle
from export.card import CardFacts, record
from export.evaluate import main as evaluate_main


def reseal_manifest(bundle, **changes):
    """The manifest rewritten with ``changes`` to its fields, its files' checksums recomputed."""
    from export.writer import file_checksums

    manifest = read_manifest(bundle)
    files = {name: digest for name, digest in file_checksums(bundle).items() if name != MANIFEST_FILE}
    manifest = manifest.model_copy(update={"files": files, **changes})
    (bundle / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2))
    return manifest


def test_a_built_bundle_carries_its_card_in_its_checksums(tiny_rae_bundle):
    manifest = read_manifest(tiny_rae_bundle)
    assert {CARD_FILE, CARD_README_FILE} <= set(manifest.files)
    bundle = load_bundle(tiny_rae_bundle)
    card = bundle.card
    assert card.bundle_id == manifest.bundle_id and card.made["created_at"] == manifest.created_at
    counts = manifest.counts
    assert card.data == {
        "name": manifest.source.data,
        "labels": counts.labels,
        "train_instances": counts.train_instances,
    }
    assert card.model["index_kind"] == "rae_memory" and card.model["dim"] == manifest.dim
    readme = (tiny_rae_bundle / CARD_README_FILE).read_text()
    assert readme.startswith(f"# Bundle {manifest.bundle_id}") and "Not measured yet" in readme


def test_recording_figures_keeps_the_id_and_merges_by_system_split_and_protocol(bundle_copy):
    before = read_manifest(bundle_copy)
    written_by = load_bundle(bundle_copy).card.made["command"]
    row = Figures(system="this bundle", split="dev", protocol="peers", metrics={"P@1": 50.0, "P@5": 20.0})
    other = Figures(system="tfidf-ovr-logreg", split="dev", protocol="peers", metrics={"P@1": 40.0})
    first = record(bundle_copy, CardFacts(recipe="smoke", seconds={"train": 12.0}, figures=[row, other], notes=["n"]))
    assert first.bundle_id == before.bundle_id == content_id(first)
    assert first.files[CARD_FILE] != before.files[CARD_FILE]
    again = row.model_copy(update={"metrics": {"P@1": 51.0}})
    record(bundle_copy, CardFacts(figures=[again], notes=["n", "m"]))
    card = load_bundle(bundle_copy).card  # loads: the new card's checksum is in the manifest
    assert [(r.system, r.metrics) for r in card.figures] == [
        ("tfidf-ovr-logreg", {"P@1": 40.0}),
        ("this bundle", {"P@1": 51.0}),
    ]
    assert card.recipe == "smoke" and card.seconds == {"train": 12.0} and card.notes == ["n", "m"]
    assert card.made["command"] == written_by  # kept: neither record named one
    record(bundle_copy, CardFacts(command="xmcserve fit"))
    assert load_bundle(bundle_copy).card.made["command"] == "xmcserve fit"  # a command named wins
    readme = (bundle_copy / CARD_README_FILE).read_text()
    assert "| this bundle | dev | peers | 51.00 |" in readme and "> m" in readme


def test_a_changed_card_is_refused_like_any_file(bundle_copy):
    card = json.loads((bundle_copy / CARD_FILE).read_text())
    card["notes"] = ["better than it is"]
    (bundle_copy / CARD_FILE).write_text(json.dumps(card))
    with pytest.raises(BundleError, match=CARD_FILE):
        load_bundle(bundle_copy)


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"{" + b" " * MAX_CARD_BYTES + b"}", "over the"),
        (b"[1, 2]", "not a bundle card"),
        (b'{"bundle_id": "x"', "not a bundle card"),
        (
            json.dumps({"bundle_id": "x", "made": {}, "data": {}, "model": {}, "surprise": 1}).encode(),
            "not a bundle card",
        ),
    ],
)
def test_an_oversized_or_malformed_card_is_refused_even_with_its_checksum(bundle_copy, content, reason):
    (bundle_copy / CARD_FILE).write_bytes(content)
    reseal_manifest(bundle_copy)
    with pytest.raises(BundleError, match=reason):
        load_bundle(bundle_copy)


def test_a_bundle_from_before_cards_loads_without_one_and_keeps_its_id(bundle_copy):
    manifest = read_manifest(bundle_copy)
    for name in (CARD_FILE, CARD_README_FILE):
        (bundle_copy / name).unlink()
    old = reseal_manifest(bundle_copy)
    assert CARD_FILE not in old.files and content_id(old) == manifest.bundle_id
    assert load_bundle(bundle_copy).card is None


def test_evaluate_record_puts_both_protocols_in_the_card(bundle_copy, sample_dir, capsys):
    assert evaluate_main(["--bundle", str(bundle_copy), "--data", str(sample_dir), "--split", "dev", "--record"]) == 0
    card = load_bundle(bundle_copy).card
    assert {(r.system, r.split, r.protocol) for r in card.figures} == {
        ("this bundle", "dev", "peers"),
        ("this bundle", "dev", "exclude-before"),
    }
    assert all("P@1" in r.metrics for r in card.figures)
