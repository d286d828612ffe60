import pytest
from pydantic import ValidationError

from service.http.settings import Settings


@pytest.mark.parametrize(
    ("env", "spins"),
    [
        ({}, True),  # a lone primary spins: lower tail at high load
        ({"XMCSERVE_CANDIDATE_BUNDLE_DIR": "bundles/b"}, False),  # leaves the cores to B's lane
        ({"XMCSERVE_CANDIDATE_BUNDLE_DIR": "bundles/b", "XMCSERVE_ALLOW_SPINNING": "true"}, True),
        ({"XMCSERVE_ALLOW_SPINNING": "false"}, False),
        ({"XMCSERVE_CPU_PRIORITY": "idle", "XMCSERVE_ALLOW_SPINNING": "true"}, False),
    ],
)
def test_ort_spinning_follows_the_candidate_unless_set(monkeypatch, env, spins):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.spinning() is spins
    assert settings.encoder_options().allow_spinning is spins



def test_shadow_settings_reach_the_worker(monkeypatch, tmp_path):
    from service.http.app import build_shadow
    from service.http.metrics import Metrics
    from service.primary_gate import PrimaryActivity

    for name, value in {
        "XMCSERVE_SHADOW_MAX_TEXTS_PER_S": "16",
        "XMCSERVE_SHADOW_ABORT_BACKOFF_MAX_MS": "250",
        "XMCSERVE_SHADOW_YIELD": "false",
        "XMCSERVE_SHADOW_BATCH_TEXTS": "8",
        "XMCSERVE_SHADOW_LOG": str(tmp_path / "s.jsonl"),
    }.items():
        monkeypatch.setenv(name, value)
    mirror = build_shadow(Settings(), Metrics(), variants=None, activity=PrimaryActivity())
    spec = mirror._worker.spec
    assert spec.config["max_texts_per_s"] == 16 and spec.config["batch_texts"] == 8
    assert spec.config["abort_backoff_max_s"] == 0.25
    assert spec.config["yield_to_primary"] is False and mirror._worker._activity is None  # not gated
    assert spec.remote_url is None and spec.log["path"] == str(tmp_path / "s.jsonl") and mirror.target == "B"


def test_a_shadow_on_cores_of_its_own_does_not_yield_unless_told(monkeypatch):
    from service.http.app import build_shadow
    from service.http.metrics import Metrics
    from service.primary_gate import PrimaryActivity

    monkeypatch.setenv("XMCSERVE_SHADOW_CPUS", "1,3-4")
    mirror = build_shadow(Settings(), Metrics(), variants=None, activity=PrimaryActivity())
    assert mirror._worker.spec.cpus == [1, 3, 4]
    assert mirror.config.yield_to_primary is False and mirror._worker._activity is None
    monkeypatch.setenv("XMCSERVE_SHADOW_YIELD", "true")
    assert build_shadow(Settings(), Metrics(), variants=None, activity=PrimaryActivity()).config.yield_to_primary
    monkeypatch.delenv("XMCSERVE_SHADOW_CPUS")
    monkeypatch.delenv("XMCSERVE_SHADOW_YIELD")
    mirror = build_shadow(Settings(), Metrics(), variants=None, activity=PrimaryActivity())
    assert mirror._worker.spec.cpus is None and mirror.config.yield_to_primary  # shares A's cores: yields


def test_a_malformed_shadow_cpu_list_fails_at_start_up(monkeypatch):
    monkeypatch.setenv("XMCSERVE_SHADOW_CPUS", "2-1")
    with pytest.raises(ValidationError, match="bad CPU range"):
        Settings()
