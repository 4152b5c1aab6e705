"""One request as the shared route code sees it, whichever front served it.

A model request reaches its dialect's route through one of two fronts: Quart (every
route) or the lean front (:mod:`.lean`: the hot completion routes, without Quart's
per-request machinery). Both open an :class:`Exchange` before the route runs, and
everything the routes share reads the request from it rather than from Quart's
globals: the host, the path (the shape of its errors), the headers (session names),
the authenticated caller, and the body when the front has read it already. The route
leaves in it what only the route knows and the request log and metrics need: the
model label, the relay's log fields, the token counts, how far its completion got.

It lives in a context variable: each request runs in a task of its own (quart-trio's
or hypercorn's), which sees its own value, and so do the tasks it starts (a stream
job), from a copy of its context. A front whose request runs in a task it started
(Quart's) learns of the exchange through :func:`watch_exchanges`, so that it can
record the request when it ends without an answer (:mod:`.metrics_endpoint`).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..engine.usage import Counts

if TYPE_CHECKING:
    from werkzeug.datastructures import Headers

    from ..host import Host
    from ..host.completion import Progress
    from .session_names import SessionNames

__all__ = [
    "UNRESOLVED",
    "Counts",
    "Exchange",
    "LowerHeaders",
    "current_exchange",
    "exchange_or_none",
    "open_exchange",
    "watch_exchanges",
]

UNRESOLVED = "(unresolved)"
"""The model label of a request whose model never resolved (404, 400 before routing)."""


class LowerHeaders(dict[str, str]):
    """Request headers by lower-cased name; :meth:`get` takes any case (as werkzeug's
    ``Headers`` does). A repeated header keeps its first value."""

    @classmethod
    def from_asgi(cls, raw: Iterable[tuple[bytes, bytes]]) -> LowerHeaders:
        out = cls()
        for name, value in raw:
            out.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        return out

    def get(self, key: str, default: Any = None) -> Any:
        return super().get(key.lower(), default)


@dataclass(slots=True, eq=False)
class Exchange:
    """One request: what the front knows of it, and what the route leaves for the
    request log and metrics (see the module docstring)."""

    host: Host
    path: str
    headers: Headers | Mapping[str, str]
    names: SessionNames
    t0: float = field(default_factory=time.perf_counter)
    caller: str | None = None
    """The HMAC identity of the key that authenticated it (None until authenticated)."""
    admin: bool = False
    raw: bytes | None = None
    """The body, when the front has read it (the lean front); None: the route reads it."""
    model: str = UNRESOLVED
    log: dict[str, Any] = field(default_factory=dict)
    counts: Counts | None = None
    progress: Progress | None = None
    """How far its completion got (the grant, the first token, the tokens generated):
    the relay's, kept up to date while it runs."""
    traced: bool = False
    """A model request: it is recorded in the request log, metrics and activity feed,
    once, whether it was answered or its client left (see :mod:`.metrics_endpoint`)."""
    recorded: bool = False
    client_left: bool = False
    """Its stream ended because the client went away or stopped reading."""


_current: contextvars.ContextVar[Exchange | None] = contextvars.ContextVar(
    "gezel_exchange", default=None
)
_watched: contextvars.ContextVar[list[Exchange] | None] = contextvars.ContextVar(
    "gezel_exchange_watch", default=None
)


def open_exchange(exchange: Exchange) -> Exchange:
    """Make ``exchange`` the current task's request (for the rest of the task: each
    request has a task of its own), and hand it to a :func:`watch_exchanges` around it."""
    _current.set(exchange)
    watched = _watched.get()
    if watched is not None:
        watched.append(exchange)
    return exchange


@contextlib.contextmanager
def watch_exchanges() -> Iterator[list[Exchange]]:
    """The exchanges opened within the block, in this task or in any task started from
    it (they see the same list through their copy of the context)."""
    opened: list[Exchange] = []
    token = _watched.set(opened)
    try:
        yield opened
    finally:
        _watched.reset(token)


def current_exchange() -> Exchange:
    """The current request. Raises RuntimeError outside one: never guess whose it is."""
    exchange = _current.get()
    if exchange is None:
        raise RuntimeError("no request is being served in this task")
    return exchange


def exchange_or_none() -> Exchange | None:
    """The current request, or None outside one."""
    return _current.get()
