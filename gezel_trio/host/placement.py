"""Where an engine runs: its binary, its command line, its memory plan and reservation.

Plain functions the host wires into each engine's supervisor: the supervisor
calls the argv builder for every start and runs the process inside the
reservation, so an engine's bytes are held exactly while its process lives.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from ..config.schema import Config, ModelConfig
from ..engine.argv import build_argv
from ..engine.binary import BuildFacts, EngineBinary, read_build_facts, resolve_engine
from ..engine.gguf_meta import GGUFError, GGUFInfo, read_gguf_info
from ..engine.planner import EnginePlan, plan_engine
from ..engine.rpc import worker_devices
from ..engine.sd_argv import sd_argv, sd_footprint
from ..engine.supervisor import SupervisorTiming, default_slot_save_dir
from ..errors import EngineFailed, EngineNotFound, NoCapacity
from ..gpu.ledger import CPU_DEVICE, DeviceLedger, denial_message
from ..gpu.placement import Placement, device_flags, place, shares
from .runtime import ModelSetup
from .snapshot import EngineBinaryStatus

__all__ = [
    "EngineBinaryStatus",
    "EngineResolver",
    "argv_builder",
    "engine_timing",
    "image_argv_builder",
    "image_reservation",
    "reservation_for",
]

log = logging.getLogger("gezel_trio.host.placement")


class EngineResolver:
    """Resolves the engine binary once, on first need, and remembers the error otherwise.
    ``resolve``: llama-server's resolution (:func:`resolve_engine`), or the image
    engine's (:func:`~gezel_trio.engine.binary.resolve_sd_server`)."""

    def __init__(
        self,
        explicit: str | None,
        *,
        resolve: Callable[[str | None], EngineBinary] = resolve_engine,
    ) -> None:
        self._explicit = explicit
        self._resolve = resolve
        self._binary: EngineBinary | None = None
        self.facts: BuildFacts | None = None
        self.error: EngineNotFound | None = None

    def get(self) -> EngineBinary:
        if self._binary is None:
            try:
                self._binary = self._resolve(self._explicit)
                self.error = None
            except EngineNotFound as exc:
                self.error = exc
                raise
        return self._binary

    async def load_facts(self) -> None:
        try:
            binary = self.get()
        except EngineNotFound:
            return
        self.facts = await trio.to_thread.run_sync(read_build_facts, binary)

    def status(self) -> EngineBinaryStatus:
        binary = self._binary
        if binary is None:
            return EngineBinaryStatus(
                path=None, found_by=None, error=self.error.message if self.error else None
            )
        return EngineBinaryStatus(path=str(binary.path), found_by=binary.found_by, build=self.facts)


def engine_timing(config: Config, model: ModelConfig) -> SupervisorTiming:
    e = config.engine
    return SupervisorTiming(
        load_timeout=e.load_timeout,
        health_interval=e.health_interval,
        health_timeout=min(5.0, max(0.5, e.health_interval)),
        health_failures=e.health_failures,
        stop_grace=e.stop_grace,
        idle_ttl=model.idle_ttl,
        park_grace=config.scheduler.park_on_stop_timeout,
    )


def argv_builder(
    config: Config, setup: ModelSetup, resolver: EngineResolver, state_dir: Path
) -> Callable[[int], tuple[list[str], int]]:
    def build(port: int) -> tuple[list[str], int]:
        model = setup.config  # read at each start: a reload may have changed it
        binary = resolver.get()
        assert model.path is not None
        if not Path(model.path).is_file():
            raise EngineFailed(
                f"engine for model {model.id!r} cannot start: "
                f"the model file {model.path!r} does not exist"
            )
        plan = setup.active_plan
        parallel, ctx_per_slot, extended = setup.planned_slots()
        profile = build_argv(
            binary=binary.path,
            model_path=model.path,
            port=port,
            parallel=parallel,
            ctx_per_slot=ctx_per_slot,
            n_gpu_layers=plan.n_gpu_layers if plan and plan.device == "gpu" else None,
            slot_save_dir=default_slot_save_dir(state_dir, model.id),
            host_args=[
                *extended,
                *config.engine.extra_args,
                *(
                    device_flags(
                        setup.placement, resolver.facts.backend if resolver.facts else None
                    )
                    if setup.placement is not None
                    else ()
                ),
            ],
            user_args=model.args,
            embeddings=model.embeddings,
            reranking=model.reranking,
            alias=model.id,
            rpc=model.rpc,
        )
        return list(profile.argv), profile.parallel

    return build


