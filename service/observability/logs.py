"""Logging set-up: one configuration for the service's loggers and uvicorn's.

JSON lines (python-json-logger, serialised by orjson) in containers, readable text on a terminal;
``XMCSERVE_LOG_FORMAT`` chooses (``auto``: text when stderr is a terminal). Every record carries
the request id of the request being handled (a context variable set by
:mod:`service.observability.requests`), ``-`` outside a request. Structured fields are passed as
``extra=``: JSON renders them as keys; the text form relies on each message already saying what
matters in words. Uvicorn passes each of its messages a second time, with terminal colour codes,
as ``extra={"color_message": ...}``: JSON leaves that copy out, so a line holds no escape
sequences and says its message once.
"""

from __future__ import annotations

import logging
import logging.config
import sys
from contextvars import ContextVar
from typing import Literal

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.orjson import OrjsonFormatter

REQUEST_ID: ContextVar[str] = ContextVar("request_id", default="-")
# The loggers uvicorn writes to: routed to the root handler, not uvicorn's own.
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")
TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(request_id)s %(name)s: %(message)s"
JSON_FIELDS = "%(asctime)s %(levelname)s %(name)s %(request_id)s %(message)s"
JSON_RENAMES = {"asctime": "time", "levelname": "level", "name": "logger"}
# Record attributes that are not fields of a JSON line: the standard ones, and uvicorn's coloured copy.
JSON_SKIPPED = [*RESERVED_ATTRS, "color_message"]

LogFormat = Literal["auto", "json", "text"]


class RequestIdFilter(logging.Filter):
    """Stamps each record with the current request's id (a record that names one keeps it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get()
        return True


def resolved_format(fmt: LogFormat, stream=None) -> Literal["json", "text"]:
    if fmt != "auto":
        return fmt
    stream = stream or sys.stderr
    return "text" if hasattr(stream, "isatty") and stream.isatty() else "json"


def formatter(fmt: Literal["json", "text"]) -> logging.Formatter:
    if fmt == "json":
        return OrjsonFormatter(JSON_FIELDS, rename_fields=JSON_RENAMES, timestamp=False, reserved_attrs=JSON_SKIPPED)
    return logging.Formatter(TEXT_FORMAT)


def configure_logging(fmt: LogFormat = "auto", level: str = "INFO", stream=None) -> Literal["json", "text"]:
    """One handler on the root logger (to ``stream``, stderr by default) with the request-id
    filter; uvicorn's loggers lose their own handlers and propagate to it. Returns the format used."""
    chosen = resolved_format(fmt, stream)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter(chosen))
    handler.addFilter(RequestIdFilter())
    logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
        logger.setLevel(level.upper())
    return chosen
