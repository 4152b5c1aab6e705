"""The host's models while it serves: opened, retired and changed live.

:func:`plan_reload` compares the models running with the ones a config asks for (no
I/O). The rest acts on a :class:`~gezel_trio.host.host.Host`:

- :func:`open_model` opens a model's engine (in the host's engine nursery) and, once the
  scheduler runs, gives it a lane, a planned-stop hook and a calibration watcher;
- :func:`retire_model` takes a model out: new requests get 404 at once, queued ones
  fail, running ones finish; then its engine stops (its sessions parked first);
- :func:`reconfigure_model` changes a model in place: once nobody holds its engine it
  stops, and the next request starts it with the new settings; queued requests wait
  for that start, none is dropped;
- :func:`reload` re-reads the config file (and ``models_dir``) and applies the
  difference; an invalid file changes nothing;
- :func:`serve_models_dir` watches ``models_dir`` for files added or removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from ..config import Config, ModelConfig, load_config
from ..engine.argv import last_arg_value
from ..engine.client import EngineClient
from ..engine.gguf_meta import GGUFError, read_gguf_info
from ..engine.rpc import unreachable
from ..engine.supervisor import default_slot_save_dir, no_reservation, open_engine
from ..errors import ConfigError
from ..models_dir import models_from_dir
from ..replicas import expand_replicas
from .calibration import serve_calibration
from .placement import argv_builder, engine_timing, reservation_for
from .runtime import ModelRuntime

if TYPE_CHECKING:
    from .host import Host

__all__ = [
    "ReloadPlan",
    "open_model",
    "plan_reload",
    "reconfigure_model",
    "reload",
    "retire_model",
    "serve_models_dir",
]

log = logging.getLogger("gezel_trio.host")


@dataclass(frozen=True, slots=True)
class ReloadPlan:
    """What a new list of models changes: ids added, removed, changed and kept."""

    added: tuple[ModelConfig, ...]
    removed: tuple[str, ...]
    changed: tuple[ModelConfig, ...]
    kept: tuple[str, ...]

    def as_dict(self) -> dict[str, list[str]]:
        return {
            "added": [m.id for m in self.added],
            "removed": list(self.removed),
            "changed": [m.id for m in self.changed],
            "unchanged": list(self.kept),
        }


def plan_reload(current: Mapping[str, ModelConfig], wanted: Sequence[ModelConfig]) -> ReloadPlan:
    """Compare the running models with ``wanted`` (no I/O). A model whose kind changes
    (a file becomes a URL, or back) is removed and added, not changed."""
    by_id = {m.id: m for m in wanted}
    added: list[ModelConfig] = []
    changed: list[ModelConfig] = []
    kept: list[str] = []
    removed = [mid for mid in current if mid not in by_id]
    for model in wanted:
        old = current.get(model.id)
        if old is None:
            added.append(model)
        elif old.external != model.external:
            removed.append(model.id)
            added.append(model)
        elif old != model:
            changed.append(model)
        else:
            kept.append(model.id)
    return ReloadPlan(tuple(added), tuple(removed), tuple(changed), tuple(kept))


async def open_model(host: Host, model: ModelConfig) -> ModelRuntime:
    """Open ``model``'s engine in the host's engine nursery and register it everywhere
    (scheduler lane, evictor, planned-stop hook, calibration) once the host serves.
    Cancellation before the engine task started leaves nothing behind; after, the model
    is listed (and shut down with the host)."""
    if model.id in host.models:
        raise ConfigError(f"models: {model.id!r} is already served")
    config = host.config
    resolver = host.resolver
    state_dir = config.state_dir
    runtime = ModelRuntime(
        config=model,
        engine=None,  # type: ignore[arg-type]  # set below: it needs the runtime
        client=None,  # type: ignore[arg-type]  # set below: it needs the engine
        arbiter=host.arbiter,
        metrics=host.metrics,
        kv=host.kv,
        build=host.build_fingerprint(),
    )
    env = None
    if not model.external and resolver.error is None:
        env = resolver.get().launch_env()
    engine_cm = open_engine(
        key=model.id,
        model_id=model.id,
        http=host.http,
        argv_builder=None if model.external else argv_builder(config, runtime, resolver, state_dir),
        url=model.url,
        env=env,
        timing=engine_timing(config, model),
        log_lines=config.engine.log_lines,
        reserve=no_reservation
        if model.external
        else reservation_for(
            runtime, ledger=host.ledger, device=host.compute_device, resolver=resolver
        ),
        pid_file=None if model.external else state_dir / "engines" / f"{model.id}.json",
    )

    if not model.external:
        assert model.path is not None
        with contextlib.suppress(GGUFError):  # an unreadable file fails at engine start
            runtime.gguf = await trio.to_thread.run_sync(read_gguf_info, model.path)

    async def run_engine(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with engine_cm as engine:
            runtime.engine = engine
            task_status.started()
            await runtime.retired.wait()

    await host.engines.start(run_engine)
    try:
        _register(host, runtime)
    except BaseException:
        runtime.retired.set()  # its engine task ends: nothing is left behind
        raise
    if host.scheduler is not None:
        host.scheduler.add_lane(runtime)
        if not model.external and host.serving:
            await host.tasks.start(serve_calibration, host.calibrator(), runtime)
    return runtime


def _register(host: Host, runtime: ModelRuntime) -> None:
    """Give an opened model its client, evictor and hooks, and list it (synchronous)."""
    model = runtime.config
    config = host.config
    runtime.client = EngineClient(
        host.transport,
        runtime.engine,
        read_timeout=config.engine.request_timeout,
        model_id=model.id,
    )
    if not model.external:
        if host.kv is not None:
            user = last_arg_value(model.args, "--slot-save-path")
            home = Path(user) if user else default_slot_save_dir(config.state_dir, model.id)
            host.kv.dirs.setdefault(model.id, home)
        host.arbiter.register_evictor(model.gpu_class, runtime.engine.stop, owner_id=model.id)
        runtime.engine.before_stop = partial(host.park_before_stop, runtime)
        if model.rpc:
            runtime.engine.explain_exit = partial(_lost_rpc_workers, runtime)
    host.models[model.id] = runtime


async def _lost_rpc_workers(runtime: ModelRuntime) -> str | None:
    """Which of the model's RPC workers stopped answering (why its engine died), if any."""
    down = await unreachable(runtime.config.rpc)
    return f"RPC worker {', '.join(down)} is unreachable" if down else None


