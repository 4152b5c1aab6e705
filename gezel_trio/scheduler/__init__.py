"""The scheduler: every request into the right engine slot, fairly, with no cross-chat KV.

:mod:`.policy` holds the pure rules (queue ordering, turns, fairness, capacity,
pinning); :mod:`.slots` the slot table (what each slot holds, who owns and who
is pinned to it); :mod:`.prefix` a request's prefix blocks (placement within an
owner); :mod:`.dispatcher` is the Trio layer (:func:`open_scheduler`,
``async with scheduler.slot(...)``).
"""

from __future__ import annotations

from gezel_trio.scheduler.dispatcher import (
    EngineLane,
    ParkingLane,
    Scheduler,
    SchedulerClosed,
    SchedulerSettings,
    SlotRequest,
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
    admission_capacity,
    hash_session,
)
from gezel_trio.scheduler.prefix import Prefix, prefix_blocks
from gezel_trio.scheduler.slots import Content, SlotTable

__all__ = [
    "EXCLUSIVE_KINDS",
    "JOB_KINDS",
    "ActiveOp",
    "Content",
    "EngineLane",
    "Grant",
    "JobKind",
    "LaneInfo",
    "ParkingLane",
    "Prefix",
    "Residency",
    "Scheduler",
    "SchedulerClosed",
    "SchedulerPolicy",
    "SchedulerSettings",
    "SchedulerStats",
    "SlotMeasurement",
    "SlotRequest",
    "SlotTable",
    "admission_capacity",
    "hash_session",
    "open_scheduler",
    "prefix_blocks",
]
