"""One model as the scheduler sees it: its engine, its GPU class and its slots.

:class:`ModelRuntime` implements the scheduler's ``EngineLane`` over a
supervised (or external) engine: making the model resident goes through the
GPU arbiter (in ``swap`` it evicts the other slot classes first), slots are
measured with ``GET /slots`` and erased with ``POST /slots/{id}?action=erase``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from .calibration import CalibrationState
from .config import ModelConfig
from .engine.planner import EnginePlan
from .engine.supervisor import Engine
from .errors import EngineFailed
from .gpu.arbiter import GpuArbiter
from .scheduler.policy import SlotMeasurement

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

    async def measure_slots(self) -> SlotMeasurement | None:
        base = self.engine.base_url
        if base is None:
            return None
        try:
            resp = await self.http.get(f"{base}/slots", timeout=2.0)
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
        resp = await self.http.post(
            f"{base}/slots/{slot_id}", params={"action": "erase"}, timeout=5.0
        )
        if resp.status_code != 200:
            raise EngineFailed(
                f"erase of slot {slot_id} answered {resp.status_code}: {resp.text[:200]}"
            )

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
            }
        )
        return stats
