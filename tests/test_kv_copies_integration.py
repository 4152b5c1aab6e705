"""Several parked copies per owner, keyless owners parked, and saves off the critical
path, against a real llama-server.

Each test measures the engine's own truth first (a conversation's next turn on a
slot that kept it: ``usage.prompt_tokens_details.cached_tokens``) and checks that the
host gives a returning conversation exactly that after its slot was taken, and
another owner nothing. Waits are on conditions (the scheduler's counters), never on
the clock.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import trio

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.host import Host
from gezel_trio.kv.prefix import shared_blocks

from .conftest import make_config, running
from .fault_tools import wait_nothing_held, wait_until

CHAT_PATH = "/v1/chat/completions"
KEY_ANN, KEY_BEA = "sk-ann-0123456789abcdef", "sk-bea-0123456789abcdef"
TEXT = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(12))


def _conversation(system: str, turns: int) -> list[dict[str, str]]:
    """A conversation of ``turns`` user turns (fixed assistant answers in between)."""
    messages = [{"role": "system", "content": system}]
    for i in range(turns):
        if i:
            messages.append({"role": "assistant", "content": f"Noted, part {i}."})
        messages.append({"role": "user", "content": f"Part {i}. {TEXT}"})
    return messages


MAIN = "You are the main agent. Plan the work and delegate it. " * 4
SUB = "You are a sub-agent that only searches files and reports back. " * 4


def _config(tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, **sections: Any) -> Any:
    # the strangers below, of the same (local) caller, would start from the prefix they
    # share (test_caller_prefix); here they stand for anyone else, who gets none of it
    sections["scheduler"] = {"share_prefix_within_caller": False, **sections.get("scheduler", {})}
    return make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=1, ctx_per_slot=2048)],
        state_dir=state_dir,
        engine_binary=engine_binary,
        **sections,
    )


async def _turn(
    host: Host,
    client: httpx.AsyncClient,
    messages: list[dict[str, str]],
    *,
    session: str | None = None,
    api_key: str | None = None,
) -> tuple[int, list[str]]:
    """One chat turn: (its cached tokens as the engine reports them, the upstream calls
    the host sent for it, up to and including its completion)."""
    upstream = host.models["tiny"].client
    since = upstream.recent[-1].seq if upstream.recent else 0
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": messages,
        "temperature": 0,
        "max_tokens": 2,
    }
    if session is not None:
        body["prompt_cache_key"] = session
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = await client.post(CHAT_PATH, json=body, headers=headers)
    assert resp.status_code == 200, resp.text
    await wait_nothing_held(host)
    calls = [c.action for c in upstream.recent if c.seq > since and c.action != "slots"]
    cached = int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    return cached, calls[: calls.index(CHAT_PATH) + 1]


def _parking(host: Host) -> dict[str, int]:
    assert host.scheduler is not None
    return dict(host.scheduler.statistics().parking)


async def _slot_saved(host: Host) -> None:
    """Wait until the background save of the one slot has ended with its copy current."""
    assert host.scheduler is not None
    table = host.scheduler.policy.table("tiny")
    await wait_until(
        lambda: table.slots[0].parked_current and table.slots[0].saving is None,
        within=30.0,
        what="the slot saved in the background",
    )


async def _truth(host: Host, client: httpx.AsyncClient, system: str, **kw: Any) -> int:
    """The engine's truth: turn 2 of a conversation on a slot that kept turn 1."""
    await _turn(host, client, _conversation(system, 1), **kw)
    cached, _ = await _turn(host, client, _conversation(system, 2), **kw)
    assert cached > 0
    return cached


