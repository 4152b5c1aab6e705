"""The scheduler: every request into the right engine slot, fairly, with no cross-chat KV.

:mod:`.policy` holds the pure rules (queue ordering, turns, fairness, capacity,
slot ownership, pinning); :mod:`.dispatcher` is the Trio layer
(:func:`open_scheduler`).
"""

from __future__ import annotations

from gezel_trio.scheduler.dispatcher import (
    EngineLane,
    Scheduler,
    SchedulerClosed,
    open_scheduler,
)
from gezel_trio.scheduler.policy import (
    EXCLUSIVE_KINDS,
    JOB_KINDS,
    ActiveOp,
    Grant,
    JobKind,
    LaneInfo,
    Residency,
    SchedulerPolicy,
    SchedulerStats,
    SlotMeasurement,
    SlotOwners,
    admission_capacity,
    hash_session,
)

__all__ = [
    "EXCLUSIVE_KINDS",
    "JOB_KINDS",
    "ActiveOp",
    "EngineLane",
    "Grant",
    "JobKind",
    "LaneInfo",
    "Residency",
    "Scheduler",
    "SchedulerClosed",
    "SchedulerPolicy",
    "SchedulerStats",
    "SlotMeasurement",
    "SlotOwners",
    "admission_capacity",
    "hash_session",
    "open_scheduler",
]
