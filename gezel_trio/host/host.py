"""``open_host(config)``: the whole tree of components, opened from the outside in.

    httpx client
      └─ GPU: NVML probe → health gate → arbiter; device ledger (SQLite)
           └─ engines (one supervisor per model, each inside its memory reservation)
                └─ scheduler (the only place a request is admitted to a slot)
                     └─ tasks (open streaming responses; health, pressure and calibration watchers)

Nesting order is cleanup order: open streams end before the scheduler, the
scheduler before the engines, each engine before its reservation.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from .. import __version__
from .._trio import unwrapping
from ..config.schema import Config, ModelKind
from ..engine.argv import last_arg_value
from ..engine.speed import measure_speed
from ..engine.supervisor import EngineState, default_slot_save_dir
from ..engine.transport import EngineTransport
from ..errors import (
    ConfigError,
    EngineAbandoned,
    EngineCrashed,
    EngineFailed,
    ModelLocked,
    NoCapacity,
    UnknownModel,
    WrongModelKind,
)
from ..gpu.arbiter import GpuArbiter, resolve_policy
from ..gpu.health import DeviceSafetyPolicy, HealthGate
from ..gpu.ledger import (
    CPU_DEVICE,
    DeviceLedger,
    default_capacities,
    gpu_device_id,
    open_ledger,
)
from ..gpu.probe import DeviceHealth, NvmlProbe, Probe
from ..images.job import ImageJob, ImageProgress, ImageResult
from ..kv.lead import Lead, LeadOf
from ..kv.prefix import shared_blocks
from ..kv.sessions import SessionKeys
from ..kv.store import KvStore, default_budget
from ..scheduler import (
    Content,
    Grant,
    JobKind,
    Prefix,
    Scheduler,
    SchedulerSettings,
    SlotRequest,
    SlotTable,
    open_scheduler,
)
from ..scheduler.replicas import KvPlace, MemberView, ReplicaRouter
from .activity import Activity
from .calibration import CalibrationBook, Calibrator, calibrate, serve_calibration
from .catalog import Catalog, wanted_models
from .completion import CompletionService
from .image_jobs import ImageJobs
from .images import render
from .metrics import Metrics
from .placement import EngineResolver
from .runtime import ModelRuntime
from .snapshot import HostSnapshot, LiveConfig, ReplicaSetStats
from .watchers import serve_device_health, serve_memory_pressure, serve_replica_revival

log = logging.getLogger("gezel_trio.host")

__all__ = ["Host", "open_host"]


class Host:
    """The running host: models, the GPU arbiter, the scheduler, and how a request runs.

    Its models are opened, retired and changed by its :attr:`catalog`, which it builds
    here from its own parts (``engines``: the nursery each model's engine lives in).
    """

    def __init__(
        self,
        *,
        config: Config,
        http: httpx.AsyncClient,
        resolver: EngineResolver,
        arbiter: GpuArbiter,
        health_gate: HealthGate,
        ledger: DeviceLedger,
        sessions: SessionKeys,
        transport: httpx.AsyncBaseTransport,
        engines: trio.Nursery,
        kv: KvStore | None = None,
    ) -> None:
        self.config = config
        self.http = http
        self.resolver = resolver
        self.arbiter = arbiter
        self.health_gate = health_gate
        self.ledger = ledger
        self.sessions = sessions
        """Derives each request's session from its caller and chat name (``session.key``)."""
        self.pressure_releases = 0
        self.calibration_book = CalibrationBook(config.state_dir / "calibration.json")
        self.metrics = Metrics(status=self.snapshot)
        self.models: dict[str, ModelRuntime] = {}
        self.scheduler: Scheduler | None = None
        self.started_at = time.time()
        self.version = __version__
        self.urls: list[str] = []
        self.tasks: trio.Nursery = _unset_nursery()
        """The host's own tasks: streaming relays waiting on their jobs, device-health and
        memory-pressure watchers, calibration watchers. Closed before the scheduler."""
        self.last_device_health: DeviceHealth | None = None
        self.kv = kv
        """The parked-KV store (None with ``kv_parking`` off)."""
        self.transport = transport
        """The connection pool every engine call goes through."""
        self.routers: dict[str, ReplicaRouter] = {}
        """Per replicated model, which member each request goes to."""
        self.activity = Activity()
        """Recent requests and per-second queue and TTFT series (the dashboard's)."""
        self.completions = CompletionService(self)
        """How every completion runs on a slot (:mod:`.completion`)."""
        self.image_jobs = ImageJobs()
        """The async image jobs (``/sdcpp/v1/*``): each runs in :attr:`tasks`."""
        self.image_checkpoints: OrderedDict[str, str] = OrderedDict()
        """caller -> the image model it chose through ``/sdapi/v1/options`` (bounded by
        the route)."""
        self.catalog = Catalog(
            config=config,
            models=self.models,
            engines=engines,
            http=http,
            transport=transport,
            resolver=resolver,
            arbiter=arbiter,
            ledger=ledger,
            metrics=self.metrics,
            kv=kv,
            device=self.compute_device,
            fingerprint=self.build_fingerprint,
        )
        """The models while the host serves: opened, retired, changed (:mod:`.catalog`);
        their engines live in ``engines``, closed last."""

    @property
    def serving(self) -> bool:
        """True while ``open_host``'s block runs (its tasks nursery is open)."""
        return self.catalog.serving

    async def reload(self) -> dict[str, Any]:
        """Re-read the config file and apply its models (:meth:`Catalog.reload`: raises
        ConfigError and changes nothing when the file is invalid; cancellation as there)."""
        return await self.catalog.reload()

    def __repr__(self) -> str:
        return f"<Host {len(self.models)} models policy={self.arbiter.policy}>"

    # -------------------------------------------------------------- model selection

    def resolve_model(
        self,
        model_id: object,
        *,
        session: str | None = None,
        avoid: Collection[str] = (),
        kind: ModelKind | None = "text",
    ) -> ModelRuntime:
        """The runtime for a request's ``model`` field, a model of ``kind`` (None: any).

        A missing ``model`` picks the first configured model of ``kind``; a model of
        another kind is :class:`WrongModelKind` (400). A replicated model's id picks one
        of its members for ``session`` (see :mod:`gezel_trio.scheduler.replicas`),
        never one in ``avoid`` while another is left. Raises :class:`UnknownModel`
        (404) or :class:`ModelLocked` (409, before the request reaches the scheduler).
        """
        if model_id is None or model_id == "":
            first = next(
                (rt for rt in self.models.values() if kind in (None, rt.config.kind)), None
            )
            if first is None:
                raise UnknownModel(f"no {kind + ' ' if kind else ''}models are configured")
            model_id = first.config.replica_of or first.id
        if not isinstance(model_id, str):
            raise UnknownModel(f"model must be a string naming a model, got {model_id!r}")
        members = self.replica_members(model_id)
        if members:
            runtime = self._route(model_id, members, session, avoid)
        else:
            found = self.models.get(model_id)
            if found is None:
                for rt in self.models.values():
                    if rt.config.name == model_id and rt.config.replica_of is None:
                        found = rt
                        break
            if found is None:
                known = ", ".join(self.public_ids()) or "none"
                raise UnknownModel(
                    f"the model {model_id[:200]!r} does not exist; known models: {known}"
                )
            runtime = found
        if kind is not None and runtime.config.kind != kind:
            raise WrongModelKind(_kind_mismatch(runtime.config.replica_of or runtime.id, kind))
        if self.config.scheduler.lock_model and self.models:
            locked = self.public_ids()[0]
            public = runtime.config.replica_of or runtime.id
            if public != locked:
                raise ModelLocked(
                    f"lock_model is on: this host serves only {locked!r}; "
                    f"{public!r} is refused (turn lock_model off with PUT /api/config)"
                )
        return runtime

    def label_of(self, model_id: object) -> str:
        """The id a request for ``model_id`` is counted under in metrics (a replicated
        model's own id, not a member's); routes nothing. Raises like resolve_model."""
        if isinstance(model_id, str) and self.replica_members(model_id):
            return model_id
        rt = self.resolve_model(model_id, kind=None)
        return rt.config.replica_of or rt.id

    def public_ids(self) -> list[str]:
        """The model ids clients name: a replicated model once, by its own id."""
        out: list[str] = []
        for rt in self.models.values():
            public = rt.config.replica_of or rt.id
            if public not in out:
                out.append(public)
        return out

    def replica_members(self, model_id: str) -> list[ModelRuntime]:
        """The engines serving the replicated model ``model_id`` (none: not replicated)."""
        return [rt for rt in self.models.values() if rt.config.replica_of == model_id]

    def _route(
        self,
        model_id: str,
        members: list[ModelRuntime],
        session: str | None,
        avoid: Collection[str],
    ) -> ModelRuntime:
        router = self.routers.setdefault(model_id, ReplicaRouter())
        chosen = router.choose(self._member_views(members, session), session, avoid=avoid)
        return self.models[chosen]

    def _member_views(self, members: list[ModelRuntime], session: str | None) -> list[MemberView]:
        """What the router needs of each member now: health, load (jobs running and
        waiting on it, and requests in flight on its engine), and whether it holds
        ``session``'s KV."""
        stats = self.scheduler.statistics() if self.scheduler is not None else None
        views = []
        for rt in members:
            load = rt.engine.busy
            if stats is not None:
                load += stats.running.get(rt.id, 0) + stats.waiting.get(rt.id, 0)
            holds = session is not None and self.holds(rt, session)
            healthy = rt.engine.state.value is not EngineState.FAILED
            if self.scheduler is not None and self.scheduler.is_down(rt.id):
                healthy = False  # its load failed or it cannot be reached: until revived
            views.append(MemberView(rt.id, healthy, load, holds))
        return views

    def _route_by_prefix(
        self,
        public: str,
        runtime: ModelRuntime,
        *,
        owner: str,
        keyless: bool,
        prefix: Prefix,
        caller: str | None = None,
    ) -> tuple[ModelRuntime, bool]:
        """The member a request of ``owner`` with blocks ``prefix`` goes to, now that
        they are known (``runtime``: the member :meth:`resolve_model` chose), and
        whether it goes there because that member holds a prefix of it (see
        :meth:`ReplicaRouter.by_prefix`; ``caller``: the owner may start from a prefix
        of that caller's, :meth:`_sharing`). Plain state, no I/O."""
        router = self.routers.setdefault(public, ReplicaRouter())
        members = self.replica_members(public)
        session = None if keyless else owner
        route = router.by_prefix(
            self._member_views(members, session),
            owner,
            prefix,
            current=runtime.id,
            session=session,
            bound=self.config.scheduler.prefix_load_bound,
            held=lambda place: self._held_blocks(place, owner, router),
            parked={rt.id: self._parked_blocks(rt.id, owner, prefix) for rt in members},
            caller=caller,
            caller_held=None if caller is None else partial(self._caller_blocks, caller=caller),
            lent=None
            if caller is None
            else lambda: {rt.id: self._lent_blocks(rt, caller, owner, prefix) for rt in members},
        )
        return self.models.get(route.member, runtime), route.hit

    def _slot_table_of(self, place: KvPlace) -> tuple[SlotTable, int] | None:
        """The slot table of ``place``'s member and its slot, or None when the scheduler
        does not run, serves no such member or has no such slot."""
        if self.scheduler is None or place.slot is None:
            return None
        try:
            table = self.scheduler.table(place.member)
        except KeyError:
            return None
        return None if place.slot >= len(table) else (table, place.slot)

    def _caller_blocks(self, place: KvPlace, *, caller: str) -> Prefix | None:
        """What ``place`` (a member's slot) holds of ``caller``'s shared prefixes now,
        from the member's slot table: its blocks, or None when the slot holds no KV of
        an owner of ``caller`` that shares within it."""
        found = self._slot_table_of(place)
        if found is None:
            return None
        table, slot = found
        entry = table.slots[slot]
        if entry.content is not Content.OWNED or entry.caller != caller:
            return None
        return entry.blocks

    def _lent_blocks(self, member: ModelRuntime, caller: str, owner: str, prefix: Prefix) -> int:
        """How many leading blocks of ``prefix`` the best parked copy that ``member``
        would lend a request of ``owner`` within ``caller`` holds (0: none)."""
        found = member.lent_copy(caller, owner, prefix)
        return 0 if found is None else shared_blocks(found[1], prefix)

    def _held_blocks(self, place: KvPlace, owner: str, router: ReplicaRouter) -> Prefix | None:
        """What ``place`` (a member's slot) holds of ``owner`` now, from the member's slot
        table: its blocks, or None when the slot holds nothing of ``owner``'s. A slot a
        request is being sent to (content unknown while pinned) keeps what the index
        says: it is the owner's request that last recorded it, finishing."""
        found = self._slot_table_of(place)
        if found is None:
            return None
        table, slot = found
        if table.owner(slot) == owner:
            return table.blocks(slot)
        if table.content(slot) is Content.UNKNOWN and table.pinned_to(slot):
            return router.index.blocks_of(place)
        return None

    def _parked_blocks(self, member: str, owner: str, prefix: Prefix) -> int:
        """How many leading blocks of ``prefix`` ``member``'s best parked copy of
        ``owner``'s KV holds (0: none)."""
        if self.kv is None:
            return 0
        return max(
            (shared_blocks(e.blocks, prefix) for e in self.kv.copies(member, owner)), default=0
        )

    def holds(self, runtime: ModelRuntime, session: str) -> bool:
        """``runtime`` holds ``session``'s KV, in a slot or parked."""
        if self.scheduler is not None and self.scheduler.holds(runtime.id, session):
            return True
        return self.kv is not None and self.kv.entry(runtime.id, session) is not None

    # -------------------------------------------------------------- running jobs

    def slot(
        self,
        runtime: ModelRuntime,
        *,
        session: str | None = None,
        keyless: bool = False,
        prefix: Prefix = (),
        caller: str | None = None,
        lead: LeadOf | None = None,
        kind: JobKind = "completion",
        any_slot: bool = False,
        needs_slot: bool = True,
        pool: bool = False,
    ) -> SlotRequest:
        """``async with host.slot(runtime, session=...) as grant``: hold a slot of
        ``runtime``'s engine for the block (see :meth:`Scheduler.slot`: ``session``
        is the owner, ``keyless`` says it is a caller's keyless owner, ``prefix``
        the request's blocks; ``pool``: a replica's job that any sibling may take).
        ``caller``: the owner's caller; the job may then start from a prefix another
        owner of that caller left in a slot, when ``[scheduler]
        share_prefix_within_caller`` is on and the engine cuts a slot back to a
        shared prefix by itself (:attr:`ModelRuntime.cuts_back`). ``lead``: reads the
        request's lead (:func:`~gezel_trio.kv.lead.lead_of`), called only where it
        is used: on an engine that cannot cut back, with sharing on, a slot holding
        nothing of the owner's starts from the caller's snapshot of it
        (:meth:`_leading`).

        The block runs once the model is resident, its turn has come and the slot
        is prepared; the engine is held (no idle or pressure release) from
        admission to exit, and the GPU lease for the model's slot class is held
        inside. Cancelling the caller withdraws a queued request or exits the
        block; pin, lease and hold are released at scope exit on every path.
        """
        assert self.scheduler is not None, "the host is not open"
        leading = self._leading(runtime, session, caller, lead)
        caller = self._sharing(runtime, session, caller)
        # the copy a restore would take: its blocks count as no work (SHORT WORK FIRST)
        parked = runtime.parked_blocks(session, prefix) if caller or prefix else None
        return self.scheduler.slot(
            runtime.id,
            session=session,
            keyless=keyless,
            prefix=prefix,
            caller=caller,
            parked=caller is not None and parked is not None,
            reuse=shared_blocks(parked, prefix) if parked else 0,
            lead=leading,
            kind=kind,
            any_slot=any_slot,
            needs_slot=needs_slot,
            pool=pool,
        )

    def _sharing(
        self, runtime: ModelRuntime, session: str | None, caller: str | None
    ) -> str | None:
        """``caller`` when a job of ``session`` on ``runtime`` may start from a prefix
        another owner of that caller left (``[scheduler] share_prefix_within_caller``
        on, an owner, an engine that cuts a slot back exactly), else None."""
        if (
            caller is None
            or session is None
            or not self.config.scheduler.share_prefix_within_caller
            or not runtime.cuts_back
        ):
            return None
        return caller

    def _leading(
        self, runtime: ModelRuntime, session: str | None, caller: str | None, lead: LeadOf | None
    ) -> Lead | None:
        """The request's lead (``lead()``, read only here) as ``caller``'s when a job of
        ``session`` on ``runtime`` starts from it (sharing within the caller on, an
        owner, an engine the host runs that cannot cut a slot back but can save and
        restore one), else None."""
        if (
            lead is None
            or caller is None
            or session is None
            or not self.config.scheduler.share_prefix_within_caller
            or runtime.config.external
            or runtime.cuts_back
            or not runtime.leads_enabled
        ):
            return None
        found = lead()
        return None if found is None else found.for_caller(caller)

    @asynccontextmanager
    async def completion_slot(
        self,
        runtime: ModelRuntime,
        *,
        session: str | None = None,
        keyless: bool = False,
        prefix: Prefix = (),
        caller: str | None = None,
        lead: LeadOf | None = None,
    ) -> AsyncIterator[tuple[ModelRuntime, Grant]]:
        """``async with host.completion_slot(runtime, session=s) as (member, grant)``:
        :meth:`slot` for a completion, across a replicated model's members
        (``session``, ``keyless``, ``prefix``, ``caller`` and ``lead`` as there).

        ``member`` is the engine the grant is on: for a replica, another member than
        ``runtime`` when the scheduler moved the job (a sibling with a free slot
        took a job whose session has no KV anywhere, or a keyless owner's job, or
        ``runtime`` went down and handed its queue on). When the slot cannot be had
        because the engine failed (it could not be started, reached or made safe:
        nothing was sent), the request queues again on another member that has not
        failed it, until none is left; then the last error is raised. A request on an external
        engine is abandoned (EngineAbandoned) when that engine fails its health
        checks meanwhile. Cancellation behaves as :meth:`slot`.
        """
        public = runtime.config.replica_of
        tried: set[str] = set()
        held: bool | None = None  # the first member routed to holds the session's KV
        by_prefix = False  # routed to a member holding a prefix of the request
        if public is not None and session is not None and prefix:
            runtime, by_prefix = self._route_by_prefix(
                public,
                runtime,
                owner=session,
                keyless=keyless,
                prefix=prefix,
                caller=self._sharing(runtime, session, caller),
            )
        async with AsyncExitStack() as stack:
            while True:
                holds = public is not None and session is not None and self.holds(runtime, session)
                held = holds if held is None else held
                # A job sent where its prefix is stays there: no sibling takes it.
                pool = public is not None and not by_prefix and (keyless or not holds)
                try:
                    grant = await stack.enter_async_context(
                        self.slot(
                            runtime,
                            session=session,
                            keyless=keyless,
                            prefix=prefix,
                            caller=caller,
                            lead=lead,
                            pool=pool,
                        )
                    )
                    break
                except (EngineFailed, EngineCrashed, NoCapacity) as exc:
                    if public is None:
                        raise
                    tried.add(runtime.id)
                    if all(m.id in tried for m in self.replica_members(public)):
                        raise
                    log.info(
                        "replica %s failed before the request reached it (%s): queueing "
                        "it on another",
                        runtime.id,
                        exc.message,
                    )
                    runtime = self.resolve_model(
                        public, session=None if keyless else session, avoid=tried
                    )
                    by_prefix = False
            member = self.models.get(grant.model_id, runtime)
            if public is not None and session is not None and not keyless and member is not runtime:
                router = self.routers.setdefault(public, ReplicaRouter())
                router.rehome(session, member.id, lost_kv=bool(held))
            if public is not None and session is not None and grant.slot_id is not None:
                # The slot holds the request's blocks from now on: recorded as the block
                # starts (a continuation sent as soon as the answer's last byte arrives
                # finds it) and again as it ends, before the slot is released (routing
                # meanwhile may have corrected the index from the slot table's older
                # content). A failure or an engine restart is caught at routing time.
                record = partial(
                    self.routers.setdefault(public, ReplicaRouter()).record,
                    session,
                    KvPlace(member.id, grant.slot_id),
                    prefix,
                    caller=self._sharing(member, session, caller),
                )
                record()
                stack.callback(record)
            if not (member.config.external and self.serving):
                yield member, grant
                return
            # An external engine that hangs keeps its sockets open and is not ours to
            # kill: when its health checks fail, the request in flight is abandoned.
            with trio.CancelScope() as abandoned:
                watch = trio.CancelScope()

                async def abandon_on_failure() -> None:
                    with watch:
                        await member.wait_failed()
                        abandoned.cancel()

                self.tasks.start_soon(abandon_on_failure)
                try:
                    yield member, grant
                finally:
                    watch.cancel()
            if abandoned.cancelled_caught:
                crashed = member.engine.crash_error("it stopped answering its health checks")
                raise EngineAbandoned(crashed.message)

    async def render(
        self,
        model: str | None,
        job: ImageJob,
        *,
        caller: str,
        on_progress: Callable[[ImageProgress], None] | None = None,
        request_id: str | None = None,
        route: str | None = None,
    ) -> ImageResult:
        """Render ``job`` on the image model ``model`` (None: the first one) for ``caller``
        (its HMAC identity) and return the images: the image lane's one slot and its GPU
        lease held for the whole job; ``on_progress`` gets each sampling step; the request
        log line, metric and activity row are written here (``route`` names the route).
        Errors are the project's: UnknownModel, WrongModelKind (a text model), BadRequest
        (sd-server refused the body: its message), QueueFull, NoCapacity, EngineFailed.
        Cancellation (the caller left) cancels a queued job in the engine, or stops the
        engine when the job is generating; grant and lease are released within a second
        (see :mod:`.images`)."""
        return await render(
            self,
            model,
            job,
            caller=caller,
            on_progress=on_progress,
            request_id=request_id,
            route=route,
        )

    async def calibrate(self, runtime: ModelRuntime) -> dict[str, Any]:
        """Run the co-batch calibration now (an exclusive operation); returns its result."""
        result = await calibrate(self.calibrator(), runtime)
        return result.to_dict()

    async def benchmark(
        self, runtime: ModelRuntime, *, prompt_tokens: int = 256, n_predict: int = 32
    ) -> dict[str, Any]:
        """Measure prefill and decode speed as the scheduler's exclusive ``benchmark`` op.

        The engine is drained first and nothing else is admitted while it runs.
        """

        async with self.slot(runtime, kind="benchmark"):
            engine = runtime.engine
            await engine.ensure_ready()
            assert engine.base_url is not None
            result = await measure_speed(
                self.http,
                engine.base_url,
                vocab_size=runtime.vocab_size,
                prompt_tokens=prompt_tokens,
                n_predict=n_predict,
            )
        runtime.last_benchmark = result
        return result

    # -------------------------------------------------------------- live configuration

    def set_policy(self, setting: str) -> None:
        """Switch the GPU policy live; the scheduler's residency follows it."""
        policy = resolve_policy(setting)
        self.config.gpu.policy = setting  # type: ignore[assignment]
        self.arbiter.set_policy(policy)
        if self.scheduler is not None:
            self.scheduler.set_residency("swap" if policy == "swap" else "coexist")

    def set_thermal(self, *, limit_c: float | None = None, margin_c: float | None = None) -> None:
        gpu = self.config.gpu
        policy = DeviceSafetyPolicy(
            temp_limit_c=gpu.temp_limit_c if limit_c is None else limit_c,
            margin_c=gpu.temp_margin_c if margin_c is None else margin_c,
        )
        gpu.temp_limit_c, gpu.temp_margin_c = policy.temp_limit_c, policy.margin_c
        self.arbiter.set_device_safety_policy(policy)

    def apply_config(self, patch: dict[str, Any]) -> dict[str, Any]:
        """Apply a validated ``PUT /api/config`` patch without a restart; returns the new values."""
        if "policy" in patch:
            if patch["policy"] not in ("auto", "coexist", "swap"):
                raise ConfigError("policy: expected one of 'auto', 'coexist', 'swap'")
            self.set_policy(patch["policy"])
        if "temp_limit_c" in patch or "temp_margin_c" in patch:
            self.set_thermal(limit_c=patch.get("temp_limit_c"), margin_c=patch.get("temp_margin_c"))
        if "lock_model" in patch:
            if not isinstance(patch["lock_model"], bool):
                raise ConfigError("lock_model: expected true or false")
            self.config.scheduler.lock_model = patch["lock_model"]
        return self.live_config()

    def live_config(self) -> dict[str, Any]:
        return self.live_settings().as_dict()

    def live_settings(self) -> LiveConfig:
        return LiveConfig(
            policy=self.config.gpu.policy,
            resolved_policy=self.arbiter.policy,
            temp_limit_c=self.config.gpu.temp_limit_c,
            temp_margin_c=self.config.gpu.temp_margin_c,
            lock_model=self.config.scheduler.lock_model,
        )

    # -------------------------------------------------------------- status

    def snapshot(self) -> HostSnapshot:
        """Every part's statistics now: what ``/api/status`` and ``/metrics`` read."""
        return HostSnapshot(
            version=self.version,
            uptime_s=round(time.time() - self.started_at, 3),
            config=self.live_settings(),
            engine_binary=self.resolver.status(),
            engines=tuple(rt.statistics() for rt in self.models.values()),
            scheduler=self.scheduler.statistics() if self.scheduler else None,
            completions=self.completions.statistics(),
            arbiter=self.arbiter.statistics(),
            health_gate=self.health_gate.statistics(),
            gpu=self.last_device_health,
            ledger=self.ledger.statistics(),
            pressure_releases=self.pressure_releases,
            replicas={
                model_id: ReplicaSetStats(
                    members=tuple(rt.id for rt in self.replica_members(model_id)),
                    router=router.statistics(),
                )
                for model_id, router in self.routers.items()
            },
        )

    def status(self) -> dict[str, Any]:
        """The ``/api/status`` document: :meth:`snapshot` as JSON."""
        return self.snapshot().as_json()

    def calibrator(self) -> Calibrator:
        assert self.scheduler is not None, "the host is not open"
        return Calibrator(
            scheduler=self.scheduler,
            http=self.http,
            book=self.calibration_book,
            fingerprint=self.build_fingerprint,
        )

    def build_fingerprint(self) -> str:
        facts = self.resolver.facts
        return facts.fingerprint if facts else "unknown-build"

    def bound_stop(self, seconds: float) -> None:
        """Make every engine's planned stop, parking included, end within ``seconds``
        from now (the rest of ``[server] shutdown_timeout`` once the front has closed):
        parking gets what is left after a quarter kept for SIGTERM (at most its
        ``park_on_stop_timeout``), then an engine that has not exited on SIGTERM within
        that quarter (at most its ``stop_grace``) is killed. Never lengthens either."""
        grace = max(0.2, seconds / 4)
        park = max(0.2, seconds - grace - 0.2)
        for runtime in self.models.values():
            timing = runtime.engine.timing
            runtime.engine.timing = replace(
                timing,
                stop_grace=min(timing.stop_grace, grace),
                park_grace=min(timing.park_grace, park),
            )

    def note_pressure_release(self, runtime: ModelRuntime) -> None:
        self.pressure_releases += 1

    def compute_device(self) -> str:
        """The ledger device engines are planned against: the first GPU, else RAM."""
        health = self.last_device_health
        if health is not None and health.available and health.readings:
            return gpu_device_id(health.readings[0].index)
        return CPU_DEVICE

    async def refresh_device_health(self) -> None:
        health = await self.health_gate.device_health(max_age=1.0)
        self.last_device_health = health


def _kind_mismatch(model_id: str, route_kind: str) -> str:
    """Why a route of ``route_kind`` refuses the model ``model_id`` (of the other kind)."""
    if route_kind == "text":
        return (
            f"the model {model_id!r} is an image model: ask an image route for it "
            "(POST /v1/images/generations); this route serves text models"
        )
    return (
        f"the model {model_id!r} is a text model: image routes serve image models "
        '(kind = "image" in [[models]])'
    )


@asynccontextmanager
async def open_host(config: Config, *, probe: Probe | None = None) -> AsyncIterator[Host]:
    """Open every component of the host; on exit, close them in reverse order.

    Cancellation (Ctrl-C, shutdown) stops every engine process, then releases
    its ledger reservation, before this returns.
    """
    resolver = EngineResolver(config.engine.binary)
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64, keepalive_expiry=4.0)
    gpu = config.gpu
    nvml = probe or NvmlProbe()
    gate = HealthGate(
        nvml, policy=DeviceSafetyPolicy(temp_limit_c=gpu.temp_limit_c, margin_c=gpu.temp_margin_c)
    )
    arbiter = GpuArbiter(
        policy=gpu.policy,
        health_gate=gate,
        stale_lease_ceiling=gpu.stale_lease_minutes * 60,
        lease_wait_poll=gpu.lease_wait_poll,
    )
    state_dir = config.state_dir
    state_dir.mkdir(parents=True, exist_ok=True)
    sessions = await trio.to_thread.run_sync(SessionKeys.load, state_dir)
    health = await gate.device_health(max_age=0)
    # one transport for every engine call: the pool, and the lean path for streams
    transport = EngineTransport(httpx.AsyncHTTPTransport(limits=limits))
    async with (
        unwrapping(),
        httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(30.0)) as http,
        open_ledger(state_dir / "ledger.sqlite", capacities=default_capacities(health)) as ledger,
        trio.open_nursery() as engines,
    ):
        await resolver.load_facts()
        kv = None
        if config.scheduler.kv_parking:
            kv = await trio.to_thread.run_sync(open_kv_store, config)
        host = Host(
            config=config,
            http=http,
            resolver=resolver,
            arbiter=arbiter,
            health_gate=gate,
            ledger=ledger,
            sessions=sessions,
            transport=transport,
            engines=engines,
            kv=kv,
        )
        host.last_device_health = health
        catalog = host.catalog
        try:
            for model in await trio.to_thread.run_sync(wanted_models, config):
                await catalog.open_model(model)
            sched = config.scheduler
            async with open_scheduler(
                lanes=host.models,
                settings=SchedulerSettings(
                    residency="swap" if arbiter.policy == "swap" else "coexist",
                    max_queue=sched.max_queue,
                    slot_poll=sched.slot_poll,
                    affinity=sched.affinity,
                    affinity_max_wait=sched.affinity_max_wait,
                    short_first_passes=sched.short_first_passes,
                    erase_on_handoff=sched.erase_on_handoff,
                    blind_handoff=sched.blind_handoff,
                    kv_parking=sched.kv_parking,
                    save_idle_slots=sched.save_idle_slots,
                    save_idle_delay=sched.save_idle_delay,
                    save_lone_delay=sched.save_lone_delay,
                ),
            ) as scheduler:
                host.scheduler = scheduler
                async with trio.open_nursery() as tasks:
                    host.tasks = tasks
                    catalog.attach(scheduler=scheduler, tasks=tasks, calibrator=host.calibrator)
                    await tasks.start(serve_device_health, host.refresh_device_health)
                    await tasks.start(
                        partial(
                            serve_memory_pressure,
                            arbiter,
                            host.models,
                            grace=config.gpu.pressure_grace,
                            on_release=host.note_pressure_release,
                        )
                    )
                    for rt in list(host.models.values()):
                        if rt.calibrates:
                            await tasks.start(serve_calibration, host.calibrator(), rt)
                    await tasks.start(
                        partial(
                            serve_replica_revival,
                            host.models,
                            scheduler,
                            interval=config.engine.health_interval * 4,
                            probe_within=config.engine.load_timeout,
                        )
                    )
                    await tasks.start(catalog.serve_models_dir)
                    await tasks.start(serve_activity, host)
                    catalog.serving = True
                    try:
                        yield host
                    finally:
                        catalog.serving = False
                        tasks.cancel_scope.cancel()
        finally:
            engines.cancel_scope.cancel()  # every engine stops (its sessions parked first)
        if isinstance(nvml, NvmlProbe):
            with trio.move_on_after(2, shield=True):
                await nvml.aclose()


