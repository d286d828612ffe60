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

