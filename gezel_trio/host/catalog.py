"""The host's models while it serves: opened, retired and changed live.

:func:`plan_reload` compares the models running with the ones a config asks for (no
I/O). The rest is a :class:`Catalog`, which the host owns (``host.catalog``) and which
holds the host's models map:

- :meth:`Catalog.open_model` opens a model's engine (in the host's engine nursery),
  builds its runtime with that engine and, once the scheduler runs, gives it a lane,
  a planned-stop hook and a calibration watcher;
- :meth:`Catalog.retire_model` takes a model out: new requests get 404 at once,
  queued ones fail, running ones finish; then its engine stops (its sessions parked
  first);
- :meth:`Catalog.reconfigure_model` changes a model in place: once nobody holds its
  engine it stops, and the next request starts it with the new settings; queued
  requests wait for that start, none is dropped;
- :meth:`Catalog.reload` re-reads the config file (and ``models_dir``) and applies
  the difference; an invalid file changes nothing;
- :meth:`Catalog.serve_models_dir` watches ``models_dir`` for files added or removed.

The catalog is given what it works with (the config, the models map, the engine
nursery, the HTTP pool, the engine resolver, the arbiter, the ledger, metrics and
the parked-KV store), then the scheduler and the host's task nursery once they run
(:meth:`Catalog.attach`). It never sees the :class:`~gezel_trio.host.host.Host`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from ..config.models_dir import models_from_dir
from ..config.schema import Config, ModelConfig, load_config
from ..engine.argv import last_arg_value
from ..engine.binary import resolve_sd_server
from ..engine.client import EngineClient
from ..engine.gguf_meta import GGUFError, read_gguf_info
from ..engine.kinds import SD_SERVER
from ..engine.rpc import unreachable
from ..engine.supervisor import Engine, default_slot_save_dir, no_reservation, open_engine
from ..errors import ConfigError, EngineNotFound
from ..gpu.arbiter import GpuArbiter
from ..gpu.ledger import DeviceLedger
from ..kv.store import KvStore
from ..scheduler import Scheduler
from ..scheduler.replicas import expand_replicas
from .calibration import Calibrator, serve_calibration
from .image_runtime import ImageRuntime
from .metrics import Metrics
from .placement import (
    EngineResolver,
    argv_builder,
    engine_timing,
    image_argv_builder,
    image_reservation,
    reservation_for,
)
from .runtime import ModelRuntime, ModelSetup

__all__ = [
    "Catalog",
    "ReloadPlan",
    "plan_reload",
    "wanted_models",
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
    (a file becomes a URL, or back; a text model an image model) is removed and added,
    not changed."""
    by_id = {m.id: m for m in wanted}
    added: list[ModelConfig] = []
    changed: list[ModelConfig] = []
    kept: list[str] = []
    removed = [mid for mid in current if mid not in by_id]
    for model in wanted:
        old = current.get(model.id)
        if old is None:
            added.append(model)
        elif old.external != model.external or old.kind != model.kind:
            removed.append(model.id)
            added.append(model)
        elif old != model:
            changed.append(model)
        else:
            kept.append(model.id)
    return ReloadPlan(tuple(added), tuple(removed), tuple(changed), tuple(kept))


def wanted_models(config: Config) -> list[ModelConfig]:
    """``config``'s explicit models plus its ``models_dir``'s, replicated models expanded
    into their members (blocking file I/O)."""
    return expand_replicas(models_from_dir(config.models, config.engine.models_dir))


