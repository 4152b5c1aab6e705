"""The host's background watchers: memory pressure, device health, failed replicas."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

import trio

from ..engine.supervisor import EngineState
from ..errors import GezelError
from ..gpu.arbiter import GpuArbiter
from ..scheduler import Scheduler
from .runtime import ModelRuntime

__all__ = ["serve_device_health", "serve_memory_pressure", "serve_replica_revival"]

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


async def serve_replica_revival(
    models: Mapping[str, ModelRuntime],
    scheduler: Scheduler,
    *,
    interval: float,
    probe_within: float,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Bring failed replicas back into their set. Every ``interval`` seconds each
    member of a replicated model whose engine failed, or that the scheduler holds
    down, is tried in the background: made resident (an external one is probed, a
    spawned one restarted, within its supervisor's backoff) and, for an external
    one, its ``/slots`` sampled, all within ``probe_within``. A member that passes is
    routed to again. Requests never wait for this: the router leaves failed members
    out meanwhile. Runs until cancelled; probes under way are cancelled with it.
    """
    task_status.started()
    probing: set[str] = set()

    async def probe(rt: ModelRuntime) -> None:
        try:
            with trio.move_on_after(probe_within):
                await rt.ensure_resident()
                if rt.config.external:
                    await rt.measure_slots()
                log.info("replica %s answers again: routed to again", rt.id)
                scheduler.member_reachable(rt.id)
        except GezelError as exc:
            log.debug("replica %s still fails: %s", rt.id, exc.message)
        finally:
            probing.discard(rt.id)

    async with trio.open_nursery() as nursery:
        while True:
            await trio.sleep(interval)
            for rt in list(models.values()):
                if rt.config.replica_of is None or rt.id in probing:
                    continue
                failed = rt.engine.state.value is EngineState.FAILED
                if failed or scheduler.is_down(rt.id):
                    probing.add(rt.id)
                    nursery.start_soon(probe, rt)
