"""The parked-KV store: its SQLite index, compatibility, the byte budget, orphans."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest
import trio
import trio.lowlevel

from gezel_trio.engine.argv import kv_shape_flags
from gezel_trio.kv.prefix import prefix_blocks
from gezel_trio.kv.store import FILE_PATTERN, KvCompat, KvEntry, KvStore

COMPAT = KvCompat(model_file="/m/tiny.gguf|100|1", build="b1", kv_flags=kv_shape_flags([]))


def _open(tmp_path: Path, budget: int = 10_000, models: tuple[str, ...] = ("a", "b")) -> KvStore:
    dirs = {m: tmp_path / "slots" / m for m in models}
    return KvStore.open(tmp_path / "kv.sqlite", budget_bytes=budget, dirs=dirs)


async def _park(
    store: KvStore,
    model: str,
    session: str,
    *,
    size: int = 100,
    tokens: int = 50,
    caller: str | None = "caller-1",
    compat: KvCompat = COMPAT,
) -> KvEntry:
    """What the runtime does after a save: the engine wrote the file, then it is indexed."""
    name = store.new_file_name(session)
    (store.dirs[model] / name).write_bytes(b"x" * size)
    now = time.time()
    entry = KvEntry(model, session, caller, name, compat, tokens, size, now, now)
    await store.put(entry)
    return entry


async def test_an_entry_survives_reopening(tmp_path: Path) -> None:
    store = _open(tmp_path)
    entry = await _park(store, "a", "s" * 64)
    again = _open(tmp_path)
    found = again.find("a", "s" * 64, COMPAT, ctx_per_slot=1024)
    assert found is not None
    assert (found.file, found.tokens, found.bytes, found.caller) == (
        entry.file,
        50,
        100,
        "caller-1",
    )
    assert again.totals("a") == (1, 100)
    assert again.find("b", "s" * 64, COMPAT, ctx_per_slot=1024) is None  # per model


async def test_a_new_save_replaces_the_previous_file(tmp_path: Path) -> None:
    store = _open(tmp_path)
    first = await _park(store, "a", "s1")
    second = await _park(store, "a", "s1", size=300)
    assert first.file != second.file
    assert not (store.dirs["a"] / first.file).exists()
    assert (store.dirs["a"] / second.file).exists()
    assert store.totals("a") == (1, 300)


@pytest.mark.parametrize(
    ("now", "why"),
    [
        (KvCompat("/m/tiny.gguf|100|2", "b1", COMPAT.kv_flags), "model file"),
        (KvCompat(COMPAT.model_file, "b2", COMPAT.kv_flags), "engine build"),
        (
            KvCompat(COMPAT.model_file, "b1", kv_shape_flags(["--cache-type-k", "q8_0"])),
            "--cache-type-k",
        ),
        (KvCompat(COMPAT.model_file, "b1", kv_shape_flags(["-fa", "on"])), "--flash-attn"),
        (KvCompat(COMPAT.model_file, "b1", kv_shape_flags(["--swa-full"])), "--swa-full"),
    ],
)
async def test_an_incompatible_entry_is_dropped_not_returned(
    tmp_path: Path, now: KvCompat, why: str
) -> None:
    store = _open(tmp_path)
    entry = await _park(store, "a", "s1")
    assert why in str(now.difference(COMPAT))
    assert store.find("a", "s1", now, ctx_per_slot=1024) is None
    assert store.model_stats("a").dropped_incompatible == 1
    assert not (store.dirs["a"] / entry.file).exists()
    assert _open(tmp_path).entry("a", "s1") is None  # gone from the index on disk too


async def test_an_entry_larger_than_a_slot_is_dropped(tmp_path: Path) -> None:
    store = _open(tmp_path)
    await _park(store, "a", "s1", tokens=900)
    assert store.find("a", "s1", COMPAT, ctx_per_slot=1024) is not None
    assert store.find("a", "s1", COMPAT, ctx_per_slot=512) is None
    assert store.model_stats("a").dropped_incompatible == 1


def test_kv_flags_read_the_last_occurrence_as_the_engine_does() -> None:
    flags = dict(kv_shape_flags(["-ctk", "f16", "--cache-type-k", "q8_0", "-fa", "--swa-full"]))
    assert flags["--cache-type-k"] == "q8_0"
    assert flags["--cache-type-v"] == "default"
    assert flags["--flash-attn"] == "on"  # bare -fa
    assert flags["--swa-full"] == "on"
    assert dict(kv_shape_flags(["-fa", "off"]))["--flash-attn"] == "off"
    assert dict(kv_shape_flags(["-kvu", "--no-kv-unified"]))["--kv-unified"] == "off"


async def test_the_byte_budget_holds_under_a_fill_evicting_least_recently_used(
    tmp_path: Path,
) -> None:
    store = _open(tmp_path, budget=1000)
    parked: list[KvEntry] = []
    for i in range(30):
        model = "a" if i % 2 else "b"
        parked.append(await _park(store, model, f"s{i}", size=90 + i))
        await trio.lowlevel.checkpoint()
        assert store.total_bytes() <= 1000
        on_disk = sum(p.stat().st_size for d in store.dirs.values() for p in d.iterdir())
        assert on_disk == store.total_bytes()  # no file outlives its entry
    kept = {e.session for e in store.sessions()}
    # the most recent ones are kept, over both models
    assert {"s29", "s28", "s27"} <= kept and "s0" not in kept
    assert store.entry("b", "s22") is not None and store.entry("a", "s23") is not None
    store.touch("a", "s23")  # used now: the next eviction spares it
    await _park(store, "b", "big", size=500)
    assert store.entry("a", "s23") is not None
    assert store.entry("b", "s22") is None  # the least recently used went first
    evicted = store.model_stats("a").evicted + store.model_stats("b").evicted
    assert evicted == 30 + 1 - len(store.sessions())


async def test_a_touch_writes_nothing_and_goes_to_disk_with_the_next_write(
    tmp_path: Path,
) -> None:
    """A restore marks its copy used without waiting on SQLite (it is on the request's
    critical path); the index on disk gets the time with the store's next write."""
    store = _open(tmp_path)
    old = await _park(store, "a", "s1")
    other = await _park(store, "a", "s2")
    store.touch("a", "s1", old.file)
    touched = store.entry("a", "s1")
    assert touched is not None and touched.used_at > old.saved_at  # the mirror has it now
    on_disk = _open(tmp_path).entry("a", "s1")
    assert on_disk is not None and on_disk.used_at == old.saved_at  # nothing written yet
    await store.drop([other])  # the next write carries it
    on_disk = _open(tmp_path).entry("a", "s1")
    assert on_disk is not None and on_disk.used_at == touched.used_at
    store.touch("a", "s1")
    again = store.entry("a", "s1")
    assert again is not None
    await _park(store, "b", "s3")  # so does a save
    on_disk = _open(tmp_path).entry("a", "s1")
    assert on_disk is not None and on_disk.used_at == again.used_at


