"""One model as the scheduler sees it: its engine, its GPU class and its slots.

:class:`ModelRuntime` implements the scheduler's ``EngineLane`` over a
supervised (or external) engine: making the model resident goes through the
GPU arbiter (in ``swap`` it evicts the other slot classes first), a running job
holds the engine (no idle or pressure release) and the GPU lease, and slots
are sampled, erased, saved and restored through the engine's
:class:`~gezel_trio.engine.client.EngineClient`.

A runtime is built with its engine and that engine's client. What the engine is
started from, its :class:`ModelSetup` (settings, file metadata, memory plan), exists
before the engine does: the engine's argv builder and reservation
(:mod:`.placement`) read and write it at every start, and the runtime shares it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Hashable
from contextlib import AbstractAsyncContextManager, AbstractContextManager, asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import trio

from ..config.schema import ModelConfig
from ..engine.argv import kv_shape_flags, last_arg_value
from ..engine.client import EngineClient
from ..engine.context import SlotRequest, extension_flags, slot_context, slot_flags, slot_request
from ..engine.gguf_meta import GGUFInfo
from ..engine.planner import AUTO_PARALLEL, DEFAULT_CTX_PER_SLOT, EnginePlan
from ..engine.supervisor import Engine, EngineState
from ..errors import EngineFailed, FieldError, GezelError
from ..gpu.arbiter import GpuArbiter
from ..gpu.ledger import Reservation
from ..gpu.placement import Placement
from ..kv.lead import Lead, LeadStart
from ..kv.prefix import Prefix
from ..kv.sessions import session_hash
from ..kv.store import KvCompat, KvEntry, KvModelStats, KvStore, file_identity
from ..scheduler.jobs import SlotMeasurement
from .calibration import CalibrationState
from .capabilities import engine_supports_tools, template_supports_tools
from .limits import OnceNotes
from .metrics import Metrics
from .snapshot import ModelStats

log = logging.getLogger("gezel_trio.host.runtime")

INEFFECTIVE_RESTORES_LIMIT = 3
"""Restores in a row that do not take before parking is turned off for a model."""
_NO_KV_STATS = KvModelStats()


@dataclass
class ModelSetup:
    """What a model's engine is started from, shared by the model's runtime and the
    engine's argv builder and reservation (built before the engine, so before the
    runtime): the model's settings, its file's metadata and its memory plan. Each
    start reads ``config`` anew (a reconfigure replaces it); the reservation writes
    the plans while the process runs. Plain state, no I/O."""

    config: ModelConfig
    gguf: GGUFInfo | None = None
    """The model file's metadata, read once when the model opens (None: external or
    unreadable)."""
    plan: dict[str, Any] | None = None
    """The last memory plan, and its reasons, for status."""
    active_plan: EnginePlan | None = None
    """The plan of the engine process running now (inside its reservation)."""
    placement: Placement[EnginePlan] | None = None
    """Its GPUs, on a machine with several (None: one GPU, or the CPU)."""
    extra_args: tuple[str, ...] = ()
    """``engine.extra_args``: the flags every engine gets, before the model's own."""
    planned: EnginePlan | None = None
    """The last plan made for this ``config`` (None: none yet, or the config changed)."""
    reservation: Reservation | None = None
    """An image engine's ledger reservation while its process runs (None: none runs),
    so its estimate can be replaced by what the process measures."""

    def replace_config(self, config: ModelConfig, gguf: GGUFInfo | None) -> None:
        """New settings (a reconfigure): the plan made for the old ones is forgotten."""
        self.config = config
        self.gguf = gguf
        self.planned = None

    def slot_request(self) -> SlotRequest:
        """What the memory planner is asked for: the settings, or what the engine flags
        (``extra_args``, then ``args``) set (:func:`~gezel_trio.engine.context.slot_request`)."""
        return slot_request(
            ctx_per_slot=self.config.ctx_per_slot,
            parallel=self.config.parallel,
            flags=[*self.extra_args, *self.config.args],
            n_ctx_train=(self.gguf.context_length if self.gguf else None) or None,
            default_parallel=AUTO_PARALLEL,
        )

    def planned_slots(self) -> tuple[int, int, tuple[str, ...]]:
        """Slots, context per slot and the flags that extend the context: the plan's
        (the running engine's, else the last one), else the plan's defaults before any
        memory check (:mod:`gezel_trio.engine.planner`)."""
        plan = self.active_plan or self.planned
        if plan is not None:
            return plan.parallel, plan.ctx_per_slot, plan.context_flags
        trained = self.gguf.context_length if self.gguf else None
        parallel = self.config.parallel or AUTO_PARALLEL
        ctx = self.config.ctx_per_slot or trained or DEFAULT_CTX_PER_SLOT
        arch = self.gguf.architecture if self.gguf else ""
        return parallel, ctx, tuple(extension_flags(arch, trained, ctx))

    def slot_flags(self) -> list[str]:
        """The flags that decide the engine's slots, in the order the engine gets them:
        :meth:`planned_slots`'s, then ``engine.extra_args``, then the model's ``args``
        (the last occurrence of a flag wins)."""
        parallel, ctx, extended = self.planned_slots()
        return slot_flags(
            parallel=parallel,
            ctx_per_slot=ctx,
            extended=extended,
            extra_args=self.extra_args,
            model_args=self.config.args,
        )

    def expected_parallel(self) -> int:
        """The slots the engine will run (:meth:`slot_flags`; an external engine: its
        configured ``parallel``, else :data:`AUTO_PARALLEL`)."""
        if self.config.external:
            return self.config.parallel or AUTO_PARALLEL
        value = last_arg_value(self.slot_flags(), "--parallel")
        return int(value) if value and value.isdigit() else AUTO_PARALLEL

    def expected_ctx_per_slot(self) -> int | None:
        """The context each slot will get (:func:`~gezel_trio.engine.context.slot_context`
        of :meth:`slot_flags`, as the engine reads them; an external engine: its
        configured ``ctx_per_slot``). None: not known."""
        if self.config.external:
            return self.config.ctx_per_slot
        trained = self.gguf.context_length if self.gguf else None
        return slot_context(self.slot_flags(), n_ctx_train=trained or None)

    @property
    def gpu_indices(self) -> tuple[int, ...] | None:
        """The NVML indices of the GPUs this model's engine runs on, on a machine with
        several (None: any GPU, as on a machine with one)."""
        if self.placement is None:
            return None
        return tuple(
            int(d.partition(":")[2]) for d in self.placement.devices if d.startswith("gpu:")
        )


