"""Caller-scoped prefix routing (no I/O): the replica router's two prefix indexes, one
keyed by owner and one by caller, property-tested against a brute-force model.

The model keeps what each place (a member's slot) holds now: its owner, the caller
it shares prefixes within (None: nobody) and its chain. The router learns it only
from :meth:`ReplicaRouter.record` and corrects itself from ``held`` and
``caller_held`` (which read the model, as the host reads its slot tables). Whatever
the bounds: a route never rests on another caller's place, never claims more blocks
than the place holds, and both indexes stay within their bounds; with nothing
evicted, the route is the longest prefix among the owner's places, else among its
caller's.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from gezel_trio.kv.prefix import Header, Prefix, prefix_blocks, shared_blocks
from gezel_trio.scheduler.replicas import KvPlace, MemberView, ReplicaRouter

CALLER_OF = {"ann-1": "ann", "ann-2": "ann", "ann-3": "ann", "bea-1": "bea", "bea-2": "bea"}
OWNERS = tuple(CALLER_OF)
MEMBERS = ("m@0", "m@1", "m@2")
PLACES = tuple(KvPlace(member, slot) for member in MEMBERS for slot in range(2))
# A small alphabet, so that chains share prefixes often, across callers too.
chains = st.lists(
    st.sampled_from([Header("system"), "tools", "sys-b", Header("user"), "u1", "u2"]),
    max_size=6,
).map(prefix_blocks)


class RoutingMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.router = ReplicaRouter()
        self.places: dict[KvPlace, tuple[str, str | None, Prefix]] = {}
        """What each place holds now: owner, the caller it shares within, blocks."""

    @initialize(max_places=st.integers(1, 8), max_blocks=st.integers(6, 40))
    def start(self, max_places: int, max_blocks: int) -> None:
        """Bounds small enough to evict (a chain is never cut: a slot holds it whole)."""
        self.router = ReplicaRouter(max_places=max_places, max_blocks=max_blocks)

    @rule(
        owner=st.sampled_from(OWNERS),
        place=st.sampled_from(PLACES),
        blocks=chains,
        shares=st.booleans(),
    )
    def complete(self, owner: str, place: KvPlace, blocks: Prefix, shares: bool) -> None:
        """A request of ``owner`` ran at ``place`` (sharing within its caller or not)."""
        caller = CALLER_OF[owner] if shares else None
        self.router.record(owner, place, blocks, caller=caller)
        if blocks:
            self.places[place] = (owner, caller, blocks)
        else:
            self.places.pop(place, None)

    @rule(place=st.sampled_from(PLACES))
    def erase(self, place: KvPlace) -> None:
        """The slot was erased or handed to a blind job: the router is not told."""
        self.places.pop(place, None)

    def _held(self, owner: str, place: KvPlace) -> Prefix | None:
        found = self.places.get(place)
        return found[2] if found is not None and found[0] == owner else None

    def _caller_held(self, caller: str, place: KvPlace) -> Prefix | None:
        found = self.places.get(place)
        return found[2] if found is not None and found[1] == caller else None

    def _best(self, prefix: Prefix, which: list[KvPlace]) -> int:
        return max((shared_blocks(self.places[p][2], prefix) for p in which), default=0)

    @rule(owner=st.sampled_from(OWNERS), prefix=chains, shares=st.booleans())
    def route(self, owner: str, prefix: Prefix, shares: bool) -> None:
        caller = CALLER_OF[owner] if shares else None
        evicted = self.router.index.evicted + self.router.callers.evicted
        route = self.router.by_prefix(
            [MemberView(m, True, 0) for m in MEMBERS],
            owner,
            prefix,
            current=MEMBERS[0],
            session=owner,
            bound=1_000,
            held=lambda p: self._held(owner, p),
            caller=caller,
            caller_held=lambda p: self._caller_held(caller or "", p),
        )
        own = [p for p, (who, _, _) in self.places.items() if who == owner]
        mine = [p for p, (_, shared, _) in self.places.items() if shared == caller]
        if route.place is None:
            assert route.blocks == 0 and not route.hit
        else:
            assert route.hit and route.member == route.place.member
            held = self.places[route.place]
            if held[0] == owner:
                assert route.blocks == shared_blocks(held[2], prefix) > 0
            else:  # never another caller's place, nor a caller's that lends to nobody
                assert caller is not None and held[1] == caller
                assert route.blocks == shared_blocks(held[2], prefix) > 0
                if self.router.index.evicted == 0:  # (an evicted place is not known)
                    assert self._best(prefix, own) == 0  # the owner's own KV comes first
        if evicted == self.router.index.evicted + self.router.callers.evicted == 0:
            expected = self._best(prefix, own) or (
                self._best(prefix, mine) if caller is not None else 0
            )
            assert route.blocks == expected

    @invariant()
    def bounded(self) -> None:
        for index in (self.router.index, self.router.callers):
            stats = index.statistics()
            assert stats.places == len(index) <= index.max_places
            assert stats.blocks <= index.max_blocks


RoutingMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_routing_by_prefix_is_scoped_by_owner_then_caller = RoutingMachine.TestCase
