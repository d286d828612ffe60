"""Lifecycle and admin events as log lines of their own (in-process app, the records' fields)."""

import logging

import pytest
from fastapi.testclient import TestClient

from engine import BundleError
from service.http.app import create_app
from service.http.settings import AdminSettings, Settings

TOKEN = "lifecycle-token"
ADMIN = {"X-Admin-Token": TOKEN}


def events(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if hasattr(r, "event")]


def test_loads_reloads_promotes_config_and_appends_each_log_a_line(bundle_root, tmp_path, caplog):
    admin = AdminSettings(token=TOKEN, bundle_root=bundle_root, append_log_dir=tmp_path / "appends")
    settings = Settings(bundle_dir=bundle_root / "tiny-rae", admin=admin)
    with caplog.at_level(logging.INFO), TestClient(create_app(settings)) as client:
        assert (
            client.post("/admin/reload", json={"variant": "B", "bundle": "corrupt"}, headers=ADMIN).status_code == 422
        )
        assert (
            client.post("/admin/reload", json={"variant": "B", "bundle": "tiny-rae"}, headers=ADMIN).status_code == 200
        )
        assert client.post("/admin/promote", headers=ADMIN).status_code == 200
        assert client.post("/admin/config", json={"split_b": 0.25}, headers=ADMIN).status_code == 200
        new_label = {"labels": [{"uid": "lifecycle-new", "text": "a label added by the lifecycle test"}]}
        assert client.post("/admin/append", json=new_label, headers=ADMIN).status_code == 200
        assert client.post("/admin/append", json=new_label, headers=ADMIN).status_code == 422  # uid taken
    by_event = {}
    for record in events(caplog):
        by_event.setdefault(record.event, []).append(record)
    assert by_event["bundle_refused"][0].reason and by_event["bundle_refused"][0].variant == "B"
    assert by_event["bundle_refused"][0].levelname == "WARNING"
    assert all(r.verified for r in by_event["bundle_loaded"])
    assert by_event["reload"][0].variant == "B" and by_event["reload"][0].bundle_id
    assert by_event["promote"][0].bundle_id == by_event["reload"][0].bundle_id
    assert by_event["config_change"][0].split_b == 0.25
    assert by_event["append_applied"][0].labels == 1 and not by_event["append_applied"][0].repeated
    assert "lifecycle-new" in by_event["append_refused"][0].reason
    assert {"serving", "shutdown", "stopped"} <= by_event.keys()
    assert "a label added by the lifecycle test" not in caplog.text  # appended texts are not logged


def test_a_primary_bundle_refused_at_start_up_says_why(bundle_root, caplog):
    with (
        caplog.at_level(logging.INFO),
        pytest.raises(BundleError),
        TestClient(create_app(Settings(bundle_dir=bundle_root / "corrupt"))),
    ):
        pass
    (refused,) = [r for r in events(caplog) if r.event == "bundle_refused"]
    assert refused.levelname == "ERROR" and "checksum mismatch" in refused.reason