@dataclass
class ModelRuntime:
    """A configured model, its engine, and what the scheduler needs of both.

    Built with its engine and that engine's client, inside the engine's block (see
    :meth:`~gezel_trio.host.catalog.Catalog.open_model`); ``setup`` is what the engine
    is started from, shared with its argv builder and reservation."""

    setup: ModelSetup
    engine: Engine
    client: EngineClient
    arbiter: GpuArbiter | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    ceiling: int | None = None
    """Admission ceiling set by calibration (1 for an engine that cannot co-batch)."""
    ceiling_reason: str | None = None
    calibration: CalibrationState = field(default_factory=CalibrationState)
    kv: KvStore | None = None
    """The host's parked-KV store (None: parking off)."""
    build: str = "unknown-build"
    """The engine build's fingerprint (part of a parked file's compatibility)."""
    _ineffective_streak: int = 0
    _compat: tuple[tuple[int, tuple[str, ...]], KvCompat] | None = None
    retired: trio.Event = field(default_factory=trio.Event)
    """Set when the model is taken out of service: its engine's task then ends."""
    metrics: Metrics | None = None
    last_benchmark: dict[str, Any] | None = None
    _crashes_seen: int = 0
    notes: OnceNotes = field(default_factory=OnceNotes)
    """The warnings given once per model (:meth:`warn_once`)."""
    _tools: tuple[int, bool] | None = None
    """Whether the engine's chat template renders tools, as the engine said, and the
    engine process (generation) that said it."""
    _asking_tools: bool = False
    leads_off: str | None = None
    """Why this model starts no slot from a caller's lead (see :meth:`verify_lead`);
    None while it does."""

    # ------------------------------------------------------------------ setup

    @property
    def config(self) -> ModelConfig:
        """The model's settings now (a reconfigure replaces them; see :class:`ModelSetup`)."""
        return self.setup.config

    @config.setter
    def config(self, value: ModelConfig) -> None:
        self.setup.replace_config(value, self.setup.gguf)

    @property
    def gguf(self) -> GGUFInfo | None:
        """The model file's metadata, read once when the model opens (None: external or
        unreadable)."""
        return self.setup.gguf

    @gguf.setter
    def gguf(self, value: GGUFInfo | None) -> None:
        self.setup.gguf = value

    @property
    def plan(self) -> dict[str, Any] | None:
        """The last memory plan, and its reasons, for status."""
        return self.setup.plan

    @property
    def active_plan(self) -> EnginePlan | None:
        """The plan of the engine process running now (inside its reservation)."""
        return self.setup.active_plan

    @property
    def placement(self) -> Placement[EnginePlan] | None:
        """Its GPUs, on a machine with several (None: one GPU, or the CPU)."""
        return self.setup.placement

    # ------------------------------------------------------------------ identity

    @property
    def id(self) -> str:
        return self.config.id

    @property
    def model_id(self) -> str:
        return self.config.id

    @property
    def display_name(self) -> str:
        return self.config.display_name

    @property
    def vocab_size(self) -> int | None:
        return self.gguf.vocab_size if self.gguf else None

    def check_token_ids(self, tokens: object, field: str) -> None:
        """400 naming ``field`` when a token id is outside the model's vocabulary.

        llama-server answers 500 (or worse) for an out-of-vocabulary id.
        """
        vocab = self.vocab_size
        if vocab is None or not isinstance(tokens, list) or not tokens:
            return
        try:
            if min(tokens) >= 0 and max(tokens) < vocab:
                return  # a list of numbers in range, checked in C (the common case)
        except TypeError:
            pass  # not a list of numbers: each item below
        for t in tokens:
            if isinstance(t, list):
                self.check_token_ids(t, field)
            elif isinstance(t, int) and not 0 <= t < vocab:
                raise FieldError(
                    field, f"token id {t} is outside the model's vocabulary (0..{vocab - 1})"
                )

    def warn_once(self, key: Hashable, message: str, **fields: object) -> bool:
        """Log ``message`` as a warning the first time ``key`` is noted for this model
        (never again); whether it was logged now."""
        if not self.notes.first(key):
            return False
        log.warning(message, extra={"fields": {"model": self.id, **fields}})
        return True

    # ------------------------------------------------------------------ capabilities

    @property
    def engine_tools(self) -> bool | None:
        """Whether the engine's chat template renders tools, as the engine said (its
        process now, or the last one that answered); None: not asked yet."""
        return None if self._tools is None else self._tools[1]

    def tools_asked_now(self) -> bool:
        """Whether the running engine process has been asked (:meth:`ask_engine_tools`)."""
        return self._tools is not None and self._tools[0] == self.engine.generation

    @property
    def supports_tools(self) -> bool:
        """Whether the model takes ``tools``: the engine's word when it has been asked,
        else a guess from the chat template's text (see :mod:`.capabilities`); never for
        a model that serves embeddings or reranking only."""
        if self.config.embeddings or self.config.reranking:
            return False
        said = self.engine_tools
        if said is not None:
            return said
        return template_supports_tools(self.gguf.chat_template if self.gguf else None)

    async def ask_engine_tools(self) -> bool | None:
        """Ask the engine (``GET /props``, ``chat_template_caps``) whether its chat template
        renders tools, once per engine process, when it is ready; the answer (None: it is
        not ready, failed, or does not say). Never raises; cancellation abandons the call."""
        if self.tools_asked_now():
            return self.engine_tools
        if not self.ready or self._asking_tools:
            return None
        generation = self.engine.generation
        self._asking_tools = True
        try:
            props = await self.client.props()
        except GezelError as exc:
            log.info("the engine's /props did not answer: %s", exc.message)
            return None
        finally:
            self._asking_tools = False
        said = engine_supports_tools(props)
        if said is not None and generation == self.engine.generation:
            self._tools = (generation, said)
        return said

    # ------------------------------------------------------------------ EngineLane

    @property
    def parallel(self) -> int:
        slots = self.slot_count
        if self.ceiling is not None:
            return max(1, min(slots, self.ceiling))
        return slots

    @property
    def slot_count(self) -> int:
        """The engine's slots: what it runs (READY), else what it will run. Of an
        external engine, a configured ``parallel`` is how many of its slots the host
        uses."""
        if self.config.external and self.config.parallel:
            return self.config.parallel
        return self.engine.parallel or self.setup.expected_parallel()

    @property
    def ctx_per_slot(self) -> int | None:
        """The context of one slot, the one value every report and limit reads: what the
        engine runs (its ``/slots`` ``n_ctx``, read when it turned READY), else what it
        will be started with (:meth:`ModelSetup.expected_ctx_per_slot`). None: not
        known (an external engine not reached yet, configured without it)."""
        return self.engine.n_ctx or self.setup.expected_ctx_per_slot()

    @property
    def generation(self) -> int:
        return self.engine.generation

    @property
    def calibrates(self) -> bool:
        """Whether the host probes this engine's co-batching (a calibration watcher): a
        llama-server it runs itself."""
        return not self.config.external

    @property
    def sole_client(self) -> bool:
        return not self.config.external

    @property
    def family(self) -> str | None:
        return self.config.replica_of

    @property
    def cuts_back(self) -> bool:
        """Whether the engine, given a slot that holds another prompt, keeps exactly the
        prefix the two share and nothing past it: an attention model, whose KV cells
        past a position can be dropped, run without ``--cache-reuse`` (which would
        also reuse shifted chunks past the shared prefix). A recurrent or hybrid model
        cannot roll its state back to a prefix; an engine the host does not run (its
        flags are not the host's to know) or an unknown architecture counts as one
        that cannot."""
        if self.config.external:
            return False
        info = self.gguf
        if info is not None:
            recurrent = info.recurrent
        else:
            arch = self.calibration.arch
            if arch is None:
                return False
            recurrent = arch.recurrent
        reuse = last_arg_value(self.engine.argv or self.config.args, "--cache-reuse")
        return not recurrent and reuse in (None, "0")

    @property
    def ready(self) -> bool:
        return self.engine.state.value is EngineState.READY and self.engine.base_url is not None

    @property
    def gpu_indices(self) -> tuple[int, ...] | None:
        """The NVML indices of the GPUs this model's engine runs on, on a machine with
        several (None: any GPU, as on a machine with one)."""
        return self.setup.gpu_indices

    def hold(self) -> AbstractContextManager[None]:
        return self.engine.in_use()

    def lease(self) -> AbstractAsyncContextManager[object]:
        return self._lease()

    @asynccontextmanager
    async def _lease(self) -> AsyncIterator[object]:
        if self.arbiter is None:
            yield None
            return
        t0 = time.perf_counter()
        async with self.arbiter.lease(self.config.gpu_class, self.gpu_indices) as lease:
            if self.metrics is not None:
                self.metrics.lease_wait(time.perf_counter() - t0)
            yield lease

    def resident_now(self) -> bool:
        """Ready, with no restart left to count (:meth:`ensure_resident` counts it)."""
        return self.ready and self.engine.crashes == self._crashes_seen

    async def ensure_resident(self) -> None:
        """Make this model's engine resident and ready (evicting others in swap mode).

        Raises EngineFailed / NoCapacity / EngineNotFound with the cause.
        Cancelling abandons the wait; an engine start under way goes on.
        """
        if self.arbiter is not None:
            await self.arbiter.acquire(self.config.gpu_class, self.gpu_indices)
        await self.engine.ensure_ready()
        if self.engine.crashes > self._crashes_seen:
            # READY again after a crash, failed start or dead health check: a restart
            self._crashes_seen = self.engine.crashes
            if self.metrics is not None and self.engine.starts > 1:
                self.metrics.engine_restart(self.id)

    async def wait_failed(self) -> None:
        """Return once the engine is FAILED (at once if it is now)."""
        await self.engine.state.wait_value(EngineState.FAILED)

    def set_idle_ttl(self, seconds: float | None) -> None:
        """Release this model's engine once it has stayed idle ``seconds`` (0: keep it
        until evicted or stopped), counted from now or from the end of the request
        that holds it, in place of its configured ``idle_ttl``; None restores the
        configured one. Ollama's ``keep_alive`` sets it per request. The engine looks
        at it at its next health check at the latest."""
        ttl = self.config.idle_ttl if seconds is None else max(0.0, seconds)
        self.engine.timing = replace(self.engine.timing, idle_ttl=ttl)
        with self.hold():
            pass  # the idle clock starts again now

    async def measure_slots(self) -> SlotMeasurement | None:
        """``GET /slots`` as a sample (``None`` when unknown). May raise project errors."""
        if self.engine.base_url is None:
            return None
        rows = await self.client.slots()
        if rows is None:
            return None
        ids: list[int] = []
        for row in rows:
            if not isinstance(row, dict) or not isinstance(row.get("id"), int):
                return SlotMeasurement(
                    idle=sum(1 for r in rows if isinstance(r, dict) and not r.get("is_processing"))
                )
            if not row.get("is_processing"):
                ids.append(row["id"])
        return SlotMeasurement(idle=len(ids), ids=tuple(ids))

    async def erase_slot(self, slot_id: int) -> None:
        """``POST /slots/{id}?action=erase``; returns once the engine acknowledged it."""
        try:
            await self.client.slot_action(slot_id, "erase", answer_within=5.0)
        except GezelError:
            if self.metrics is not None:
                self.metrics.erase(self.id, False)
            raise
        if self.metrics is not None:
            self.metrics.erase(self.id, True)

    # ------------------------------------------------------------------ KV parking

    @property
    def parking_enabled(self) -> bool:
        """Whether this model parks KV: a store is open and its restores have not proven
        ineffective. An external engine parks on its own disk (its ``--slot-save-path``),
        through the same save and restore API; the host keeps the index."""
        return self.kv is not None and self.kv_stats.disabled is None

    @property
    def kv_stats(self) -> KvModelStats:
        if self.kv is None:
            return _NO_KV_STATS
        return self.kv.model_stats(self.id)

    def kv_compat(self) -> KvCompat:
        """What a parked file of this model must match to load into the engine now. Read
        once per engine process (a stat of the model file and a parse of its argv): the
        request path asks for it on every keyed handoff."""
        key = (self.engine.generation, self.engine.argv)
        cached = self._compat
        if cached is None or cached[0] != key:
            if self.config.external:  # its files load only into that same engine
                compat = KvCompat(model_file=f"external:{self.config.url}", build="external")
            else:
                compat = KvCompat(
                    model_file=file_identity(self.config.path or ""),
                    build=self.build,
                    kv_flags=kv_shape_flags(self.engine.argv),
                )
            self._compat = cached = (key, compat)
        return cached[1]

    def _parked_entry(self, session: str, prefix: Prefix | None = None) -> KvEntry | None:
        if self.kv is None:
            return None
        return self.kv.find(
            self.id, session, self.kv_compat(), ctx_per_slot=self.ctx_per_slot, prefix=prefix
        )

    def is_parked(self, session: str | None, prefix: Prefix | None = None) -> bool:
        """Whether ``session`` has a parked copy that the engine running now can load, for
        a request of ``prefix`` blocks (see :meth:`KvStore.find`; None: any copy)."""
        return self.parked_blocks(session, prefix) is not None

    def parked_blocks(self, session: str | None, prefix: Prefix | None = None) -> Prefix | None:
        """The blocks of the copy :meth:`unpark_slot` would restore for a request of
        ``prefix`` (None: there is none)."""
        if session is None or not self.parking_enabled:
            return None
        entry = self._parked_entry(session, prefix)
        return None if entry is None else entry.blocks

    def lent_copy(self, caller: str, session: str, prefix: Prefix) -> tuple[str, Prefix] | None:
        """The parked copy of another owner of ``caller`` (not ``session``) that a request
        of ``session`` with blocks ``prefix`` may start from (see
        :meth:`KvStore.find_lent`): its owner and its blocks; None: none."""
        if self.kv is None or not self.parking_enabled or not prefix:
            return None
        entry = self.kv.find_lent(
            self.id,
            caller,
            self.kv_compat(),
            ctx_per_slot=self.ctx_per_slot,
            prefix=prefix,
            besides=session,
        )
        return None if entry is None else (entry.session, entry.blocks)

    def is_current(self, session: str, blocks: Prefix) -> bool:
        """Whether a parked copy of ``session`` holds exactly ``blocks`` (a slot with that
        content needs no save)."""
        return self.kv is not None and self.kv.current(self.id, session, blocks)

    def note_miss(self) -> None:
        """A keyed job found its session neither in its slot nor parked (a cold prefill)."""
        if self.kv is not None:
            self.kv_stats.misses += 1

    async def park_slot(
        self,
        slot_id: int,
        session: str,
        blocks: Prefix = (),
        *,
        within: float = math.inf,
        share_caller: str | None = None,
    ) -> int:
        """Save ``session``'s KV from ``slot_id`` into the store as a copy of ``blocks``
        (a new file; the session's copies it continues are deleted once the index points
        at this one, see :meth:`KvStore.put`): the tokens saved, 0 when the slot held
        none (nothing is kept). ``share_caller``: the caller whose other owners may
        start from the copy (:attr:`KvEntry.share_caller`; None: nobody).

        Raises on failure (the caller then erases instead): the engine's error, or
        EngineFailed when the save took longer than ``within`` seconds; a failure is counted
        (``save_failures``) and logged with its reason. Cancellation (the request's
        client left, a shutdown) is no failure: it is counted in ``save_cancelled`` and
        logged at debug level; it leaves the index as it was, and the file the engine
        writes for it, meanwhile or once it runs the save, is deleted (then at the end of
        a later save: :meth:`KvStore.sweep_late`).
        """
        kv = self.kv
        if kv is None:
            raise EngineFailed(f"KV parking is off for {self.id!r}")
        stats = self.kv_stats
        name = kv.new_file_name(session)
        try:
            with trio.move_on_after(within):
                return await self._save(kv, slot_id, session, blocks, name, share_caller)
            raise EngineFailed(f"the engine did not save slot {slot_id} within {within:g}s")
        except trio.Cancelled:
            stats.save_cancelled += 1
            log.debug("KV save of %s slot %d cancelled: not a failure", self.id, slot_id)
            raise
        except Exception as exc:
            stats.save_failures += 1
            log.warning(
                "KV save of %s slot %d failed: %s",
                self.id,
                slot_id,
                _reason(exc),
                extra={"fields": {"session": session_hash(session)}},
            )
            raise
        finally:
            if not kv.has_file(self.id, name):
                kv.discard_file(self.id, name)
            kv.sweep_late(self.id)

    async def _save(
        self,
        kv: KvStore,
        slot_id: int,
        session: str,
        blocks: Prefix,
        name: str,
        share_caller: str | None,
    ) -> int:
        """The I/O of :meth:`park_slot`: the engine's save, then the index's entry."""
        stats = self.kv_stats
        t0 = time.perf_counter()
        body = await self.client.slot_action(slot_id, "save", filename=name)
        tokens, size = body.get("n_saved"), body.get("n_written")
        if not isinstance(tokens, int) or not isinstance(size, int):
            raise EngineFailed(f"save of slot {slot_id} answered without n_saved/n_written")
        if tokens <= 0:
            return 0  # nothing to keep: the slot is empty
        now = time.time()
        await kv.put(
            KvEntry(
                model=self.id,
                session=session,
                caller=kv.caller_of(session),
                file=name,
                compat=self.kv_compat(),
                tokens=tokens,
                bytes=size,
                saved_at=now,
                used_at=now,
                blocks=tuple(blocks),
                share_caller=share_caller,
            )
        )
        stats.saves += 1
        stats.saved_tokens += tokens
        stats.save_ms += (time.perf_counter() - t0) * 1000
        if self.metrics is not None:
            self.metrics.kv_park(self.id, "save", time.perf_counter() - t0)
        return tokens

    async def unpark_slot(
        self,
        slot_id: int,
        session: str,
        prefix: Prefix | None = None,
        *,
        within: float = math.inf,
        lent_to: str | None = None,
    ) -> int:
        """Restore ``session``'s parked copy for a request of ``prefix`` blocks (the one
        :meth:`parked_blocks` names) into ``slot_id``; the tokens restored, 0 when
        nothing was (none parked, or the restore did not take: counted, and dropped).
        ``lent_to`` (a caller): instead, the copy of another owner of that caller that
        :meth:`lent_copy` names for a request of ``session``; the copy stays its
        owner's (a restore copies the file into the slot).

        A restore replaces the slot's whole content, so it also isolates the slot
        from its previous owner. Raises on an engine error (the entry is dropped, the
        restore counted as not taking) and EngineFailed when the engine did not answer
        within ``within`` seconds (``restore_failures``; the entry stays); both are logged with
        their reason. Cancellation (the client left, a shutdown) is no failure: counted
        in ``restore_cancelled``, logged at debug level; it leaves the entry, and the
        slot is then unknown to the caller.
        """
        kv = self.kv
        if kv is None or self.engine.base_url is None or not self.parking_enabled:
            return 0
        if lent_to is None:
            entry = self._parked_entry(session, prefix)
        elif prefix:
            entry = kv.find_lent(
                self.id,
                lent_to,
                self.kv_compat(),
                ctx_per_slot=self.ctx_per_slot,
                prefix=prefix,
                besides=session,
            )
        else:
            entry = None
        if entry is None:
            return 0
        stats = self.kv_stats
        t0 = time.perf_counter()
        try:
            with trio.move_on_after(within) as deadline:
                body = await self.client.slot_action(slot_id, "restore", filename=entry.file)
        except trio.Cancelled:
            stats.restore_cancelled += 1
            log.debug("KV restore of %s slot %d cancelled: not a failure", self.id, slot_id)
            raise
        except EngineFailed as exc:
            log.warning("KV restore of %s slot %d failed: %s", self.id, slot_id, _reason(exc))
            stats.ineffective += 1
            await kv.drop([entry])
            raise
        except Exception as exc:  # the engine went away meanwhile
            log.warning("KV restore of %s slot %d failed: %s", self.id, slot_id, _reason(exc))
            raise
        if deadline.cancelled_caught:
            stats.restore_failures += 1
            why = f"the engine did not restore slot {slot_id} within {within:g}s"
            log.warning("KV restore of %s slot %d failed: %s", self.id, slot_id, why)
            raise EngineFailed(why)
        restored = body.get("n_restored")
        if not isinstance(restored, int) or restored != entry.tokens:
            # A restore that did not bring back what was parked is not a hit.
            self._restore_did_not_take(entry, restored if isinstance(restored, int) else 0, None)
            await kv.drop([entry])
            return 0
        stats.restores += 1
        stats.restored_tokens += restored
        stats.restore_ms += (time.perf_counter() - t0) * 1000
        if self.metrics is not None:
            self.metrics.kv_park(self.id, "restore", time.perf_counter() - t0)
        kv.touch(self.id, entry.session, entry.file)
        return restored

    def verify_restore(self, restored: int, prompt: int | None, cached: int | None) -> None:
        """The first completion after a restore of ``restored`` tokens reported
        ``cached`` tokens reused: a hit when it reused at least half of what it could,
        ``diverged`` when its prompt is shorter than what was restored (a new chat under
        the same name), else the restore did not take."""
        if cached is None or self.kv is None:
            return
        stats = self.kv_stats
        if prompt is not None and prompt < restored and cached * 2 < prompt:
            # A prompt shorter than the restored history is no continuation of it: the
            # chat started over under the same name. Not a sign the restore did not take.
            stats.diverged += 1
            return
        reusable = restored if prompt is None else min(restored, max(prompt - 1, 0))
        if reusable <= 0:
            return
        if cached * 2 >= reusable:
            stats.hits += 1
            self._ineffective_streak = 0
            return
        self._restore_did_not_take(None, restored, cached)

    # ------------------------------------------------------------------ leads

    @property
    def leads_enabled(self) -> bool:
        """Whether a slot may be started from a caller's lead (see
        :mod:`gezel_trio.kv.lead`): parking works, and no lead proved not to be a
        prefix of its request."""
        return self.parking_enabled and self.leads_off is None

    async def start_lead(self, slot_id: int, lead: Lead, *, within: float = math.inf) -> LeadStart:
        """Make ``slot_id`` hold exactly ``lead`` (a caller's, :meth:`Lead.for_caller`):
        restore its snapshot when one is parked; else prefill the lead alone (sent with
        ``cache_prompt`` off: the engine empties the slot first) and save the slot as
        the snapshot, under the parking budget like any parked copy. The restore and
        the save each within ``within`` seconds; the prefill, which is the request's
        own work done one call early, as long as a request may take (the engine's
        read timeout). 0 tokens: it failed (logged); the slot is then unknown. A
        failed save leaves the lead in the slot (the tokens are returned, not saved).
        Cancellation (the client left) leaves the slot unknown."""
        kv, owner = self.kv, lead.owner
        if kv is None or not owner:
            return LeadStart(0, 0)
        try:
            restored = await self.unpark_slot(slot_id, owner, within=within)
        except Exception:
            return LeadStart(0, 1)  # unpark_slot logged it
        if restored:
            return LeadStart(restored, 1, restored=True)
        body = {**lead.body, "id_slot": slot_id, "cache_prompt": False}
        tokens = 0
        try:
            answer = await self.client.forward("POST", lead.path, body=body, slot=slot_id)
            tokens = _prompt_tokens(answer.json()) if answer.head.status == 200 else 0
            failure = f"the engine answered {answer.head.status}: {answer.content[:200]!r}"
        except Exception as exc:
            failure = _reason(exc)
        if tokens <= 0:
            log.warning("lead prefill on %s slot %d failed: %s", self.id, slot_id, failure)
            return LeadStart(0, 1)
        if lead.caller is not None:
            kv.note_caller(owner, lead.caller)
        try:
            saved = await self.park_slot(slot_id, owner, lead.blocks, within=within)
        except Exception:
            saved = 0  # park_slot logged it; the lead is in the slot all the same
        return LeadStart(tokens, 2, saved=saved > 0)

    def verify_lead(self, lead_tokens: int, cached: int | None) -> None:
        """The first completion on a slot started from a lead of ``lead_tokens`` tokens
        reused ``cached`` of them: fewer means the model's chat template renders the
        lead otherwise when the conversation goes on (the engine then cleared the slot),
        and this model starts no slot from a lead from now on (logged once)."""
        if cached is None or cached >= lead_tokens or self.leads_off is not None:
            return
        self.leads_off = (
            f"a lead of {lead_tokens} tokens was not a prefix of its request (the engine "
            f"reused {cached}): new sessions start cold"
        )
        log.warning("leads are off for %s: %s", self.id, self.leads_off)

    def _restore_did_not_take(
        self, entry: KvEntry | None, restored: int, cached: int | None
    ) -> None:
        stats = self.kv_stats
        stats.ineffective += 1
        self._ineffective_streak += 1
        what = (
            f"{restored} of {entry.tokens} parked tokens restored"
            if entry is not None
            else f"{restored} tokens restored, {cached} reused by the next completion"
        )
        log.warning("KV restore on %s did not take: %s", self.id, what)
        if self._ineffective_streak >= INEFFECTIVE_RESTORES_LIMIT and stats.disabled is None:
            stats.disabled = (
                f"{self._ineffective_streak} restores in a row did not take (last: {what}): "
                "sessions are erased on handoff instead of parked"
            )
            log.warning("KV parking is off for %s: %s", self.id, stats.disabled)

    def statistics(self) -> ModelStats:
        return ModelStats(
            engine=self.engine.statistics(),
            name=self.display_name,
            slot_class=self.config.gpu_class,
            admission_ceiling=self.parallel,
            ctx_per_slot=self.ctx_per_slot,
            ceiling_reason=self.ceiling_reason,
            plan=self.plan,
            calibration=self.calibration.as_dict(),
            benchmark=self.last_benchmark,
            kv_parking=self.kv.statistics(self.id) if self.kv is not None else None,
            upstream_calls=dict(self.client.calls),
            replica_of=self.config.replica_of,
        )


def _reason(exc: BaseException) -> str:
    """Why a KV save or restore failed, for its log line."""
    return str(exc) or type(exc).__name__


def _prompt_tokens(answer: object) -> int:
    """The prompt tokens an engine's chat or Responses answer reports (0: none)."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(usage, dict):
        return 0
    for key in ("prompt_tokens", "input_tokens"):
        value = usage.get(key)
        if isinstance(value, int):
            return value
    return 0