async def test_a_budget_of_zero_keeps_nothing(tmp_path: Path) -> None:
    store = _open(tmp_path, budget=0)
    entry = await _park(store, "a", "s1")
    assert store.entry("a", "s1") is None
    assert not (store.dirs["a"] / entry.file).exists()


async def test_orphans_are_deleted_at_start_and_other_files_kept(tmp_path: Path) -> None:
    store = _open(tmp_path)
    kept = await _park(store, "a", "s1")
    orphan = store.new_file_name("s2")
    (store.dirs["a"] / orphan).write_bytes(b"left by a save cut short")
    assert FILE_PATTERN.fullmatch(orphan)
    user_file = store.dirs["a"] / "notes.bin"  # a user's slot-save dir may hold anything
    user_file.write_bytes(b"mine")
    lost = await _park(store, "b", "s3")
    (store.dirs["b"] / lost.file).unlink()  # its file vanished while we were down
    again = _open(tmp_path)
    assert again.orphans_deleted == 1
    assert not (again.dirs["a"] / orphan).exists()
    assert user_file.exists()
    assert (again.dirs["a"] / kept.file).exists()
    assert again.entry("a", "s1") is not None
    assert again.entry("b", "s3") is None


def test_a_file_written_after_its_save_was_cut_short_is_deleted_by_a_later_sweep(
    tmp_path: Path,
) -> None:
    """The engine runs a save whose client left: its file appears after the runtime
    discarded the name. The next sweep of that model deletes it, and only it."""
    store = _open(tmp_path)
    cut = store.new_file_name("s1")
    store.discard_file("a", cut)  # nothing written yet
    assert store.sweep_late("b") == 0 and store.sweep_late("a") == 0
    (store.dirs["a"] / cut).write_bytes(b"written once the engine ran the save")
    other = store.dirs["a"] / store.new_file_name("s2")  # not discarded: none of the sweep's
    other.write_bytes(b"x")
    assert store.sweep_late("b") == 0  # another model's sweep leaves it
    assert (store.dirs["a"] / cut).exists()
    assert store.sweep_late("a") == 1
    assert not (store.dirs["a"] / cut).exists() and other.exists()
    assert store.orphans_deleted == 1
    (store.dirs["a"] / cut).write_bytes(b"again")  # a name is swept once
    assert store.sweep_late("a") == 0
    user_file = store.dirs["a"] / "notes.bin"  # not a name of ours: never deleted
    user_file.write_bytes(b"mine")
    store.discard_file("a", user_file.name)
    store.discard_file("gone", store.new_file_name("s3"))  # a model it keeps no files of
    assert store.sweep_late("a") == 0 and store.sweep_late("gone") == 0
    assert user_file.exists()


