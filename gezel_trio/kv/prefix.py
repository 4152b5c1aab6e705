"""Prefix blocks: what a request's prompt is, in a form the slot table can compare.

The caller cuts the request, as the engine will see it, into blocks (one per
message for chat, messages and responses; fixed-size pieces of text or tokens
for ``/completion`` and ``/infill``) and hands :func:`prefix_blocks` their bytes.
Each block's value is a hash *chained* over every block before it, so one value
names a whole prefix: two requests share their first ``n`` blocks exactly when
their ``n``-th values are equal. The slot table records the blocks of the last
request that ran on each slot, and the scheduler sends a request to its owner's
slot whose blocks are a prefix of it (see :func:`~.admission.choose_slot`).

Placement only: blocks never decide isolation (that is the owner's business), so
a hash collision can cost a re-prefill, never a leak. Pure functions, no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

__all__ = ["Prefix", "is_prefix", "prefix_blocks", "shared_blocks"]

Prefix = tuple[int, ...]
"""Chained block hashes of a request (``()``: unknown)."""

MAX_BLOCKS = 4096
"""Blocks kept per request: a longer one is compared on its first blocks only."""


def prefix_blocks(parts: Iterable[bytes | str]) -> Prefix:
    """The chained hashes of ``parts`` (at most :data:`MAX_BLOCKS`): value ``i``
    depends on parts ``0..i`` and their boundaries, nothing else."""
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
        out.append(int.from_bytes(previous, "little"))
    return tuple(out)


def shared_blocks(a: Prefix, b: Prefix) -> int:
    """How many leading blocks ``a`` and ``b`` share (binary search: the values are
    chained, so the first ``n`` agree exactly when the ``n``-th does)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def is_prefix(head: Prefix, whole: Prefix) -> bool:
    """Whether ``head`` (non-empty) is a prefix of ``whole``."""
    return 0 < len(head) <= len(whole) and whole[len(head) - 1] == head[-1]
