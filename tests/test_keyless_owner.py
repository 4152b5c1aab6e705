"""Keyless requests as owners (``[scheduler] keyless``), scoped by caller.

In ``shared`` mode a caller's keyless requests are one owner
(:meth:`SessionKeys.keyless`): sent with ``cache_prompt`` on, they reuse what
that owner left in its slots, and like any owner its KV is parked (or erased
without parking) before a slot changes owner, and restored when it returns.
``blind`` mode is what the other tests check.

First the policy without I/O (placement, spreading, handoffs, the slot table's
model with keyless owners in it), then the engine's own cache accounting
against a real llama-server.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from gezel_trio.api.auth import OPENING_TOKENS, conversation_opening
from gezel_trio.config.schema import ModelConfig, apply_env, config_from_mapping
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.errors import ConfigError
from gezel_trio.host import Host, open_host
from gezel_trio.host.completion import TEXT_BLOCK_CHARS, TOKEN_BLOCK, prompt_blocks
from gezel_trio.kv.prefix import (
    MAX_BLOCKS,
    Header,
    Prefix,
    is_prefix,
    prefix_blocks,
    shared_blocks,
)
from gezel_trio.kv.sessions import SessionKeys
from gezel_trio.scheduler.admission import Admit, Load, choose_slot
from gezel_trio.scheduler.policy import SchedulerPolicy
from gezel_trio.scheduler.queues import Job
from gezel_trio.scheduler.slots import Content, Preparation, SlotTable

from .conftest import make_config
from .test_slot_table import SlotTableMachine

KEYS = SessionKeys(b"k" * 32)
ANN, BEA = KEYS.caller("key-ann"), KEYS.caller("key-bea")
ANN_KEYLESS, BEA_KEYLESS = KEYS.keyless(ANN), KEYS.keyless(BEA)


# --------------------------------------------------------------------------- identities


def test_a_callers_keyless_owner_is_stable_scoped_and_no_session() -> None:
    assert KEYS.keyless(ANN) == ANN_KEYLESS != BEA_KEYLESS
    assert SessionKeys(b"x" * 32).keyless(ANN) != ANN_KEYLESS  # another secret
    local = KEYS.caller(None)
    owners = {ANN_KEYLESS, BEA_KEYLESS, KEYS.keyless(local)}
    for caller in (ANN, BEA, local):
        for name in ("", "keyless", ANN_KEYLESS, "\x00"):
            assert KEYS.session(caller, name) not in owners
    with pytest.raises(ValueError, match="caller"):
        KEYS.keyless("key-ann")  # a raw key is not a caller


def test_owner_picks_the_session_the_keyless_owner_or_none() -> None:
    for mode in ("shared", "blind"):
        assert KEYS.owner(ANN, "chat", keyless=mode) == KEYS.session(ANN, "chat")
    assert KEYS.owner(ANN, None, keyless="shared") == ANN_KEYLESS
    assert KEYS.owner(ANN, None, keyless="blind") is None
    # conversation: one owner per opening, per caller; none of them anyone else's
    first = KEYS.owner(ANN, None, keyless="conversation", opening="[system, hello]")
    assert first == KEYS.conversation(ANN, "[system, hello]")
    other = KEYS.owner(ANN, None, keyless="conversation", opening="[system, bye]")
    theirs = KEYS.owner(BEA, None, keyless="conversation", opening="[system, hello]")
    assert len({first, other, theirs, ANN_KEYLESS, KEYS.session(ANN, "[system, hello]")}) == 5
    # no opening to name it: the caller's keyless owner
    assert KEYS.owner(ANN, None, keyless="conversation") == ANN_KEYLESS
    with pytest.raises(ValueError, match="caller"):
        KEYS.owner("key-ann", None, keyless="blind")


def test_a_conversation_is_named_by_its_opening_alone() -> None:
    chat = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}
    later = {"messages": [*chat["messages"], {"role": "assistant", "content": "yo"}]}
    assert conversation_opening(chat) == conversation_opening(later) is not None
    ids = list(range(OPENING_TOKENS))
    named = conversation_opening({"prompt": ids})
    # a longer prompt, even one that goes on in text, opens alike: its tail is not read
    assert conversation_opening({"prompt": [*ids, *range(3_500)]}) == named is not None
    assert conversation_opening({"prompt": [*ids, "and then text"]}) == named
    assert conversation_opening({"prompt": [1, 2]}) != named
    assert conversation_opening({"prompt": ["a", "b"]}) is None  # several prompts
    assert conversation_opening({"prompt": [1, "text", 2]}) is None
    assert conversation_opening({}) is None


def test_the_keyless_setting() -> None:
    assert config_from_mapping({}).scheduler.keyless == "shared"
    assert config_from_mapping({"scheduler": {"keyless": "blind"}}).scheduler.keyless == "blind"
    conversation = config_from_mapping({"scheduler": {"keyless": "conversation"}})
    assert conversation.scheduler.keyless == "conversation"
    with pytest.raises(ConfigError, match=r"scheduler\.keyless: expected one of"):
        config_from_mapping({"scheduler": {"keyless": "anyone"}})
    cfg = config_from_mapping({})
    apply_env(cfg, {"GEZEL_SCHEDULER_KEYLESS": "blind"})
    assert cfg.scheduler.keyless == "blind"


# --------------------------------------------------------------------------- prefix blocks


def test_prefix_blocks_chain_every_block_before() -> None:
    a = prefix_blocks(["system", "user 1", "assistant 1", "user 2"])
    assert a == prefix_blocks([b"system", b"user 1", b"assistant 1", b"user 2"])
    assert prefix_blocks(["system", "user 1"]) == a[:2]
    b = prefix_blocks(["system", "user 1", "assistant 1'", "user 2"])
    assert shared_blocks(a, b) == 2 and shared_blocks(a, a) == 4 and shared_blocks(a, ()) == 0
    assert a[3] != b[3]  # the same last block after a different one is another prefix
    assert prefix_blocks(["ab", "c"]) != prefix_blocks(["a", "bc"])  # boundaries count
    assert is_prefix(a[:2], a) and is_prefix(a, a) and not is_prefix(a, a[:2])
    assert not is_prefix((), a) and not is_prefix(b[:3], a)
    assert len(prefix_blocks(["x"] * (MAX_BLOCKS + 5))) == MAX_BLOCKS


def _chat(*contents: object, role: str = "user") -> dict[str, Any]:
    """A chat body: a system prompt, then ``contents`` alternating ``role`` and assistant."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for i, content in enumerate(contents):
        messages.append({"role": role if i % 2 == 0 else "assistant", "content": content})
    return {"model": "m", "messages": messages}


