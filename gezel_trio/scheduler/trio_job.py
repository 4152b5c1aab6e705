"""A job as the Trio layer holds it: the policy's job, with the event that grants it,
the error that fails it, its engine hold and its cancel scope."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import trio

from gezel_trio.scheduler.queues import Job

__all__ = ["_TrioJob"]


@dataclass(eq=False, slots=True)
class _TrioJob(Job):
    granted: trio.Event = field(default_factory=trio.Event)
    error: BaseException | None = None
    hold: AbstractContextManager[object] | None = None
    scope: trio.CancelScope | None = None
