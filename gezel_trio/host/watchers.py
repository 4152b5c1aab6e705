"""The host's background watchers: memory pressure and device health."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

import trio

from ..gpu.arbiter import GpuArbiter
from .runtime import ModelRuntime

__all__ = ["serve_device_health", "serve_memory_pressure"]

log = logging.getLogger("gezel_trio.host")


async def serve_memory_pressure(
    arbiter: GpuArbiter,
    models: Mapping[str, ModelRuntime],
    *,
    grace: float,
    on_release: Callable[[ModelRuntime], None],
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Release idle engines while VRAM is pressured (the seed's rule), judged over the GPUs
    each engine runs on (every GPU on a machine with one).

    Active inference always finishes (a running request holds its engine); an
    engine idle for ``grace`` seconds is stopped, and restarts lazily on its
    next request. Runs until cancelled; a stop under way when cancelled goes on.
    """
    task_status.started()
    while True:
        await trio.sleep(min(5.0, max(0.5, grace / 4)))
        for rt in list(models.values()):
            engine = rt.engine
            if rt.config.external or not rt.ready:
                continue
            # the GPUs this engine is on (every GPU on a machine with one)
            pressure = await arbiter.memory_pressure(max_age=1.0, devices=rt.gpu_indices)
            if not pressure.pressured:
                continue
            if engine.busy == 0 and engine.idle_for() >= grace:
                log.warning(
                    "releasing idle engine under memory pressure",
                    extra={"fields": {"model": rt.id, "detail": pressure.detail}},
                )
                on_release(rt)
                await engine.stop()


async def serve_device_health(
    refresh: Callable[[], Awaitable[None]],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep a fresh device-health snapshot for status and metrics (NVML reads are
    cached): ``refresh()`` now, then every 5 s until cancelled."""
    await refresh()
    task_status.started()
    while True:
        await trio.sleep(5)
        await refresh()