# 2 complete pieces and a rest; a character outside the BMP and one of each block tag
LONG = "".join(f"{i:04d} \U0001f98a \x00\x01 fox. " for i in range(40))[: 2 * 256 + 90]


def test_prompt_blocks_of_identical_requests_are_identical() -> None:
    a = prompt_blocks(_chat(LONG, "ok", "more"))
    assert a == prompt_blocks(_chat(LONG, "ok", "more"))
    assert a == prompt_blocks({"messages": _chat(LONG, "ok", "more")["messages"], "stream": True})
    assert len(a) == 2 + (1 + 2 + 1) + 2 + 2  # headers, pieces and rests
    assert prompt_blocks(_chat(LONG)) != prompt_blocks(_chat(LONG, role="tool"))
    assert prompt_blocks({"model": "m"}) == ()


def test_a_request_continuing_another_message_by_message_has_its_blocks_as_a_prefix() -> None:
    turn1 = prompt_blocks(_chat(LONG))
    turn2 = prompt_blocks(_chat(LONG, "Noted.", "Now the next part."))
    assert is_prefix(turn1, turn2) and shared_blocks(turn1, turn2) == len(turn1)
    # the rest block of the unchanged message is the same block in both
    assert turn2[len(turn1) - 1] == turn1[-1]
    assert len(LONG) % TEXT_BLOCK_CHARS  # (LONG has a rest)
    # the same for a Responses request's input items
    items = [{"type": "message", "role": "user", "content": LONG}]
    more = [*items, {"type": "function_call", "name": "f", "arguments": "{}"}]
    r1 = prompt_blocks({"instructions": "Be brief.", "input": items})
    assert is_prefix(r1, prompt_blocks({"instructions": "Be brief.", "input": more}))