def test_a_file_written_before_its_discard_is_deleted_at_once(tmp_path: Path) -> None:
    store = _open(tmp_path)
    name = store.new_file_name("s1")
    (store.dirs["a"] / name).write_bytes(b"x")
    store.discard_file("a", name)
    assert not (store.dirs["a"] / name).exists()
    (store.dirs["a"] / name).write_bytes(b"x")
    assert store.sweep_late("a") == 0  # not kept: it was there to delete


async def test_a_model_no_longer_served_loses_its_entries(tmp_path: Path) -> None:
    store = _open(tmp_path)
    await _park(store, "b", "s1")
    again = _open(tmp_path, models=("a",))
    assert again.sessions() == []


async def test_sessions_list_per_caller_and_drop(tmp_path: Path) -> None:
    store = _open(tmp_path)
    mine = await _park(store, "a", "s1", caller="me")
    await _park(store, "b", "s1", caller="me")
    await _park(store, "a", "s2", caller="them")
    assert {(e.model, e.session) for e in store.sessions(caller="me")} == {("a", "s1"), ("b", "s1")}
    assert len(store.sessions()) == 3
    same = store.by_id(mine.session_id)
    assert {e.model for e in same} == {"a", "b"}
    await store.drop(same)
    assert [e.session for e in store.sessions()] == ["s2"]
    assert not any(p.name == mine.file for p in store.dirs["a"].iterdir())
    assert [e.session for e in _open(tmp_path).sessions()] == ["s2"]


# --------------------------------------------------------------------------- copies


async def _copy(store: KvStore, session: str, blocks: tuple[int, ...], **kw: object) -> KvEntry:
    name = store.new_file_name(session)
    (store.dirs["a"] / name).write_bytes(b"x" * 100)
    now = time.time()
    entry = KvEntry("a", session, "caller-1", name, COMPAT, 50, 100, now, now, blocks)
    await store.put(entry)
    await trio.lowlevel.checkpoint()
    return entry


async def test_an_owner_keeps_one_copy_per_conversation_found_by_longest_prefix(
    tmp_path: Path,
) -> None:
    store = _open(tmp_path)
    main = await _copy(store, "s1", (1, 2, 3))
    sub = await _copy(store, "s1", (7, 8))
    assert {e.file for e in store.copies("a", "s1")} == {main.file, sub.file}
    assert store.find("a", "s1", COMPAT, ctx_per_slot=1024, prefix=(1, 2, 3, 4)) == main
    assert store.find("a", "s1", COMPAT, ctx_per_slot=1024, prefix=(1, 2, 9)) == main  # 2 shared
    assert store.find("a", "s1", COMPAT, ctx_per_slot=1024, prefix=(7, 8, 9)) == sub
    assert store.find("a", "s1", COMPAT, ctx_per_slot=1024, prefix=(5,)) is None  # shares none
    assert store.find("a", "s2", COMPAT, ctx_per_slot=1024, prefix=(1, 2, 3)) is None  # owner
    assert store.find("a", "s1", COMPAT, ctx_per_slot=1024) == sub  # most recently used
    assert store.current("a", "s1", (1, 2, 3)) and not store.current("a", "s1", (1, 2))
    # a later turn of a conversation replaces its copy; the other conversation stays
    longer = await _copy(store, "s1", (1, 2, 3, 4, 5))
    assert {e.file for e in store.copies("a", "s1")} == {longer.file, sub.file}
    assert not (store.dirs["a"] / main.file).exists()
    assert store.totals("a") == (2, 200)
    # a branch (not a continuation) is a copy of its own, and the best match wins
    branch = await _copy(store, "s1", (1, 2, 6))
    assert store.find("a", "s1", COMPAT, ctx_per_slot=1024, prefix=(1, 2, 6, 7)) == branch
    assert store.find("a", "s1", COMPAT, ctx_per_slot=1024, prefix=(1, 2, 3, 4, 5, 6)) == longer
    # blocks and copies survive a restart; deleting the session deletes every copy
    again = _open(tmp_path)
    assert again.find("a", "s1", COMPAT, ctx_per_slot=1024, prefix=(7, 8)) is not None
    assert {e.blocks for e in again.copies("a", "s1")} == {(1, 2, 3, 4, 5), (7, 8), (1, 2, 6)}
    await again.drop(again.by_id(main.session_id))
    assert again.copies("a", "s1") == [] and _open(tmp_path).sessions() == []
    assert not any(FILE_PATTERN.fullmatch(p.name) for p in again.dirs["a"].iterdir())


