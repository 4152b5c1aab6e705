"""The names clients gave their sessions, kept so a caller sees its own chats by name."""

from __future__ import annotations

import collections

__all__ = ["SessionNames"]


class SessionNames:
    """The names clients sent for their sessions, by session id, so that a caller can
    see its own chats by the name it gave them. In memory only and bounded (the least
    recently used are forgotten): a name is the caller's own data, shown back to that
    caller alone, never logged and never written to disk."""

    __slots__ = ("_names", "limit")

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._names: collections.OrderedDict[str, str] = collections.OrderedDict()

    def __repr__(self) -> str:
        return f"<SessionNames {len(self._names)} of at most {self.limit}>"

    def note(self, session: str, name: str) -> None:
        self._names[session] = name
        self._names.move_to_end(session)
        while len(self._names) > self.limit:
            self._names.popitem(last=False)

    def name_of(self, session: str) -> str | None:
        return self._names.get(session)
