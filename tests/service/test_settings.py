import pytest

from service.settings import Settings


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
    from service.app import build_shadow
    from service.metrics import Metrics
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
