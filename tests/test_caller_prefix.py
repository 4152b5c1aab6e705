"""Prefix sharing within a caller (``[scheduler] share_prefix_within_caller``).

A request whose owner holds no KV for it may start from a slot that another owner of
the *same caller* left: that owner's KV is parked (as on any handoff), the slot is
not erased, and the engine keeps only the prefix the two prompts share; or, when no
slot holds it, from such an owner's parked copy, restored into its slot (a copy: it
stays that owner's). Replicas route a new owner to its caller's longest prefix. Never
across callers, never for a model that cannot cut its state back (recurrent, hybrid:
those start from a lead, test_leads.py).

First the policy without I/O (preparation, placement, the slot table's model with
callers), then the engine's own cached-token counts against a real llama-server (and
a bare one, for the count a parked copy must give).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from hypothesis import settings

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.host import Host
from gezel_trio.kv.prefix import Header, prefix_blocks
from gezel_trio.kv.sessions import SessionKeys
from gezel_trio.scheduler.admission import Admit, Load, choose_slot
from gezel_trio.scheduler.policy import SchedulerPolicy
from gezel_trio.scheduler.queues import Job
from gezel_trio.scheduler.replicas import ReplicaRouter
from gezel_trio.scheduler.slots import SHORT_TAIL_BLOCKS, Content, Preparation, SlotTable

from ._engine_bin import ENGINE_LIMITS, open_llama_server
from .conftest import make_config, running
from .fault_tools import wait_until
from .test_keyless_owner import Lane
from .test_slot_table import SlotTableMachine

KEYS = SessionKeys(b"p" * 32)
ANN, BEA = KEYS.caller("key-ann"), KEYS.caller("key-bea")
ANN_1, ANN_2, ANN_3 = (KEYS.session(ANN, f"chat-{i}") for i in (1, 2, 3))
BEA_1 = KEYS.session(BEA, "chat-1")

SYSTEM = [Header("system"), *(f"tools and instructions {i}" for i in range(8))]


def _blocks(*user: str) -> tuple[int, ...]:
    """A chat's blocks: the long shared system prompt, then its own user turns."""
    return prefix_blocks([*SYSTEM, *(part for text in user for part in (Header("user"), text))])


def _table(*owners: tuple[str, str | None, tuple[int, ...]]) -> SlotTable:
    """A table whose slot ``i`` holds ``owners[i]``'s KV: (session, caller, blocks)."""
    table = SlotTable(len(owners) + 1, generation=1)
    for slot, (session, caller, blocks) in enumerate(owners):
        job = object()
        table.pin(slot, job)
        table.sending(slot, job)
        table.completed(slot, job, session, blocks=blocks, caller=caller)
        table.unpin(slot, job)
    return table


def _prep_with_copy(table: SlotTable, shares: int, prefix: tuple[int, ...]) -> Preparation:
    """What Ann's chat-2 needs done to slot 0 for ``prefix`` when it has a parked copy
    sharing ``shares`` blocks of it (parking on, its caller's prefixes shared)."""
    copy = {ANN_2: shares}
    return table.preparation(
        0,
        ANN_2,
        parking=True,
        caller=ANN,
        is_parked=copy.__contains__,
        prefix=prefix,
        parked_shares=copy.get,
    )


# --------------------------------------------------------------------------- preparation


@pytest.mark.parametrize("parking", [True, False])
def test_another_owner_of_the_caller_is_parked_not_erased(parking: bool) -> None:
    table = _table((ANN_1, ANN, _blocks("one", "and what followed")))
    two = _blocks("two")
    assert table.shares_with(0, ANN_2, ANN, two) == len(SYSTEM) + 1  # and the user header
    assert table.safe_for(0, ANN_2, ANN, two)
    # sharing nothing (or message headers only) is no reason to keep it: erased
    elsewhere = prefix_blocks([Header("system"), "another prompt"])
    assert not table.shares_with(0, ANN_2, ANN, elsewhere)
    assert not table.shares_with(0, ANN_2, ANN, ())
    assert table.preparation(0, ANN_2, caller=ANN, prefix=elsewhere) == Preparation(erase=True)
    prep = table.preparation(0, ANN_2, parking=parking, caller=ANN, prefix=_blocks("two"))
    assert prep == Preparation(park=ANN_1 if parking else None)
    # its own parked copy, when it shares more than the slot does, is restored instead
    prep = _prep_with_copy(table, len(_blocks("two", "more")), _blocks("two", "more"))
    assert prep == Preparation(park=ANN_1, restore=True)
    # a copy sharing the system prompt, as the slot does
    prep = _prep_with_copy(table, len(_blocks("two")) - 1, _blocks("two"))
    assert prep == Preparation(park=ANN_1, restore=True)  # a tie: its own copy
    prep = _prep_with_copy(table, 1, _blocks("two"))
    assert prep == Preparation(park=ANN_1)