def test_a_grown_last_message_shares_its_header_and_complete_pieces_but_is_no_prefix() -> None:
    pieces = len(LONG) // TEXT_BLOCK_CHARS
    for grown in (LONG + " and then some", LONG + "x" * 1000):
        short, long = prompt_blocks(_chat(LONG)), prompt_blocks(_chat(grown))
        # the system message (header, rest), the user header and its complete pieces
        assert shared_blocks(short, long) >= 2 + 1 + pieces
        assert shared_blocks(short, long) == len(short) - 1  # all but the rest
        assert not is_prefix(short, long)
    # one message that grows turn after turn, alone in its request
    transcript = [LONG[: n * 100] for n in range(1, 6)]
    blocks = [prompt_blocks({"messages": [{"role": "user", "content": t}]}) for t in transcript]
    for before, after, text in zip(blocks, blocks[1:], transcript, strict=False):
        assert shared_blocks(before, after) == (
            1 + len(text) // TEXT_BLOCK_CHARS if len(text) >= TEXT_BLOCK_CHARS else 0
        )  # a header alone is no share (below)


def test_content_parts_piece_their_text_and_keep_other_parts_whole() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 900}}

    def parts(text: str, img: dict[str, Any] = image) -> dict[str, Any]:
        return _chat([{"type": "text", "text": text}, img, {"type": "text", "text": "Why?"}])

    base = prompt_blocks(parts(LONG))
    pieces = len(LONG) // TEXT_BLOCK_CHARS
    # system (2), user header, text part header, pieces, rest, image, part header, rest
    assert len(base) == 2 + 1 + 1 + pieces + 1 + 1 + 1 + 1
    assert base == prompt_blocks(parts(LONG))
    grown = prompt_blocks(parts(LONG + "!"))
    assert shared_blocks(base, grown) == 2 + 1 + 1 + pieces and not is_prefix(base, grown)
    other_image = {**image, "image_url": {"url": "data:image/png;base64," + "B" * 900}}
    changed = prompt_blocks(parts(LONG, other_image))
    assert shared_blocks(base, changed) == 2 + 1 + 1 + pieces + 1  # up to the image
    # text parts alone are what the engine renders of them, their texts joined by
    # newlines: a string's blocks, whatever cache_control marks they carry
    cached = _chat([{"type": "text", "text": LONG, "cache_control": {"type": "ephemeral"}}])
    assert prompt_blocks(cached) == prompt_blocks(_chat(LONG))
    two = _chat([{"type": "text", "text": "A"}, {"type": "input_text", "text": "B"}])
    assert prompt_blocks(two) == prompt_blocks(_chat("A\nB"))
    assert shared_blocks(prompt_blocks(cached), base) == 3  # up to the user's header


def test_a_token_prompt_is_cut_into_complete_pieces_that_a_longer_one_keeps() -> None:
    ids = [(i * 7919) % 50_000 for i in range(3 * TOKEN_BLOCK + 5)]
    blocks = prompt_blocks({"prompt": ids})
    assert len(blocks) == 3  # the unfinished tail is left out
    assert prompt_blocks({"prompt": ids[: 3 * TOKEN_BLOCK]}) == blocks
    grown = prompt_blocks({"prompt": [*ids, *range(TOKEN_BLOCK)]})
    assert len(grown) == 4 and is_prefix(blocks, grown)
    changed = list(ids)
    changed[TOKEN_BLOCK + 1] += 1
    assert shared_blocks(prompt_blocks({"prompt": changed}), blocks) == 1
    # the same text as digits is not the same prompt
    assert prompt_blocks({"prompt": ",".join(map(str, ids))}) != blocks
    # ids mixed with text, several prompts, numbers that are no ids: no blocks
    for other in ([*ids[:-1], "text"], [ids, ids], [*ids[:-1], 1.5], [*ids[:-1], 2**70]):
        assert prompt_blocks({"prompt": other}) == ()


