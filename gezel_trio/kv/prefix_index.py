"""The prefix index: which places hold which block chains, per owner (no I/O).

A *place* is anything that holds KV and can be named by a hashable value: a slot of
a replica member, a parked copy on a member's disk. The index does not look inside
it. For each owner it records the block chain (see :mod:`.prefix`) each of the
owner's places holds, and answers :meth:`PrefixIndex.longest`: the owner's place
whose chain shares the most leading blocks with a request's, among the places a
caller will take.

Lookup uses the chained-hash property: a chain's ``n``-th value names its whole
first ``n`` blocks, so "some place holds the request's first ``n`` blocks" is one
dictionary probe of ``(n, prefix[n - 1])``, and it is monotone in ``n``. A binary
search over ``n`` finds the longest match in ``O(log len(prefix))`` probes, each
looking at the places that share that exact prefix (stopping at the first one the
caller will take).

Owners never see each other's places: a probe reads only the owner's own map, and
a place belongs to one owner at a time (recording it for another owner moves it).

Bounded: at most ``max_places`` places and ``max_blocks`` recorded blocks over all
owners; the least recently recorded places are evicted first, and an owner with no
place left is dropped. A chain longer than ``max_blocks`` is kept on its first
blocks. The index is a placement hint only: a stale or evicted entry costs a
re-prefill, never a leak (isolation is the owner's business, checked elsewhere).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

from gezel_trio.kv.prefix import MAX_BLOCKS, Prefix, headers_only

__all__ = ["PrefixIndex", "PrefixIndexStats"]

MAX_PLACES = 65_536
"""Default bound on places over every owner."""
MAX_INDEX_BLOCKS = 1_048_576
"""Default bound on recorded blocks over every owner (about 100 MiB at worst)."""


@dataclass(slots=True)
class _Entry:
    owner: str
    blocks: Prefix
    stamp: int
    """When it was last recorded (larger: more recent); ties go to the most recent."""


@dataclass(frozen=True, slots=True)
class PrefixIndexStats:
    owners: int
    places: int
    blocks: int
    max_places: int
    max_blocks: int
    evicted: int

    def as_dict(self) -> dict[str, int]:
        return {
            "owners": self.owners,
            "places": self.places,
            "blocks": self.blocks,
            "max_places": self.max_places,
            "max_blocks": self.max_blocks,
            "evicted": self.evicted,
        }


class PrefixIndex:
    """Per owner, the block chain each of its places holds (see the module docstring)."""

    __slots__ = (
        "_blocks",
        "_clock",
        "_group",
        "_groups",
        "_owners",
        "_places",
        "evicted",
        "max_blocks",
        "max_places",
    )

    def __init__(
        self,
        *,
        max_places: int = MAX_PLACES,
        max_blocks: int = MAX_INDEX_BLOCKS,
        group: Callable[[Hashable], Hashable] | None = None,
    ) -> None:
        """``group`` names the group a place belongs to (a replica member, say), so
        that :meth:`count` can say how many places a group has in O(1)."""
        if max_places < 1 or max_blocks < 1:
            raise ValueError("a prefix index holds at least one place and one block")
        self.max_places = max_places
        self.max_blocks = max_blocks
        self._group = group
        self._groups: collections.Counter[Hashable] = collections.Counter()
        self._places: collections.OrderedDict[Hashable, _Entry] = collections.OrderedDict()
        """Every place, least recently recorded first."""
        self._owners: dict[str, dict[tuple[int, int], dict[Hashable, None]]] = {}
        """owner -> (depth, chained hash at that depth) -> the places holding that prefix."""
        self._blocks = 0
        self._clock = 0
        self.evicted = 0
        """Places dropped to stay within the bounds."""

    def __repr__(self) -> str:
        return (
            f"<PrefixIndex {len(self._owners)} owners, {len(self._places)} places, "
            f"{self._blocks} blocks>"
        )

    def __len__(self) -> int:
        return len(self._places)

    def __contains__(self, place: object) -> bool:
        return place in self._places

    # ------------------------------------------------------------------ writing

    def record(self, owner: str, place: Hashable, blocks: Prefix) -> None:
        """``place`` now holds ``blocks`` of ``owner`` (and nothing of anyone else's).

        Replaces what the index knew of ``place``, for whatever owner; ``()`` (no
        blocks known) forgets it. Evicts the least recently recorded places while a
        bound is exceeded (never the one just recorded)."""
        self.forget(place)
        if not blocks:
            return
        blocks = blocks[: min(self.max_blocks, MAX_BLOCKS)]
        self._clock += 1
        self._places[place] = _Entry(owner, blocks, self._clock)
        keys = self._owners.setdefault(owner, {})
        for depth, value in enumerate(blocks):
            keys.setdefault((depth, value), {})[place] = None
        self._blocks += len(blocks)
        if self._group is not None:
            self._groups[self._group(place)] += 1
        while len(self._places) > self.max_places or self._blocks > self.max_blocks:
            oldest = next(iter(self._places))
            if oldest == place:  # pragma: no cover - its blocks were cut to the bound
                break
            self.forget(oldest)
            self.evicted += 1

    def forget(self, place: Hashable) -> bool:
        """Drop ``place`` (it holds nothing of its owner now); False if unknown."""
        entry = self._places.pop(place, None)
        if entry is None:
            return False
        keys = self._owners[entry.owner]
        for depth, value in enumerate(entry.blocks):
            holders = keys[(depth, value)]
            del holders[place]
            if not holders:
                del keys[(depth, value)]
        if not keys:
            del self._owners[entry.owner]
        self._blocks -= len(entry.blocks)
        if self._group is not None:
            group = self._group(place)
            self._groups[group] -= 1
            if not self._groups[group]:
                del self._groups[group]
        return True

    def forget_owner(self, owner: str) -> int:
        """Drop every place of ``owner``; returns how many."""
        gone = [place for place, entry in self._places.items() if entry.owner == owner]
        for place in gone:
            self.forget(place)
        return len(gone)

    def forget_where(self, which: Callable[[Hashable], bool]) -> int:
        """Drop every place for which ``which(place)`` is true (a member that went
        away, say); returns how many. O(places)."""
        gone = [place for place in self._places if which(place)]
        for place in gone:
            self.forget(place)
        return len(gone)

    # ------------------------------------------------------------------ reading

    def longest(
        self,
        owner: str,
        prefix: Prefix,
        *,
        take: Callable[[Hashable], bool] | None = None,
    ) -> tuple[Hashable | None, int]:
        """``owner``'s place sharing the most leading blocks with ``prefix``, and how
        many: ``(None, 0)`` when none shares any (or only message headers). ``take``
        limits the candidates (None: every place of the owner); among places sharing
        as many blocks, the most recently recorded wins. ``O(log len(prefix))`` probes."""
        keys = self._owners.get(owner)
        if keys is None or not prefix:
            return None, 0

        def holders(n: int) -> dict[Hashable, None] | None:
            return keys.get((n - 1, prefix[n - 1]))

        def found(n: int) -> bool:
            places = holders(n)
            if not places:
                return False
            return take is None or any(take(p) for p in places)

        lo, hi = 0, min(len(prefix), self.max_blocks, MAX_BLOCKS)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if found(mid):
                lo = mid
            else:
                hi = mid - 1
        if headers_only(prefix, lo):
            return None, 0  # nothing, or message headers only: no shared conversation
        places = holders(lo)
        assert places
        best = max(
            (p for p in places if take is None or take(p)),
            key=lambda p: self._places[p].stamp,
        )
        return best, lo

    def count(self, group: Hashable) -> int:
        """How many places of ``group`` (see ``group`` in the constructor) are recorded."""
        return self._groups.get(group, 0)

    def blocks_of(self, place: Hashable) -> Prefix:
        """What ``place`` holds, as recorded (``()``: unknown)."""
        entry = self._places.get(place)
        return () if entry is None else entry.blocks

    def owner_of(self, place: Hashable) -> str | None:
        entry = self._places.get(place)
        return None if entry is None else entry.owner

    def places(self, owner: str | None = None) -> Iterator[Hashable]:
        """Every place (of ``owner``), least recently recorded first."""
        for place, entry in self._places.items():
            if owner is None or entry.owner == owner:
                yield place

    def statistics(self) -> PrefixIndexStats:
        return PrefixIndexStats(
            owners=len(self._owners),
            places=len(self._places),
            blocks=self._blocks,
            max_places=self.max_places,
            max_blocks=self.max_blocks,
            evicted=self.evicted,
        )