def test_a_short_tail_beyond_the_shared_prefix_is_not_saved_first() -> None:
    """Codex's second session differs from its first in its last message alone: the slot
    keeps all but that, and the save of the whole slot is skipped (counted apart)."""
    table = _table((ANN_1, ANN, _blocks("one")))  # ..., user header, "one"
    two = _blocks("two")
    assert len(_blocks("one")) - table.shares_with(0, ANN_2, ANN, two) == SHORT_TAIL_BLOCKS
    prep = table.preparation(0, ANN_2, parking=True, caller=ANN, prefix=two)
    assert prep == Preparation(drop_tail=True) and prep.calls == 0
    # its own copy sharing more replaces the slot's whole content: the owner is parked
    prep = _prep_with_copy(table, len(_blocks("two", "more")), _blocks("two", "more"))
    assert prep == Preparation(park=ANN_1, restore=True)
    # a longer tail is saved first
    table = _table((ANN_1, ANN, _blocks("one", "and more")))
    prep = table.preparation(0, ANN_2, parking=True, caller=ANN, prefix=two)
    assert prep == Preparation(park=ANN_1)
    # never across callers: Bea's request shares nothing, the slot is parked and erased
    prep = table.preparation(0, BEA_1, parking=True, caller=BEA, prefix=two)
    assert prep == Preparation(park=ANN_1, erase=True)


def test_never_across_callers_nor_without_a_caller() -> None:
    table = _table((ANN_1, ANN, _blocks("one")))
    for session, caller in ((BEA_1, BEA), (ANN_2, None)):
        assert not table.safe_for(0, session, caller, _blocks("two"))
        prep = table.preparation(0, session, parking=True, caller=caller, prefix=_blocks("two"))
        assert prep == Preparation(park=ANN_1, erase=True)
    # a slot recorded without a caller (its job could not share) is no one's to share
    table = _table((ANN_1, None, _blocks("one")))
    assert not table.shares_with(0, ANN_2, ANN, _blocks("two"))
    assert table.preparation(0, ANN_2, caller=ANN, prefix=_blocks("two")) == Preparation(erase=True)
    # a blind job's leftovers and unknown content are erased as ever
    for content in (Content.KEYLESS, Content.UNKNOWN):
        table.slots[0].hold(content)
        prep = table.preparation(0, ANN_2, caller=ANN, prefix=_blocks("two"))
        assert prep == Preparation(erase=True)


def test_a_parked_copy_of_the_caller_is_lent_when_no_slot_shares_as_much() -> None:
    two = _blocks("two")
    copy = (ANN_1, len(SYSTEM) + 1)  # chat-1's parked copy: the system prompt and a header

    def prep(
        table: SlotTable,
        session: str,
        caller: str | None,
        *,
        parking: bool = True,
        is_parked: Callable[[str], bool] = lambda _s: False,
    ) -> Preparation:
        return table.preparation(
            0,
            session,
            parking=parking,
            caller=caller,
            prefix=two,
            is_parked=is_parked,
            lent=lambda: copy,
        )

    # the slot holds another caller's KV: parked, then Ann's copy restored in its place
    table = _table((BEA_1, BEA, _blocks("one")))
    assert prep(table, ANN_2, ANN) == Preparation(park=BEA_1, lend=ANN_1)
    assert prep(table, ANN_2, None) == Preparation(park=BEA_1, erase=True)  # may not share
    assert prep(table, ANN_2, ANN, parking=False) == Preparation(erase=True)
    # the job's own copy comes first
    own = {ANN_2: 1}
    assert prep(table, ANN_2, ANN, is_parked=own.__contains__) == Preparation(
        park=BEA_1, restore=True
    )
    # a clean slot, or a blind job's leftovers: the copy replaces it
    table = SlotTable(2, generation=1)
    assert prep(table, ANN_2, ANN) == Preparation(lend=ANN_1)
    table.slots[0].hold(Content.KEYLESS)
    assert prep(table, ANN_2, ANN) == Preparation(lend=ANN_1)
    # a slot of the caller sharing as much is used as it is; sharing less, the copy wins
    table = _table((ANN_3, ANN, _blocks("one", "and more")))
    assert prep(table, ANN_2, ANN) == Preparation(park=ANN_3)
    short = _table((ANN_3, ANN, _blocks("one")))  # its tail not worth a save
    assert prep(short, ANN_2, ANN) == Preparation(drop_tail=True)
    copy = (ANN_1, len(SYSTEM) + 2)
    assert prep(short, ANN_2, ANN) == Preparation(park=ANN_3, lend=ANN_1)
    assert prep(table, ANN_2, ANN) == Preparation(park=ANN_3, lend=ANN_1)
    # once restored, the slot holds chat-1's KV, current: nothing more to do
    job = object()
    table.pin(0, job)
    table.restored(0, job, ANN_1, blocks=_blocks("two", "more"), caller=ANN)
    current = {ANN_1: 1}
    assert prep(table, ANN_2, ANN, is_parked=current.__contains__) == Preparation()
    assert Preparation(park=BEA_1, lend=ANN_1).calls == 2


