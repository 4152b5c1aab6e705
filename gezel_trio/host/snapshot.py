"""The host's snapshot: every part's statistics at one instant, typed.

:meth:`Host.snapshot <gezel_trio.host.host.Host.snapshot>` composes it from each
component's ``statistics()``; ``/api/status`` is :meth:`HostSnapshot.as_json`
(the one place the parts become JSON), and the ``/metrics`` collector
(:class:`gezel_trio.host.metrics.StatusCollector`) reads the same snapshot's fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config.schema import GpuPolicySetting
from ..engine.binary import BuildFacts
from ..engine.stats import EngineStats
from ..gpu.arbiter import ArbiterStatistics, Policy
from ..gpu.health import HealthGateStatistics
from ..gpu.ledger import LedgerStats
from ..gpu.probe import DeviceHealth
from ..kv.store import KvParkingStats
from ..scheduler import SchedulerStats
from ..scheduler.replicas import ReplicaStats

__all__ = [
    "CompletionStats",
    "EngineBinaryStatus",
    "HostSnapshot",
    "LiveConfig",
    "ModelStats",
    "ReplicaSetStats",
]


@dataclass(frozen=True, slots=True)
class LiveConfig:
    """The settings an admin can change while the host runs (``PUT /api/config``)."""

    policy: GpuPolicySetting
    resolved_policy: Policy
    temp_limit_c: float
    temp_margin_c: float
    lock_model: bool

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "resolved_policy": self.resolved_policy,
            "temp_limit_c": self.temp_limit_c,
            "temp_margin_c": self.temp_margin_c,
            "lock_model": self.lock_model,
        }


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
    kv_parking: KvParkingStats | None
    """None with parking off (``{}`` in JSON)."""
    upstream_calls: dict[str, int]
    replica_of: str | None = None
    ctx_per_slot: int | None = None
    """Each slot's context: the running engine's ``n_ctx``, else what it will run."""
    kind: str = "text"
    """``text`` (llama-server) or ``image`` (sd-server)."""
    job: dict[str, Any] | None = None
    """An image model's job running now: its sampling step and steps (None: none)."""

    def as_dict(self) -> dict[str, Any]:
        """The engine's fields and the host's, flat (the status page and the
        metrics collector read them so)."""
        return {
            **self.engine.as_dict(),
            "name": self.name,
            "kind": self.kind,
            "job": self.job,
            "slot_class": self.slot_class,
            "admission_ceiling": self.admission_ceiling,
            "ctx_per_slot": self.ctx_per_slot,
            "ceiling_reason": self.ceiling_reason,
            "plan": self.plan,
            "calibration": self.calibration,
            "benchmark": self.benchmark,
            "kv_parking": self.kv_parking.as_dict() if self.kv_parking is not None else {},
            "replica_of": self.replica_of,
            "upstream_calls": dict(self.upstream_calls),
        }


@dataclass(frozen=True, slots=True)
class CompletionStats:
    """What the service has done. ``resent``: completions sent again because their
    engine went away before any of the answer reached the client (each is one more
    upstream completion than requests, by design)."""

    resent: int

    def as_dict(self) -> dict[str, int]:
        return {"resent": self.resent}


@dataclass(frozen=True, slots=True)
class EngineBinaryStatus:
    """The engine binary: where it was found and its build, or why none resolved
    (``path`` None: not resolved yet, or ``error`` says why not)."""

    path: str | None
    found_by: str | None
    error: str | None = None
    build: BuildFacts | None = None

    def as_dict(self) -> dict[str, Any]:
        if self.path is None:
            return {"path": None, "found_by": self.found_by, "error": self.error}
        return {
            "path": self.path,
            "found_by": self.found_by,
            "build": self.build.as_dict() if self.build else None,
        }


@dataclass(frozen=True, slots=True)
class ReplicaSetStats:
    """One replicated model: its members (in order) and its router's statistics."""

    members: tuple[str, ...]
    router: ReplicaStats

    def as_dict(self) -> dict[str, Any]:
        return {"members": list(self.members), **self.router.as_dict()}


@dataclass(frozen=True, slots=True)
class HostSnapshot:
    """Everything ``/api/status`` shows and ``/metrics`` reads, at one instant."""

    version: str
    uptime_s: float
    config: LiveConfig
    engine_binary: EngineBinaryStatus
    engines: tuple[ModelStats, ...]
    scheduler: SchedulerStats | None
    """None before the scheduler is open."""
    completions: CompletionStats
    arbiter: ArbiterStatistics
    health_gate: HealthGateStatistics
    gpu: DeviceHealth | None
    """The last device reading the host took (None before the first)."""
    ledger: LedgerStats
    pressure_releases: int
    replicas: dict[str, ReplicaSetStats]
    """Per replicated model id."""

    def as_json(self) -> dict[str, Any]:
        """The ``/api/status`` document."""
        return {
            "version": self.version,
            "uptime_s": self.uptime_s,
            "config": self.config.as_dict(),
            "engine_binary": self.engine_binary.as_dict(),
            "engines": [model.as_dict() for model in self.engines],
            "scheduler": self.scheduler.as_dict() if self.scheduler is not None else None,
            "completions": self.completions.as_dict(),
            "arbiter": self.arbiter.as_dict(),
            "health_gate": self.health_gate.as_dict(),
            "gpu": self.gpu.as_dict() if self.gpu is not None else None,
            "ledger": self.ledger.as_dict(),
            "pressure_releases": self.pressure_releases,
            "replicas": {model: rs.as_dict() for model, rs in self.replicas.items()},
        }