def test_a_boundary_between_messages_is_never_one_between_pieces() -> None:
    whole = "y" * TEXT_BLOCK_CHARS
    one = prompt_blocks({"messages": [{"role": "user", "content": whole + "z"}]})
    two = prompt_blocks(
        {"messages": [{"role": "user", "content": whole}, {"role": "user", "content": "z"}]}
    )
    assert len(one) == 3 and len(two) == 5  # header, piece, rest (+ header, rest)
    assert shared_blocks(one, two) == 2 and one[2] != two[2]
    # a text that looks like a header, or an empty rest, is still a piece of its message
    header = '\x00{"role":"user"}'
    fake = prompt_blocks({"messages": [{"role": "user", "content": whole + header + "z"}]})
    real = prompt_blocks(
        {"messages": [{"role": "user", "content": whole}, {"role": "user", "content": "z"}]}
    )
    assert not set(fake[2:]) & set(real[2:])
    # headers are marked, every other block is not
    assert [v & 1 for v in two] == [1, 0, 0, 1, 0]
    text = prompt_blocks({"prompt": "p" * 3 * TEXT_BLOCK_CHARS})
    assert len(text) == 3 and not any(v & 1 for v in text)


def test_sharing_only_headers_is_sharing_nothing() -> None:
    """Every chat that opens with a user message shares its header block; that is no
    shared conversation (a parked copy of another one is not restored for it)."""
    a = prompt_blocks({"messages": [{"role": "user", "content": "Hello there."}]})
    b = prompt_blocks({"messages": [{"role": "user", "content": "Something else."}]})
    assert a[0] == b[0] and shared_blocks(a, b) == 0 and shared_blocks(a, a) == 2
    assert prefix_blocks([Header("h"), "x"])[0] == prefix_blocks([Header("h"), "y"])[0]
    assert shared_blocks(prefix_blocks([Header("h"), "x"]), prefix_blocks([Header("h")])) == 0
    assert shared_blocks(prefix_blocks(["h", "x"]), prefix_blocks(["h", "y"])) == 1


def test_prompt_blocks_stay_bounded() -> None:
    huge = "w" * (TEXT_BLOCK_CHARS * (MAX_BLOCKS + 10))
    assert len(prompt_blocks(_chat(huge))) == MAX_BLOCKS
    many = [{"role": "user", "content": str(i)} for i in range(MAX_BLOCKS)]
    assert len(prompt_blocks({"messages": many})) == MAX_BLOCKS
    parts = [{"type": "input_image", "image_url": "data:,"}] * MAX_BLOCKS
    assert len(prompt_blocks({"input": [{"role": "user", "content": parts}]})) == MAX_BLOCKS


# --------------------------------------------------------------------------- the policy


@dataclass
class Lane:
    """An engine the host spawned: free slots come from the table."""

    model_id: str = "m"
    parallel: int = 3
    generation: int = 1
    display_name: str = "M"
    sole_client: bool = True
    family: str | None = None

    @property
    def slot_count(self) -> int:
        return self.parallel


class Driver:
    """Plays the dispatcher: plans, loads, admits, settles (no I/O)."""

    def __init__(self, slots: int = 3) -> None:
        self.policy = SchedulerPolicy([Lane(parallel=slots)])
        self.now = 0.0

    @property
    def table(self) -> SlotTable:
        return self.policy.table("m")

    def submit(self, owner: str | None, prefix: Prefix = (), *, keyless: bool = True) -> Job:
        job = Job(model_id="m", session=owner, keyless=keyless and owner is not None)
        job.prefix = prefix
        return self.policy.enqueue(job, now=self.now)

    def step(self) -> list[Job]:
        started: list[Job] = []
        for _ in range(10):
            actions = self.policy.plan()
            for action in actions:
                if isinstance(action, Load):
                    self.policy.load_done(action.model_id)
                elif isinstance(action, Admit):
                    started.extend(self.policy.admit(action.model_id, None, now=self.now).jobs)
            if not actions:
                break
        return started

    def run(self, owner: str | None, prefix: Prefix = (), *, keyless: bool = True) -> int:
        """One request from submission to its end; returns its slot. Checks that the
        slot is safe for it once prepared as the dispatcher would."""
        job = self.submit(owner, prefix, keyless=keyless)
        (started,) = self.step()
        assert started is job and job.slot_id is not None
        self.finish(job)
        return job.slot_id

    def prepare(self, job: Job, *, parking: bool = True) -> Preparation:
        """What the dispatcher would do to the job's slot before sending it (acknowledged)."""
        assert job.slot_id is not None
        table = self.table
        prep = table.preparation(job.slot_id, job.session, parking=parking)
        if prep.park is not None:
            table.parked(job.slot_id, job, prep.park)
        if prep.erase:
            table.sending(job.slot_id, job)
            table.erased(job.slot_id, job)
        assert table.safe_for(job.slot_id, job.session)
        return prep

    def finish(self, job: Job) -> Preparation:
        prep = self.prepare(job)
        assert job.slot_id is not None
        self.table.sending(job.slot_id, job)
        job.ran = True
        self.now += 1
        self.policy.settle(job, now=self.now)
        return prep