class Catalog:
    """The host's models while it serves: opened, retired and changed live.

    ``models`` is the host's map of model id to runtime (the scheduler's lanes are
    opened from it); the catalog is the only writer. Built by the host with the
    collaborators a model's engine and runtime need; :meth:`attach` gives it the
    scheduler and the host's task nursery once they run.
    """

    def __init__(
        self,
        *,
        config: Config,
        models: dict[str, ModelRuntime],
        engines: trio.Nursery,
        http: httpx.AsyncClient,
        transport: httpx.AsyncBaseTransport,
        resolver: EngineResolver,
        arbiter: GpuArbiter,
        ledger: DeviceLedger,
        metrics: Metrics,
        kv: KvStore | None,
        device: Callable[[], str],
        fingerprint: Callable[[], str],
    ) -> None:
        self.config = config
        self.models = models
        """The served models by id (the host's map, shared)."""
        self._engines = engines
        """Where each model's engine lives; closed after the scheduler."""
        self._http = http
        self._transport = transport
        """The connection pool every engine call goes through."""
        self._resolver = resolver
        self._image_resolver = EngineResolver(config.engine.sd_server, resolve=resolve_sd_server)
        """sd-server, for the image models."""
        self._arbiter = arbiter
        self._ledger = ledger
        self._metrics = metrics
        self._kv = kv
        self._device = device
        """The ledger device an engine is planned against now (the first GPU, else RAM)."""
        self._fingerprint = fingerprint
        """The engine build's fingerprint (part of a parked file's compatibility)."""
        self.scheduler: Scheduler | None = None
        """Set by :meth:`attach`: from then on a model opened gets a lane."""
        self._tasks: trio.Nursery | None = None
        self._calibrator: Callable[[], Calibrator] | None = None
        self.serving = False
        """True while the host serves (``open_host``'s block runs): a model opened now
        gets its calibration watcher at once."""

    def __repr__(self) -> str:
        return f"<Catalog {len(self.models)} models serving={self.serving}>"

    def attach(
        self, *, scheduler: Scheduler, tasks: trio.Nursery, calibrator: Callable[[], Calibrator]
    ) -> None:
        """The scheduler runs and the host's task nursery is open: a model opened from
        now on gets a lane, a retired one loses it, background retires and
        reconfigures run in ``tasks``, and ``calibrator()`` builds the context of a new
        model's calibration watcher."""
        self.scheduler = scheduler
        self._tasks = tasks
        self._calibrator = calibrator

    @property
    def tasks(self) -> trio.Nursery:
        """The host's task nursery (RuntimeError before :meth:`attach`)."""
        if self._tasks is None:
            raise RuntimeError("the host is not open")
        return self._tasks

    # -------------------------------------------------------------- one model

    async def open_model(self, model: ModelConfig) -> ModelRuntime:
        """Open ``model``'s engine in the host's engine nursery, build its runtime with
        that engine, and register it everywhere (scheduler lane, evictor, planned-stop
        hook, calibration) once the host serves. Cancellation before the engine task
        started leaves nothing behind; after, the model is listed (and shut down with
        the host)."""
        if model.id in self.models:
            raise ConfigError(f"models: {model.id!r} is already served")
        setup = ModelSetup(config=model, extra_args=tuple(self.config.engine.extra_args))
        if model.kind == "image":
            engine_cm, make_runtime = self._image_engine(model, setup)
        else:
            engine_cm, make_runtime = await self._text_engine(model, setup)

        async def run_engine(
            *, task_status: trio.TaskStatus[ModelRuntime] = trio.TASK_STATUS_IGNORED
        ) -> None:
            async with engine_cm as engine:
                runtime = make_runtime(
                    setup=setup,
                    engine=engine,
                    client=EngineClient(
                        self._transport,
                        engine,
                        read_timeout=self.config.engine.request_timeout,
                        model_id=model.id,
                    ),
                    arbiter=self._arbiter,
                    metrics=self._metrics,
                )
                task_status.started(runtime)
                await runtime.retired.wait()

        runtime: ModelRuntime = await self._engines.start(run_engine)
        try:
            self._register(runtime)
        except BaseException:
            runtime.retired.set()  # its engine task ends: nothing is left behind
            raise
        if self.scheduler is not None:
            self.scheduler.add_lane(runtime)
            if runtime.calibrates and self.serving:
                assert self._calibrator is not None
                await self.tasks.start(serve_calibration, self._calibrator(), runtime)
        return runtime

    async def _text_engine(
        self, model: ModelConfig, setup: ModelSetup
    ) -> tuple[AbstractAsyncContextManager[Engine], Callable[..., ModelRuntime]]:
        """A text model's engine (llama-server, or an external one) and its runtime's
        maker; its GGUF's metadata read into ``setup``."""
        config = self.config
        resolver = self._resolver
        state_dir = config.state_dir
        env = None
        if not model.external and resolver.error is None:
            env = resolver.get().launch_env()
        engine_cm = open_engine(
            key=model.id,
            model_id=model.id,
            http=self._http,
            argv_builder=None
            if model.external
            else argv_builder(config, setup, resolver, state_dir),
            url=model.url,
            env=env,
            timing=engine_timing(config, model),
            log_lines=config.engine.log_lines,
            reserve=no_reservation
            if model.external
            else reservation_for(
                setup, ledger=self._ledger, device=self._device, resolver=resolver
            ),
            pid_file=None if model.external else state_dir / "engines" / f"{model.id}.json",
        )
        if not model.external:
            assert model.path is not None
            with contextlib.suppress(GGUFError):  # an unreadable file fails at engine start
                setup.gguf = await trio.to_thread.run_sync(read_gguf_info, model.path)
        return engine_cm, partial(ModelRuntime, kv=self._kv, build=self._fingerprint())

    def _image_engine(
        self, model: ModelConfig, setup: ModelSetup
    ) -> tuple[AbstractAsyncContextManager[Engine], Callable[..., ModelRuntime]]:
        """An image model's engine (sd-server: its health route, no slots to read) and
        its runtime's maker: the same supervisor, arbiter and ledger as a text model's."""
        config = self.config
        resolver = self._image_resolver
        env = dict(os.environ)
        if resolver.error is None:
            with contextlib.suppress(EngineNotFound):  # the start says so, with the places tried
                env = resolver.get().launch_env()
        engine_cm = open_engine(
            key=model.id,
            model_id=model.id,
            http=self._http,
            argv_builder=image_argv_builder(setup, resolver),
            env=SD_SERVER.environment(env),
            timing=engine_timing(config, model),
            log_lines=config.engine.log_lines,
            reserve=image_reservation(setup, ledger=self._ledger, device=self._device),
            pid_file=config.state_dir / "engines" / f"{model.id}.json",
            kind=SD_SERVER,
        )
        return engine_cm, ImageRuntime

    def _register(self, runtime: ModelRuntime) -> None:
        """Give an opened model its evictor and hooks, and list it (synchronous)."""
        model = runtime.config
        config = self.config
        if model.kind == "image":
            self._arbiter.register_evictor(model.gpu_class, runtime.engine.stop, owner_id=model.id)
        elif not model.external:
            if self._kv is not None:
                user = last_arg_value(model.args, "--slot-save-path")
                home = Path(user) if user else default_slot_save_dir(config.state_dir, model.id)
                self._kv.dirs.setdefault(model.id, home)
            self._arbiter.register_evictor(model.gpu_class, runtime.engine.stop, owner_id=model.id)
            runtime.engine.before_stop = partial(self._before_stop, runtime)
            if model.rpc:
                runtime.engine.explain_exit = partial(_lost_rpc_workers, runtime)
        self.models[model.id] = runtime

    async def _before_stop(self, runtime: ModelRuntime) -> None:
        """What the supervisor runs before a planned stop (eviction, idle release,
        pressure release, unload, shutdown) sends SIGTERM, within its deadline: the
        sessions' KV parked (:meth:`_park_before_stop`), then the idle connections to
        the engine closed, so that it exits at once. Cancellation (the stop's deadline)
        ends it; the stop goes on."""
        try:
            await self._park_before_stop(runtime)
        finally:
            with trio.CancelScope(shield=True):
                await runtime.client.drop_idle()

    async def _park_before_stop(self, runtime: ModelRuntime) -> None:
        """Save every session's KV that ``runtime``'s engine holds and that is not parked
        yet, within the stop's deadline. The time it adds to the stop shows in status
        and ``/metrics``. Cancellation (the stop's deadline) ends the parking; the time
        spent is still counted."""
        if self.scheduler is None or self._kv is None:
            return
        t0 = time.perf_counter()
        try:
            saved = await self.scheduler.park_owned(runtime.id)
        finally:
            elapsed = time.perf_counter() - t0
            stats = runtime.kv_stats
            stats.stop_parks += 1
            stats.stop_park_ms += elapsed * 1000
            self._metrics.kv_stop_park(runtime.id, elapsed)
        if saved:
            log.info(
                "saved %d sessions of %s before stopping its engine (%.0f ms)",
                saved,
                runtime.id,
                elapsed * 1000,
            )

    async def retire_model(self, model_id: str) -> None:
        """Stop serving ``model_id``: new requests get 404 from now, queued ones fail with
        404, running ones finish; then its engine stops (sessions parked first) and its
        task ends. Cancellation stops the wait for the running requests; the model stays
        out of service."""
        runtime = self.models.pop(model_id, None)
        if runtime is None:
            return
        if self.scheduler is not None:
            self.scheduler.remove_lane(model_id)
        await runtime.engine.wait_idle()  # every admitted job holds the engine until it ends
        if not runtime.config.external:
            self._arbiter.unregister_evictor(runtime.config.gpu_class, owner_id=model_id)
        runtime.engine.closing_reason = "its model was removed"
        runtime.retired.set()
        log.info("model %s removed: its engine stops", model_id)

    async def reconfigure_model(self, model: ModelConfig) -> None:
        """Apply ``model``'s new settings to the running model of that id: once nobody
        holds its engine, stop it (sessions parked first); the next request starts it
        with the new settings. Queued requests wait for that start. Cancellation leaves
        the old settings."""
        runtime = self.models.get(model.id)
        if runtime is None:
            return
        gguf = runtime.gguf
        if model.kind == "text" and model.path and model.path != runtime.config.path:
            gguf = None
            with contextlib.suppress(GGUFError):
                gguf = await trio.to_thread.run_sync(read_gguf_info, model.path)
        while runtime.engine.busy:  # (woken, someone may have taken it again)
            await runtime.engine.wait_idle()
        # no checkpoint from here to the stop request: nothing can be admitted in between
        runtime.setup.replace_config(model, gguf)
        runtime.engine.timing = engine_timing(self.config, model)
        await runtime.engine.stop()
        log.info(
            "model %s changed: its engine restarts with the new settings on next use", model.id
        )

    # -------------------------------------------------------------- many models

    async def apply_models(self, wanted: Sequence[ModelConfig]) -> ReloadPlan:
        """Make the served models ``wanted``: open the added ones now; retire the removed
        and reconfigure the changed ones in the background (they wait for running work).
        Cancellation stops the opening between models: those opened stay served, and
        the retires and reconfigures already started go on."""
        plan = plan_reload({mid: rt.config for mid, rt in self.models.items()}, wanted)
        kind_changed = {m.id for m in plan.added} & set(plan.removed)
        for model_id in plan.removed:
            if model_id not in kind_changed:
                self.tasks.start_soon(self.retire_model, model_id)
        for model in plan.added:
            if model.id in kind_changed:
                await self.retire_model(model.id)  # the old one drains before the new one opens
            await self.open_model(model)
        for model in plan.changed:
            self.tasks.start_soon(self.reconfigure_model, model)
        return plan

    async def reload(self) -> dict[str, Any]:
        """Re-read the config file the host was started from, validate it, and apply its
        models. Raises ConfigError (naming the key) and changes nothing when the file is
        invalid or there is none. Settings outside ``[[models]]`` and ``models_dir`` need a
        restart: they are named in ``restart_needed``. Cancellation while the file is read
        changes nothing; while the models are applied, as :meth:`apply_models` (the
        config keeps its old model list)."""
        source = self.config.source
        if source is None:
            raise ConfigError("reload: this host was not started from a config file (--config)")
        new = await trio.to_thread.run_sync(load_config, source)
        if new.state_dir != self.config.state_dir:
            raise ConfigError("engine.state_dir: changes need a restart; the reload was refused")
        wanted = await trio.to_thread.run_sync(wanted_models, new)
        restart = [
            name
            for name in ("server", "scheduler", "gpu")
            if dataclasses.asdict(getattr(new, name))
            != dataclasses.asdict(getattr(self.config, name))
        ]
        old_engine = dataclasses.asdict(self.config.engine)
        new_engine = dataclasses.asdict(new.engine)
        if {k: v for k, v in old_engine.items() if not k.startswith("models_dir")} != {
            k: v for k, v in new_engine.items() if not k.startswith("models_dir")
        }:
            restart.append("engine")
        plan = await self.apply_models(wanted)
        self.config.models = new.models
        self.config.engine.models_dir = new.engine.models_dir
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
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Every ``models_dir_poll`` seconds, serve the files added to ``models_dir`` and
        retire the models whose files went away. Runs until cancelled; cancellation
        during a change stops it as :meth:`apply_models` does."""
        task_status.started()
        while True:
            await trio.sleep(self.config.engine.models_dir_poll)
            if not self.config.engine.models_dir:
                continue
            wanted = await trio.to_thread.run_sync(wanted_models, self.config)
            plan = plan_reload({mid: rt.config for mid, rt in self.models.items()}, wanted)
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
                    keep[model.id] = self.models[model.id].config
                await self.apply_models(list(keep.values()))


async def _lost_rpc_workers(runtime: ModelRuntime) -> str | None:
    """Which of the model's RPC workers stopped answering (why its engine died), if any."""
    down = await unreachable(runtime.config.rpc)
    return f"RPC worker {', '.join(down)} is unreachable" if down else None
