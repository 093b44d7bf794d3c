"""logs: every line the server writes is bounded, in text and in JSON."""

from __future__ import annotations

import json
import logging

from replay_server.app.logs import JsonFormatter, TextFormatter


def record(message: str, *args: object, exc: BaseException | None = None) -> logging.LogRecord:
    return logging.LogRecord("replay_server", logging.ERROR, __file__, 1, message, args,
                             (type(exc), exc, None) if exc else None)


def test_a_huge_message_and_traceback_are_cut_in_text() -> None:
    line = TextFormatter().format(record("no table %s", "t" * (8 << 20),
                                         exc=ValueError("v" * (8 << 20))))
    assert len(line) < 40_000 and "characters in all" in line


def test_a_huge_message_is_cut_in_json_which_stays_json() -> None:
    line = JsonFormatter().format(record("no table %s", "t" * (8 << 20),
                                         exc=ValueError("v" * (8 << 20))))
    entry = json.loads(line)
    assert len(line) < 40_000 and entry["msg"].endswith("characters in all)")
    assert entry["exc"].endswith("characters in all)")


def test_ordinary_lines_are_unchanged() -> None:
    line = TextFormatter().format(record("listening on %s:%d", "127.0.0.1", 50051))
    assert line.endswith("ERROR replay_server: listening on 127.0.0.1:50051")
