"""One model as the scheduler sees it: its engine, its GPU class and its slots.

:class:`ModelRuntime` implements the scheduler's ``EngineLane`` over a
supervised (or external) engine: making the model resident goes through the
GPU arbiter (in ``swap`` it evicts the other slot classes first), slots are
measured with ``GET /slots`` and erased with ``POST /slots/{id}?action=erase``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from .calibration import CalibrationState
from .config import ModelConfig
from .engine.gguf_meta import GGUFInfo
from .engine.planner import EnginePlan
from .engine.supervisor import Engine
from .errors import EngineFailed, FieldError
from .gpu.arbiter import GpuArbiter
from .metrics import Metrics
from .proxy import engine_request
from .scheduler.policy import SlotMeasurement
from .sessions import session_hash

log = logging.getLogger("gezel_trio.lane")


@dataclass
class ModelRuntime:
    """A configured model, its engine, and what the scheduler needs of both."""

    config: ModelConfig
    engine: Engine
    http: httpx.AsyncClient
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
    def generation(self) -> int:
        return self.engine.generation

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
        base = self.engine.base_url
        if base is None:
            return None
        try:
            resp = await engine_request(self.http, "GET", f"{base}/slots", timeout=2.0)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        try:
            rows = resp.json()
        except ValueError:
            return None
        if not isinstance(rows, list):
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
        base = self.engine.base_url
        if base is None:
            raise EngineFailed(f"engine for model {self.id!r} is not running")
        try:
            resp = await engine_request(
                self.http,
                "POST",
                f"{base}/slots/{slot_id}",
                params={"action": "erase"},
                timeout=5.0,
            )
        except httpx.HTTPError:
            if self.metrics is not None:
                self.metrics.erase(self.id, False)
            raise
        ok = resp.status_code == 200
        if self.metrics is not None:
            self.metrics.erase(self.id, ok)
        if not ok:
            raise EngineFailed(
                f"erase of slot {slot_id} answered {resp.status_code}: {resp.text[:200]}"
            )

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
        base = self.engine.base_url
        if base is None:
            raise EngineFailed(f"engine for model {self.id!r} is not running")
        self._sync_parking()
        name = self._park_file(session)
        resp = await engine_request(
            self.http,
            "POST",
            f"{base}/slots/{slot_id}",
            params={"action": "save"},
            json={"filename": name},
            timeout=30.0,
        )
        if resp.status_code != 200:
            raise EngineFailed(
                f"save of slot {slot_id} answered {resp.status_code}: {resp.text[:200]}"
            )
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
        base = self.engine.base_url
        if base is None or not self.is_parked(session):
            return False
        name = self._parked[session]
        resp = await engine_request(
            self.http,
            "POST",
            f"{base}/slots/{slot_id}",
            params={"action": "restore"},
            json={"filename": name},
            timeout=30.0,
        )
        if resp.status_code != 200:
            self._parked.pop(session, None)
            self._remove_park_file(name)
            raise EngineFailed(
                f"restore of slot {slot_id} answered {resp.status_code}: {resp.text[:200]}"
            )
        self._parked.move_to_end(session)
        self.parking_stats["restored"] += 1
        return True

    def statistics(self) -> dict[str, Any]:
        stats = self.engine.statistics()
        stats.update(
            {
                "name": self.display_name,
                "slot_class": self.config.gpu_class,
                "admission_ceiling": self.parallel,
                "ceiling_reason": self.ceiling_reason,
                "plan": self.plan,
                "calibration": self.calibration.as_dict(),
                "benchmark": self.last_benchmark,
                "kv_parking": {**self.parking_stats, "parked": len(self._parked)},
            }
        )
        return stats
