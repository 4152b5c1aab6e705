"""The host's log: readable lines for a person at a terminal, one JSON object per line for
machines (a file, journald, a log shipper), with a record's ``fields`` in both.

:func:`setup_logging` picks text when the stream is a terminal and JSON otherwise;
``gezel-trio serve --log-format text|json`` chooses.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Literal, TextIO

__all__ = ["JsonFormatter", "LogFormat", "TextFormatter", "setup_logging"]

LogFormat = Literal["auto", "text", "json"]


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``msg`` and the fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_fields(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def _ms(value: object) -> str | None:
    if not isinstance(value, int | float):
        return None
    return f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.0f} ms"


class TextFormatter(logging.Formatter):
    """``HH:MM:SS.mmm LEVEL  message  key=value ...`` in local time. A lifecycle event
    (a record with an ``event`` field) says everything in its message; a request is one
    line: path, model, status, times, tokens, what was clamped, session and slot."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        head = f"{stamp}.{int(record.msecs):03d} {record.levelname:<7}"
        fields = _fields(record)
        if record.name == "gezel_trio.requests" and record.msg == "request":
            line = f"{head} {self._request(fields)}"
        else:
            line = f"{head} {record.getMessage()}"
            if "event" not in fields:
                extra = " ".join(
                    f"{k}={self._value(v)}" for k, v in fields.items() if v is not None
                )
                if extra:
                    line += "  " + extra
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line

    @staticmethod
    def _value(value: object) -> str:
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        return text if len(text) <= 120 else text[:117] + "..."

    @staticmethod
    def _request(f: dict[str, Any]) -> str:
        parts = [str(f.get("path") or "-"), str(f.get("model") or "-"), str(f.get("status"))]
        times = [f"in {_ms(f.get('duration_ms')) or '?'}"]
        if _ms(f.get("ttft_ms")):
            times.append(f"first token {_ms(f.get('ttft_ms'))}")
        if _ms(f.get("queue_wait_ms")) and f.get("queue_wait_ms"):
            times.append(f"queued {_ms(f.get('queue_wait_ms'))}")
        parts.append(", ".join(times))
        prompt, cached, completion = (
            f.get("prompt_tokens"),
            f.get("cached_tokens"),
            f.get("completion_tokens"),
        )
        if prompt is not None or completion is not None:
            tokens = f"tokens {prompt if prompt is not None else '?'} in"
            if cached:
                tokens += f" ({cached} cached)"
            tokens += f", {completion if completion is not None else '?'} out"
            parts.append(tokens)
        clamped = f.get("clamped")
        if isinstance(clamped, dict) and clamped:
            parts.append(
                "clamped "
                + ", ".join(
                    f"{name} {c.get('asked')} -> {c.get('served')}"
                    for name, c in clamped.items()
                    if isinstance(c, dict)
                )
            )
        for key in ("session", "slot"):
            if f.get(key) is not None:
                parts.append(f"{key}={f[key]}")
        return "request " + " ".join(parts[:3]) + "  " + "; ".join(parts[3:])


def setup_logging(
    level: str = "info", *, stream: TextIO | None = None, fmt: LogFormat = "auto"
) -> None:
    """Log at ``level`` to ``stream`` (default stderr), as text (``fmt="text"``, or
    ``"auto"`` on a terminal) or JSON lines (``"json"``, or ``"auto"`` otherwise)."""
    out = stream or sys.stderr
    if fmt == "auto":
        try:
            fmt = "text" if out.isatty() else "json"
        except (AttributeError, ValueError):  # a closed or odd stream
            fmt = "json"
    handler = logging.StreamHandler(out)
    handler.setFormatter(TextFormatter() if fmt == "text" else JsonFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # hypercorn's own access log is replaced by our one line per request
    logging.getLogger("hypercorn.access").disabled = True
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