def image_argv_builder(
    setup: ModelSetup, resolver: EngineResolver
) -> Callable[[int], tuple[list[str], int]]:
    """The image engine's argv at each start (:func:`~gezel_trio.engine.sd_argv.sd_argv`):
    its model files, the port, the model's ``args``; one slot (sd-server renders one
    job at a time). Raises EngineFailed naming a model file that is gone."""

    def build(port: int) -> tuple[list[str], int]:
        model = setup.config  # read at each start: a reload may have changed it
        binary = resolver.get()
        for name, file in [*model.files.items(), *([("path", model.path)] if model.path else [])]:
            if not Path(file).expanduser().is_file():
                raise EngineFailed(
                    f"engine for model {model.id!r} cannot start: its {name} file "
                    f"{file!r} does not exist"
                )
        argv = sd_argv(
            str(binary.path), files=model.files, path=model.path, port=port, user_args=model.args
        )
        return argv, 1

    return build


def image_reservation(
    setup: ModelSetup, *, ledger: DeviceLedger, device: Callable[[], str]
) -> Callable[[], AbstractAsyncContextManager[object]]:
    """Hold the image engine's bytes on ``device()`` while its process runs: its
    footprint estimated from its files (:func:`~gezel_trio.engine.sd_argv.sd_footprint`),
    kept in ``setup.reservation`` so that the runtime replaces it by what the process
    measures (:meth:`~gezel_trio.host.image_runtime.ImageRuntime.measure_footprint`).
    Raises NoCapacity (bytes needed, free and held) when they do not fit; cancellation
    holds nothing."""

    @asynccontextmanager
    async def reserve() -> AsyncIterator[object]:
        model = setup.config
        nbytes = await trio.to_thread.run_sync(sd_footprint, model.files, model.path)
        device_id = device()
        setup.plan = {
            "kind": "image",
            "device": device_id,
            "total_bytes": nbytes,
            "reasons": ["estimated from the model files' sizes"],
        }
        async with ledger.reservation(device_id, nbytes, owner=model.id, model=model.id) as held:
            setup.reservation = held
            try:
                yield held
            finally:
                setup.reservation = None

    return reserve