async def serve_activity(
    host: Host, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Sample the queue into ``host.activity`` once a second until cancelled."""
    task_status.started()
    while True:
        await trio.sleep(1.0)
        if host.scheduler is not None:
            stats = host.scheduler.statistics()
            host.activity.sample(queued=stats.queued, running=sum(stats.running.values()))


def kv_dirs(config: Config) -> dict[str, Path]:
    """Each spawned text model's slot-save directory, where its parked files live: the
    user's ``--slot-save-path`` by its last occurrence (as llama-server reads it),
    else the host's default under the state dir. Blocking file I/O."""
    dirs: dict[str, Path] = {}
    for model in wanted_models(config):
        if model.external or model.kind == "image":  # an image engine keeps no KV
            continue
        user = last_arg_value(model.args, "--slot-save-path")
        dirs[model.id] = Path(user) if user else default_slot_save_dir(config.state_dir, model.id)
    return dirs


def open_kv_store(config: Config) -> KvStore:
    """Open the state dir's parked-KV store (blocking: from a thread)."""
    budget = config.scheduler.kv_store_bytes
    if budget is None:
        budget = default_budget(config.state_dir)
    return KvStore.open(config.state_dir / "kv.sqlite", budget_bytes=budget, dirs=kv_dirs(config))


def _unset_nursery() -> trio.Nursery:
    class _Unset:
        def start_soon(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("the host is not open")

    return _Unset()  # type: ignore[return-value]
