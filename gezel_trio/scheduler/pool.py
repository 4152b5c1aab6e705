"""The replica pool: a replicated model's members share their queued work.

A member with room takes pool jobs from its siblings' claimed queues, earliest
first, unless the sibling has room for them itself, and a member that goes down
hands its queued completions to a live sibling (see THE POOL in :mod:`.policy`).
No I/O.
"""

from __future__ import annotations

from collections.abc import Callable

from gezel_trio.scheduler.queues import Job, _Family, _Model, detach

__all__ = ["STEAL_SCAN", "fail_over", "pool_jobs"]

STEAL_SCAN = 16
"""How many claimed jobs of each sibling a member with room looks at for pool jobs."""


def pool_jobs(
    family: _Family,
    bound: float,
    *,
    skip: _Model | None = None,
    room: Callable[[_Model], int] = lambda _model: 0,
) -> list[Job]:
    """Claimed jobs any member may take (see THE POOL), earliest first, among the
    first :data:`STEAL_SCAN` of each member but ``skip``: pool jobs whose session
    holds no slot (or that is a keyless owner's), and every job of a down member.

    ``room(member)``: how many of its claimed jobs a member admits itself in this
    pass; the first that many of its queue are its own (a job the router sent to a
    member with room, for its load or its prefix, runs there), unless it is down."""
    found: list[Job] = []
    for model in family.members:
        if model is skip:
            continue
        own = 0 if model.down else room(model)
        for i, job in enumerate(model.queue.prefix()):
            if i >= STEAL_SCAN or job.seq >= bound:
                break
            if i < own:
                continue
            if model.down or (job.pool and (job.keyless or not _held(family, job.session))):
                found.append(job)
    found.sort(key=lambda j: j.seq)
    return found


def _held(family: _Family, session: str | None) -> bool:
    if session is None:
        return False
    return any(m.table.holds(session) for m in family.members)


def fail_over(model: _Model) -> int:
    """Move ``model``'s queued completions to its live siblings, each to the one with
    the least work, keeping their queue order; returns how many moved. Nothing moves
    for a model of its own, or when every sibling is down."""
    live = model.family.live(other_than=model)
    if not live:
        return 0
    moved = 0
    for job in list(model.queue):
        target = min(live, key=lambda m: (m.running + m.waiting, m.model_id))
        detach(job)
        model.waiting -= 1
        job.model_id = target.model_id
        job.model_state = target
        target.insert(job)
        target.waiting += 1
        moved += 1
    return moved