def reservation_for(
    setup: ModelSetup,
    *,
    ledger: DeviceLedger,
    device: Callable[[], str],
    resolver: EngineResolver | None = None,
) -> Callable[[], AbstractAsyncContextManager[object]]:
    """Plan the engine against the ledger's free bytes on ``device()`` (the first
    GPU, else RAM) and hold its reservation.

    The engine process runs inside this block, so the bytes are released only
    after it has exited. Raises NoCapacity naming bytes needed, free and held.
    Cancellation while planning holds nothing; inside, the reservation is
    released on the way out.
    """

    @asynccontextmanager
    async def reserve() -> AsyncIterator[object]:
        model = setup.config  # read at each start: a reload may have changed it
        if model.rpc:
            async with _rpc_plan(setup, resolver) as plan:
                yield plan
            return
        info = await _model_info(setup)
        device_id = device()
        snapshot = await ledger.snapshot()

        def free_on(dev: str) -> tuple[int, list[Any]]:
            usage = snapshot.devices.get(dev)
            others = [h for h in (usage.holders if usage else ()) if h.owner != model.id]
            return ledger.capacities.get(dev, 0) - sum(h.nbytes for h in others), others

        request = setup.slot_request()

        def plan_for(budget: int, *, reserved: int = 0, gpu: bool = True) -> EnginePlan:
            return plan_engine(
                info,
                budget_bytes=budget,
                already_reserved_bytes=reserved,
                requested_ctx_per_slot=request.ctx_per_slot,
                requested_parallel=request.parallel,
                fixed=request.fixed,
                gpu=gpu,
            )

        gpus = [d for d in ledger.capacities if d != CPU_DEVICE] if device_id != CPU_DEVICE else []
        placement = place({d: free_on(d)[0] for d in gpus}, plan_for) if len(gpus) > 1 else None
        if placement is None:
            capacity = ledger.capacities.get(device_id, 0)
            free = free_on(device_id)[0]
            plan = plan_for(capacity, reserved=capacity - free, gpu=device_id != CPU_DEVICE)
            placement = Placement(plan, (device_id,))
        plan = placement.plan
        if plan.context_flags:
            log.warning(
                "model %s: %d tokens per slot is above its trained context %s: the engine "
                "runs it with %s; answers past the trained length may be worse",
                model.id,
                plan.ctx_per_slot,
                info.context_length,
                " ".join(plan.context_flags),
            )
        setup.plan = {
            **plan.as_dict(),
            "devices": list(placement.devices),
            "tensor_split": list(placement.split) if placement.split else None,
        }
        if not plan.fits:
            roomiest = placement.devices[0]
            who = denial_message(
                device=roomiest,
                nbytes=plan.total_bytes,
                owner=model.id,
                model=model.id,
                capacity=ledger.capacities.get(roomiest, 0),
                holders=free_on(roomiest)[1],
            )
            raise NoCapacity(f"{who}. Plan: " + "; ".join(plan.reasons))
        async with AsyncExitStack() as held:
            for dev, nbytes in shares(placement).items():
                await held.enter_async_context(
                    ledger.reservation(dev, nbytes, owner=model.id, model=model.id)
                )
            setup.active_plan = setup.planned = plan
            setup.placement = placement if len(placement.devices) > 1 or len(gpus) > 1 else None
            try:
                yield plan
            finally:
                setup.active_plan = None
                setup.placement = None

    return reserve


async def _model_info(setup: ModelSetup) -> GGUFInfo:
    """The model file's metadata (read once, in a thread). EngineFailed when unreadable."""
    model = setup.config
    assert model.path is not None
    if setup.gguf is None:
        try:
            setup.gguf = await trio.to_thread.run_sync(read_gguf_info, model.path)
        except GGUFError as exc:
            raise EngineFailed(
                f"engine for model {model.id!r} cannot start: {exc.message}"
            ) from exc
    return setup.gguf


@asynccontextmanager
async def _rpc_plan(setup: ModelSetup, resolver: EngineResolver | None) -> AsyncIterator[object]:
    """Plan a model whose layers go to RPC workers against the memory they report (the
    ledger holds this machine's bytes only: nothing is reserved for the workers').
    Raises EngineFailed naming a worker that is unreachable or reports no device."""
    model = setup.config
    info = await _model_info(setup)
    if resolver is None:
        raise EngineFailed(f"engine for model {model.id!r} cannot start: no llama-server resolves")
    binary = resolver.get()
    try:
        devices = await worker_devices(binary.path, model.rpc, binary.launch_env())
    except EngineFailed as exc:
        raise EngineFailed(f"engine for model {model.id!r} cannot start: {exc.message}") from exc
    budget = sum(d.free_bytes for d in devices)
    request = setup.slot_request()
    plan = plan_engine(
        info,
        budget_bytes=budget,
        already_reserved_bytes=0,
        requested_ctx_per_slot=request.ctx_per_slot,
        requested_parallel=request.parallel,
        fixed=request.fixed,
        gpu=True,
    )
    where = ", ".join(f"{d.endpoint} ({d.free_bytes // 1024**2} MiB free)" for d in devices)
    setup.plan = {**plan.as_dict(), "rpc_workers": where}
    if not plan.fits:
        raise NoCapacity(
            f"model {model.id!r} does not fit its RPC workers {where}: " + "; ".join(plan.reasons)
        )
    setup.active_plan = setup.planned = plan
    try:
        yield plan
    finally:
        setup.active_plan = None
