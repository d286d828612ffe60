"""The logging set-up: one handler, JSON or text, the request id on every record, uvicorn's
loggers routed through it."""

import io
import json
import logging

import pytest

from service.observability.logs import REQUEST_ID, configure_logging, resolved_format


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_is_text_on_a_terminal_and_json_otherwise():
    assert resolved_format("auto", Terminal()) == "text"
    assert resolved_format("auto", io.StringIO()) == "json"
    assert resolved_format("text", io.StringIO()) == "text"


def test_json_lines_carry_the_request_id_and_the_extra_fields(restore_logging):
    out = io.StringIO()
    assert configure_logging("json", "INFO", out) == "json"
    token = REQUEST_ID.set("rid-42")
    try:
        logging.getLogger("xmcserve.test").info("bundle %s loaded", "b1", extra={"event": "bundle_loaded"})
    finally:
        REQUEST_ID.reset(token)
    logging.getLogger("xmcserve.test").debug("below the level")
    (line,) = [json.loads(x) for x in out.getvalue().splitlines()]
    assert line["message"] == "bundle b1 loaded" and line["event"] == "bundle_loaded"
    assert line["request_id"] == "rid-42" and line["level"] == "INFO" and line["logger"] == "xmcserve.test"
    assert "time" in line


def test_uvicorn_loggers_go_through_the_same_handler(restore_logging):
    logging.getLogger("uvicorn.error").addHandler(logging.StreamHandler(io.StringIO()))  # as uvicorn's own config would
    out = Terminal()
    configure_logging("auto", "INFO", out)
    logging.getLogger("uvicorn.error").info("Application startup complete.")
    assert not logging.getLogger("uvicorn.error").handlers
    (line,) = out.getvalue().splitlines()
    assert "INFO" in line and " - uvicorn.error: Application startup complete." in line  # "-": outside a request


def test_the_log_settings_read_the_environment(monkeypatch):
    from service.http.settings import LogSettings

    monkeypatch.setenv("XMCSERVE_LOG_LEVEL", "debug")
    monkeypatch.setenv("XMCSERVE_LOG_FORMAT", "text")
    monkeypatch.setenv("XMCSERVE_LOG_ACCESS", "false")
    settings = LogSettings()
    assert (settings.level, settings.format, settings.access, settings.texts) == ("DEBUG", "text", False, False)