def test_the_slot_records_the_caller_and_forgets_it_with_its_owner() -> None:
    table = _table((ANN_1, ANN, _blocks("one")))
    assert table.slots[0].caller == ANN
    job = object()
    table.pin(0, job)
    table.sending(0, job)  # unknown while a request is in flight: nobody's to share
    two = _blocks("two")
    assert table.slots[0].caller is None and not table.shares_with(0, ANN_2, ANN, two)
    table.restored(0, job, ANN_2, caller=ANN, blocks=_blocks("two", "more"))
    assert (
        table.shares_with(0, ANN_1, ANN, _blocks("one")) == len(SYSTEM) + 1
    )  # and the user header
    assert not table.shares_with(0, ANN_2, ANN, two)  # its own: no share, its KV
    table.erased(0, job)
    assert table.slots[0].caller is None
    assert table.sync(1, 3) == [] and table.slots[0].caller is None  # kept: still clean
    assert "caller" not in repr(table.statistics())


# --------------------------------------------------------------------------- placement


def test_a_new_owner_takes_its_callers_slot_sharing_the_longest_prefix() -> None:
    table = _table(
        (ANN_1, ANN, prefix_blocks([Header("system"), "another prompt"])),
        (ANN_2, ANN, _blocks("two")),
        (BEA_1, BEA, _blocks("three", "and more")),  # shares more, another caller's
    )
    request = _blocks("three", "and more", "and then")
    free = [0, 1, 2, 3]
    # sharing nothing but a header is sharing nothing: slot 0 is never picked for it
    assert choose_slot(free, session=ANN_3, table=table, prefix=request, caller=ANN) == 1
    assert choose_slot([0, 2, 3], session=ANN_3, table=table, prefix=request, caller=ANN) == 3
    # without a caller, as today: the fresh slot
    assert choose_slot(free, session=ANN_3, table=table, prefix=request) == 3
    # an owner whose job waits in this turn keeps its slot
    wanted = {ANN_2}.__contains__
    assert (
        choose_slot(free, session=ANN_3, table=table, prefix=request, caller=ANN, wanted=wanted)
        == 3
    )
    # Bea never lands on Ann's slots for a prefix; her own caller's slot is hers
    assert (
        choose_slot(
            [0, 1, 3], session=KEYS.session(BEA, "x"), table=table, prefix=request, caller=BEA
        )
        == 3
    )
    assert (
        choose_slot(free, session=KEYS.session(BEA, "x"), table=table, prefix=request, caller=BEA)
        == 2
    )
    # an owner whose own slot holds an unrelated conversation starts from its caller's
    # prefix, as a new owner does, rather than from nothing
    assert choose_slot(free, session=ANN_1, table=table, prefix=request, caller=ANN) == 1
    assert choose_slot(free, session=ANN_1, table=table, prefix=request) == 3
    # the owner's own slot that its request continues always comes first
    assert (
        choose_slot(free, session=ANN_2, table=table, prefix=_blocks("two", "next"), caller=ANN)
        == 1
    )


