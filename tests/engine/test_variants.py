"""The engine's variants (engine.variants): sticky routing by request key, the split, atomic
swaps, promote and rollback."""

import random

import pytest

from engine.variants import Variants, key_fraction, route

PRIMARY, CANDIDATE = "A", "B"


def routed_to(key, split, candidate_ready, rng=None) -> str:
    return CANDIDATE if route(key, split, candidate_ready, rng) else PRIMARY


def test_split_fraction_holds_over_many_keys():
    for split in (0.1, 0.5, 0.9):
        routed = [routed_to(f"user-{i}", split, candidate_ready=True) for i in range(20_000)]
        share_b = routed.count(CANDIDATE) / len(routed)
        assert share_b == pytest.approx(split, abs=0.015)


def test_a_key_always_gets_the_same_variant():
    for i in range(500):
        key = f"session-{i}"
        first = routed_to(key, 0.3, candidate_ready=True)
        assert all(routed_to(key, 0.3, candidate_ready=True) == first for _ in range(5))


def test_raising_the_split_only_moves_keys_from_a_to_b():
    keys = [f"k{i}" for i in range(5000)]
    at_10 = {k: routed_to(k, 0.1, True) for k in keys}
    at_50 = {k: routed_to(k, 0.5, True) for k in keys}
    assert all(at_50[k] == CANDIDATE for k in keys if at_10[k] == CANDIDATE)


def test_no_candidate_or_zero_split_means_a():
    assert all(routed_to(f"k{i}", 1.0, candidate_ready=False) == PRIMARY for i in range(100))
    assert all(routed_to(f"k{i}", 0.0, candidate_ready=True) == PRIMARY for i in range(100))


def test_requests_without_a_key_are_split_at_random():
    rng = random.Random(0)
    routed = [routed_to(None, 0.25, True, rng) for _ in range(20_000)]
    assert routed.count(CANDIDATE) / len(routed) == pytest.approx(0.25, abs=0.015)


def test_key_fraction_is_uniform_enough():
    values = [key_fraction(str(i)) for i in range(10_000)]
    assert min(values) >= 0 and max(values) < 1
    assert sum(values) / len(values) == pytest.approx(0.5, abs=0.01)


def test_requests_queued_for_b_when_it_is_promoted_are_served_by_the_new_a():
    from engine.batcher import BatcherConfig

    variants = Variants.create(BatcherConfig(), lambda name: lambda n, t: None)
    old_a, candidate = object(), object()
    variants.install(PRIMARY, old_a, "a")
    variants.install(CANDIDATE, candidate, "b")
    assert variants[CANDIDATE].current_predictor() is candidate
    variants.promote()
    assert variants[PRIMARY].current_predictor() is candidate
    # B is empty now, but whatever was still queued for it runs on B's bundle, now A's
    assert not variants[CANDIDATE].ready and variants[CANDIDATE].current_predictor() is candidate


def test_a_rollback_puts_back_the_a_that_a_promote_or_reload_replaced_and_a_second_undoes_it():
    from engine.batcher import BatcherConfig

    variants = Variants.create(BatcherConfig(), lambda name: lambda n, t, s, tags: None)
    old_a, candidate, reloaded = object(), object(), object()
    variants.install(PRIMARY, old_a, "/bundles/a")
    with pytest.raises(LookupError, match="no previous A bundle"):
        variants.rollback()  # nothing replaced A yet
    variants.install(CANDIDATE, candidate, "/bundles/b")
    variants.promote()
    assert variants.rollback() is candidate and variants[PRIMARY].predictor is old_a
    assert variants[PRIMARY].source == "/bundles/a" and variants.previous.source == "/bundles/b"
    assert variants.rollback() is old_a and variants[PRIMARY].predictor is candidate  # undone
    variants.install(PRIMARY, reloaded, "/bundles/c")  # a reload of A can be rolled back too
    assert variants.rollback() is reloaded and variants[PRIMARY].predictor is candidate
    assert not variants[CANDIDATE].ready  # B untouched throughout


def test_the_front_end_names_the_variants():
    from engine.batcher import BatcherConfig

    variants = Variants.create(BatcherConfig(), lambda name: lambda n, t: None, names=("blue", "green"))
    assert list(variants.slots) == ["blue", "green"]
    variants.install("blue", blue := object(), "/b")
    with pytest.raises(LookupError, match="no candidate \\(green\\)"):
        variants.promote()
    variants.install("green", green := object(), "/g")
    assert variants.choose("any key").name == "blue"  # no split: the primary
    variants.split_b = 1.0
    assert variants.choose("any key").name == "green"
    assert variants.promote() is blue and variants["blue"].predictor is green
