"""One model served by several engines: replicas (policy and expansion, no I/O).

A ``[[models]]`` entry with ``replicas = N`` (engines the host runs) and/or
``replica_urls = [...]`` (llama-servers elsewhere that serve the same model) is expanded
by :func:`expand_replicas` into one internal model per engine, ``<id>@0``, ``<id>@1``,
... (``@`` cannot appear in a configured id). Each member is a model of its own to the
rest of the host: its engine, slot table, scheduler lane, parked KV and status row. The
public id names the set: requests for it are routed to one member by
:class:`ReplicaRouter`:

- a keyed request (``prompt_cache_key``) goes to the member that holds the session's KV
  (in a slot, or parked), else to the member it went to last; a session whose member is
  unhealthy moves to another, where it re-prefills (counted as ``moved``);
- a keyless request goes to the least-loaded healthy member, and so does a new session
  (ties: the member given the fewest sessions);
- a member whose engine has failed is left out until it is ready again; when every
  member is unhealthy, the least-loaded one is tried (its error then says why).

Routing picks where a request queues; the scheduler has the last word (see THE POOL
in :mod:`gezel_trio.scheduler.policy`): a request with no KV anywhere may be taken by
a sibling with a free slot first, and a member that goes down hands its queue on.
The host tells the router where each request really ran (:meth:`ReplicaRouter.rehome`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from .config import ModelConfig

__all__ = ["MemberView", "ReplicaRouter", "expand_replicas", "member_id"]

MAX_AFFINITIES = 100_000


def member_id(model_id: str, index: int) -> str:
    return f"{model_id}@{index}"


def expand_replicas(models: Sequence[ModelConfig]) -> list[ModelConfig]:
    """Each replicated model as its members (others as they are)."""
    out: list[ModelConfig] = []
    for model in models:
        if model.replicas <= 1 and not model.replica_urls:
            out.append(model)
            continue
        members: list[ModelConfig] = []
        # One slot class for the set: in swap mode its members are resident together
        # (the arbiter evicts other classes, never a sibling), and are evicted together.
        base = dataclasses.replace(
            model, replicas=1, replica_urls=[], replica_of=model.id, slot_class=model.gpu_class
        )
        if model.external:
            members.append(dataclasses.replace(base, id=member_id(model.id, 0)))
        else:
            for _ in range(model.replicas):
                members.append(dataclasses.replace(base, id=member_id(model.id, len(members))))
        for url in model.replica_urls:
            members.append(
                dataclasses.replace(
                    base, id=member_id(model.id, len(members)), path=None, url=url, args=[]
                )
            )
        out.extend(members)
    return out


@dataclass(frozen=True, slots=True)
class MemberView:
    """What the router needs of one member, read at routing time."""

    id: str
    healthy: bool
    load: int
    """Jobs running and waiting on it."""
    holds: bool = False
    """It holds the request's session's KV (in a slot or parked)."""


class ReplicaRouter:
    """Routes one replicated model's requests to its members. Plain state, no I/O."""

    def __init__(self) -> None:
        self._affinity: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._assigned: collections.Counter[str] = collections.Counter()
        """Sessions each member was last given (new sessions go where fewer are)."""
        self.routed: dict[str, int] = {}
        self.moved = 0
        """Sessions sent to another member than the one holding (or last given) them."""
        self.returns = 0
        """Keyed requests of a session that was routed before."""
        self.kept = 0
        """Of those, the ones that ran on the member the session's last request ran on."""
        self._kept_now: set[str] = set()  # sessions whose latest request counted in kept

    def __repr__(self) -> str:
        return f"<ReplicaRouter {len(self._affinity)} sessions, {self.moved} moved>"

    def choose(
        self, members: Sequence[MemberView], session: str | None, *, avoid: Collection[str] = ()
    ) -> str:
        """The member to send a request of ``session`` (None: keyless) to."""
        if not members:
            raise ValueError("a replica set has no members")
        usable = [m for m in members if m.id not in avoid] or list(members)
        healthy = [m for m in usable if m.healthy] or usable
        least = min(healthy, key=lambda m: (m.load, self._assigned[m.id], m.id))
        if session is None:
            chosen = least.id
        else:
            holder = next((m for m in healthy if m.holds), None)
            last = self._affinity.get(session)
            if holder is not None:
                chosen = holder.id
            elif last is not None and any(m.id == last for m in healthy):
                chosen = last
            else:
                chosen = least.id
            previous = last or next((m.id for m in members if m.holds), None)
            if previous is not None and previous != chosen:
                self.moved += 1
            self._kept_now.discard(session)
            if last is not None:
                self.returns += 1
                if chosen == last:
                    self.kept += 1
                    self._kept_now.add(session)
            self._assign(session, chosen, last)
        self.routed[chosen] = self.routed.get(chosen, 0) + 1
        return chosen

    def _assign(self, session: str, member: str, last: str | None) -> None:
        if last != member:
            if last is not None:
                self._assigned[last] -= 1
            self._assigned[member] += 1
        self._affinity[session] = member
        self._affinity.move_to_end(session)
        while len(self._affinity) > MAX_AFFINITIES:
            gone, dropped = self._affinity.popitem(last=False)
            self._assigned[dropped] -= 1
            self._kept_now.discard(gone)

    def rehome(self, session: str, member: str, *, lost_kv: bool) -> None:
        """``session``'s request ran on ``member``, not where it was routed (the
        scheduler moved it: a sibling with room took it, or its member went down).
        ``lost_kv``: the member it left held its KV, so it re-prefills (``moved``)."""
        last = self._affinity.get(session)
        if last == member:
            return
        if lost_kv:
            self.moved += 1
        if session in self._kept_now:
            self._kept_now.discard(session)
            self.kept -= 1
        if last is not None:
            self.routed[last] = self.routed.get(last, 1) - 1
        self.routed[member] = self.routed.get(member, 0) + 1
        self._assign(session, member, last)

    def member_of(self, session: str) -> str | None:
        """The member ``session`` was last sent to (None: never routed)."""
        return self._affinity.get(session)

    def statistics(self) -> dict[str, object]:
        return {
            "routed": dict(self.routed),
            "moved": self.moved,
            "sessions": len(self._affinity),
            "returns": self.returns,
            "kept": self.kept,
            "affinity_hit_rate": round(self.kept / self.returns, 4) if self.returns else None,
        }