def test_a_callers_keyless_requests_reuse_their_owners_slot() -> None:
    d = Driver()
    first = d.run(ANN_KEYLESS)
    entry = d.table.slots[first]
    assert (entry.content, entry.session, entry.keyless) == (Content.OWNED, ANN_KEYLESS, True)
    for _ in range(3):  # fresh slots are free, but the owner's KV is in this one
        job = d.submit(ANN_KEYLESS)
        (started,) = d.step()
        assert started.slot_id == first
        assert d.finish(job) == Preparation()  # nothing to do: its own KV
    assert d.policy.snapshot().erases["skipped_same_session"] == 3


def test_concurrent_keyless_requests_of_one_caller_spread_over_free_slots() -> None:
    d = Driver(slots=3)
    home = d.run(ANN_KEYLESS)
    jobs = [d.submit(ANN_KEYLESS) for _ in range(3)]
    started = d.step()
    assert started == jobs  # none waits for the owner's slot while others are free
    assert jobs[0].slot_id == home and len({j.slot_id for j in jobs}) == 3
    for job in jobs:
        d.finish(job)
    assert set(d.table.holders()) == {ANN_KEYLESS}
    assert sorted(d.table.holders()[ANN_KEYLESS]) == [0, 1, 2]  # one owner, three slots
    # while one request runs on a slot, the next one takes another at once
    running = d.submit(ANN_KEYLESS)
    assert d.step() == [running]
    later = d.submit(ANN_KEYLESS)
    assert d.step() == [later] and later.slot_id != running.slot_id


def test_a_keyless_request_goes_to_the_slot_it_continues() -> None:
    d = Driver(slots=3)
    a1 = prefix_blocks(["sys", "agent A 1"])
    b1 = prefix_blocks(["sys", "agent B 1"])
    slot_a = d.run(ANN_KEYLESS, a1)
    slot_b = d.run(ANN_KEYLESS, b1)
    assert slot_b != slot_a  # B continues nothing there: a fresh slot keeps A's KV
    for turn in range(2, 7):  # two agents alternate: each continues its own slot
        a = prefix_blocks(["sys", "agent A 1", *(f"A {i}" for i in range(2, turn + 1))])
        b = prefix_blocks(["sys", "agent B 1", *(f"B {i}" for i in range(2, turn + 1))])
        assert d.run(ANN_KEYLESS, a) == slot_a
        assert d.run(ANN_KEYLESS, b) == slot_b
    # a third conversation takes the last fresh slot; a fourth finds none and replaces
    # the owner's slot sharing most of its blocks, its own owner's (no erase)
    slot_c = d.run(ANN_KEYLESS, prefix_blocks(["sys", "agent C 1"]))
    assert slot_c not in (slot_a, slot_b)
    job = d.submit(ANN_KEYLESS, prefix_blocks(["other sys", "agent D 1"]))
    (started,) = d.step()
    assert started.slot_id == slot_a  # none shares a block: the least recently used
    assert d.finish(job) == Preparation()
    # a request whose blocks are unknown goes to the owner's most recently used slot
    assert d.run(ANN_KEYLESS) == slot_a