def test_a_session_that_asked_for_a_title_first_starts_its_task_from_its_callers() -> None:
    """opencode: a session asks for a title (one system prompt), then runs its task
    (another). The second session's task goes to the slot where the first session's
    task left its prefix, not to its own title's slot nor to a clean one (measured on
    the host: 5 of 2,217 tokens cached before, where a bare llama-server reused 2,209)."""
    title = prefix_blocks([Header("system"), "you make titles", Header("user"), "hello"])
    table = _table(
        (ANN_1, ANN, title),  # the first session's title
        (ANN_1, ANN, _blocks("one")),  # and its task
        (ANN_2, ANN, title),  # the second session's title
    )
    free = [0, 1, 2, 3]
    task = _blocks("two")
    assert choose_slot(free, session=ANN_2, table=table, prefix=task, caller=ANN) == 1
    # its title again continues its own slot
    again = prefix_blocks([Header("system"), "you make titles", Header("user"), "hello", "x"])
    assert choose_slot(free, session=ANN_2, table=table, prefix=again, caller=ANN) == 2
    # a task sharing no more with the caller's slots than with its own: a clean slot
    other = prefix_blocks([Header("system"), "something else entirely"])
    assert choose_slot(free, session=ANN_2, table=table, prefix=other, caller=ANN) == 3
    # with no clean slot left, its own slot (the caller's share no larger)
    assert choose_slot([0, 1, 2], session=ANN_2, table=table, prefix=other, caller=ANN) == 2


def test_a_returning_owner_with_a_parked_copy_takes_a_clean_slot() -> None:
    """Two sessions of one caller on 2 of 3 slots must not trade one slot back and
    forth: the displaced one comes back with its parked copy, which it restores into a
    clean slot rather than displacing the other."""
    policy = SchedulerPolicy([Lane(parallel=3)])
    now = 0.0

    def run(session: str, blocks: tuple[int, ...], *, parked: bool = False) -> int:
        nonlocal now
        job = Job(model_id="m", session=session, prefix=blocks, caller=ANN, parked=parked)
        policy.enqueue(job, now=now)
        for _ in range(5):
            for action in policy.plan():
                if isinstance(action, Load):
                    policy.load_done(action.model_id)
                elif isinstance(action, Admit):
                    policy.admit(action.model_id, None, now=now)
        assert job.slot_id is not None
        table = policy.table("m")
        prep = table.preparation(job.slot_id, session, caller=ANN, parking=True, prefix=blocks)
        assert not prep.erase
        if prep.park is not None:
            table.parked(job.slot_id, job, prep.park)
        table.sending(job.slot_id, job)
        job.ran = True
        now += 1
        policy.settle(job, now=now)
        return job.slot_id

    first = run(ANN_1, _blocks("one"))
    assert run(ANN_2, _blocks("two")) == first  # Ann's system prompt is in it
    other = run(ANN_1, _blocks("one", "again"), parked=True)
    assert other != first  # a clean slot, for its parked copy
    assert run(ANN_2, _blocks("two", "again")) == first
    assert run(ANN_1, _blocks("one", "again", "more")) == other


# --------------------------------------------------------------------------- the model

CALLERS = {"session-ann": "caller-1", "session-bea": "caller-1", "session-cat": "caller-2"}


class CallerSharingMachine(SlotTableMachine):
    """The slot table's model (``test_slot_table``) with callers: Ann's and Bea's
    sessions are one caller's and may share prefixes, Cat's another's. A job is sent
    only onto a KV holding nothing but its own caller's tokens, and only onto another
    session's tokens when its caller shares."""

    def _caller(self, session: str | None) -> str | None:
        return None if session is None else CALLERS.get(session)

    def _blocks(self, session: str | None) -> tuple[int, ...]:
        """Every session's requests open with the same system prompt (one block), then
        their own: a share across callers would be there for the taking."""
        if session not in CALLERS:
            return ()
        return (2, 4 + 2 * sorted(CALLERS).index(session))


CallerSharingMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None
)
test_callers_share_only_their_own_prefixes = CallerSharingMachine.TestCase


# --------------------------------------------------------------------------- the engine

KEY_ANN, KEY_BEA = "key-ann-0123456789", "key-bea-0123456789"
KEY_CAT, KEY_DAN, KEY_EVE = "key-cat-0123456789", "key-dan-0123456789", "key-eve-0123456789"
SHARED = [300 + (i * 7) % 200 for i in range(512)]  # 8 blocks of 64 tokens
BLOCK = 64


def _prompt(seed: int) -> list[int]:
    return [*SHARED, *(520 + (seed * 13 + i) % 300 for i in range(40))]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