async def retire_model(host: Host, model_id: str) -> None:
    """Stop serving ``model_id``: new requests get 404 from now, queued ones fail with
    404, running ones finish; then its engine stops (sessions parked first) and its
    task ends. Cancellation stops the wait for the running requests; the model stays
    out of service."""
    runtime = host.models.pop(model_id, None)
    if runtime is None:
        return
    if host.scheduler is not None:
        host.scheduler.remove_lane(model_id)
    await runtime.engine.wait_idle()  # every admitted job holds the engine until it ends
    if not runtime.config.external:
        host.arbiter.unregister_evictor(runtime.config.gpu_class, owner_id=model_id)
    runtime.engine.closing_reason = "its model was removed"
    runtime.retired.set()
    log.info("model %s removed: its engine stops", model_id)


async def reconfigure_model(host: Host, model: ModelConfig) -> None:
    """Apply ``model``'s new settings to the running model of that id: once nobody holds
    its engine, stop it (sessions parked first); the next request starts it with the new
    settings. Queued requests wait for that start. Cancellation leaves the old settings."""
    runtime = host.models.get(model.id)
    if runtime is None:
        return
    gguf = runtime.gguf
    if model.path and model.path != runtime.config.path:
        gguf = None
        with contextlib.suppress(GGUFError):
            gguf = await trio.to_thread.run_sync(read_gguf_info, model.path)
    while runtime.engine.busy:  # (woken, someone may have taken it again)
        await runtime.engine.wait_idle()
    # no checkpoint from here to the stop request: nothing can be admitted in between
    runtime.config = model
    runtime.gguf = gguf
    runtime.engine.timing = engine_timing(host.config, model)
    await runtime.engine.stop()
    log.info("model %s changed: its engine restarts with the new settings on next use", model.id)