def test_choose_slot_within_an_owner() -> None:
    table = SlotTable(4, generation=1)
    a = prefix_blocks(["s", "a", "a2"])
    b = prefix_blocks(["s", "b"])
    for slot, blocks in ((0, a[:2]), (1, b), (2, a)):
        job = object()
        table.pin(slot, job)
        table.sending(slot, job)
        table.completed(slot, job, "owner", keyless=True, blocks=blocks)
        table.unpin(slot, job)
    free = [0, 1, 2, 3]
    longer = prefix_blocks(["s", "a", "a2", "a3"])
    assert choose_slot(free, session="owner", table=table, prefix=longer) == 2  # longest
    assert choose_slot([0, 1, 3], session="owner", table=table, prefix=longer) == 0
    assert choose_slot(free, session="owner", table=table) == 2  # unknown: most recent
    other = prefix_blocks(["s", "c"])
    assert choose_slot(free, session="owner", table=table, prefix=other) == 3  # clean first
    # no clean slot: the owner's slot sharing the most blocks, least recently used first
    assert choose_slot([0, 1, 2], session="owner", table=table, prefix=other) == 0
    assert choose_slot([1, 2], session="owner", table=table, prefix=other) == 1
    # blocks never take another owner's slot
    assert choose_slot([0, 1, 2, 3], session="someone", table=table, prefix=longer) == 3


def test_a_keyless_owners_kv_is_parked_like_any_owners_when_its_slot_changes_owner() -> None:
    d = Driver(slots=1)
    d.run(ANN_KEYLESS)
    named = KEYS.session(ANN, "chat")
    for incoming in (named, BEA_KEYLESS):  # a session, another caller's keyless owner
        table = d.table
        assert not table.safe_for(0, incoming)
        assert table.preparation(0, incoming, parking=True) == Preparation(
            park=ANN_KEYLESS, erase=True
        )
        assert table.preparation(0, incoming, parking=False) == Preparation(erase=True)
        # a blind job reads nothing, but the owner's KV is parked before it is displaced
        assert table.preparation(0, None, parking=True) == Preparation(park=ANN_KEYLESS)
        assert table.preparation(0, None, parking=False) == Preparation()
    job = d.submit(BEA_KEYLESS)
    assert d.step() == [job]
    assert d.finish(job) == Preparation(park=ANN_KEYLESS, erase=True)
    assert d.table.owner(0) == BEA_KEYLESS
    # a named session's KV displaced by a keyless owner is parked first, as between sessions
    d.run(named, keyless=False)  # (erases Bea's keyless KV before)
    prep = d.table.preparation(0, ANN_KEYLESS, parking=True)
    assert prep == Preparation(park=named, erase=True)
    assert d.table.preparation(0, ANN_KEYLESS) == Preparation(erase=True)


def test_two_callers_keyless_owners_never_share_a_slot() -> None:
    d = Driver(slots=2)
    ann = d.run(ANN_KEYLESS)
    bea = d.run(BEA_KEYLESS)
    assert bea != ann  # a fresh slot rather than an erase of Ann's
    assert d.table.holders() == {ANN_KEYLESS: [ann], BEA_KEYLESS: [bea]}
    for _ in range(2):  # alternating, each keeps its own
        assert d.run(ANN_KEYLESS) == ann and d.run(BEA_KEYLESS) == bea
    # when Bea's slot is busy, her next request takes Ann's, parked and erased first
    busy = d.submit(BEA_KEYLESS)
    d.step()
    job = d.submit(BEA_KEYLESS)
    assert d.step() == [job]
    assert job.slot_id == ann
    assert d.finish(job) == Preparation(park=ANN_KEYLESS, erase=True)
    d.finish(busy)
    assert set(d.table.holders()) == {BEA_KEYLESS}


def test_a_save_makes_the_other_slots_of_its_session_stale() -> None:
    table = SlotTable(2, generation=1)
    jobs = [object(), object()]
    for slot, job in enumerate(jobs):
        table.pin(slot, job)
        table.sending(slot, job)
        table.completed(slot, job, "chat")
        table.parked(slot, job, "chat")  # each save replaces the session's one parked file
    assert [e.parked_current for e in table.slots] == [False, True]
    on_disk = {"chat"}.__contains__
    assert table.preparation(0, "other", parking=True, is_parked=on_disk) == (
        Preparation(park="chat", erase=True)
    )
    assert table.preparation(1, "other", parking=True, is_parked=on_disk) == (
        Preparation(erase=True)
    )


# --------------------------------------------------------------------------- the model

KEYLESS_OWNERS = ("keyless-of-ann", "keyless-of-bea")