async def _send(
    client: httpx.AsyncClient, key: str, prompt: list[int], session: str | None
) -> tuple[int, int]:
    """One ``/completion`` of ``key``'s caller: (the engine's cached tokens, the
    engine's prompt length minus ``prompt``'s, 1 when it added a BOS token)."""
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "n_predict": 2, "temperature": 0}
    if session is not None:
        body["prompt_cache_key"] = session
    r = await client.post("/completion", json=body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    timings = r.json()["timings"]
    cached = int(timings["cache_n"])
    return cached, cached + int(timings["prompt_n"]) - len(prompt)


def _config(model: Path, state_dir: Path, engine_binary: EngineBinary, **scheduler: Any) -> Any:
    return make_config(
        [
            ModelConfig(
                id="tiny",
                path=str(model),
                parallel=scheduler.pop("parallel", 1),
                ctx_per_slot=2048,
                replicas=scheduler.pop("replicas", 1),
            )
        ],
        state_dir=state_dir,
        engine_binary=engine_binary,
        server={"api_keys": [KEY_ANN, KEY_BEA, KEY_CAT, KEY_DAN, KEY_EVE]},
        scheduler=scheduler,
    )


def _parking(host: Host) -> dict[str, int]:
    assert host.scheduler is not None
    return host.scheduler.statistics().parking


async def _idle(host: Host) -> None:
    """No job runs and no background save is in flight (a slot is saved in the
    background once its request ends, and a request placed there waits for it)."""
    scheduler = host.scheduler
    assert scheduler is not None

    def settled() -> bool:
        stats = scheduler.statistics().as_dict()
        return not stats["running"] and all(t["saving"] == 0 for t in stats["slots"].values())

    await wait_until(settled, within=60, what="background saves settled")


async def _shares_exactly(
    client: httpx.AsyncClient, key: str, earlier: list[int], prompt: list[int], session: str | None
) -> int:
    """Send ``prompt``: the engine's cached tokens must be its prefix shared with
    ``earlier`` (the slot's last prompt), less at most a block, and never more."""
    cached, bos = await _send(client, key, prompt, session)
    common = _common(earlier, prompt) + bos
    assert common - BLOCK <= cached <= common, (cached, common)
    return cached


async def test_a_new_session_of_the_caller_starts_from_its_prefix(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """Two slots. Ann's second session (and her keyless request) go to the slot her
    first left, with its system prompt: the engine reuses exactly the prefix the two
    prompts share. Bea's sessions take the other slot; her second shares her first's.
    (Each slot is saved as soon as its request ends: ``save_idle_delay`` and
    ``save_lone_delay`` 0, so that each save is in flight when its request returns.)"""
    cfg = _config(
        tiny_model,
        state_dir,
        engine_binary,
        parallel=2,
        save_idle_delay=0.0,
        save_lone_delay=0.0,
    )
    with trio.fail_after(180):
        async with running(cfg) as (host, client):
            assert host.models["tiny"].cuts_back
            assert (await _send(client, KEY_ANN, _prompt(1), "chat-1"))[0] == 0
            await _idle(host)
            await _shares_exactly(client, KEY_ANN, _prompt(1), _prompt(2), "chat-2")
            await _idle(host)
            await _shares_exactly(client, KEY_ANN, _prompt(2), _prompt(3), None)  # keyless
            assert _parking(host)["shared_within_caller"] == 2
            await _idle(host)
            # Bea, with Ann's very prompts and session name: a fresh slot, nothing of Ann's
            assert (await _send(client, KEY_BEA, _prompt(1), "chat-1"))[0] == 0
            await _idle(host)
            await _shares_exactly(client, KEY_BEA, _prompt(1), _prompt(4), "chat-9")
            assert _parking(host)["shared_within_caller"] == 3
            # Ann's first session comes back to its own parked KV, restored
            cached, _ = await _send(client, KEY_ANN, [*_prompt(1), 7, 8], "chat-1")
            assert cached >= len(_prompt(1)) - 1
            assert host.models["tiny"].kv_stats.restores >= 1


async def test_a_short_tail_is_not_saved_and_its_owner_starts_from_the_prefix_kept(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """Codex's shape: a second session right after the first, differing in its last
    message alone (less than a block). The first's slot is not saved first: the second
    starts from the prefix they share, and the first, back, from the same prefix, which
    the slot kept; the engine says so in both."""
    cfg = _config(tiny_model, state_dir, engine_binary, parallel=2, save_lone_delay=math.inf)
    with trio.fail_after(180):
        async with running(cfg) as (host, client):
            assert (await _send(client, KEY_ANN, _prompt(1), "chat-1"))[0] == 0
            await _idle(host)
            await _shares_exactly(client, KEY_ANN, _prompt(1), _prompt(2), "chat-2")
            parking = _parking(host)
            assert parking["save_skipped_tail"] == 1 and parking["saved"] == 0
            await _idle(host)
            back = [*_prompt(1), 7, 8]
            cached = await _shares_exactly(client, KEY_ANN, _prompt(2), back, "chat-1")
            assert cached >= len(SHARED) - BLOCK


async def test_a_session_that_asked_for_a_title_first_starts_its_task_warm(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """opencode's shape on two slots: each session asks for a title (one system prompt),
    then runs its task (another). Ann's second session's title starts from her first
    title's slot, and its task from her first task's slot, not from its own title's:
    the engine reuses exactly the prefix each pair shares."""
    titles = [
        [*(100 + i % 50 for i in range(192)), *(160 + s + i for i in range(8))] for s in (0, 9)
    ]
    cfg = _config(tiny_model, state_dir, engine_binary, parallel=2)
    with trio.fail_after(180):
        async with running(cfg) as (host, client):
            for prompt in (titles[0], _prompt(1)):  # the first session: both slots
                assert (await _send(client, KEY_ANN, prompt, "chat-1"))[0] == 0
                await _idle(host)
            await _shares_exactly(client, KEY_ANN, titles[0], titles[1], "chat-2")
            await _idle(host)
            cached = await _shares_exactly(client, KEY_ANN, _prompt(1), _prompt(2), "chat-2")
            assert cached >= len(SHARED) - BLOCK
            assert _parking(host)["shared_within_caller"] == 2


@pytest.mark.parametrize("mode", ["shared", "conversation", "blind"])
async def test_another_caller_gets_none_of_it_in_every_mode(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, mode: str
) -> None:
    """One slot, so every owner lands on the previous one's KV. Whatever the keyless
    mode, another caller's requests (named, with Ann's session name, or keyless) get 0
    of Ann's tokens, from her slot or her parked copies, and Ann's none of theirs;
    within one caller a new owner shares, from the slot or from a parked copy."""
    cfg = _config(tiny_model, state_dir, engine_binary, keyless=mode)
    with trio.fail_after(180):
        async with running(cfg) as (host, client):
            assert (await _send(client, KEY_ANN, _prompt(1), "chat-1"))[0] == 0
            await _idle(host)
            await _shares_exactly(client, KEY_ANN, _prompt(1), _prompt(2), "chat-2")
            await _idle(host)
            # each stranger's owner (a caller with no KV of its own) lands on Ann's KV and
            # gets none of it; each new one of Ann's then lands on the stranger's, and
            # starts from her own caller's parked copy of _prompt(2)
            strangers = (KEY_BEA, KEY_CAT, KEY_DAN)
            for i, (key, session) in enumerate(
                zip(strangers, ("chat-2", None, "chat-3"), strict=True)
            ):
                assert (await _send(client, key, _prompt(2), session))[0] == 0, session
                await _idle(host)
                await _shares_exactly(client, KEY_ANN, _prompt(2), _prompt(2), f"new-{i}")
                await _idle(host)
            assert _parking(host)["lent_within_caller"] == 3
            # Ann's last owner left the slot: another new session of hers shares
            await _shares_exactly(client, KEY_ANN, _prompt(2), _prompt(5), "chat-4")
            await _idle(host)
            cached, _ = await _send(client, KEY_ANN, _prompt(6), None)  # her keyless owner
            if mode in ("blind", "conversation"):
                # a blind request reuses nothing; a keyless conversation shares no prefix
                # with the caller's other owners (the mode narrows the side channel)
                assert cached == 0
            else:
                assert 0 < cached <= _common(_prompt(5), _prompt(6)) + 1
            await _idle(host)
            assert (await _send(client, KEY_EVE, _prompt(6), "eve-new"))[0] == 0
            # Ann's handoffs that kept her caller's prefix: chat-2, new-0 to new-2 (but
            # new-1 after a blind request: no owner's slot handed off), chat-4, and her
            # keyless owner where it shares
            shared = _parking(host)["shared_within_caller"]
            assert shared == {"shared": 6, "conversation": 5, "blind": 4}[mode]


async def test_turned_off_a_new_session_starts_cold(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    cfg = _config(tiny_model, state_dir, engine_binary, share_prefix_within_caller=False)
    with trio.fail_after(180):
        async with running(cfg) as (host, client):
            assert (await _send(client, KEY_ANN, _prompt(1), "chat-1"))[0] == 0
            await _idle(host)
            assert (await _send(client, KEY_ANN, _prompt(2), "chat-2"))[0] == 0
            assert host.scheduler is not None
            erases = host.scheduler.statistics().erases
            # emptied by the engine: sent with cache_prompt off, no erase call first
            assert erases["sent_blind"] >= 1 and erases["blind_unanswered"] == 0
            assert _parking(host)["shared_within_caller"] == 0
            await _idle(host)
            # chat-1 and chat-2 are parked now; a new session with chat-1's prompt
            # (a copy ending at a block boundary it shares) still starts cold
            kv = host.kv
            assert kv is not None and kv.copies("tiny", _owner_of(host, KEY_ANN, "chat-1"))
            assert all(e.share_caller is None for e in kv.sessions())
            assert (await _send(client, KEY_ANN, _prompt(1), "chat-3"))[0] == 0
            assert _parking(host)["lent_within_caller"] == 0


async def test_a_recurrent_model_shares_nothing(
    models_dir: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """A Mamba model cannot roll its state back to a shared prefix: a new session of
    the caller gets an emptied slot, and never another session's parked copy (its
    copies are lent to nobody), though the copy is there: even a copy ending where
    the request goes on (a shared block boundary) is not lent; only an exact
    boundary, which the host does not know for the generated tokens a copy ends with,
    would be safe. (Raw ``/completion`` prompts have no lead, the exact boundary a
    chat's system prompt gives: see test_leads.py.)"""
    from gezel_trio.engine.demo_model import write_demo_model

    path = models_dir / "prefix-mamba.gguf"
    if not path.exists():
        write_demo_model(path, size="tiny", arch="mamba")
    cfg = _config(path, state_dir, engine_binary)
    with trio.fail_after(180):
        async with running(cfg) as (host, client):
            assert not host.models["tiny"].cuts_back
            assert (await _send(client, KEY_ANN, _prompt(1), "chat-1"))[0] == 0
            await _idle(host)
            assert (await _send(client, KEY_ANN, _prompt(2), "chat-2"))[0] == 0
            assert host.scheduler is not None
            erases = host.scheduler.statistics().erases
            # emptied by the engine: sent with cache_prompt off, no erase call first
            assert erases["sent_blind"] >= 1 and erases["blind_unanswered"] == 0
            assert _parking(host)["shared_within_caller"] == 0
            await _idle(host)
            # chat-1 and chat-2 are parked now; a new session with chat-1's prompt
            # (a copy ending at a block boundary it shares) still starts cold
            kv = host.kv
            assert kv is not None and kv.copies("tiny", _owner_of(host, KEY_ANN, "chat-1"))
            assert all(e.share_caller is None for e in kv.sessions())
            assert (await _send(client, KEY_ANN, _prompt(1), "chat-3"))[0] == 0
            assert _parking(host)["lent_within_caller"] == 0


def _owner_of(host: Host, key: str, name: str) -> str:
    """The owner the host keys ``key``'s session ``name`` under."""
    return host.sessions.session(host.sessions.caller(key), name)


OTHER = [250 - (i * 11) % 150 for i in range(300)]  # shares no block with _prompt(n)


async def _bare_cached(model: Path, first: list[int], second: list[int]) -> int:
    """The engine's own truth: a bare llama-server, one slot, ``first`` then ``second``
    as :func:`_send` sends them: the cached tokens it reports for ``second``."""
    async with (
        open_llama_server(model, parallel=1, ctx=2048) as bare,
        httpx.AsyncClient(base_url=bare.base_url, limits=ENGINE_LIMITS, timeout=60) as direct,
    ):
        cached = -1
        for prompt in (first, second):
            body = {"prompt": prompt, "n_predict": 2, "temperature": 0, "id_slot": 0}
            r = await direct.post("/completion", json=body)
            assert r.status_code == 200, r.text
            cached = int(r.json()["timings"]["cache_n"])
        return cached


async def test_a_new_session_starts_from_its_callers_parked_copy(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """One slot. Ann's chat-1 is parked when Bea takes the slot. Ann's new chat-2 finds
    no slot of her caller holding a prefix of it, but chat-1's parked copy: restored
    into the slot, the engine keeps exactly the prefix the two prompts share, as many
    cached tokens as a bare llama-server reports for the same two prompts on one slot.
    The copy stays chat-1's (it comes back to it whole), and Bea's new session with
    Ann's very prompt gets 0."""
    with trio.fail_after(240):
        expected = await _bare_cached(tiny_model, _prompt(1), _prompt(2))
        assert expected >= len(SHARED)  # the engine keeps the shared prefix
        cfg = _config(tiny_model, state_dir, engine_binary)
        async with running(cfg) as (host, client):
            assert (await _send(client, KEY_ANN, _prompt(1), "chat-1"))[0] == 0
            await _idle(host)
            assert (await _send(client, KEY_BEA, OTHER, "bea-1"))[0] == 0
            await _idle(host)
            assert host.kv is not None
            lent = host.kv.copies("tiny", _owner_of(host, KEY_ANN, "chat-1"))
            assert [e.share_caller for e in lent] == [host.sessions.caller(KEY_ANN)]
            cached, _ = await _send(client, KEY_ANN, _prompt(2), "chat-2")
            assert cached == expected
            parking = _parking(host)
            assert parking["lent_within_caller"] == 1 and parking["shared_within_caller"] == 1
            await _idle(host)
            # Bea, a new session with Ann's very prompt: Ann's copies are not hers
            assert (await _send(client, KEY_BEA, _prompt(2), "bea-2"))[0] == 0
            await _idle(host)
            # her own next session shares her own tokens (the slot she left)
            await _shares_exactly(client, KEY_BEA, _prompt(2), _prompt(1), "bea-3")
            assert _parking(host)["lent_within_caller"] == 1
            await _idle(host)
            # chat-1's copy is still chat-1's, whole: it continues from all of it
            cached, _ = await _send(client, KEY_ANN, [*_prompt(1), 7, 8], "chat-1")
            assert cached >= len(_prompt(1)) - 1


async def test_replicas_route_a_new_session_to_its_callers_prefix(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """Two replicas of one slot each. A new session of Ann's goes to the member whose
    slot holds her caller's prefix, then, once another caller took that slot, to the
    member holding her caller's parked copies, where it starts from one: the engines'
    own cached tokens say so, where routing by load alone would send it to the member
    given fewer sessions, which holds none of it. Other callers' new sessions with
    Ann's prompts are routed as if her prefixes did not exist, and get 0."""
    cfg = _config(tiny_model, state_dir, engine_binary, replicas=2)
    with trio.fail_after(240):
        async with running(cfg) as (host, client):
            router = host.routers.setdefault("tiny", ReplicaRouter())

            def hits() -> dict[str, int]:
                return {m: c.hits for m, c in router.prefix.items() if c.hits}

            assert (await _send(client, KEY_ANN, _prompt(1), "chat-1"))[0] == 0
            await _idle(host)
            before = hits()
            await _shares_exactly(client, KEY_ANN, _prompt(1), _prompt(2), "chat-2")
            holder = [m for m, n in hits().items() if n > before.get(m, 0)]
            assert len(holder) == 1
            ann = holder[0]  # the member with Ann's slot, given both her sessions
            await _idle(host)
            before = hits()
            assert (await _send(client, KEY_BEA, _prompt(2), "bea-1"))[0] == 0
            assert hits() == before  # no prefix of hers anywhere: routed by load
            await _idle(host)
            # Cat takes the slot of Ann's member (named by its own id): Ann's KV parked
            body = {"model": ann, "prompt": OTHER, "n_predict": 2, "temperature": 0}
            headers = {"Authorization": f"Bearer {KEY_CAT}"}
            r = await client.post("/completion", json=body, headers=headers)
            assert r.status_code == 200 and r.json()["timings"]["cache_n"] == 0
            await _idle(host)
            before = hits()
            await _shares_exactly(client, KEY_ANN, _prompt(2), _prompt(3), "chat-3")
            assert hits()[ann] == before[ann] + 1  # routed to her caller's parked copies
            assert _parking(host)["lent_within_caller"] == 1
            await _idle(host)
            before = hits()
            assert (await _send(client, KEY_DAN, _prompt(3), "dan-1"))[0] == 0
            assert hits() == before
