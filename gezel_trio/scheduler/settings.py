"""The scheduler's settings."""

from __future__ import annotations

from dataclasses import dataclass

from gezel_trio.scheduler.jobs import Residency

__all__ = ["SchedulerSettings"]


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    """Every knob of the scheduler, in one place (config, host, tests, benchmarks).

    ``residency``: ``swap`` (one model resident at a time, one turn for all) or
    ``coexist`` (each model its own turns). ``max_queue`` bounds queued jobs
    (QueueFull beyond). ``slot_poll``: the ``/slots`` poll interval when capacity
    is zero and none of our jobs runs. ``reconcile_interval``: background
    ``/slots`` reconciliation of spawned engines. ``measure_timeout``,
    ``erase_timeout`` and ``park_timeout`` bound one sample, one erase and one
    save or restore. ``save_idle_slots``: save an owner's slot in the background
    once it has stayed idle ``save_idle_delay`` seconds after its job (with
    ``kv_parking``), so that a handoff finds its copy current; a slot no handoff is
    likely to take (a fresh or clean slot is left for a newcomer) only once it has stayed
    idle ``save_lone_delay`` (``inf``: never). ``blind_handoff``: a
    slot that must be emptied for its new owner is not erased; the request is sent
    with ``cache_prompt`` off instead, and the engine starts it from nothing (one
    upstream call per handoff, as on a bare engine). ``short_first_passes``: how many
    times a queued job with a long prefill may be passed over by jobs with a short
    one (0: FIFO; see SHORT WORK FIRST in :mod:`.policy`).
    """

    residency: Residency = "swap"
    max_queue: int = 256
    slot_poll: float = 0.25
    affinity: bool = True
    affinity_max_wait: float = 1.0
    short_first_passes: int = 4
    erase_on_handoff: bool = True
    blind_handoff: bool = True
    kv_parking: bool = True
    measure_timeout: float = 2.0
    erase_timeout: float = 5.0
    park_timeout: float = 30.0
    reconcile_interval: float = 5.0
    idle_erase_delay: float = 0.1
    save_idle_slots: bool = True
    save_idle_delay: float = 0.05
    save_lone_delay: float = 0.1

    def __post_init__(self) -> None:
        if self.short_first_passes < 0:
            raise ValueError(f"short_first_passes must be >= 0, not {self.short_first_passes}")
        if self.slot_poll <= 0:
            raise ValueError(f"slot_poll must be > 0, not {self.slot_poll}")
        if self.reconcile_interval <= 0:
            raise ValueError(f"reconcile_interval must be > 0, not {self.reconcile_interval}")
        if self.idle_erase_delay < 0:
            raise ValueError(f"idle_erase_delay must be >= 0, not {self.idle_erase_delay}")
        if self.save_idle_delay < 0:
            raise ValueError(f"save_idle_delay must be >= 0, not {self.save_idle_delay}")
        if not self.save_lone_delay >= 0:  # (NaN too)
            raise ValueError(f"save_lone_delay must be >= 0, not {self.save_lone_delay}")
