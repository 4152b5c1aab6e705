"""Recent activity for the dashboard: the last requests, and per-second series of queue
depth, running jobs and TTFT over the last minutes. Plain bookkeeping, no I/O: the API
records each finished request, a host task samples the queue once a second."""

from __future__ import annotations

import collections
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Activity", "ActivitySample", "ActivitySnapshot", "RequestEvent"]


@dataclass(frozen=True, slots=True)
class RequestEvent:
    at: float
    model: str
    status: int
    path: str | None
    session: str | None
    ttft_ms: float | None
    duration_ms: float
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None


@dataclass(frozen=True, slots=True)
class ActivitySample:
    """One second of the series: the queue then, and the median TTFT of the requests
    that finished in it (None: none did)."""

    t: float
    queued: int
    running: int
    ttft_ms: float | None


@dataclass(frozen=True, slots=True)
class ActivitySnapshot:
    """The dashboard's feed: the last requests (newest first) and the series."""

    requests: tuple[RequestEvent, ...]
    series: tuple[ActivitySample, ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": [asdict(r) for r in self.requests],
            "series": [asdict(s) for s in self.series],
        }


class Activity:
    """The last ``max_requests`` requests and ``window`` one-second samples."""

    def __init__(self, *, max_requests: int = 100, window: int = 600) -> None:
        self.requests: collections.deque[RequestEvent] = collections.deque(maxlen=max_requests)
        self.series: collections.deque[ActivitySample] = collections.deque(maxlen=window)
        self._ttfts: list[float] = []

    def __repr__(self) -> str:
        return f"<Activity {len(self.requests)} requests, {len(self.series)} samples>"

    def record(self, event: RequestEvent) -> None:
        self.requests.append(event)
        if event.ttft_ms is not None:
            self._ttfts.append(event.ttft_ms)

    def sample(self, *, queued: int, running: int, now: float | None = None) -> None:
        """One point of the series: the queue now, and the median TTFT of the requests
        that finished since the last point (None: none did)."""
        ttft = statistics.median(self._ttfts) if self._ttfts else None
        self._ttfts = []
        self.series.append(
            ActivitySample(
                t=round(time.time() if now is None else now, 3),
                queued=queued,
                running=running,
                ttft_ms=None if ttft is None else round(ttft, 1),
            )
        )

    def snapshot(self) -> ActivitySnapshot:
        return ActivitySnapshot(requests=tuple(reversed(self.requests)), series=tuple(self.series))
