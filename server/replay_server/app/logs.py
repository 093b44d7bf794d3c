"""Logging set-up: plain text for people, or one JSON object per line for collectors.

Every line is bounded: a record's message and its traceback are each cut to
:data:`~replay_server.service.excerpt.LOG_LINE_CHARS` characters, whatever
logged them (lines about clients are cut further, and rate-limited, by
:mod:`~replay_server.service.peer_log`).
"""

from __future__ import annotations

import json
import logging
import sys
import time

from replay_server.service.excerpt import LOG_LINE_CHARS, excerpt

_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message"}


class TextFormatter(logging.Formatter):
    """``time level logger: message``, the message and the traceback each cut to a bound."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = excerpt(record.message, LOG_LINE_CHARS)
        return super().formatMessage(record)

    def formatException(self, ei) -> str:  # noqa: N802
        return excerpt(super().formatException(ei), LOG_LINE_CHARS)


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", ...extra fields, "exc"}`` per record, each bounded."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": excerpt(record.getMessage(), LOG_LINE_CHARS),
        }
        entry.update({k: v for k, v in record.__dict__.items() if k not in _RESERVED})
        if record.exc_info:
            entry["exc"] = excerpt(self.formatException(record.exc_info), LOG_LINE_CHARS)
        return json.dumps(entry, default=str)


def configure(log_format: str = "text", level: int = logging.INFO) -> None:
    """Route the root logger to stderr in ``log_format`` (``text`` or ``json``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
