"""Errors of the benchmark harness, as project errors (see :mod:`gezel_trio.errors`)."""

from __future__ import annotations

from gezel_trio.errors import GezelError

__all__ = ["BenchError", "TargetFailed", "TraceFormatError"]


class BenchError(GezelError):
    """A benchmark cannot run as asked; the message says what to change."""

    status = 400
    code = "bench_error"
    type = "invalid_request_error"


class TraceFormatError(BenchError):
    """A trace file is malformed; the message names the file, line and field."""

    code = "invalid_trace"


class TargetFailed(BenchError):
    """A benchmark target could not be launched or stopped answering."""

    status = 502
    code = "target_failed"
    type = "server_error"
