"""Prefix blocks: what a request's prompt is, in a form the slot table can compare.

The caller cuts the request, as the engine will see it, into blocks and hands
:func:`prefix_blocks` their bytes: for chat, messages and Responses input, each
message's header (its role, name and tool fields, a :class:`Header`) then its text
in complete fixed-size pieces and a final block for the rest; for ``/completion``
and ``/infill``, complete fixed-size pieces of text or tokens.
Each block's value is a hash *chained* over every block before it, so one value
names a whole prefix: two requests share their first ``n`` blocks exactly when
their ``n``-th values are equal. The slot table records the blocks of the last
request that ran on each slot, and the scheduler sends a request to its owner's
slot whose blocks are a prefix of it (see :func:`~.admission.choose_slot`).

Placement only: blocks never decide isolation (that is the owner's business), so
a hash collision can cost a re-prefill, never a leak. Pure functions, no I/O.

Sharing nothing but headers is sharing nothing: every chat that opens with a user
message shares that message's header block, a handful of template tokens. A header
block's value has its lowest bit set (every other block's is clear), and
:func:`shared_blocks` (and :meth:`.PrefixIndex.longest`) count 0 for such a share,
so that a parked copy of another conversation of the owner is never restored (nor
a slot or replica preferred) for it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

__all__ = ["Header", "Prefix", "headers_only", "is_prefix", "prefix_blocks", "shared_blocks"]

Prefix = tuple[int, ...]
"""Chained block hashes of a request (``()``: unknown)."""

MAX_BLOCKS = 4096
"""Blocks kept per request: a longer one is compared on its first blocks only."""


class Header(str):
    """A part that only opens a message (its role, name, tool fields): its block's
    value is marked, and a share of headers alone counts for nothing
    (:func:`shared_blocks`). The caller makes its text unlike any other part's."""

    __slots__ = ()


def prefix_blocks(parts: Iterable[bytes | str]) -> Prefix:
    """The chained hashes of ``parts`` (at most :data:`MAX_BLOCKS`; ``parts`` is read
    no further): value ``i`` depends on parts ``0..i`` and their boundaries, nothing
    else; its lowest bit says whether part ``i`` is a :class:`Header`."""
    out: list[int] = []
    previous = b""
    for part in parts:
        if len(out) == MAX_BLOCKS:
            break
        data = part.encode("utf-8", "surrogatepass") if isinstance(part, str) else part
        h = hashlib.blake2b(digest_size=8)
        h.update(previous)
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
        previous = h.digest()
        value = int.from_bytes(previous, "little")
        out.append(value | 1 if isinstance(part, Header) else value & ~1)
    return tuple(out)


def shared_blocks(a: Prefix, b: Prefix) -> int:
    """How many leading blocks ``a`` and ``b`` share (binary search: the values are
    chained, so the first ``n`` agree exactly when the ``n``-th does); 0 when those
    are all message headers (:class:`Header`)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return 0 if headers_only(a, lo) else lo


def headers_only(blocks: Prefix, n: int) -> bool:
    """Whether the first ``n`` of ``blocks`` are all message headers (:class:`Header`),
    which is no shared conversation: a few template tokens. True for ``n`` 0."""
    return all(blocks[i] & 1 for i in range(n))


def is_prefix(head: Prefix, whole: Prefix) -> bool:
    """Whether ``head`` (non-empty) is a prefix of ``whole``."""
    return 0 < len(head) <= len(whole) and whole[len(head) - 1] == head[-1]
