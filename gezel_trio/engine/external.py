"""An external engine: a llama-server the host talks to but does not own.

It is never spawned or killed. It is READY while ``/health`` answers 200: checked
once when a start is asked for (:func:`check_external`), then every
``interval`` seconds while it is READY (:func:`watch_external`), until it fails
``failures`` checks in a row or a stop is asked for. The states themselves are
the supervisor's (:mod:`gezel_trio.engine.supervisor`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx

from .client import check_health

__all__ = ["check_external", "watch_external"]


async def check_external(
    http: httpx.AsyncClient, base_url: str, *, answer_within: float
) -> str | None:
    """None when the engine at ``base_url`` answers ``/health`` with 200; otherwise why
    it is not ready (the failure its start reports). Cancellation abandons the check."""
    check = await check_health(http, base_url, answer_within=answer_within)
    if check.ok:
        return None
    return f"external engine at {base_url} is not ready ({check.why})"


async def watch_external(
    http: httpx.AsyncClient,
    base_url: str,
    *,
    interval: float,
    answer_within: float,
    failures: int,
    nap: Callable[[float], Awaitable[None]],
    stop_requested: Callable[[], bool],
) -> str | None:
    """Watch a READY external engine: ``nap(interval)`` (which a stop request cuts
    short), then stop if ``stop_requested()``, else check ``/health``. Returns None
    when a stop was asked for, or the failure once ``failures`` checks in a row
    failed. Cancellation abandons the watch."""
    failed = 0
    while True:
        await nap(interval)
        if stop_requested():
            return None
        healthy = (await check_health(http, base_url, answer_within=answer_within)).ok
        failed = 0 if healthy else failed + 1
        if failed >= failures:
            return f"external engine at {base_url} stopped answering /health"
