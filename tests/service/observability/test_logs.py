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


def unique_keys(pairs: list) -> dict:
    keys = [key for key, _ in pairs]
    assert len(keys) == len(set(keys)), f"duplicated fields: {keys}"
    return dict(pairs)


def test_json_lines_hold_no_colour_codes_and_no_field_twice(restore_logging):
    """Uvicorn logs its start-up lines with a coloured copy of the message in ``color_message``."""
    out = io.StringIO()
    configure_logging("json", "INFO", out)
    logging.getLogger("uvicorn.error").info(
        "Uvicorn running on %s (Press CTRL+C to quit)",
        "http://127.0.0.1:8000",
        extra={"color_message": "Uvicorn running on \x1b[1m%s\x1b[0m (Press CTRL+C to quit)"},
    )
    logging.getLogger("xmcserve.access").info("GET / 200", extra={"request_id": "r1", "status": 200})
    text = out.getvalue()
    assert "\x1b" not in text and "\\u001b" not in text and "color_message" not in text
    first, second = [json.loads(line, object_pairs_hook=unique_keys) for line in text.splitlines()]
    assert first["message"] == "Uvicorn running on http://127.0.0.1:8000 (Press CTRL+C to quit)"
    assert second["request_id"] == "r1" and second["status"] == 200


def test_the_log_settings_read_the_environment(monkeypatch):
    from service.http.settings import LogSettings

    monkeypatch.setenv("XMCSERVE_LOG_LEVEL", "debug")
    monkeypatch.setenv("XMCSERVE_LOG_FORMAT", "text")
    monkeypatch.setenv("XMCSERVE_LOG_ACCESS", "false")
    settings = LogSettings()
    assert (settings.level, settings.format, settings.access, settings.texts) == ("DEBUG", "text", False, False)
