"""One model as the scheduler sees it: its engine, its GPU class and its slots.

:class:`ModelRuntime` implements the scheduler's ``EngineLane`` over a
supervised (or external) engine: making the model resident goes through the
GPU arbiter (in ``swap`` it evicts the other slot classes first), a running job
holds the engine (no idle or pressure release) and the GPU lease, and slots
are sampled, erased, saved and restored through the engine's
:class:`~gezel_trio.engine.client.EngineClient`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import ModelConfig
from ..engine.client import EngineClient
from ..engine.gguf_meta import GGUFInfo
from ..engine.planner import EnginePlan
from ..engine.supervisor import Engine, EngineState, EngineStats
from ..errors import EngineFailed, FieldError, GezelError
from ..gpu.arbiter import GpuArbiter
from ..scheduler.policy import SlotMeasurement
from ..sessions import session_hash
from .calibration import CalibrationState
from .metrics import Metrics

log = logging.getLogger("gezel_trio.host.runtime")


@dataclass
class ModelRuntime:
    """A configured model, its engine, and what the scheduler needs of both."""

    config: ModelConfig
    engine: Engine
    client: EngineClient
    arbiter: GpuArbiter | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    ceiling: int | None = None
    """Admission ceiling set by calibration (1 for an engine that cannot co-batch)."""
    ceiling_reason: str | None = None
    plan: dict[str, Any] | None = None
    """The last memory plan, and its reasons, for status."""
    active_plan: EnginePlan | None = None
    """The plan of the engine process running now (inside its reservation)."""
    calibration: CalibrationState = field(default_factory=CalibrationState)
    max_parked: int = 64
    """Sessions whose KV may be parked on disk per engine (LRU beyond it)."""
    parking_stats: dict[str, int] = field(default_factory=lambda: {"saved": 0, "restored": 0})
    _parked: collections.OrderedDict[str, str] = field(default_factory=collections.OrderedDict)
    _parked_generation: int = -1
    metrics: Metrics | None = None
    gguf: GGUFInfo | None = None
    last_benchmark: dict[str, Any] | None = None
    """The model file's metadata, read once when the host opens (None: external or unreadable)."""
    _crashes_seen: int = 0

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
        if vocab is None or not isinstance(tokens, list):
            return
        for t in tokens:
            if isinstance(t, list):
                self.check_token_ids(t, field)
            elif isinstance(t, int) and not 0 <= t < vocab:
                raise FieldError(
                    field, f"token id {t} is outside the model's vocabulary (0..{vocab - 1})"
                )

    # ------------------------------------------------------------------ EngineLane

    @property
    def parallel(self) -> int:
        slots = self.engine.parallel or self.config.parallel
        if self.ceiling is not None:
            return max(1, min(slots, self.ceiling))
        return slots

    @property
    def slot_count(self) -> int:
        return self.engine.parallel or self.config.parallel

    @property
    def generation(self) -> int:
        return self.engine.generation

    @property
    def sole_client(self) -> bool:
        return not self.config.external

    @property
    def ready(self) -> bool:
        return self.engine.state.value is EngineState.READY and self.engine.base_url is not None

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
        async with self.arbiter.lease(self.config.gpu_class) as lease:
            if self.metrics is not None:
                self.metrics.lease_wait(time.perf_counter() - t0)
            yield lease

    async def ensure_resident(self) -> None:
        """Make this model's engine resident and ready (evicting others in swap mode).

        Raises EngineFailed / NoCapacity / EngineNotFound with the cause.
        Cancelling abandons the wait; an engine start under way goes on.
        """
        if self.arbiter is not None:
            await self.arbiter.acquire(self.config.gpu_class)
        await self.engine.ensure_ready()
        if self.engine.crashes > self._crashes_seen:
            # READY again after a crash, failed start or dead health check: a restart
            self._crashes_seen = self.engine.crashes
            if self.metrics is not None and self.engine.starts > 1:
                self.metrics.engine_restart(self.id)

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

    def _park_file(self, session: str) -> str:
        return f"park-{session_hash(session)}.bin"

    def _sync_parking(self) -> None:
        if self._parked_generation != self.engine.generation:
            # a new engine process: its slot-save dir may hold another build's files
            self._parked.clear()
            self._parked_generation = self.engine.generation

    async def park_slot(self, slot_id: int, session: str) -> None:
        """Save ``session``'s KV from ``slot_id`` to the engine's slot-save dir.

        Raises on failure (the caller then erases instead). The oldest parked
        session beyond ``max_parked`` is dropped, and its file deleted.
        """
        self._sync_parking()
        name = self._park_file(session)
        await self.client.slot_action(slot_id, "save", filename=name)
        self._parked[session] = name
        self._parked.move_to_end(session)
        self.parking_stats["saved"] += 1
        while len(self._parked) > self.max_parked:
            _, old = self._parked.popitem(last=False)
            self._remove_park_file(old)

    def _remove_park_file(self, name: str) -> None:
        argv = self.engine.argv
        try:
            i = argv.index("--slot-save-path")
        except ValueError:
            return
        with contextlib.suppress(OSError):
            (Path(argv[i + 1]) / name).unlink()

    def is_parked(self, session: str | None) -> bool:
        self._sync_parking()
        return session is not None and session in self._parked

    async def unpark_slot(self, slot_id: int, session: str) -> bool:
        """Restore ``session``'s parked KV into ``slot_id``; False when none is parked.

        A restore replaces the slot's whole content, so it also isolates the
        slot from its previous owner. Raises on an engine error.
        """
        if self.engine.base_url is None or not self.is_parked(session):
            return False
        name = self._parked[session]
        try:
            await self.client.slot_action(slot_id, "restore", filename=name)
        except EngineFailed:
            self._parked.pop(session, None)
            self._remove_park_file(name)
            raise
        self._parked.move_to_end(session)
        self.parking_stats["restored"] += 1
        return True

    def statistics(self) -> ModelStats:
        return ModelStats(
            engine=self.engine.statistics(),
            name=self.display_name,
            slot_class=self.config.gpu_class,
            admission_ceiling=self.parallel,
            ceiling_reason=self.ceiling_reason,
            plan=self.plan,
            calibration=self.calibration.as_dict(),
            benchmark=self.last_benchmark,
            kv_parking={**self.parking_stats, "parked": len(self._parked)},
            upstream_calls=dict(self.client.calls),
        )


@dataclass(frozen=True, slots=True)
class ModelStats:
    """A snapshot of one model for ``/api/status`` and ``/metrics``: its engine's,
    and what the host adds (plan, calibration, parking, upstream calls)."""

    engine: EngineStats
    name: str
    slot_class: str
    admission_ceiling: int
    ceiling_reason: str | None
    plan: dict[str, Any] | None
    calibration: dict[str, Any]
    benchmark: dict[str, Any] | None
    kv_parking: dict[str, int]
    upstream_calls: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        """The engine's fields and the host's, flat (the status page and the
        metrics collector read them so)."""
        return {
            **self.engine.as_dict(),
            "name": self.name,
            "slot_class": self.slot_class,
            "admission_ceiling": self.admission_ceiling,
            "ceiling_reason": self.ceiling_reason,
            "plan": self.plan,
            "calibration": self.calibration,
            "benchmark": self.benchmark,
            "kv_parking": dict(self.kv_parking),
            "upstream_calls": dict(self.upstream_calls),
        }
