"""The parked-KV store: sessions' saved slots, per model, surviving engines and restarts.

A session's KV is *parked* when llama-server saves its slot to a file
(``POST /slots/{id}?action=save``) and *restored* into any slot of any later
engine process of the same model (``action=restore``). The files live in each
model's slot-save directory; this module keeps their index, in SQLite in the
state dir (``kv.sqlite``), so that what was parked outlives the engine process
that saved it, and the host process too.

An entry records what decides whether its file may be loaded again
(:class:`KvCompat`: the model file, the engine build and the KV-shaping engine
flags) and its token count; :meth:`KvStore.find` drops an entry whose
compatibility no longer holds instead of letting it be restored. The store is
bounded by bytes (``kv_store_bytes``): saving beyond the budget evicts the least
recently used entries of every model. At start, files in the store's
directories that look like ours (:data:`FILE_PATTERN`) and that the index does
not know are deleted, and entries whose file is gone are dropped.

Reads come from an in-memory mirror of the index (the request path never
waits on SQLite); writes run in a worker thread and update the mirror once
they are on disk, so the mirror never claims a file the database does not.
A write is not abandoned on cancellation (``trio.to_thread.run_sync`` waits
for its thread), so the two cannot diverge.

Each save goes to a new file name; the previous file of that session is
deleted only once the index points at the new one. A save cut short leaves at
most an unindexed file, which the next start deletes: never an index entry
that describes another file's content.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import sqlite3
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import trio

from .sessions import session_hash

__all__ = [
    "DEFAULT_BUDGET_CAP",
    "FILE_PATTERN",
    "KvCompat",
    "KvEntry",
    "KvModelStats",
    "KvStore",
    "default_budget",
]

log = logging.getLogger("gezel_trio.kvstore")

FILE_PATTERN = re.compile(r"kv-[0-9a-f]{16}-[0-9a-f]{12}\.bin")
"""The names the store gives its files; only such files are ever deleted as orphans
(a user's ``--slot-save-path`` may hold other files)."""

DEFAULT_BUDGET_CAP = 32 * 1024**3
"""The default budget is a quarter of the state dir's free space, at most this."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (
    model TEXT NOT NULL,
    session TEXT NOT NULL,
    caller TEXT,
    file TEXT NOT NULL,
    compat TEXT NOT NULL,
    tokens INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    saved_at REAL NOT NULL,
    used_at REAL NOT NULL,
    PRIMARY KEY (model, session)
)
"""


def default_budget(state_dir: Path) -> int:
    """A quarter of the free space where the state dir lives, capped at 32 GiB."""
    try:
        free = shutil.disk_usage(state_dir).free
    except OSError:
        return 1024**3
    return int(min(free // 4, DEFAULT_BUDGET_CAP))


@dataclass(frozen=True, slots=True)
class KvCompat:
    """What must be equal for a parked file to load into a later engine.

    ``model_file``: the GGUF's resolved path, size and mtime; ``build``: the
    engine build's fingerprint; ``kv_flags``: the engine flags that shape the KV
    cache (cache types, flash attention, full-size SWA cache), as the engine
    reads them (last occurrence). The context per slot is checked separately:
    it must hold the entry's tokens.
    """

    model_file: str
    build: str
    kv_flags: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> str:
        return json.dumps(
            {"model_file": self.model_file, "build": self.build, "kv_flags": self.kv_flags}
        )

    @classmethod
    def from_json(cls, text: str) -> KvCompat:
        data = json.loads(text)
        flags = tuple((str(k), str(v)) for k, v in data.get("kv_flags", ()))
        return cls(str(data["model_file"]), str(data["build"]), flags)

    def difference(self, other: KvCompat) -> str | None:
        """What differs from ``other`` in words, None when they are compatible."""
        if self.model_file != other.model_file:
            return "the model file changed"
        if self.build != other.build:
            return "the engine build changed"
        if self.kv_flags != other.kv_flags:
            mine, theirs = dict(self.kv_flags), dict(other.kv_flags)
            changed = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
            return f"engine flags changed: {', '.join(changed)}"
        return None


@dataclass(slots=True)
class KvEntry:
    """One parked session of one model."""

    model: str
    session: str
    caller: str | None
    file: str
    compat: KvCompat
    tokens: int
    bytes: int
    saved_at: float
    used_at: float

    @property
    def session_id(self) -> str:
        """The short id shown for the session (its hash)."""
        return session_hash(self.session) or ""

    def as_dict(self) -> dict[str, object]:
        return {
            "id": self.session_id,
            "model": self.model,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "saved_at": self.saved_at,
            "used_at": self.used_at,
        }


@dataclass(slots=True)
class KvModelStats:
    """Counters of one model's parking (status and ``/metrics``)."""

    saves: int = 0
    save_failures: int = 0
    save_ms: float = 0.0
    saved_tokens: int = 0
    restores: int = 0
    restore_ms: float = 0.0
    restored_tokens: int = 0
    hits: int = 0
    """Restores the next completion confirmed: it reused the restored tokens."""
    misses: int = 0
    """A keyed job whose session had nothing to restore (never parked, or dropped)."""
    ineffective: int = 0
    """Restores that did not take: fewer tokens than parked, or re-prefilled anyway."""
    diverged: int = 0
    """Restores whose next prompt was shorter than what was restored: the chat started
    over under the same name (neither a hit nor a failure of the restore)."""
    dropped_incompatible: int = 0
    evicted: int = 0
    stop_parks: int = 0
    stop_park_ms: float = 0.0
    """Time planned stops spent saving owned slots before the SIGTERM."""
    disabled: str | None = None
    """Why parking is off for this model (restores do not take), None while on."""


@dataclass(frozen=True, slots=True)
class _Drop:
    entry: KvEntry
    reason: str


@dataclass
class KvStore:
    """The index of parked KV files. Open with :meth:`open` (blocking: from a thread)."""

    path: Path
    budget_bytes: int
    dirs: dict[str, Path] = field(default_factory=dict)
    _entries: dict[tuple[str, str], KvEntry] = field(default_factory=dict)
    _callers: collections.OrderedDict[str, str] = field(default_factory=collections.OrderedDict)
    stats: dict[str, KvModelStats] = field(default_factory=dict)
    orphans_deleted: int = 0
    _seq: int = 0

    MAX_CALLERS = 100_000

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(cls, path: Path, *, budget_bytes: int, dirs: Mapping[str, Path]) -> KvStore:
        """Read the index at ``path`` (created if absent), drop entries whose file is
        gone or whose model is no longer served, and delete our files that the index
        does not know. Blocking file and SQLite I/O: call it from a thread."""
        store = cls(path=Path(path), budget_bytes=int(budget_bytes), dirs=dict(dirs))
        for d in store.dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        with store._connect() as conn:
            conn.execute(_SCHEMA)
            rows = conn.execute(
                "SELECT model, session, caller, file, compat, tokens, bytes, saved_at, used_at "
                "FROM kv"
            ).fetchall()
        gone: list[tuple[str, str]] = []
        for model, session, caller, file, compat, tokens, size, saved_at, used_at in rows:
            home = store.dirs.get(model)
            try:
                entry = KvEntry(
                    model,
                    session,
                    caller,
                    file,
                    KvCompat.from_json(compat),
                    int(tokens),
                    int(size),
                    float(saved_at),
                    float(used_at),
                )
            except (ValueError, KeyError, TypeError):
                gone.append((model, session))
                continue
            if home is None or not (home / file).is_file():
                gone.append((model, session))
                continue
            store._entries[(model, session)] = entry
        if gone:
            with store._connect() as conn:
                conn.executemany("DELETE FROM kv WHERE model = ? AND session = ?", gone)
            log.info("kv store: %d entries had lost their file or model: dropped", len(gone))
        known = {(e.model, e.file) for e in store._entries.values()}
        for model, d in store.dirs.items():
            for child in d.iterdir():
                if FILE_PATTERN.fullmatch(child.name) and (model, child.name) not in known:
                    with contextlib.suppress(OSError):
                        child.unlink()
                        store.orphans_deleted += 1
        if store.orphans_deleted:
            log.info("kv store: deleted %d files the index did not know", store.orphans_deleted)
        for model in store.dirs:
            store.stats.setdefault(model, KvModelStats())
        store._evict_over_budget_sync()
        return store

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=10.0, isolation_level=None)
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    # ------------------------------------------------------------------ reads

    def model_stats(self, model: str) -> KvModelStats:
        return self.stats.setdefault(model, KvModelStats())

    def entry(self, model: str, session: str) -> KvEntry | None:
        """The entry of ``session`` on ``model`` as indexed (no compatibility check)."""
        return self._entries.get((model, session))

    def find(
        self, model: str, session: str, compat: KvCompat, *, ctx_per_slot: int | None
    ) -> KvEntry | None:
        """The entry ``session`` may restore on ``model`` now, or None.

        An entry that no longer fits (``compat`` differs, or it holds more tokens
        than a slot's context) is dropped and counted, in the background; it is
        never returned.
        """
        entry = self._entries.get((model, session))
        if entry is None:
            return None
        reason = entry.compat.difference(compat)
        if reason is None and ctx_per_slot is not None and entry.tokens > ctx_per_slot:
            reason = f"{entry.tokens} tokens do not fit a slot of {ctx_per_slot}"
        if reason is None:
            return entry
        self.model_stats(model).dropped_incompatible += 1
        log.info(
            "parked KV of session %s on %s is not restored: %s; dropped",
            entry.session_id,
            model,
            reason,
        )
        self._forget(entry)
        self._delete_soon([entry])
        return None

    def sessions(self, *, caller: str | None = None) -> list[KvEntry]:
        """Parked entries, most recently used first; only ``caller``'s when given."""
        entries = [e for e in self._entries.values() if caller is None or e.caller == caller]
        return sorted(entries, key=lambda e: e.used_at, reverse=True)

    def by_id(self, session_id: str) -> list[KvEntry]:
        """Every model's entry of the session shown as ``session_id``."""
        return [e for e in self._entries.values() if e.session_id == session_id]

    def totals(self, model: str) -> tuple[int, int]:
        """(parked sessions, bytes) of ``model``."""
        entries = [e for e in self._entries.values() if e.model == model]
        return len(entries), sum(e.bytes for e in entries)

    def total_bytes(self) -> int:
        return sum(e.bytes for e in self._entries.values())

    # ------------------------------------------------------------------ callers

    def note_caller(self, session: str, caller: str) -> None:
        """Remember whose ``session`` is (for listing a caller's own sessions)."""
        self._callers[session] = caller
        self._callers.move_to_end(session)
        while len(self._callers) > self.MAX_CALLERS:
            self._callers.popitem(last=False)

    def caller_of(self, session: str) -> str | None:
        return self._callers.get(session)

    # ------------------------------------------------------------------ writes

    def new_file_name(self, session: str) -> str:
        """A fresh file name for a save of ``session`` (never the name of its last save)."""
        self._seq += 1
        stamp = (time.time_ns() // 1000 + self._seq) & 0xFFFFFFFFFFFF
        return f"kv-{session_hash(session)}-{stamp:012x}.bin"

    async def put(self, entry: KvEntry) -> list[KvEntry]:
        """Index ``entry`` (its file is on disk), replacing the session's previous one on
        that model (whose file is deleted), then evict beyond the budget. Returns the
        entries evicted. Not abandoned on cancellation."""
        key = (entry.model, entry.session)
        previous = self._entries.get(key)
        await trio.to_thread.run_sync(self._put_sync, entry)
        self._entries[key] = entry
        old = [previous] if previous is not None and previous.file != entry.file else []
        evicted = self._over_budget()
        if evicted:
            await trio.to_thread.run_sync(self._delete_rows_sync, evicted)
            for e in evicted:
                self._forget(e)
                self.model_stats(e.model).evicted += 1
        await trio.to_thread.run_sync(self._unlink_sync, old + evicted)
        return evicted

    async def touch(self, model: str, session: str) -> None:
        """Mark ``session``'s entry on ``model`` used now (least-recently-used order)."""
        entry = self._entries.get((model, session))
        if entry is None:
            return
        now = time.time()
        await trio.to_thread.run_sync(self._touch_sync, model, session, now)
        entry.used_at = now

    async def drop(self, entries: Iterable[KvEntry]) -> None:
        """Remove ``entries`` from the index and delete their files."""
        doomed = [e for e in entries if self._entries.get((e.model, e.session)) is e]
        if not doomed:
            return
        await trio.to_thread.run_sync(self._delete_rows_sync, doomed)
        for e in doomed:
            self._forget(e)
        await trio.to_thread.run_sync(self._unlink_sync, doomed)

    def discard_file(self, model: str, name: str) -> None:
        """Delete a file no entry points at (a save whose indexing failed)."""
        d = self.dirs.get(model)
        if d is not None and FILE_PATTERN.fullmatch(name):
            with contextlib.suppress(OSError):
                (d / name).unlink()

    # ------------------------------------------------------------------ internals

    def _forget(self, entry: KvEntry) -> None:
        key = (entry.model, entry.session)
        if self._entries.get(key) is entry:
            del self._entries[key]

    def _delete_soon(self, entries: list[KvEntry]) -> None:
        """Delete rows and files now, synchronously (small: one row, one unlink)."""
        with contextlib.suppress(sqlite3.Error), self._connect() as conn:
            self._delete_rows(conn, entries)
        self._unlink_sync(entries)

    def _over_budget(self) -> list[KvEntry]:
        total = self.total_bytes()
        out: list[KvEntry] = []
        for entry in sorted(self._entries.values(), key=lambda e: e.used_at):
            if total <= self.budget_bytes:
                break
            out.append(entry)
            total -= entry.bytes
        return out

    def _evict_over_budget_sync(self) -> None:
        evicted = self._over_budget()
        if not evicted:
            return
        with self._connect() as conn:
            self._delete_rows(conn, evicted)
        for e in evicted:
            self._forget(e)
            self.model_stats(e.model).evicted += 1
        self._unlink_sync(evicted)

    def _put_sync(self, entry: KvEntry) -> None:
        with self._connect() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO kv (model, session, caller, file, compat, tokens, "
                "bytes, saved_at, used_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    entry.model,
                    entry.session,
                    entry.caller,
                    entry.file,
                    entry.compat.to_json(),
                    entry.tokens,
                    entry.bytes,
                    entry.saved_at,
                    entry.used_at,
                ),
            )

    def _touch_sync(self, model: str, session: str, now: float) -> None:
        with self._connect() as conn:
            conn.execute(
                "UPDATE kv SET used_at = ? WHERE model = ? AND session = ?", (now, model, session)
            )

    def _delete_rows_sync(self, entries: list[KvEntry]) -> None:
        with self._connect() as conn:
            self._delete_rows(conn, entries)

    @staticmethod
    def _delete_rows(conn: sqlite3.Connection, entries: list[KvEntry]) -> None:
        conn.executemany(
            "DELETE FROM kv WHERE model = ? AND session = ? AND file = ?",
            [(e.model, e.session, e.file) for e in entries],
        )

    def _unlink_sync(self, entries: list[KvEntry]) -> None:
        for e in entries:
            d = self.dirs.get(e.model)
            if d is not None:
                with contextlib.suppress(OSError):
                    (d / e.file).unlink()

    def statistics(self, model: str) -> dict[str, object]:
        """One model's parking for status: totals and counters."""
        parked, size = self.totals(model)
        return {"parked": parked, "bytes": size, **dataclasses.asdict(self.model_stats(model))}

    def __post_init__(self) -> None:
        if self.budget_bytes < 0:
            raise ValueError("the kv store budget must be >= 0 bytes")


def file_identity(path: str) -> str:
    """The model file's identity for :class:`KvCompat`: resolved path, size, mtime."""
    try:
        st = os.stat(path)
    except OSError:
        return f"{path}|missing"
    return f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}"