class KeylessOwnersMachine(SlotTableMachine):
    """The slot table's model (``test_slot_table``) with two callers' keyless owners
    among the sessions: they are owners like any other (a job of one runs only on
    its own KV or nothing), parked and restored like any other."""

    def _keyless(self, session: str) -> bool:
        return session in KEYLESS_OWNERS

    def _end(self, job: Any, *, tokens: bool) -> None:
        if tokens:
            self.truth[job.slot].add(job.token)
        keyless = job.session in KEYLESS_OWNERS
        self.table.completed(job.slot, job, job.session, keyless=keyless)
        job.ended = True

    def _prepare(self, job: Any) -> None:
        super()._prepare(job)
        parks = [session for kind, session in job.steps if kind == "park"]
        assert all(p == self.table.owner(job.slot) for p in parks), f"{job!r} parks another"

    @precondition(lambda self: bool(self._pinnable()))
    @rule(data=st.data(), owner=st.sampled_from(KEYLESS_OWNERS))
    def submit_keyless_owner(self, data: st.DataObject, owner: str) -> None:
        self._submit(data.draw(st.sampled_from(self._pinnable()), label="slot"), owner)

    @precondition(lambda self: bool(self._pinnable()))
    @rule(data=st.data(), owner=st.sampled_from(KEYLESS_OWNERS))
    def whole_keyless_owner_job(self, data: st.DataObject, owner: str) -> None:
        SlotTableMachine.whole_job(self, data, owner)

    @invariant()
    def keyless_owners_are_marked(self) -> None:
        for entry in self.table.slots:
            assert entry.keyless == (
                entry.content is Content.OWNED and entry.session in KEYLESS_OWNERS
            )


KeylessOwnersMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None
)
test_keyless_owners_against_the_engines_truth = KeylessOwnersMachine.TestCase


# --------------------------------------------------------------------------- the engine

KEY_ANN, KEY_BEA = "key-ann-0123456789", "key-bea-0123456789"
# token-id prompts: the second extends the first
FIRST = [300 + (i * 7) % 200 for i in range(96)]
EXTENDED = [*FIRST, *(320 + i for i in range(24))]


async def _complete(
    host: Host, mode: str, api_key: str, prompt: list[int]
) -> tuple[int, int, int | None]:
    """One keyless ``/completion`` of the caller of ``api_key``, sent as the API layer
    does: its owner from ``SessionKeys.owner``, ``id_slot`` from the grant,
    ``cache_prompt`` off when the grant is blind, and word of the engine's answer to
    the grant. Returns (cached tokens, upstream
    calls made before it, slot)."""
    caller = host.sessions.caller(api_key)
    owner = host.sessions.owner(caller, None, keyless=mode)  # type: ignore[arg-type]
    runtime = host.models["tiny"]
    blocks = prefix_blocks(str(t) for t in prompt)
    async with host.completion_slot(runtime, session=owner, keyless=True, prefix=blocks) as (
        member,
        grant,
    ):
        body: dict[str, Any] = {"prompt": prompt, "n_predict": 2, "temperature": 0}
        body["id_slot"] = grant.slot_id
        if grant.blind:
            body["cache_prompt"] = False
        result = await member.client.forward("POST", "/completion", body=body, slot=grant.slot_id)
        if result.head.status == 200 and result.json()["timings"]["predicted_n"] > 0:
            grant.answered()  # the engine generated: a blind request emptied the slot first
    assert result.head.status == 200, result.content[:300]
    return int(result.json()["timings"]["cache_n"]), grant.prepare_calls, grant.slot_id


async def _slot_settled(host: Host, mode: str) -> None:
    """Wait for the background work on the one slot: shared, its owner's KV saved (the
    copy current); blind, the erase of what the blind job left."""
    assert host.scheduler is not None
    entry = host.scheduler.policy.table("tiny").slots[0]

    def settled() -> bool:
        if mode == "shared":
            return entry.parked_current and entry.saving is None
        return entry.content is Content.CLEAN and entry.pin is None

    with trio.fail_after(30):
        while not settled():
            await trio.sleep(0.01)
            entry = host.scheduler.policy.table("tiny").slots[0]


