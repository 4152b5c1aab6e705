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
- then, once the request's prefix blocks are known (:meth:`ReplicaRouter.by_prefix`), a
  request of an owner (a named session or a caller's keyless owner) goes to the member
  holding the longest prefix of it among the owner's KV, in a slot or parked (the
  router's :class:`~gezel_trio.kv.prefix_index.PrefixIndex`, recorded as each
  request completes), unless that member's load exceeds the least-loaded member's by
  more than ``[scheduler] prefix_load_bound`` (then the least loaded: ``shed``). This is
  the cache-aware routing of SGLang's router, scoped by owner. With no prefix held
  anywhere the choice above stands, except that a keyless request picks, among the
  least-loaded members, the one holding the fewest cached prefixes (a miss goes where
  it displaces the least, as SGLang's router sends it to the smallest tree);
- an owner that holds no prefix of its request anywhere, and may start from one its
  caller's other owners left (``[scheduler] share_prefix_within_caller``), goes to the
  member whose slots or lent parked copies hold the longest prefix of it *among that
  caller's* (the router's second index, keyed by caller), with the same load bound;
  another caller's prefixes are never a reason;
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
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass

from ..config.schema import ModelConfig
from ..kv.prefix import Prefix
from ..kv.prefix_index import PrefixIndex, PrefixIndexStats

__all__ = [
    "KvPlace",
    "MemberPrefixStats",
    "MemberView",
    "PrefixCounts",
    "PrefixRoute",
    "ReplicaRouter",
    "ReplicaStats",
    "expand_replicas",
    "member_id",
]

MAX_AFFINITIES = 100_000
MAX_PREFIX_PLACES = 65_536
"""Places (slots and parked copies, over every owner) a router's prefix index keeps."""
MAX_PREFIX_BLOCKS = 1_048_576
"""Prefix blocks a router's index keeps over every place."""
VALIDATE_TRIES = 4
"""How many stale index entries one routing drops before it gives up on the index."""


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


@dataclass(frozen=True, slots=True)
class KvPlace:
    """Where an owner's KV is on a member: slot ``slot``, or (``slot`` None) the parked
    copy of owner ``parked`` (one per member and owner)."""

    member: str
    slot: int | None = None
    parked: str | None = None


def _member_of(place: Hashable) -> Hashable:
    return place.member if isinstance(place, KvPlace) else None


@dataclass(slots=True)
class PrefixCounts:
    """One member's prefix routing: requests sent to it because it held their longest
    prefix (``hits``, and the ``blocks`` those matched), requests with a prefix that
    it got with none held anywhere (``misses``), and hits it did not get because its
    load was over the bound (``shed``)."""

    hits: int = 0
    misses: int = 0
    shed: int = 0
    blocks: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "shed": self.shed, "blocks": self.blocks}

    def snapshot(self) -> MemberPrefixStats:
        return MemberPrefixStats(self.hits, self.misses, self.shed, self.blocks)


@dataclass(frozen=True, slots=True)
class MemberPrefixStats:
    """A snapshot of one member's :class:`PrefixCounts`."""

    hits: int
    misses: int
    shed: int
    blocks: int

    def as_dict(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "shed": self.shed, "blocks": self.blocks}


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """A snapshot of one replicated model's router for ``/api/status`` and ``/metrics``:
    requests per member, chats moved, session affinity and prefix routing."""

    routed: dict[str, int]
    """Requests that ran on each member."""
    moved: int
    """Chats sent to another member than the one holding their KV."""
    sessions: int
    returns: int
    kept: int
    affinity_hit_rate: float | None
    prefix: dict[str, MemberPrefixStats]
    """Per member, its prefix routing counts."""
    prefix_hit_rate: float | None
    prefix_index: PrefixIndexStats

    def as_dict(self) -> dict[str, object]:
        return {
            "routed": dict(self.routed),
            "moved": self.moved,
            "sessions": self.sessions,
            "returns": self.returns,
            "kept": self.kept,
            "affinity_hit_rate": self.affinity_hit_rate,
            "prefix": {member: counts.as_dict() for member, counts in self.prefix.items()},
            "prefix_hit_rate": self.prefix_hit_rate,
            "prefix_index": self.prefix_index.as_dict(),
        }


