"""What one engine reports: the snapshot ``/api/status`` and ``/metrics`` read
(:meth:`gezel_trio.engine.supervisor.Engine.statistics` takes it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["EngineStats"]


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of one engine for ``/api/status`` and ``/metrics``."""

    key: str
    model: str
    external: bool
    state: str
    failure: str | None
    pid: int | None
    port: int | None
    url: str | None
    parallel: int | None
    generation: int
    starts: int
    crashes: int
    crash_streak: int
    last_crash: str | None
    busy: int
    idle_seconds: float
    load_seconds: float | None
    stop_seconds: float | None
    argv: tuple[str, ...]
    log_tail: tuple[str, ...]
    n_ctx: int | None = None
    """Each slot's context, as the running engine reported it (None: not running)."""

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["argv"], out["log_tail"] = list(self.argv), list(self.log_tail)
        return out
