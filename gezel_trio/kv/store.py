"""The parked-KV store: sessions' saved slots, per model, surviving engines and restarts.

A session's KV is *parked* when llama-server saves its slot to a file
(``POST /slots/{id}?action=save``) and *restored* into any slot of any later
engine process of the same model (``action=restore``). The files live in each
model's slot-save directory; this module keeps their index, in SQLite in the
state dir (``kv.sqlite``), so that what was parked outlives the engine process
that saved it, and the host process too.

An owner (a named session, a caller's keyless owner, a keyless conversation) may
hold several conversations at once: an agent and its sub-agents under one
session id, or a caller's keyless chats. Each parked *copy* records the prefix
blocks of what it holds (:mod:`gezel_trio.kv.prefix`), and
:meth:`KvStore.find` picks the owner's copy that shares the longest prefix with
a request. A new save replaces the owner's copies it continues (their blocks are
a prefix of its own, or all but their last block, the end of a message that has
since grown), so one conversation keeps one copy; an owner keeps at most
:attr:`KvStore.MAX_COPIES` per model. A copy is only ever found for its exact
owner: KV never crosses owners.

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
A touch (a restore's "used now") is the exception: it writes nothing itself, so that
a restore's request waits on no disk; the time goes to disk with the next write.
A write is not abandoned on cancellation (``trio.to_thread.run_sync`` waits
for its thread), so the two cannot diverge; once an entry's row is deleted, its
file is deleted too, cancelled or not (shielded).

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
import struct
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import trio

from .prefix import Prefix, is_prefix, shared_blocks
from .sessions import session_hash

__all__ = [
    "DEFAULT_BUDGET_CAP",
    "FILE_PATTERN",
    "KvCompat",
    "KvEntry",
    "KvModelStats",
    "KvParkingStats",
    "KvStore",
    "default_budget",
]

log = logging.getLogger("gezel_trio.kv.store")

FILE_PATTERN = re.compile(r"kv-[0-9a-f]{16}-[0-9a-f]{12}\.bin")
"""The names the store gives its files; only such files are ever deleted as orphans
(a user's ``--slot-save-path`` may hold other files)."""

LATE_FILES_KEPT = 64
"""Files of saves cut short that the store looks for after later saves (see
:meth:`KvStore.discard_file`); beyond, the oldest is left to the next start's sweep."""

UNLINK_TIMEOUT = 30.0
"""The deadline of the shield under which the files of dropped entries are deleted."""

DEFAULT_BUDGET_CAP = 32 * 1024**3
"""The default budget is a quarter of the state dir's free space, at most this."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS parked (
    model TEXT NOT NULL,
    session TEXT NOT NULL,
    caller TEXT,
    file TEXT NOT NULL,
    compat TEXT NOT NULL,
    tokens INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    saved_at REAL NOT NULL,
    used_at REAL NOT NULL,
    blocks BLOB NOT NULL DEFAULT x'',
    share_caller TEXT,
    PRIMARY KEY (model, file)
)
"""
_LEGACY_TABLE = "kv"
"""The index of the stores that kept one copy per session (blocks unknown): read once
into :data:`_SCHEMA`'s table, then dropped."""
_COLUMNS = (
    "model, session, caller, file, compat, tokens, bytes, saved_at, used_at, blocks, share_caller"
)


def pack_blocks(blocks: Prefix) -> bytes:
    """``blocks`` as stored in SQLite: 8 little-endian bytes each."""
    return struct.pack(f"<{len(blocks)}Q", *blocks)


def unpack_blocks(data: bytes | None) -> Prefix:
    """The inverse of :func:`pack_blocks` (a malformed value reads as unknown: ``()``)."""
    if not data or len(data) % 8:
        return ()
    return struct.unpack(f"<{len(data) // 8}Q", data)


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
    """One parked copy of a session's KV on one model. ``blocks``: the prefix blocks of
    what it holds (``()``: unknown)."""

    model: str
    session: str
    caller: str | None
    file: str
    compat: KvCompat
    tokens: int
    bytes: int
    saved_at: float
    used_at: float
    blocks: Prefix = ()
    share_caller: str | None = None
    """The caller whose other owners may start from this copy's prefix (a restore
    copies it into their slot; it stays this session's): the caller of a slot that
    shared prefixes within its caller when it was saved. None: nobody's."""

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
    """Saves that failed (an engine error, or no answer within ``park_timeout``)."""
    save_cancelled: int = 0
    """Saves cut short by a cancellation (the request's client left, a shutdown): no
    failure."""
    save_ms: float = 0.0
    saved_tokens: int = 0
    restores: int = 0
    restore_failures: int = 0
    """Restores the engine did not answer within ``park_timeout`` (an engine error is
    counted in ``ineffective``)."""
    restore_cancelled: int = 0
    """Restores cut short by a cancellation: no failure."""
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
class KvParkingStats:
    """A snapshot of one model's parking for ``/api/status`` and ``/metrics``: what is
    parked now (``parked`` copies, their ``bytes``), then its counters as they were
    (the fields of :class:`KvModelStats`, in its order)."""

    parked: int
    bytes: int
    saves: int
    save_failures: int
    save_cancelled: int
    save_ms: float
    saved_tokens: int
    restores: int
    restore_failures: int
    restore_cancelled: int
    restore_ms: float
    restored_tokens: int
    hits: int
    misses: int
    ineffective: int
    diverged: int
    dropped_incompatible: int
    evicted: int
    stop_parks: int
    stop_park_ms: float
    disabled: str | None

    @classmethod
    def of(cls, parked: int, size: int, counters: KvModelStats) -> KvParkingStats:
        return cls(parked, size, **dataclasses.asdict(counters))

    def as_dict(self) -> dict[str, object]:
        """JSON-ready: the totals, then every counter."""
        return dataclasses.asdict(self)


def _continues(new: Prefix, old: Prefix) -> bool:
    """Whether a copy with blocks ``new`` holds what one with ``old`` held: ``old`` is
    unknown, a prefix of ``new``, or shares all but its last block with it (a chat
    message's last block is the rest of its text, which changes as the message grows)."""
    if not old or is_prefix(old, new):
        return True
    return len(old) > 1 and shared_blocks(old, new) >= len(old) - 1


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
    _entries: dict[tuple[str, str], dict[str, KvEntry]] = field(default_factory=dict)
    """(model, session) -> file -> its copy."""
    _callers: collections.OrderedDict[str, str] = field(default_factory=collections.OrderedDict)
    stats: dict[str, KvModelStats] = field(default_factory=dict)
    orphans_deleted: int = 0
    _seq: int = 0
    _used: dict[tuple[str, str], float] = field(default_factory=dict)
    """(model, file) -> when it was last used: touches the index on disk lacks yet."""
    _late: collections.deque[tuple[str, str]] = field(
        default_factory=lambda: collections.deque(maxlen=LATE_FILES_KEPT)
    )
    """(model, file): discarded files the engine may still write (:meth:`discard_file`)."""

    MAX_CALLERS = 100_000
    MAX_COPIES = 8
    """Copies one owner keeps per model (conversations it holds at once); beyond, its
    least recently used one is evicted."""

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(cls, path: Path, *, budget_bytes: int, dirs: Mapping[str, Path]) -> KvStore:
        """Read the index at ``path`` (created if absent; the one-copy-per-session index
        of earlier versions is carried over), drop entries whose file is gone or whose
        model is no longer served, and delete our files that the index does not know.
        Blocking file and SQLite I/O: call it from a thread."""
        store = cls(path=Path(path), budget_bytes=int(budget_bytes), dirs=dict(dirs))
        for d in store.dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        with store._connect() as conn:
            conn.execute(_SCHEMA)
            columns = {row[1] for row in conn.execute("PRAGMA table_info(parked)")}
            if "share_caller" not in columns:  # an index from before prefix lending
                conn.execute("ALTER TABLE parked ADD COLUMN share_caller TEXT")
            legacy = conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name = ?",
                (_LEGACY_TABLE,),
            ).fetchone()
            if legacy is not None:
                conn.execute(
                    f"INSERT OR IGNORE INTO parked ({_COLUMNS}) SELECT model, session, caller, "
                    "file, compat, tokens, bytes, saved_at, used_at, x'', NULL "
                    f"FROM {_LEGACY_TABLE}"
                )
                conn.execute(f"DROP TABLE {_LEGACY_TABLE}")
            rows = conn.execute(f"SELECT {_COLUMNS} FROM parked").fetchall()
        gone: list[tuple[str, str]] = []
        for row in rows:
            model, session, caller, file, compat, tokens, size, saved_at, used_at, blocks = row[:10]
            share = row[10] if isinstance(row[10], str) else None
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
                    unpack_blocks(blocks if isinstance(blocks, bytes) else None),
                    share,
                )
            except (ValueError, KeyError, TypeError):
                gone.append((model, file))
                continue
            if home is None or not (home / file).is_file():
                gone.append((model, file))
                continue
            store._index(entry)
        if gone:
            with store._connect() as conn:
                conn.executemany("DELETE FROM parked WHERE model = ? AND file = ?", gone)
            log.info("kv store: %d entries had lost their file or model: dropped", len(gone))
        known = {(e.model, e.file) for e in store._all()}
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

    def _all(self) -> Iterable[KvEntry]:
        for copies in self._entries.values():
            yield from copies.values()

    def copies(self, model: str, session: str) -> list[KvEntry]:
        """Every parked copy of ``session`` on ``model``, most recently used first (no
        compatibility check)."""
        found = self._entries.get((model, session))
        if not found:
            return []
        return sorted(found.values(), key=lambda e: e.used_at, reverse=True)

    def entry(self, model: str, session: str) -> KvEntry | None:
        """The most recently used copy of ``session`` on ``model`` as indexed (no
        compatibility check)."""
        copies = self.copies(model, session)
        return copies[0] if copies else None

    def has_file(self, model: str, name: str) -> bool:
        """Whether an entry points at the file ``name`` of ``model``."""
        return any(e.model == model and e.file == name for e in self._all())

    def current(self, model: str, session: str, blocks: Prefix) -> bool:
        """Whether ``session`` has a copy on ``model`` that holds exactly ``blocks`` (a
        slot with that content needs no save)."""
        found = self._entries.get((model, session))
        return found is not None and any(e.blocks == blocks for e in found.values())

    def find(
        self,
        model: str,
        session: str,
        compat: KvCompat,
        *,
        ctx_per_slot: int | None,
        prefix: Prefix | None = None,
    ) -> KvEntry | None:
        """The copy ``session`` may restore on ``model`` now for a request of ``prefix``
        blocks, or None.

        The copy sharing the most leading blocks with ``prefix`` wins, and it must
        share at least one; a copy or a request whose blocks are unknown (``()``)
        may match too, after every real match. ``prefix`` None: the most recently
        used copy. Ties go to the most recently used. A copy that no longer fits
        (``compat`` differs, or it holds more tokens than a slot's context) is
        dropped and counted, synchronously; it is never returned.
        """
        ranked: list[tuple[int, float, KvEntry]] = []
        for entry in self.copies(model, session):
            if prefix is None or not prefix or not entry.blocks:
                score = 0
            else:
                score = shared_blocks(entry.blocks, prefix)
                if score == 0:
                    continue  # another conversation of the owner
            ranked.append((score, entry.used_at, entry))
        return self._first_fitting(ranked, compat, ctx_per_slot)

    def find_lent(
        self,
        model: str,
        caller: str,
        compat: KvCompat,
        *,
        ctx_per_slot: int | None,
        prefix: Prefix,
        besides: str,
    ) -> KvEntry | None:
        """The copy of another owner of ``caller`` (not ``besides``, the request's own)
        on ``model`` that a request of ``prefix`` blocks may start from: lent within
        its caller (its :attr:`KvEntry.share_caller` is ``caller``), sharing the most
        leading blocks with ``prefix`` (more than message headers; ties: the most
        recently used), and fitting as :meth:`find` checks (a copy that no longer
        fits is dropped). None: none. Never another caller's copy."""
        ranked: list[tuple[int, float, KvEntry]] = []
        for (home, session), copies in self._entries.items():
            if home != model or session == besides:
                continue
            for entry in copies.values():
                if entry.share_caller != caller or not entry.blocks:
                    continue
                score = shared_blocks(entry.blocks, prefix)
                if score:
                    ranked.append((score, entry.used_at, entry))
        return self._first_fitting(ranked, compat, ctx_per_slot)

    def _first_fitting(
        self, ranked: list[tuple[int, float, KvEntry]], compat: KvCompat, ctx: int | None
    ) -> KvEntry | None:
        """The best-ranked entry that still loads into the engine (``compat``, a slot of
        ``ctx`` tokens); the ones ahead of it that do not are dropped and counted."""
        ranked.sort(key=lambda r: (r[0], r[1]), reverse=True)
        for _score, _used, entry in ranked:
            reason = entry.compat.difference(compat)
            if reason is None and ctx is not None and entry.tokens > ctx:
                reason = f"{entry.tokens} tokens do not fit a slot of {ctx}"
            if reason is None:
                return entry
            self.model_stats(entry.model).dropped_incompatible += 1
            log.info(
                "parked KV of session %s on %s is not restored: %s; dropped",
                entry.session_id,
                entry.model,
                reason,
            )
            self._forget(entry)
            self._delete_soon([entry])
        return None

    def sessions(self, *, caller: str | None = None) -> list[KvEntry]:
        """Parked copies, most recently used first; only ``caller``'s when given."""
        entries = [e for e in self._all() if caller is None or e.caller == caller]
        return sorted(entries, key=lambda e: e.used_at, reverse=True)

    def by_id(self, session_id: str) -> list[KvEntry]:
        """Every copy, on every model, of the session shown as ``session_id``."""
        return [e for e in self._all() if e.session_id == session_id]

    def totals(self, model: str) -> tuple[int, int]:
        """(parked copies, bytes) of ``model``."""
        entries = [e for e in self._all() if e.model == model]
        return len(entries), sum(e.bytes for e in entries)

    def total_bytes(self) -> int:
        return sum(e.bytes for e in self._all())

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
        """Index ``entry`` (its file is on disk). It replaces the copies of its session on
        that model that it continues (:func:`_continues`: their blocks are unknown, a
        prefix of its own, or differ from its own only in their last block),
        and the session's least recently used copies beyond :attr:`MAX_COPIES`; their
        files are deleted. Then evict beyond the budget. Returns the entries evicted by
        the budget. Not abandoned on cancellation."""
        others = [e for e in self.copies(entry.model, entry.session) if e.file != entry.file]
        replaced = [e for e in others if _continues(entry.blocks, e.blocks)]
        kept = [e for e in others if e not in replaced]
        replaced += kept[self.MAX_COPIES - 1 :]  # most recently used first
        await trio.to_thread.run_sync(self._put_sync, entry, replaced, self._take_used())
        for e in replaced:
            self._forget(e)
        self._index(entry)
        gone = list(replaced)  # their rows are deleted: their files go, cancelled or not
        try:
            evicted = self._over_budget()
            if evicted:
                await trio.to_thread.run_sync(self._delete_rows_sync, evicted, {})
                for e in evicted:
                    self._forget(e)
                    self.model_stats(e.model).evicted += 1
                gone += evicted
        finally:
            await self._unlink(gone)
        return evicted

    def touch(self, model: str, session: str, file: str | None = None) -> None:
        """Mark ``session``'s copy ``file`` on ``model`` (None: each of its copies) used
        now (least-recently-used order). No I/O: a restore's request waits for nothing.
        The mirror, which eviction reads, has it at once; the index on disk gets it with
        its next write (a later save, drop or eviction), so a host that stops before one
        keeps the earlier order of those copies, and nothing else."""
        now = time.time()
        for e in self.copies(model, session):
            if file is None or e.file == file:
                e.used_at = now
                self._used[(e.model, e.file)] = now

    def _take_used(self) -> dict[tuple[str, str], float]:
        """The touches not yet written (see :meth:`touch`), handed to a write's thread."""
        used, self._used = self._used, {}
        return used

    async def drop(self, entries: Iterable[KvEntry]) -> None:
        """Remove ``entries`` from the index and delete their files."""
        doomed = [e for e in entries if self._indexed(e)]
        if not doomed:
            return
        await trio.to_thread.run_sync(self._delete_rows_sync, doomed, self._take_used())
        for e in doomed:
            self._forget(e)
        await self._unlink(doomed)

    def discard_file(self, model: str, name: str) -> None:
        """Delete a file no entry points at: a save whose indexing failed, or one cut
        short. The engine may still write the file of a save it has not answered (it
        runs a save whose client left): the name is kept, and :meth:`sweep_late` deletes
        the file once it appears."""
        if model not in self.dirs or not FILE_PATTERN.fullmatch(name):
            return  # not a file of ours: never deleted, never looked for
        if not self._unlinked(model, name) and (model, name) not in self._late:
            self._late.append((model, name))

    def sweep_late(self, model: str) -> int:
        """Delete the files that ``model``'s engine wrote for saves discarded before
        (:meth:`discard_file`); the number deleted. Call it when the engine has answered
        a later save: it runs the saves it is sent in turn. An unlink tried per name
        kept (at most :data:`LATE_FILES_KEPT`), on the caller's thread."""
        found = [(m, n) for m, n in self._late if m == model and self._unlinked(m, n)]
        for key in found:
            self._late.remove(key)
        self.orphans_deleted += len(found)
        return len(found)

    def _unlinked(self, model: str, name: str) -> bool:
        """Delete the file ``name`` of ``model`` (one of ours); whether it was there."""
        try:
            (self.dirs[model] / name).unlink()
        except OSError:
            return False
        return True

    # ------------------------------------------------------------------ internals

    def _index(self, entry: KvEntry) -> None:
        self._entries.setdefault((entry.model, entry.session), {})[entry.file] = entry

    def _indexed(self, entry: KvEntry) -> bool:
        found = self._entries.get((entry.model, entry.session))
        return found is not None and found.get(entry.file) is entry

    def _forget(self, entry: KvEntry) -> None:
        key = (entry.model, entry.session)
        found = self._entries.get(key)
        if found is not None and found.get(entry.file) is entry:
            del found[entry.file]
            if not found:
                del self._entries[key]

    async def _unlink(self, entries: list[KvEntry]) -> None:
        """Delete the files of ``entries``, whose rows are gone, even when the caller is
        cancelled: a row deleted without its file would leave a file nothing lists until
        the next start (``to_thread.run_sync`` checks for cancellation before it starts
        its thread; once started, the thread is waited for anyway)."""
        if not entries:
            return
        with trio.move_on_after(UNLINK_TIMEOUT, shield=True):
            await trio.to_thread.run_sync(self._unlink_sync, entries)

    def _delete_soon(self, entries: list[KvEntry]) -> None:
        """Delete rows and files now, synchronously (small: one row, one unlink)."""
        with contextlib.suppress(sqlite3.Error), self._connect() as conn:
            self._delete_rows(conn, entries)
        self._unlink_sync(entries)

    def _over_budget(self) -> list[KvEntry]:
        total = self.total_bytes()
        out: list[KvEntry] = []
        for entry in sorted(self._all(), key=lambda e: e.used_at):
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

    def _put_sync(
        self, entry: KvEntry, replaced: list[KvEntry], used: dict[tuple[str, str], float]
    ) -> None:
        with self._connect() as conn:
            conn.execute("BEGIN")
            self._write_used(conn, used)
            conn.execute(
                f"INSERT OR REPLACE INTO parked ({_COLUMNS}) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
                    pack_blocks(entry.blocks),
                    entry.share_caller,
                ),
            )
            self._delete_rows(conn, replaced)
            conn.execute("COMMIT")

    @staticmethod
    def _write_used(conn: sqlite3.Connection, used: dict[tuple[str, str], float]) -> None:
        conn.executemany(
            "UPDATE parked SET used_at = ? WHERE model = ? AND file = ?",
            [(at, model, file) for (model, file), at in used.items()],
        )

    def _delete_rows_sync(self, entries: list[KvEntry], used: dict[tuple[str, str], float]) -> None:
        with self._connect() as conn:
            conn.execute("BEGIN")
            self._write_used(conn, used)
            self._delete_rows(conn, entries)
            conn.execute("COMMIT")

    @staticmethod
    def _delete_rows(conn: sqlite3.Connection, entries: list[KvEntry]) -> None:
        conn.executemany(
            "DELETE FROM parked WHERE model = ? AND file = ?",
            [(e.model, e.file) for e in entries],
        )

    def _unlink_sync(self, entries: list[KvEntry]) -> None:
        for e in entries:
            d = self.dirs.get(e.model)
            if d is not None:
                with contextlib.suppress(OSError):
                    (d / e.file).unlink()

    def statistics(self, model: str) -> KvParkingStats:
        """One model's parking for status: totals (``parked``: copies) and counters."""
        parked, size = self.totals(model)
        return KvParkingStats.of(parked, size, self.model_stats(model))

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
