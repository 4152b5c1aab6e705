"""The scheduler's statistics: the snapshot ``/api/status`` and ``/metrics`` read,
and the hashed form a session takes in them."""

from __future__ import annotations

from dataclasses import dataclass

from gezel_trio.kv.sessions import session_hash
from gezel_trio.scheduler.slots import SlotTableStats

__all__ = ["ActiveOp", "SchedulerStats", "hash_session"]


@dataclass(frozen=True, slots=True)
class ActiveOp:
    model_id: str
    kind: str


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A snapshot for ``/api/status`` and ``/metrics``. Sessions appear only hashed."""

    residency: str
    queued: int
    max_queue: int
    waiting: dict[str, int]  # display name -> queued jobs
    waiting_model_ids: dict[str, int]  # model id -> queued jobs
    running: dict[str, int]  # model id -> admitted completions not yet settled
    last_turn: str | None
    turns: dict[str, str | None]  # group ("*" in swap mode, else family) -> turn family
    active: ActiveOp | None  # the exclusive op running (the first one in coexist mode)
    active_ops: tuple[ActiveOp, ...]
    loading: tuple[str, ...]
    slot_owners: dict[str, dict[int, str | None]]  # model -> slot -> hashed session|None
    slots: dict[str, SlotTableStats]  # model -> its slot table (contents, pins, held out,
    # background saves in flight)
    erases: dict[str, int]  # ok, failed, skipped_same_session, after_keyless, sent_blind,
    # blind_unanswered
    parking: dict[str, int]  # saved, save_skipped_current, save_skipped_tail (a short tail
    # beyond a prefix its slot keeps, not saved), restored, failed, saved_idle,
    # handoffs, handoff_calls (upstream calls of those handoffs, their requests included),
    # shared_within_caller (handoffs that kept the prefix another owner of the caller left),
    # lent_within_caller (restores of another owner's parked copy of the caller, to start from),
    # leads_saved, leads_restored, leads_failed (slots started from a caller's lead: prefilled
    # alone and saved, restored from its snapshot, or failed; see gezel_trio.kv.lead)
    pool: dict[str, int]  # failovers (moved off a down member), pooled (taken by a sibling)
    admissions: int
    short_first: int  # jobs with a short prefill admitted before a long FIFO head
    reconciliations: int
    held_out: int
    switches: int
    slot_polls: int
    slot_measurements: int
    slot_measure_failures: int
    dispatch_passes: int
    dispatch_seconds: float

    def as_dict(self) -> dict[str, object]:
        """JSON-ready: slot ids become strings, tuples become lists."""
        return {
            "residency": self.residency,
            "queued": self.queued,
            "max_queue": self.max_queue,
            "waiting": dict(self.waiting),
            "waiting_model_ids": dict(self.waiting_model_ids),
            "running": dict(self.running),
            "last_turn": self.last_turn,
            "turns": dict(self.turns),
            "active": (
                None
                if self.active is None
                else {"model_id": self.active.model_id, "kind": self.active.kind}
            ),
            "active_ops": [{"model_id": a.model_id, "kind": a.kind} for a in self.active_ops],
            "loading": list(self.loading),
            "slot_owners": {
                model: {str(slot): owner for slot, owner in owners.items()}
                for model, owners in self.slot_owners.items()
            },
            "slots": {
                model: {
                    "generation": table.generation,
                    "slots": table.slots,
                    "pinned": table.pinned,
                    "held_out": table.held_out,
                    "saving": table.saving,
                    "contents": dict(table.contents),
                }
                for model, table in self.slots.items()
            },
            "erases": dict(self.erases),
            "parking": dict(self.parking),
            "pool": dict(self.pool),
            "admissions": self.admissions,
            "short_first": self.short_first,
            "reconciliations": self.reconciliations,
            "held_out": self.held_out,
            "switches": self.switches,
            "slot_polls": self.slot_polls,
            "slot_measurements": self.slot_measurements,
            "slot_measure_failures": self.slot_measure_failures,
            "dispatch_passes": self.dispatch_passes,
            "dispatch_seconds": self.dispatch_seconds,
        }


def hash_session(session: str) -> str:
    """The form a session takes in stats and logs: a prefix of its caller-scoped HMAC
    (see :mod:`gezel_trio.kv.sessions`), never a name or a key."""
    return session_hash(session) or ""
