"""The host's log format: text on a terminal, JSON otherwise, and ``--log-format``."""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Iterator

import pytest

from gezel_trio.cli.logging_setup import JsonFormatter, TextFormatter, setup_logging


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def _formatter() -> logging.Formatter | None:
    (handler,) = logging.getLogger().handlers
    return handler.formatter


def test_auto_is_text_on_a_terminal_and_json_otherwise(restore_root: None) -> None:
    primary, secondary = os.openpty()
    with os.fdopen(secondary, "w") as tty:
        setup_logging("info", stream=tty)
        assert isinstance(_formatter(), TextFormatter)
    os.close(primary)
    setup_logging("info", stream=io.StringIO())
    assert isinstance(_formatter(), JsonFormatter)
    setup_logging("info", stream=io.StringIO(), fmt="text")
    assert isinstance(_formatter(), TextFormatter)


def test_lines_in_each_format(restore_root: None) -> None:
    text, js = io.StringIO(), io.StringIO()
    for stream, fmt in ((text, "text"), (js, "json")):
        setup_logging("info", stream=stream, fmt=fmt)  # type: ignore[arg-type]
        logging.getLogger("gezel_trio.engine.supervisor").info(
            "engine %s %s",
            "tiny",
            "ready in 0.11s (pid 7, port 9, 2 slots)",
            extra={"fields": {"event": "engine_ready", "model": "tiny", "pid": 7}},
        )
        logging.getLogger("gezel_trio.requests").info(
            "request",
            extra={
                "fields": {
                    "model": "tiny",
                    "status": 200,
                    "session": "ab12",
                    "slot": 1,
                    "queue_wait_ms": 0.0,
                    "ttft_ms": 45.2,
                    "duration_ms": 1234.5,
                    "prompt_tokens": 30,
                    "cached_tokens": 20,
                    "completion_tokens": 4,
                    "path": "/v1/chat/completions",
                }
            },
        )
        logging.getLogger("gezel_trio.server").info("serving", extra={"fields": {"port": 8080}})
    ready, request, serving = text.getvalue().splitlines()
    assert ready.split(" ", 1)[1] == "INFO    engine tiny ready in 0.11s (pid 7, port 9, 2 slots)"
    assert request.endswith(
        "request /v1/chat/completions tiny 200  in 1.23 s, first token 45 ms; "
        "tokens 30 in (20 cached), 4 out; session=ab12; slot=1"
    ), request
    assert serving.endswith("serving  port=8080")
    first, second, _ = (json.loads(line) for line in js.getvalue().splitlines())
    assert first["event"] == "engine_ready" and first["level"] == "info" and first["pid"] == 7
    assert second["path"] == "/v1/chat/completions" and second["msg"] == "request"