@dataclass(frozen=True, slots=True)
class PrefixRoute:
    """What :meth:`ReplicaRouter.by_prefix` decided: the member, the place holding the
    request's longest prefix (None: none), how many blocks it holds, and whether the
    request goes there (``hit``; False with a ``place``: shed for load)."""

    member: str
    place: KvPlace | None = None
    blocks: int = 0
    hit: bool = False


class ReplicaRouter:
    """Routes one replicated model's requests to its members. Plain state, no I/O."""

    def __init__(
        self, *, max_places: int = MAX_PREFIX_PLACES, max_blocks: int = MAX_PREFIX_BLOCKS
    ) -> None:
        self.index = PrefixIndex(max_places=max_places, max_blocks=max_blocks, group=_member_of)
        """Per owner, which member's slots and parked copies hold which prefixes."""
        self.callers = PrefixIndex(max_places=max_places, max_blocks=max_blocks)
        """Per caller, which member's slots hold which prefixes of the caller's owners
        that share them within the caller (see ``caller`` in :meth:`by_prefix`)."""
        self.prefix: dict[str, PrefixCounts] = {}
        """Per member, its prefix routing counts."""
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

    def by_prefix(
        self,
        members: Sequence[MemberView],
        owner: str,
        prefix: Prefix,
        *,
        current: str,
        session: str | None,
        bound: int,
        held: Callable[[KvPlace], Prefix | None],
        parked: Mapping[str, int] | None = None,
        avoid: Collection[str] = (),
        caller: str | None = None,
        caller_held: Callable[[KvPlace], Prefix | None] | None = None,
        lent: Callable[[], Mapping[str, int]] | None = None,
    ) -> PrefixRoute:
        """Where a request of ``owner`` with blocks ``prefix`` goes, now that they are
        known; ``current`` is the member :meth:`choose` gave it (for ``session``, its
        routed session: None for a keyless owner's request).

        The healthy member (not in ``avoid``) whose place holds the longest prefix of
        ``prefix`` among ``owner``'s, unless its load exceeds the least-loaded
        member's by more than ``bound`` (then the least loaded); with no prefix held
        anywhere, ``current`` (for a keyless request: among the least loaded, the
        member holding the fewest places). ``held(place)`` says what a slot place
        holds of ``owner`` now (None: nothing); the index is corrected from it before
        it is trusted. ``parked``: per member, how many leading blocks of ``prefix``
        its best parked copy of ``owner``'s holds (a slot wins a tie: no restore). A
        move away from ``current`` is booked as :meth:`rehome` books a session's (or,
        keyless, in ``routed``); a session shed away from the member holding its prefix
        counts as ``moved``.

        ``caller``: the owner may start from a prefix its caller's other owners left
        (the scheduler then places it there, see
        :func:`~gezel_trio.scheduler.admission.choose_slot`). When none of the
        owner's own places shares a block with ``prefix``, the member whose slot
        holds the longest prefix of it among that caller's (``caller_held(place)``
        says what a slot holds of the caller now, None: nothing) or whose parked
        copies lent within the caller share the most (``lent()``: per member, how many
        blocks; asked only then) is taken as above. Another caller's places are never looked at."""
        by_id = {m.id: m for m in members}
        usable = [m for m in members if m.id not in avoid] or list(members)
        healthy = [m for m in usable if m.healthy] or usable
        ids = {m.id for m in healthy}
        least = min(healthy, key=lambda m: (m.load, self.index.count(m.id), m.id))
        place: KvPlace | None = None
        n = 0
        for _ in range(VALIDATE_TRIES):
            found, n = self.index.longest(
                owner, prefix, take=lambda p: isinstance(p, KvPlace) and p.member in ids
            )
            if not isinstance(found, KvPlace):
                place, n = None, 0
                break
            now = held(found)
            if now == self.index.blocks_of(found):
                place = found
                break
            # The index was stale (an engine restart, a slot handed to a blind job, a
            # slot parked): correct it and look again.
            if now is None:
                self.index.forget(found)
            else:
                self.index.record(owner, found, now)
            place, n = None, 0
        for member, shared in (parked or {}).items():
            if member in ids and shared > n:
                place, n = KvPlace(member, None, owner), shared
        if place is None and caller is not None and caller_held is not None:
            place, n = self._caller_place(caller, prefix, ids, caller_held, lent)
        if place is not None:
            holder = by_id[place.member]
            if holder.load - least.load > bound:
                chosen, hit = least.id, False
                self._counts(holder.id).shed += 1
            else:
                chosen, hit = holder.id, True
                counts = self._counts(holder.id)
                counts.hits += 1
                counts.blocks += n
        else:
            chosen, hit = (least.id if session is None else current), False
            self._counts(chosen).misses += 1
        if chosen != current:
            if session is not None:  # shed away from its KV, it re-prefills: a move
                self.rehome(session, chosen, lost_kv=place is not None and not hit)
            else:
                self.routed[current] = self.routed.get(current, 1) - 1
                self.routed[chosen] = self.routed.get(chosen, 0) + 1
        return PrefixRoute(chosen, place, n, hit)

    def _caller_place(
        self,
        caller: str,
        prefix: Prefix,
        ids: Collection[str],
        held: Callable[[KvPlace], Prefix | None],
        lent: Callable[[], Mapping[str, int]] | None,
    ) -> tuple[KvPlace | None, int]:
        """The place holding the longest prefix of ``prefix`` among ``caller``'s (a slot
        in :attr:`callers`, checked with ``held``; a member's lent parked copies,
        ``lent``), on a member in ``ids``, and how many blocks; (None, 0): none."""
        place: KvPlace | None = None
        n = 0
        for _ in range(VALIDATE_TRIES):
            found, n = self.callers.longest(
                caller, prefix, take=lambda p: isinstance(p, KvPlace) and p.member in ids
            )
            if not isinstance(found, KvPlace):
                place, n = None, 0
                break
            now = held(found)
            if now == self.callers.blocks_of(found):
                place = found
                break
            if now is None:
                self.callers.forget(found)
            else:
                self.callers.record(caller, found, now)
            place, n = None, 0
        for member, shared in (lent() if lent is not None else {}).items():
            if member in ids and shared > n:
                place, n = KvPlace(member), shared
        return place, n

    def record(
        self, owner: str, place: KvPlace, blocks: Prefix, *, caller: str | None = None
    ) -> None:
        """A request of ``owner`` with blocks ``blocks`` completed at ``place``: it
        holds them now (and nothing of any other owner's). ``caller``: the owner shares
        its prefixes within that caller (None: with nobody)."""
        self.index.record(owner, place, blocks)
        if caller is not None:
            self.callers.record(caller, place, blocks)
        else:
            self.callers.forget(place)

    def forget_member(self, member: str) -> int:
        """``member`` holds nothing any more (its engine restarted or went away)."""
        self.callers.forget_where(lambda p: isinstance(p, KvPlace) and p.member == member)
        return self.index.forget_where(lambda p: isinstance(p, KvPlace) and p.member == member)

    def _counts(self, member: str) -> PrefixCounts:
        counts = self.prefix.get(member)
        if counts is None:
            counts = self.prefix[member] = PrefixCounts()
        return counts

    def member_of(self, session: str) -> str | None:
        """The member ``session`` was last sent to (None: never routed)."""
        return self._affinity.get(session)

    def statistics(self) -> ReplicaStats:
        hits = sum(c.hits for c in self.prefix.values())
        found = hits + sum(c.shed for c in self.prefix.values())
        return ReplicaStats(
            routed=dict(self.routed),
            moved=self.moved,
            sessions=len(self._affinity),
            returns=self.returns,
            kept=self.kept,
            affinity_hit_rate=round(self.kept / self.returns, 4) if self.returns else None,
            prefix={member: counts.snapshot() for member, counts in self.prefix.items()},
            prefix_hit_rate=round(hits / found, 4) if found else None,
            prefix_index=self.index.statistics(),
        )
