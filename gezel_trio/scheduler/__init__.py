"""The scheduler: every request into the right engine slot, fairly, with no cross-chat KV.

:mod:`.policy` holds the pure rules (queue ordering, turns, fairness, capacity,
pinning), over :mod:`.jobs` (the values), :mod:`.queues` (queued jobs and their
deques), :mod:`.admission` (turns, capacity, slot choice), :mod:`.pool` (the
replica pool) and :mod:`.stats`; :mod:`.slots` the slot table (what each slot
holds, who owns and who is pinned to it); :mod:`.replicas` the replica router
(which member a request goes to, no I/O). :mod:`.dispatcher` is the Trio layer
(:func:`open_scheduler`, ``async with scheduler.slot(...)``, the dispatch pass),
with :mod:`.settings`, :mod:`.lanes` (what it needs of an engine),
:mod:`.trio_job` (a job with its Trio events), :mod:`.preparation` (park, restore
or erase before a job), :mod:`.maintenance` (slot work off the critical path) and
:mod:`.reconcile` (``/slots`` samples). A request's prefix blocks, which place it
within its owner, come from :mod:`gezel_trio.kv.prefix`.
"""

from __future__ import annotations

from gezel_trio.kv.prefix import Prefix, prefix_blocks
from gezel_trio.scheduler.admission import admission_capacity
from gezel_trio.scheduler.dispatcher import (
    Scheduler,
    SchedulerClosed,
    SlotRequest,
    open_scheduler,
)
from gezel_trio.scheduler.jobs import (
    EXCLUSIVE_KINDS,
    JOB_KINDS,
    Grant,
    JobKind,
    LaneInfo,
    Residency,
    SlotMeasurement,
)
from gezel_trio.scheduler.lanes import EngineLane, ParkingLane
from gezel_trio.scheduler.policy import SchedulerPolicy
from gezel_trio.scheduler.settings import SchedulerSettings
from gezel_trio.scheduler.slots import Content, SlotTable
from gezel_trio.scheduler.stats import ActiveOp, SchedulerStats, hash_session

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