async def test_a_copy_whose_last_message_grew_replaces_the_one_before(tmp_path: Path) -> None:
    """A chat message's last block is the rest of its text: a message that grows ends in
    another block, and its new copy replaces the old one instead of piling up."""
    store = _open(tmp_path)
    before = await _copy(store, "s1", (1, 2, 3))
    other = await _copy(store, "s1", (1, 9, 9, 9))  # shares one block of four: its own
    grown = await _copy(store, "s1", (1, 2, 4, 5))  # (1, 2) shared, then grew
    assert {e.file for e in store.copies("a", "s1")} == {grown.file, other.file}
    assert not (store.dirs["a"] / before.file).exists()


async def test_an_owner_keeps_at_most_max_copies(tmp_path: Path) -> None:
    store = _open(tmp_path, budget=100_000)
    first = await _copy(store, "s1", (100,))
    for i in range(KvStore.MAX_COPIES):
        await _copy(store, "s1", (101 + i,))
    assert len(store.copies("a", "s1")) == KvStore.MAX_COPIES
    assert first not in store.copies("a", "s1")  # the least recently used went
    assert len(_open(tmp_path, budget=100_000).copies("a", "s1")) == KvStore.MAX_COPIES


async def test_an_unknown_copy_is_a_last_resort_and_replaced_by_the_next_save(
    tmp_path: Path,
) -> None:
    store = _open(tmp_path)
    unknown = await _copy(store, "s1", ())
    assert store.find("a", "s1", COMPAT, ctx_per_slot=1024, prefix=(1, 2)) == unknown
    known = await _copy(store, "s1", (1, 2))
    assert store.copies("a", "s1") == [known]


async def test_an_index_of_one_copy_per_session_is_carried_over(tmp_path: Path) -> None:
    """The index earlier versions wrote (table ``kv``, one row per session) is read into
    the new one at start, each entry a copy with unknown blocks."""
    import sqlite3

    dirs = tmp_path / "slots" / "a"
    dirs.mkdir(parents=True)
    (dirs / "kv-0123456789abcdef-000000000001.bin").write_bytes(b"x" * 10)
    conn = sqlite3.connect(tmp_path / "kv.sqlite")
    conn.execute(
        "CREATE TABLE kv (model TEXT NOT NULL, session TEXT NOT NULL, caller TEXT, "
        "file TEXT NOT NULL, compat TEXT NOT NULL, tokens INTEGER NOT NULL, "
        "bytes INTEGER NOT NULL, saved_at REAL NOT NULL, used_at REAL NOT NULL, "
        "PRIMARY KEY (model, session))"
    )
    conn.execute(
        "INSERT INTO kv VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        ("a", "s1", "me", "kv-0123456789abcdef-000000000001.bin", COMPAT.to_json(), 5, 10, 1, 1),
    )
    conn.commit()
    conn.close()
    store = _open(tmp_path)
    entry = store.find("a", "s1", COMPAT, ctx_per_slot=1024, prefix=(1,))
    assert entry is not None and entry.blocks == () and entry.caller == "me"
    assert _open(tmp_path).entry("a", "s1") is not None  # migrated once, kept


