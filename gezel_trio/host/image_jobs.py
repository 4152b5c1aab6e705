"""The host's asynchronous image jobs: a bounded table of who submitted what, and where
each job stands. A plain class, no I/O and no clock of its own (every call is given
``now``); the route module runs each job as a task of the host's nursery and reports
here.

The rules, as sd-server's own job manager has them (``async_jobs.cpp``), with the
host's owner rule added:

- A job is visible only to the caller that submitted it: to any other, it does not
  exist (404), so job ids leak nothing across callers.
- At most ``max_pending`` jobs are queued or generating at once (more is a
  :class:`~gezel_trio.errors.QueueFull`, 503 with ``Retry-After``, where sd-server says
  429); at most ``max_jobs`` are kept in all, finished ones dropped oldest first.
- A finished job is kept ``keep_s`` seconds after it ended, then forgotten; its id then
  answers 410 ``job expired`` for as long again (bounded to ``max_jobs`` ids).
"""

from __future__ import annotations

import itertools
import secrets
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import trio

from ..errors import GezelError, QueueFull
from ..images.job import ImageResult

__all__ = ["ImageJobRecord", "ImageJobs", "JobExpired", "JobNotFound", "JobStatus"]

JobStatus = Literal["queued", "generating", "completed", "failed", "cancelled"]
FINISHED: frozenset[str] = frozenset({"completed", "failed", "cancelled"})


class JobNotFound(GezelError):
    status = 404
    code = "job_not_found"
    type = "invalid_request_error"


class JobExpired(GezelError):
    status = 410
    code = "job_expired"
    type = "invalid_request_error"


@dataclass(slots=True)
class ImageJobRecord:
    """One job as the table knows it. ``created``/``started``/``completed`` are Unix
    seconds (sd-server's fields); ``ended_at`` is the caller's clock for expiry."""

    id: str
    owner: str
    kind: Literal["img_gen", "vid_gen"]
    model: str
    created: int
    status: JobStatus = "queued"
    started: int | None = None
    completed: int | None = None
    step: int = 0
    steps: int = 0
    result: ImageResult | None = field(default=None, repr=False)
    error: tuple[str, str] | None = None
    """``(code, message)``, sd-server's error fields."""
    ended_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


class ImageJobs:
    """The table. Not thread-safe; one Trio run owns it."""

    def __init__(self, *, max_jobs: int = 256, max_pending: int = 64, keep_s: float = 3600.0):
        if max_pending > max_jobs:
            raise ValueError("max_pending cannot exceed max_jobs")
        self.max_jobs = max_jobs
        self.max_pending = max_pending
        self.keep_s = keep_s
        self._jobs: OrderedDict[str, ImageJobRecord] = OrderedDict()
        self._expired: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._serial = itertools.count(1)
        self._scopes: dict[str, trio.CancelScope] = {}
        """Each running job's cancel scope, by job id (while its task runs)."""

    def __repr__(self) -> str:
        return f"<ImageJobs {self.statistics()}>"

    def statistics(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for job in self._jobs.values():
            counts[job.status] = counts.get(job.status, 0) + 1
        return {"jobs": len(self._jobs), "expired_ids": len(self._expired), **counts}

    # ------------------------------------------------------------------ submit/look up

    def submit(
        self,
        owner: str,
        *,
        kind: Literal["img_gen", "vid_gen"],
        model: str,
        now: float,
        unix_now: int,
    ) -> ImageJobRecord:
        """A new queued job of ``owner``; :class:`QueueFull` when ``max_pending`` are
        already under way."""
        self.expire(now)
        pending = sum(1 for job in self._jobs.values() if not job.finished)
        if pending >= self.max_pending:
            raise QueueFull(
                f"{pending} image jobs are queued or generating (the limit is "
                f"{self.max_pending}): poll them, or try again later",
                retry_after=5,
            )
        while len(self._jobs) >= self.max_jobs:
            oldest = next(job for job in self._jobs.values() if job.finished)
            self._forget(oldest, now)
        job_id = f"job_{unix_now:x}_{next(self._serial):08x}{secrets.token_hex(4)}"
        record = ImageJobRecord(job_id, owner, kind, model, unix_now)
        self._jobs[job_id] = record
        return record

    def get(self, owner: str, job_id: str, *, now: float) -> ImageJobRecord:
        """``owner``'s job; :class:`JobNotFound` for an unknown id or another caller's,
        :class:`JobExpired` for one of the owner's that was forgotten."""
        self.expire(now)
        job = self._jobs.get(job_id)
        if job is not None and job.owner == owner:
            return job
        expired = self._expired.get(job_id)
        if job is None and expired is not None and expired[0] == owner:
            raise JobExpired("job expired")
        raise JobNotFound("job not found")

    def queue_position(self, job: ImageJobRecord) -> int:
        """1-based place among the queued jobs (every caller's: that is the wait), 0 once
        it is no longer queued."""
        if job.status != "queued":
            return 0
        position = 0
        for other in self._jobs.values():
            if other.status == "queued":
                position += 1
            if other is job:
                return position
        return 0

    # ------------------------------------------------------------------ transitions

    def progress(self, job: ImageJobRecord, step: int, steps: int, *, unix_now: int) -> None:
        """The render reported progress: it is generating."""
        if job.finished:
            return
        if job.status == "queued":
            job.status = "generating"
            job.started = unix_now
        job.step, job.steps = step, steps

    def complete(
        self, job: ImageJobRecord, result: ImageResult, *, now: float, unix_now: int
    ) -> None:
        if job.finished:
            return
        if job.started is None:
            job.started = unix_now
        if job.steps:
            job.step = job.steps
        self._end(job, "completed", now, unix_now)
        job.result = result

    def fail(
        self, job: ImageJobRecord, code: str, message: str, *, now: float, unix_now: int
    ) -> None:
        if job.finished:
            return
        self._end(job, "failed", now, unix_now)
        job.error = (code, message)

    @contextmanager
    def running(self, job: ImageJobRecord) -> Iterator[trio.CancelScope]:
        """The scope ``job``'s task runs in: :meth:`cancel` cancels it."""
        with trio.CancelScope() as scope:
            self._scopes[job.id] = scope
            try:
                yield scope
            finally:
                self._scopes.pop(job.id, None)

    def cancel(self, job: ImageJobRecord, *, now: float, unix_now: int) -> bool:
        """Mark a queued or generating job cancelled and cancel its task's scope (its
        render ends); False when it had finished."""
        if job.finished:
            return False
        self._end(job, "cancelled", now, unix_now)
        job.error = ("cancelled", "job cancelled by client")
        scope = self._scopes.get(job.id)
        if scope is not None:
            scope.cancel()
        return True

    def _end(self, job: ImageJobRecord, status: JobStatus, now: float, unix_now: int) -> None:
        job.status = status
        job.completed = unix_now
        job.ended_at = now

    # ------------------------------------------------------------------ expiry

    def expire(self, now: float) -> None:
        """Forget finished jobs older than ``keep_s``, and expired ids older than that."""
        for job_id, (_, until) in list(self._expired.items()):
            if until > now:
                break
            del self._expired[job_id]
        for job in list(self._jobs.values()):
            if job.ended_at is not None and now - job.ended_at >= self.keep_s:
                self._forget(job, now)

    def _forget(self, job: ImageJobRecord, now: float) -> None:
        del self._jobs[job.id]
        self._expired[job.id] = (job.owner, now + self.keep_s)
        while len(self._expired) > self.max_jobs:
            self._expired.popitem(last=False)
