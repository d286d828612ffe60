import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.http.settings import Settings, environment_variables

OPERATIONS_DOC = Path(__file__).resolve().parents[3] / "docs" / "operations.md"


def documented_variables() -> set[str]:
    """The variables named in the first column of docs/operations.md's settings table."""
    section = OPERATIONS_DOC.read_text().split("## Settings", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(XMCSERVE_[A-Z_]+)`", section, re.M))


def test_every_variable_the_server_reads_is_documented_and_nothing_else():
    read = set(environment_variables())
    documented = documented_variables()
    assert read - documented == set(), "read but not documented"
    assert documented - read == set(), "documented but not read"


def test_groups_read_their_own_prefixes(monkeypatch, tmp_path):
    for name, value in {
        "XMCSERVE_MAX_K": "7",
        "XMCSERVE_MAX_QUEUE": "9",
        "XMCSERVE_SPLIT_B": "0.25",
        "XMCSERVE_SHADOW_URL": "http://127.0.0.1:9",
        "XMCSERVE_SHADOW_FRACTION": "0.5",
        "XMCSERVE_SHADOW_BATCH_TEXTS": "8",
        "XMCSERVE_SHADOW_LOG": str(tmp_path / "s.jsonl"),
        "XMCSERVE_ADMIN_TOKEN": "t0k",
        "XMCSERVE_BUNDLE_ROOT": str(tmp_path),
    }.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.limits.max_k == 7 and settings.batching.max_queue == 9 and settings.rollout.split_b == 0.25
    assert settings.shadow.url == "http://127.0.0.1:9" and settings.shadow.batch_texts == 8
    assert settings.admin.token.get_secret_value() == "t0k" and settings.admin.bundle_root == tmp_path


def test_out_of_range_values_fail_at_start_up(monkeypatch):
    monkeypatch.setenv("XMCSERVE_SPLIT_B", "1.5")
    with pytest.raises(ValidationError, match="split_b"):
        Settings()


@pytest.mark.parametrize(("env", "spins"), [({}, True), ({"XMCSERVE_CANDIDATE_BUNDLE_DIR": "bundles/b"}, False)])
def test_ort_spinning_only_for_a_lone_primary(monkeypatch, env, spins):
    """Spinning pools of A and B would keep each other's cores busy."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert Settings().encoder_options().allow_spinning is spins


def test_shadow_settings_reach_the_worker(monkeypatch, tmp_path):
    from service.http.app import build_shadow
    from service.http.metrics import Metrics

    for name, value in {
        "XMCSERVE_SHADOW_URL": "http://127.0.0.1:9",
        "XMCSERVE_SHADOW_FRACTION": "0.5",
        "XMCSERVE_SHADOW_BATCH_TEXTS": "8",
        "XMCSERVE_SHADOW_TIMEOUT_MS": "250",
        "XMCSERVE_SHADOW_LOG": str(tmp_path / "s.jsonl"),
    }.items():
        monkeypatch.setenv(name, value)
    mirror = build_shadow(Settings(), Metrics())
    worker = mirror._worker
    assert worker.config.batch_texts == 8 and worker.config.timeout_s == 0.25 and worker.config.fraction == 0.5
    assert worker.url == "http://127.0.0.1:9" and worker.config.log == tmp_path / "s.jsonl"
    assert worker.config.log_texts is False  # the log names texts by digest unless asked
    monkeypatch.setenv("XMCSERVE_SHADOW_LOG_TEXTS", "true")
    assert build_shadow(Settings(), Metrics())._worker.config.log_texts is True
    assert mirror.target == "http://127.0.0.1:9"


def test_no_shadow_url_means_no_mirroring(monkeypatch):
    from service.http.app import build_shadow
    from service.http.metrics import Metrics

    monkeypatch.setenv("XMCSERVE_SHADOW_FRACTION", "1.0")
    assert build_shadow(Settings(), Metrics()).config.fraction == 0.0


def test_the_batcher_and_the_encoder_get_one_thread_layout(monkeypatch):
    from engine import encoder as enc

    monkeypatch.setattr(enc, "confined_cpu_count", lambda: 6)
    monkeypatch.setenv("XMCSERVE_PROVIDERS", "cpu")
    default = Settings()
    assert default.batcher_config().workers == 6 and default.encoder_options().intra_op_threads == 1
    monkeypatch.setenv("XMCSERVE_BATCH_WORKERS", "2")
    latency_first = Settings()
    assert latency_first.batcher_config().workers == 2 and latency_first.encoder_options().intra_op_threads == 3


def test_the_null_encoder_setting_reaches_the_loaded_engine(monkeypatch, tiny_rae_bundle, tmp_path):
    """XMCSERVE_ENCODER=null → EngineParams → the engine's loaded bundle has the null encoder,
    over the vector file XMCSERVE_NULL_VECTORS names (absolute, as the vetting child and a
    group's workers read it); the default stays the ONNX encoder."""
    import asyncio

    from engine import Engine
    from engine.offline import NullEncoder, OnnxEncoder, load_encoder, write_null_vectors

    write_null_vectors(load_encoder(tiny_rae_bundle)[1], ["libc6: GNU C Library"], tmp_path / "vectors.npz")
    assert Settings().engine_params().encoder.backend == "onnx"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XMCSERVE_ENCODER", "null")
    monkeypatch.setenv("XMCSERVE_NULL_VECTORS", "vectors.npz")
    params = Settings(bundle_dir=tiny_rae_bundle).engine_params()
    assert (params.encoder.backend, params.encoder.null_vectors) == ("null", tmp_path / "vectors.npz")
    assert params.encoder.providers == "auto" and params.encoder.intra_op_threads >= 1  # the layout as before
    predictor = asyncio.run(Engine(params).load(tiny_rae_bundle, vet=False))
    assert isinstance(predictor.bundle.encoder, NullEncoder)
    assert predictor.bundle.encoder.vectors_path == tmp_path / "vectors.npz"
    assert predictor.predict(["libc6: GNU C Library"], k=3).rankings[0].ids.size == 3
    monkeypatch.delenv("XMCSERVE_NULL_VECTORS")
    assert not isinstance(load_encoder(tiny_rae_bundle, Settings().encoder_options())[1], OnnxEncoder)


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"XMCSERVE_ENCODER": "onnxx"}, "encoder\n  Input should be 'onnx' or 'null'"),
        ({"XMCSERVE_ENCODER": "null", "XMCSERVE_NULL_VECTORS": "/no/such/vectors.npz"}, "null_vectors\n  Path does"),
        ({"XMCSERVE_NULL_VECTORS": __file__}, "XMCSERVE_NULL_VECTORS .* is read only with XMCSERVE_ENCODER=null"),
    ],
    ids=["unknown-backend", "missing-file", "vectors-without-null"],
)
def test_a_bad_encoder_choice_fails_at_start_up(monkeypatch, env, reason):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError, match=reason):
        Settings()
