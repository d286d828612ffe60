"""Start-up loads are vetted like reloads: A, A's previous and B (the settings' or the group's
admin log's) each in the memory-capped child first, so a bundle that would crash the loader or
inflate without bound costs that child, never the process that is about to serve."""

import asyncio
from pathlib import Path

import pytest

import engine.serving
from bundle import BundleError
from service.http.app import install_routing
from service.http.group import Routing
from service.http.metrics import Metrics
from service.http.settings import Settings
from service.http.state import ServingState, build_engine
from service.rollout import CANDIDATE, PRIMARY
from tests.service.http.test_group import FakeTime


@pytest.fixture
def vetting(monkeypatch):
    """The vetting child replaced by a record of what it was asked (and a refusal of ``refused``),
    the in-process loader by a record of what it loaded before calling it."""
    vetted, loaded, refused = [], [], set()

    def vet(path, options=None, verify=True, memory_limit_bytes=0):
        vetted.append(Path(path).resolve())
        assert memory_limit_bytes > 0  # under the cap a reload's child has
        if Path(path).resolve() in refused:
            raise BundleError(f"{path}: the loader process died (exit code -11)")

    real_load = engine.serving.load_predictor

    def load(path, *args, **kwargs):
        loaded.append(Path(path).resolve())
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(engine.serving, "vet_in_child", vet)
    monkeypatch.setattr(engine.serving, "load_predictor", load)
    return vetted, loaded, refused


def serving_state(bundle: Path) -> ServingState:
    settings = Settings(bundle_dir=bundle)
    metrics = Metrics(None)
    return ServingState(settings, metrics, build_engine(settings, metrics))


def test_every_bundle_loaded_at_start_is_vetted_in_the_child_before_it_is_loaded(bundle_root, vetting):
    vetted, loaded, _ = vetting
    a, previous, b = (bundle_root / name for name in ("tiny-rae", "tiny-labels", "tiny-rae"))
    state = serving_state(a)
    routing = Routing(primary=str(a), previous=str(previous), candidate=str(b))
    asyncio.run(install_routing(state, routing, logged_candidate=True))  # B named by the group's admin log
    assert vetted == loaded == [a.resolve(), previous.resolve(), b.resolve()]
    assert state.engine.predictor(CANDIDATE) is not None


def test_a_primary_the_child_refuses_stops_start_up_without_being_loaded_here(bundle_root, vetting):
    vetted, loaded, refused = vetting
    a = bundle_root / "tiny-rae"
    refused.add(a.resolve())
    with pytest.raises(BundleError, match="loader process died"):
        asyncio.run(install_routing(serving_state(a), Routing(primary=str(a))))
    assert vetted == [a.resolve()] and loaded == []


def test_a_previous_the_child_refuses_is_left_out_and_a_served(bundle_root, vetting):
    vetted, loaded, refused = vetting
    a, previous = bundle_root / "tiny-rae", bundle_root / "tiny-labels"
    refused.add(previous.resolve())
    state = serving_state(a)
    asyncio.run(install_routing(state, Routing(primary=str(a), previous=str(previous))))
    assert loaded == [a.resolve()] and state.engine.predictor(PRIMARY) is not None


def busy_at_first(monkeypatch, busy: dict[Path, int]) -> list:
    """The loader (after ``vetting``'s record) raising MemoryBusy on the first ``busy[path]`` loads
    of ``path``: another worker's writer held its lineage's append log past the read wait."""
    from engine import MemoryBusy

    calls, inner = [], engine.serving.load_predictor

    def load(path, *args, **kwargs):
        calls.append(Path(path).resolve())
        if calls.count(Path(path).resolve()) <= busy.get(Path(path).resolve(), 0):
            raise MemoryBusy(f"{path}: another worker held its append log past the read wait; load it again")
        return inner(path, *args, **kwargs)

    monkeypatch.setattr(engine.serving, "load_predictor", load)
    return calls


def test_a_start_outwaits_an_append_log_held_past_the_read_wait_for_a_its_previous_and_b(
    bundle_root, vetting, monkeypatch
):
    """A brief hold on an append log (MemoryBusy) failed a worker's start, even for A's previous
    and the settings' B (only refusals were caught): each load is tried again, vetted once."""
    from engine import BusyRetry

    vetted, _, _ = vetting
    a, previous, b = (bundle_root / name for name in ("tiny-rae", "tiny-labels", "tiny-rae"))
    calls = busy_at_first(monkeypatch, {a.resolve(): 2, previous.resolve(): 1})
    state = serving_state(a)
    fake = FakeTime()
    state.busy_retry = BusyRetry(clock=fake.clock, sleep=fake.sleep)
    asyncio.run(install_routing(state, Routing(primary=str(a), previous=str(previous), candidate=str(b))))
    assert calls == [a.resolve()] * 3 + [previous.resolve()] * 2 + [b.resolve()]
    assert vetted == [a.resolve(), previous.resolve(), b.resolve()]  # the vet is not repeated
    assert fake.pauses == [0.05, 0.1, 0.05]
    assert state.engine.previous is not None and state.engine.predictor(CANDIDATE) is not None


def test_a_start_whose_append_log_stays_held_past_the_bound_fails(bundle_root, vetting, monkeypatch):
    from engine import MemoryBusy
    from engine.serving import BUSY_WITHIN_S, BusyRetry

    a = bundle_root / "tiny-rae"
    calls = busy_at_first(monkeypatch, {a.resolve(): 10**6})
    state = serving_state(a)
    fake = FakeTime()
    state.busy_retry = BusyRetry(clock=fake.clock, sleep=fake.sleep)
    with pytest.raises(MemoryBusy):
        asyncio.run(install_routing(state, Routing(primary=str(a))))
    assert sum(fake.pauses) == pytest.approx(BUSY_WITHIN_S) and len(calls) == len(fake.pauses) + 1
    assert state.engine.predictor(PRIMARY) is None