@pytest.mark.parametrize("mode", ["shared", "blind"])
async def test_keyless_cache_on_a_real_engine(
    tiny_model: Path, tmp_path: Path, engine_binary: EngineBinary, mode: str
) -> None:
    """One slot. Ann's keyless request, then one that extends it: the engine reuses
    the first one's prefix in ``shared`` mode, nothing in ``blind`` mode. Then Bea's
    keyless request with the same prompt on that slot reuses nothing in either mode
    (shared: Ann's KV is parked in the background once her turn ended, and Bea's
    request sent with ``cache_prompt`` off instead of an erase), and Ann's next one
    gets her own KV back in shared mode (restored: the slot's handoff makes one call
    before the request, the save is off its path), nothing in blind mode."""
    state = tmp_path / "state"
    state.mkdir()
    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=1, ctx_per_slot=1024)],
        state_dir=state,
        engine_binary=engine_binary,
        server={"api_keys": [KEY_ANN, KEY_BEA]},
        scheduler={"keyless": mode},
    )
    with trio.fail_after(120):
        async with open_host(cfg) as host:
            assert await _complete(host, mode, KEY_ANN, FIRST) == (0, 0, 0)
            cached, calls, _ = await _complete(host, mode, KEY_ANN, EXTENDED)
            assert calls == 0
            if mode == "shared":
                assert cached >= len(FIRST) - 1  # its own prefix, as llama-server would
            else:
                assert cached == 0
            # another caller on the same slot: Ann's KV was saved in the background, and
            # the request is sent blind (cache_prompt off) in both modes, so no call
            # precedes it; the engine reuses nothing either way
            await _slot_settled(host, mode)
            cached, calls, _ = await _complete(host, mode, KEY_BEA, EXTENDED)
            assert cached == 0
            assert calls == 0
            await _slot_settled(host, mode)
            cached, calls, _ = await _complete(host, mode, KEY_ANN, EXTENDED)
            assert calls == (1 if mode == "shared" else 0)
            runtime = host.models["tiny"]
            if mode == "shared":  # Ann's own KV, restored
                assert cached >= len(EXTENDED) - 1
                assert runtime.kv_stats.saves >= 2 and runtime.kv_stats.restores == 1
            else:
                assert cached == 0 and runtime.kv_stats.saves == 0
            assert host.scheduler is not None
            erases = host.scheduler.statistics().erases
            assert erases["failed"] == 0
            assert erases["sent_blind"] == (1 if mode == "shared" else 0)
            assert erases["blind_unanswered"] == 0


def test_a_keyless_owners_jobs_spread_over_replicas_even_where_it_holds_kv() -> None:
    """A named session's job stays with the replica holding its KV; a keyless owner's
    (many conversations of one caller) is taken by a sibling with room."""
    policy = SchedulerPolicy(
        [Lane("m@0", parallel=1, family="m"), Lane("m@1", parallel=1, family="m")],
        residency="coexist",
    )

    def step() -> list[Job]:
        started: list[Job] = []
        for _ in range(10):
            actions = policy.plan()
            for action in actions:
                if isinstance(action, Load):
                    policy.load_done(action.model_id)
                elif isinstance(action, Admit):
                    started.extend(policy.admit(action.model_id, None, now=0).jobs)
            if not actions:
                break
        return started

    def submit(session: str, *, keyless: bool) -> Job:
        job = Job(model_id="m@0", session=session, keyless=keyless, pool=True)
        return policy.enqueue(job, now=0)

    for owner, keyless in ((ANN_KEYLESS, True), (KEYS.session(ANN, "chat"), False)):
        first = submit(owner, keyless=keyless)
        assert step() == [first] and first.model_id == "m@0"
        first.ran = True
        policy.settle(first, now=0)
        assert policy.table("m@0").holds(owner)
        busy = submit(owner, keyless=keyless)
        assert step() == [busy] and busy.model_id == "m@0"  # its KV's replica, free
        waiting = submit(owner, keyless=keyless)
        if keyless:  # the sibling has room: it takes the job
            assert step() == [waiting] and waiting.model_id == "m@1"
            policy.settle(busy, now=0)
        else:  # bound to its KV: it waits for m@0
            assert step() == [] and waiting.model_id == "m@0"
            policy.settle(busy, now=0)
            assert step() == [waiting] and waiting.model_id == "m@0"
        policy.settle(waiting, now=0)
