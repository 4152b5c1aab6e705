"""The one exception-group unwrap: what a caller sees instead of a group.

Under trio's strict exception groups every nursery wraps what escapes it in an
exception group, even a single error. Every ``open_*`` boundary hands its
caller one exception instead, with :func:`unwrapping` around its body.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager

import trio


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def unwrap(
    group: BaseExceptionGroup[BaseException],
    *,
    several: Callable[[list[BaseException]], BaseException] | None = None,
) -> BaseException:
    """The one exception a caller should see instead of ``group``.

    The first leaf, depth first, that is not :class:`trio.Cancelled`: a real
    error beats the cancellations it caused in its sibling tasks. If every
    leaf is a Cancelled, the first of them, so that the cancel scope it
    belongs to still catches it. Any other leaves are dropped, unless
    ``several`` is given: when more than one leaf is a real error, the
    exception it makes of them all (in depth-first order) is the answer (the
    benchmark harness reports every failed request that way). A
    :class:`KeyboardInterrupt` or :class:`SystemExit` leaf beats every other:
    someone asked the process to stop, and no error report may swallow that.
    """
    leaves = list(_leaves(group))  # never empty: a group holds at least one exception
    for leaf in leaves:
        if isinstance(leaf, KeyboardInterrupt | SystemExit):
            return leaf
    real = [leaf for leaf in leaves if not isinstance(leaf, trio.Cancelled)]
    if not real:
        return leaves[0]
    if several is not None and len(real) > 1:
        return several(real)
    return real[0]


@asynccontextmanager
async def unwrapping() -> AsyncIterator[None]:
    """Re-raise an exception group leaving the block as its :func:`unwrap` leaf.

    The leaf leaves as itself: same object, its own traceback (the frames it
    was raised in, then the ones it has since passed), and its own
    ``__cause__``/``__context__``; the group is not chained to it, as with
    ``raise leaf from None``. Anything that is not a group passes through
    untouched.

    Cancellation: a block cancelled from outside leaves with a
    :class:`trio.Cancelled`, never a group of them, so the cancel scope that
    owns it catches it as usual; a real error raised alongside the
    cancellation wins over it.

    Use it as the outermost block of an ``@asynccontextmanager`` generator,
    around its ``yield``::

        async with unwrapping(), trio.open_nursery() as nursery:
            ...
            yield handle

    or as ``@unwrapping()`` on a coroutine function.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        leaf = unwrap(group)
        chain = leaf.__cause__, leaf.__context__, leaf.__suppress_context__
        try:
            raise leaf from None
        finally:
            # `raise` chained the group as the leaf's context; put back the leaf's own.
            leaf.__cause__, leaf.__context__, leaf.__suppress_context__ = chain
            del leaf  # no reference cycle through this frame