async def test_cancellation_while_a_copy_is_indexed_or_dropped_leaves_no_file(
    tmp_path: Path,
) -> None:
    """Cancellation that lands while a save is being indexed (the write is not
    abandoned), or while a drop deletes its rows, still deletes the files of the rows
    that went: a replaced or dropped copy leaves no file that nothing lists."""
    store = _open(tmp_path)
    await _copy(store, "s1", (1,))  # the conversation's earlier turn
    token = trio.lowlevel.current_trio_token()
    real_put, real_delete = store._put_sync, store._delete_rows_sync
    name = store.new_file_name("s1")
    (store.dirs["a"] / name).write_bytes(b"x" * 100)
    now = time.time()
    longer = KvEntry("a", "s1", "caller-1", name, COMPAT, 60, 100, now, now, (1, 2))

    with trio.CancelScope() as scope:

        def put_then_cancel(*args: object) -> None:
            real_put(*args)  # type: ignore[arg-type]
            trio.from_thread.run_sync(scope.cancel, trio_token=token)

        store._put_sync = put_then_cancel  # type: ignore[method-assign]
        await store.put(longer)  # replaces old (a conversation's later turn)
        await trio.lowlevel.checkpoint()
    assert scope.cancelled_caught
    assert store.copies("a", "s1") == [longer]
    assert {p.name for p in store.dirs["a"].iterdir()} == {longer.file}  # the earlier's went
    assert [e.file for e in _open(tmp_path).sessions()] == [longer.file]  # (deletes orphans)

    with trio.CancelScope() as scope:

        def delete_then_cancel(*args: object) -> None:
            real_delete(*args)  # type: ignore[arg-type]
            trio.from_thread.run_sync(scope.cancel, trio_token=token)

        store._delete_rows_sync = delete_then_cancel  # type: ignore[method-assign]
        await store.drop([longer])
        await trio.lowlevel.checkpoint()
    assert scope.cancelled_caught
    assert store.sessions() == [] and list(store.dirs["a"].iterdir()) == []
    assert _open(tmp_path).sessions() == []


async def test_a_copy_is_lent_only_within_the_caller_it_was_saved_for(tmp_path: Path) -> None:
    """``find_lent``: another owner's copy of the request's caller, sharing the most
    blocks; never another caller's, nor a copy lent to nobody, nor the request's own
    owner's; and ``share_caller`` survives reopening (an older index gains the column)."""
    system = ["system prompt", "tools"]
    store = _open(tmp_path)
    now = time.time()

    async def park(session: str, caller: str, share: str | None, *parts: str) -> KvEntry:
        name = store.new_file_name(session)
        (store.dirs["a"] / name).write_bytes(b"x" * 10)
        blocks = prefix_blocks([*system, *parts])
        entry = KvEntry("a", session, caller, name, COMPAT, 5, 10, now, now, blocks, share)
        await store.put(entry)
        return entry

    short = await park("ann-1", "ann", "ann", "u1")
    longer = await park("ann-2", "ann", "ann", "u2", "u3")
    await park("bea-1", "bea", "bea", "u2", "u3", "u4")  # shares more: Bea's
    await park("ann-3", "ann", None, "u2", "u3", "u4")  # shares more: lent to nobody
    request = prefix_blocks([*system, "u2", "u3", "u5"])

    def lent(caller: str, besides: str, prefix: tuple[int, ...] = request) -> KvEntry | None:
        return store.find_lent(
            "a", caller, COMPAT, ctx_per_slot=1024, prefix=prefix, besides=besides
        )

    assert lent("ann", "ann-9") == longer
    assert lent("ann", "ann-2") == short  # its own copy is no loan
    assert lent("ann", "ann-9", prefix_blocks(["another prompt"])) is None
    found = lent("bea", "bea-9")
    assert found is not None and found.session == "bea-1"
    assert lent("cat", "cat-1") is None
    assert (
        store.find_lent("b", "ann", COMPAT, ctx_per_slot=1024, prefix=request, besides="x") is None
    )  # per model
    again = _open(tmp_path)
    assert {e.session: e.share_caller for e in again.sessions()} == {
        "ann-1": "ann",
        "ann-2": "ann",
        "bea-1": "bea",
        "ann-3": None,
    }
    # an index from before the column: opened, every copy lent to nobody
    with sqlite3.connect(tmp_path / "kv.sqlite") as conn:
        conn.execute("ALTER TABLE parked DROP COLUMN share_caller")
    old = _open(tmp_path)
    assert len(old.sessions()) == 4 and all(e.share_caller is None for e in old.sessions())
    assert old.find_lent("a", "ann", COMPAT, ctx_per_slot=1024, prefix=request, besides="x") is None