async def test_one_session_keeps_two_conversations_and_gets_each_back(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """An agent and its sub-agent under one session id (other system prompts), on one
    slot: each turn of one displaces the other, which is parked, and each comes back
    with exactly the cached tokens the engine gives a conversation that kept its slot."""
    cfg = _config(tiny_model, state_dir, engine_binary)
    with trio.fail_after(240):
        async with running(cfg) as (host, client):
            main_truth = await _truth(host, client, MAIN, session="ref-main")
            sub_truth = await _truth(host, client, SUB, session="ref-sub")
            await _turn(host, client, _conversation(MAIN, 1), session="agent")
            await _turn(host, client, _conversation(SUB, 1), session="agent")
            for turns in (2, 3):
                # the other conversation of the session was parked; this one restored
                cached, calls = await _turn(
                    host, client, _conversation(MAIN, turns), session="agent"
                )
                assert "restore" in calls
                if turns == 2:
                    assert cached == main_truth
                else:
                    assert cached >= main_truth
                cached, calls = await _turn(
                    host, client, _conversation(SUB, turns), session="agent"
                )
                assert "restore" in calls
                if turns == 2:
                    assert cached == sub_truth
                else:
                    assert cached >= sub_truth
            kv = host.models["tiny"].statistics().as_dict()["kv_parking"]
            assert kv["ineffective"] == 0 and kv["hits"] >= 4
            assert host.kv is not None
            copies = host.kv.copies(
                "tiny", host.sessions.session(host.sessions.caller(None), "agent")
            )
            assert len(copies) == 2  # one copy per conversation, each its latest turn
            assert shared_blocks(copies[0].blocks, copies[1].blocks) == 0  # two chats
            # another session with the same conversation gets none of it
            cached, _ = await _turn(host, client, _conversation(MAIN, 3), session="stranger")
            assert cached == 0


async def test_a_keyless_owners_conversation_survives_another_callers_request(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """``keyless = "shared"``: Ann's keyless chat is parked when Bea's keyless request
    takes the one slot (Bea, with Ann's very conversation, gets 0 cached tokens), and
    restored when Ann returns, with the engine's own cached tokens."""
    cfg = _config(
        tiny_model,
        state_dir,
        engine_binary,
        server={"api_keys": [KEY_ANN, KEY_BEA]},
        scheduler={"keyless": "shared"},
    )
    with trio.fail_after(240):
        async with running(cfg) as (host, client):
            truth = await _truth(host, client, MAIN, session="ref", api_key=KEY_ANN)
            await _turn(host, client, _conversation(MAIN, 1), api_key=KEY_ANN)
            cached, calls = await _turn(host, client, _conversation(MAIN, 2), api_key=KEY_BEA)
            assert cached == 0 and "restore" not in calls
            cached, calls = await _turn(host, client, _conversation(MAIN, 2), api_key=KEY_ANN)
            assert "restore" in calls
            assert cached == truth
            assert host.models["tiny"].kv_stats.saves >= 2  # Ann's and Bea's
            assert _parking(host)["handoffs"] >= 3


async def test_a_keyed_handoff_after_an_idle_turn_makes_at_most_two_upstream_calls(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """The outgoing chat's save happens in the background once its turn ended: the
    handoff sends only the incoming chat's restore and its request, or its request
    alone (sent with ``cache_prompt`` off, the engine empties the slot). Without
    background saves each handoff makes one call more, the save."""
    for background, total_calls in ((False, 5), (True, 3)):
        state = state_dir / ("bg" if background else "fg")
        state.mkdir()
        cfg = _config(tiny_model, state, engine_binary, scheduler={"save_idle_slots": background})
        with trio.fail_after(240):
            async with running(cfg) as (host, client):
                truth = await _truth(host, client, MAIN, session="ref")
                await _turn(host, client, _conversation(MAIN, 1), session="A")
                if background:
                    await _slot_saved(host)
                before = _parking(host)
                _, calls = await _turn(host, client, _conversation(SUB, 1), session="B")
                assert calls == ([CHAT_PATH] if background else ["save", CHAT_PATH])
                if background:
                    await _slot_saved(host)
                cached, calls = await _turn(host, client, _conversation(MAIN, 2), session="A")
                assert calls == (
                    ["restore", CHAT_PATH] if background else ["save", "restore", CHAT_PATH]
                )
                assert cached == truth
                after = _parking(host)
                handoffs = after["handoffs"] - before["handoffs"]
                assert handoffs == 2
                assert after["handoff_calls"] - before["handoff_calls"] == total_calls
                if background:
                    assert after["save_skipped_current"] - before["save_skipped_current"] == 2
                    assert after["saved"] == before["saved"]  # no save at a handoff
                    assert after["saved_idle"] - before["saved_idle"] >= 1  # B's


async def test_a_growing_single_message_is_restored_from_its_parked_copy(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """A client that sends its whole transcript as one user message, longer each turn:
    when another owner took the one slot in between, the next turn restores the
    session's parked copy (its header and complete pieces match) and the engine reuses
    its tokens; another session with the very same message gets none of them."""
    cfg = _config(tiny_model, state_dir, engine_binary)

    def grown(turns: int) -> list[dict[str, str]]:
        text = "".join(f"Turn {i}: {TEXT}\n" for i in range(turns))
        return [{"role": "user", "content": text}]

    with trio.fail_after(240):
        async with running(cfg) as (host, client):
            await _turn(host, client, grown(1), session="chat")
            await _turn(host, client, _conversation(SUB, 1), session="other")  # parks it
            before = host.models["tiny"].statistics().as_dict()["kv_parking"]
            cached, calls = await _turn(host, client, grown(2), session="chat")
            after = host.models["tiny"].statistics().as_dict()["kv_parking"]
            assert "restore" in calls
            assert cached > 0
            assert after["restores"] == before["restores"] + 1
            assert after["ineffective"] == before["ineffective"] == 0
            cached, calls = await _turn(host, client, grown(2), session="stranger")
            assert cached == 0 and "restore" not in calls


async def _answer_order(cfg: Any, cold: list[dict[str, str]]) -> tuple[list[str], int, int, int]:
    """Conversation A's first turn, parked; then, while another job holds the one slot,
    ``cold`` queues, then A's next turn. Returns the order the two were answered in,
    A's cached tokens, the engine's truth for them, and the scheduler's short_first."""
    order: list[str] = []
    cached: dict[str, int] = {}
    async with running(cfg) as (host, client):
        truth = await _truth(host, client, MAIN, session="ref")
        await _turn(host, client, _conversation(MAIN, 1), session="A")
        await _slot_saved(host)
        sched = host.scheduler
        assert sched is not None

        async def send(name: str, messages: list[dict[str, str]]) -> None:
            body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 2}
            resp = await client.post(CHAT_PATH, json={**body, "prompt_cache_key": name})
            order.append(name)  # when its answer came (one slot: in the order they ran)
            assert resp.status_code == 200, resp.text
            cached[name] = int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

        async with trio.open_nursery() as nursery, host.slot(host.models["tiny"], session="x"):
            nursery.start_soon(send, "cold", cold)
            await wait_until(lambda: sched.statistics().queued == 1, within=30)
            nursery.start_soon(send, "A", _conversation(MAIN, 2))
            await wait_until(lambda: sched.statistics().queued == 2, within=30)
        return order, cached["A"], truth, sched.statistics().short_first


async def test_an_agents_next_turn_on_its_parked_kv_goes_before_a_cold_prompt(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """One slot, held by another job. A long new conversation queues first, then A's
    next turn, whose first turn is parked. With short work first (the default) A's turn
    is answered first, from its parked copy (the engine's cached count is the truth
    measured on a slot that kept it); with ``short_first_passes = 0`` the queue is
    first come, first served."""
    cold = _conversation(SUB * 8, 1)  # about 2,700 characters: more than 8 blocks, all new
    for passes, first in ((4, "A"), (0, "cold")):
        state = state_dir / f"passes{passes}"
        state.mkdir()
        cfg = _config(tiny_model, state, engine_binary, scheduler={"short_first_passes": passes})
        with trio.fail_after(240):
            order, cached, truth, short_first = await _answer_order(cfg, cold)
        assert order[0] == first
        assert cached == truth  # from its parked copy, either way
        assert short_first == (1 if passes else 0)
