"""The prefix index (no I/O): property-based against a brute-force model, with hypothesis.

The model keeps every place's owner, chain and recording time in a plain dict and
answers ``longest`` by comparing the request with every chain of the owner; the index
must give the same answer, never exceed its bounds, never hand one owner another's
place, and forget what it is told to."""

from __future__ import annotations

from collections.abc import Hashable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from gezel_trio.kv.prefix import Prefix, prefix_blocks, shared_blocks
from gezel_trio.kv.prefix_index import PrefixIndex

OWNERS = ("alice", "bob", "carol")
PLACES = tuple(range(8))
# A tiny alphabet, so that chains share prefixes often.
chains = st.lists(st.sampled_from(["sys", "u1", "u2", "a1", "a2"]), max_size=7).map(prefix_blocks)


class Model:
    """The brute-force reference."""

    def __init__(self, max_places: int, max_blocks: int) -> None:
        self.max_places, self.max_blocks = max_places, max_blocks
        self.places: dict[Hashable, tuple[str, Prefix, int]] = {}
        self.clock = 0

    def record(self, owner: str, place: Hashable, blocks: Prefix) -> None:
        self.places.pop(place, None)
        if not blocks:
            return
        self.clock += 1
        self.places[place] = (owner, blocks[: self.max_blocks], self.clock)
        while len(self.places) > self.max_places or self.blocks() > self.max_blocks:
            oldest = min(self.places, key=lambda p: self.places[p][2])
            del self.places[oldest]

    def blocks(self) -> int:
        return sum(len(b) for _, b, _ in self.places.values())

    def longest(
        self, owner: str, prefix: Prefix, take: frozenset[int] | None
    ) -> tuple[Hashable | None, int]:
        best: tuple[int, int] = (0, 0)
        found: Hashable | None = None
        for place, (who, blocks, stamp) in self.places.items():
            if who != owner or (take is not None and place not in take):
                continue
            n = shared_blocks(blocks, prefix)
            if n > 0 and (n, stamp) > best:
                best, found = (n, stamp), place
        return found, best[0]


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex()
        self.model = Model(self.index.max_places, self.index.max_blocks)

    @initialize(max_places=st.integers(1, 6), max_blocks=st.integers(1, 30))
    def start(self, max_places: int, max_blocks: int) -> None:
        self.index = PrefixIndex(max_places=max_places, max_blocks=max_blocks)
        self.model = Model(max_places, max_blocks)

    @rule(owner=st.sampled_from(OWNERS), place=st.sampled_from(PLACES), blocks=chains)
    def record(self, owner: str, place: int, blocks: Prefix) -> None:
        self.index.record(owner, place, blocks)
        self.model.record(owner, place, blocks)

    @rule(place=st.sampled_from(PLACES))
    def forget(self, place: int) -> None:
        known = place in self.model.places
        assert self.index.forget(place) is known
        self.model.places.pop(place, None)
        assert place not in self.index

    @rule(owner=st.sampled_from(OWNERS))
    def forget_owner(self, owner: str) -> None:
        gone = [p for p, (who, _, _) in self.model.places.items() if who == owner]
        assert self.index.forget_owner(owner) == len(gone)
        for place in gone:
            del self.model.places[place]
        assert list(self.index.places(owner)) == []

    @rule(
        owner=st.sampled_from(OWNERS),
        prefix=chains,
        take=st.none() | st.frozensets(st.sampled_from(PLACES)),
    )
    def longest(self, owner: str, prefix: Prefix, take: frozenset[int] | None) -> None:
        got = self.index.longest(
            owner, prefix, take=None if take is None else (lambda p: p in take)
        )
        assert got == self.model.longest(owner, prefix, take)
        place, n = got
        if place is not None:  # an owner only ever sees its own places
            assert self.index.owner_of(place) == owner
            assert shared_blocks(self.index.blocks_of(place), prefix) == n

    @invariant()
    def same_contents_and_bounded(self) -> None:
        stats = self.index.statistics()
        assert stats.places == len(self.index) <= self.index.max_places
        assert stats.blocks <= self.index.max_blocks
        assert stats.blocks == self.model.blocks()
        assert set(self.index.places()) == set(self.model.places)
        for place, (owner, blocks, _) in self.model.places.items():
            assert self.index.owner_of(place) == owner
            assert self.index.blocks_of(place) == blocks
        assert stats.owners == len({who for who, _, _ in self.model.places.values()})


IndexMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_the_index_answers_as_a_brute_force_model = IndexMachine.TestCase


def test_a_place_moves_to_its_new_owner_and_groups_are_counted() -> None:
    index = PrefixIndex(group=lambda place: place[0] if isinstance(place, tuple) else None)
    chat = prefix_blocks(["sys", "hello"])
    index.record("alice", ("m@0", 0), chat)
    index.record("alice", ("m@1", 0), chat[:1])
    assert index.longest("alice", prefix_blocks(["sys", "hello", "more"])) == (("m@0", 0), 2)
    assert index.longest("bob", chat) == (None, 0)  # another owner sees nothing
    index.record("bob", ("m@0", 0), chat)  # the slot changed owner
    assert index.longest("alice", chat) == (("m@1", 0), 1)
    assert index.longest("bob", chat) == (("m@0", 0), 2)
    assert (index.count("m@0"), index.count("m@1"), index.count("m@2")) == (1, 1, 0)
    assert index.forget_where(lambda p: isinstance(p, tuple) and p[0] == "m@1") == 1
    assert index.longest("alice", chat) == (None, 0) and index.count("m@1") == 0


def test_lookups_cost_log_probes_in_a_long_chain() -> None:
    """A 4096-block chain: the answer comes from about 12 probes, not 4096."""
    probes = 0
    chain = prefix_blocks(str(i) for i in range(4096))
    index = PrefixIndex()
    index.record("o", "place", chain[:3000])

    def take(place: Hashable) -> bool:
        nonlocal probes
        probes += 1
        return True

    assert index.longest("o", chain, take=take) == ("place", 3000)
    assert probes <= 14


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(max_places=0)
