"""Typed host snapshots for tests of what reads them (the ``/metrics`` collector):
every part at rest, and the fields a test names set as it says."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gezel_trio.engine.stats import EngineStats
from gezel_trio.gpu.arbiter import ArbiterStatistics
from gezel_trio.gpu.health import DeviceSafetyPolicy, HealthGateStatistics
from gezel_trio.gpu.ledger import LedgerStats
from gezel_trio.gpu.probe import DeviceHealth, GpuReading
from gezel_trio.host.snapshot import (
    CompletionStats,
    EngineBinaryStatus,
    HostSnapshot,
    LiveConfig,
    ModelStats,
    ReplicaSetStats,
)
from gezel_trio.kv.prefix_index import PrefixIndexStats
from gezel_trio.scheduler import SchedulerStats
from gezel_trio.scheduler.replicas import MemberPrefixStats, ReplicaStats


def scheduler(**fields: Any) -> SchedulerStats:
    """An idle scheduler's statistics, with ``fields`` set."""
    idle = SchedulerStats(
        residency="coexist",
        queued=0,
        max_queue=256,
        waiting={},
        waiting_model_ids={},
        running={},
        last_turn=None,
        turns={},
        active=None,
        active_ops=(),
        loading=(),
        slot_owners={},
        slots={},
        erases={},
        parking={},
        pool={},
        admissions=0,
        short_first=0,
        reconciliations=0,
        held_out=0,
        switches=0,
        slot_polls=0,
        slot_measurements=0,
        slot_measure_failures=0,
        dispatch_passes=0,
        dispatch_seconds=0.0,
    )
    return replace(idle, **fields)


def model(
    model_id: str,
    *,
    state: str = "stopped",
    busy: int = 0,
    starts: int = 0,
    crashes: int = 0,
    calibration: dict[str, Any] | None = None,
) -> ModelStats:
    """One model's statistics: its engine in ``state`` with these counts."""
    engine = EngineStats(
        key=model_id,
        model=model_id,
        external=False,
        state=state,
        failure=None,
        pid=None,
        port=None,
        url=None,
        parallel=1,
        generation=0,
        starts=starts,
        crashes=crashes,
        crash_streak=0,
        last_crash=None,
        busy=busy,
        idle_seconds=0.0,
        load_seconds=None,
        stop_seconds=None,
        argv=(),
        log_tail=(),
    )
    return ModelStats(
        engine=engine,
        name=model_id,
        slot_class=model_id,
        admission_ceiling=1,
        ceiling_reason=None,
        plan=None,
        calibration=calibration or {"status": "not_run"},
        benchmark=None,
        kv_parking=None,
        upstream_calls={},
    )


def gpu(*readings: GpuReading) -> DeviceHealth:
    return DeviceHealth(readings=readings, available=True, reason=None, taken_at=0.0)


def replica_set(
    members: tuple[str, ...],
    *,
    routed: dict[str, int],
    moved: int = 0,
    prefix: dict[str, MemberPrefixStats] | None = None,
) -> ReplicaSetStats:
    router = ReplicaStats(
        routed=routed,
        moved=moved,
        sessions=0,
        returns=0,
        kept=0,
        affinity_hit_rate=None,
        prefix=prefix or {},
        prefix_hit_rate=None,
        prefix_index=PrefixIndexStats(0, 0, 0, 0, 0, 0),
    )
    return ReplicaSetStats(members=members, router=router)


def host(**fields: Any) -> HostSnapshot:
    """A host with nothing running, with ``fields`` set."""
    at_rest = HostSnapshot(
        version="0",
        uptime_s=0.0,
        config=LiveConfig("auto", "coexist", 85.0, 5.0, False),
        engine_binary=EngineBinaryStatus(path=None, found_by=None),
        engines=(),
        scheduler=None,
        completions=CompletionStats(resent=0),
        arbiter=ArbiterStatistics(
            policy="coexist",
            active_class=None,
            holders={},
            since=None,
            waiters=(),
            evictors={},
            evictions=0,
            eviction_errors=0,
            broken_leases=0,
            leases_granted=0,
        ),
        health_gate=HealthGateStatistics(
            policy=DeviceSafetyPolicy(),
            hot=False,
            max_temperature_c=None,
            waiters=(),
            admitted=0,
            waited=0,
            last=None,
        ),
        gpu=None,
        ledger=LedgerStats(
            path="",
            pid=0,
            capacities={},
            held=0,
            held_bytes=0,
            admitted=0,
            denied=0,
            released=0,
            reclaimed=0,
        ),
        pressure_releases=0,
        replicas={},
    )
    return replace(at_rest, **fields)
