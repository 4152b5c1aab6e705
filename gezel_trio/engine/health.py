"""Is the engine ready? Waiting for a starting process, and checking a running one.

Both ask ``GET /health`` through :func:`gezel_trio.engine.client.check_health`
(llama-server answers 503 while it loads its model, 200 once it serves). What a
failed check means (a failed start, a killed process, an unreachable external
engine) is the supervisor's to decide.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import httpx
import trio

from .client import check_health

__all__ = ["StartOutcome", "healthy_within", "wait_healthy"]

StartOutcome = Literal["healthy", "exited", "stopping", "timeout"]
"""How :func:`wait_healthy` ended: ``/health`` answered 200, the process exited, a stop
was asked for, or ``within`` seconds passed first."""


async def wait_healthy(
    http: httpx.AsyncClient,
    base_url: str,
    *,
    exited: trio.Event,
    stopping: Callable[[], bool],
    within: float,
    check_timeout: float,
    path: str = "/health",
) -> StartOutcome:
    """Poll the starting engine at ``base_url`` until ``path`` answers 200, ``exited``
    is set, ``stopping()`` is true or ``within`` seconds have passed; say which.

    It polls fast while the socket comes up (5 ms, doubling), then every 20 ms; an
    exit ends the wait between polls at once. Cancellation abandons the wait.
    """
    delay = 0.005
    with trio.move_on_after(within):
        while True:
            if exited.is_set():
                return "exited"
            if stopping():
                return "stopping"
            if (await check_health(http, base_url, answer_within=check_timeout, path=path)).ok:
                return "healthy"
            # Poll fast while the socket comes up, then back off gently.
            with trio.move_on_after(delay):
                await exited.wait()
            delay = min(delay * 2, 0.02)
    return "timeout"


async def healthy_within(
    http: httpx.AsyncClient, base_url: str, *, within: float, path: str = "/health"
) -> bool:
    """One check of a running engine: whether ``path`` (``/health``) answered 200 within
    ``within`` seconds, all of it (connecting included). Cancellation abandons the check."""
    with trio.move_on_after(within):
        return (await check_health(http, base_url, answer_within=within, path=path)).ok
    return False