def wanted_models(config: Config) -> list[ModelConfig]:
    """``config``'s explicit models plus its ``models_dir``'s, replicated models expanded
    into their members (blocking file I/O)."""
    return expand_replicas(models_from_dir(config.models, config.engine.models_dir))


async def apply_models(host: Host, wanted: Sequence[ModelConfig]) -> ReloadPlan:
    """Make the served models ``wanted``: open the added ones now; retire the removed
    and reconfigure the changed ones in the background (they wait for running work)."""
    plan = plan_reload({mid: rt.config for mid, rt in host.models.items()}, wanted)
    kind_changed = {m.id for m in plan.added} & set(plan.removed)
    for model_id in plan.removed:
        if model_id not in kind_changed:
            host.tasks.start_soon(retire_model, host, model_id)
    for model in plan.added:
        if model.id in kind_changed:
            await retire_model(host, model.id)  # the old one drains before the new one opens
        await open_model(host, model)
    for model in plan.changed:
        host.tasks.start_soon(reconfigure_model, host, model)
    return plan


async def reload(host: Host) -> dict[str, Any]:
    """Re-read the config file the host was started from, validate it, and apply its
    models. Raises ConfigError (naming the key) and changes nothing when the file is
    invalid or there is none. Settings outside ``[[models]]`` and ``models_dir`` need a
    restart: they are named in ``restart_needed``."""
    source = host.config.source
    if source is None:
        raise ConfigError("reload: this host was not started from a config file (--config)")
    new = await trio.to_thread.run_sync(load_config, source)
    if new.state_dir != host.config.state_dir:
        raise ConfigError("engine.state_dir: changes need a restart; the reload was refused")
    wanted = await trio.to_thread.run_sync(wanted_models, new)
    restart = [
        name
        for name in ("server", "scheduler", "gpu")
        if dataclasses.asdict(getattr(new, name)) != dataclasses.asdict(getattr(host.config, name))
    ]
    old_engine = dataclasses.asdict(host.config.engine)
    new_engine = dataclasses.asdict(new.engine)
    if {k: v for k, v in old_engine.items() if not k.startswith("models_dir")} != {
        k: v for k, v in new_engine.items() if not k.startswith("models_dir")
    }:
        restart.append("engine")
    plan = await apply_models(host, wanted)
    host.config.models = new.models
    host.config.engine.models_dir = new.engine.models_dir
    what = plan.as_dict()
    summary = (
        "; ".join(f"{k} {', '.join(v)}" for k, v in what.items() if v and k != "unchanged")
        or "no model changed"
    )
    if restart:
        summary += f"; changes to [{'], ['.join(restart)}] need a restart"
    log.info(
        "reload applied from %s: %s",
        source,
        summary,
        extra={"fields": {"event": "reload_applied", **what, "restart_needed": restart}},
    )
    return {**plan.as_dict(), "restart_needed": restart}


async def serve_models_dir(
    host: Host, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Every ``models_dir_poll`` seconds, serve the files added to ``models_dir`` and
    retire the models whose files went away. Runs until cancelled."""
    task_status.started()
    while True:
        await trio.sleep(host.config.engine.models_dir_poll)
        if not host.config.engine.models_dir:
            continue
        wanted = await trio.to_thread.run_sync(wanted_models, host.config)
        plan = plan_reload({mid: rt.config for mid, rt in host.models.items()}, wanted)
        if plan.added or plan.removed:
            for model in plan.added:
                log.info(
                    "models_dir: %s added (%s)",
                    model.id,
                    model.path,
                    extra={"fields": {"event": "model_added", "model": model.id}},
                )
            for model_id in plan.removed:
                log.info(
                    "models_dir: %s removed (its file is gone)",
                    model_id,
                    extra={"fields": {"event": "model_removed", "model": model_id}},
                )
            # only what the folder changed: a changed [[models]] entry waits for a reload
            keep = {m.id: m for m in wanted}
            for model in plan.changed:
                keep[model.id] = host.models[model.id].config
            await apply_models(host, list(keep.values()))
