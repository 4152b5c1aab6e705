"""A trace named on the command line: a file in one of the formats the bench reads, or
a trace the bench builds (``claude-code``)."""

from __future__ import annotations

from pathlib import Path

from .agentic import parse_claude_code_spec
from .traces import Scaling, Trace, import_mooncake, import_weka, load_trace, scale_trace

__all__ = ["open_trace_spec"]


def open_trace_spec(spec: str, *, scaling: Scaling | None = None) -> Trace:
    """Load ``weka:PATH``, ``mooncake:PATH``, ``native:PATH`` or a plain native ``PATH``,
    or build ``claude-code[:OPTIONS]`` (:mod:`gezel_bench.agentic`), then apply
    ``scaling`` (when given)."""
    kind, sep, rest = spec.partition(":")
    if kind == "claude-code":
        trace = parse_claude_code_spec(rest)
        return trace if scaling is None else scale_trace(trace, scaling)
    if sep and kind in ("weka", "mooncake", "native"):
        path = Path(rest).expanduser()
    else:
        kind, path = "native", Path(spec).expanduser()
    if kind == "weka":
        trace = import_weka(path)
    elif kind == "mooncake":
        trace = import_mooncake(path)
    else:
        trace = load_trace(path)
    return trace if scaling is None else scale_trace(trace, scaling)
