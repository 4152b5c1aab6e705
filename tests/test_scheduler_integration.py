"""The scheduler against a real llama-server: handoff erase, concurrency, disconnect, swap."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from gezel_trio.config.schema import Config, ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.host import Host

from ._engine_bin import ENGINE_LIMITS
from .conftest import make_config, running

# Distinct token-id prompts (no shared prefix beyond BOS) so "cached" can only
# come from the session's own earlier turn.
A_PROMPT = [300 + (i * 7) % 200 for i in range(120)]
B_PROMPT = [310 + (i * 11) % 180 for i in range(120)]


def _completion(prompt: list[int], session: str, n: int = 4) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt,
        "n_predict": n,
        "temperature": 0,
        "cache_prompt": True,
        "prompt_cache_key": session,
    }


def _cached(body: dict[str, Any]) -> int:
    return int(body["timings"]["cache_n"])


def _one_model(
    tiny_model: Path,
    state_dir: Path,
    engine_binary: EngineBinary,
    *,
    parallel: int,
    **sections: dict[str, object],
) -> Config:
    """The tiny model alone, ``parallel`` slots of 1024 tokens."""
    return make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=parallel, ctx_per_slot=1024)],
        state_dir=state_dir,
        engine_binary=engine_binary,
        **sections,
    )


class EraseSpy:
    """Wraps a lane's erase to record when each erase was acknowledged."""

    def __init__(self, host: Host, model: str, events: list[tuple[str, float]]) -> None:
        rt = host.models[model]
        self._inner = rt.erase_slot
        self._events = events
        rt.erase_slot = self  # type: ignore[method-assign]

    async def __call__(self, slot_id: int) -> None:
        await self._inner(slot_id)
        self._events.append((f"erase:{slot_id}", trio.current_time()))


@pytest.mark.parametrize("kv_parking", [False, True])
async def test_handoff_erases_and_same_session_keeps_kv(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, kv_parking: bool
) -> None:
    """Two sessions alternate on one slot.

    Without parking the handoff erases: B starts from 0 cached tokens, and A's
    KV is gone when it comes back. With parking, A's KV is saved before B gets
    the slot and restored when A returns (B still sees 0 cached tokens: the
    restore or erase always happens before the completion reaches the engine).
    """
    cfg = _one_model(
        tiny_model,
        state_dir,
        engine_binary,
        parallel=1,
        # every save at its handoff (the background saves have tests of their own), and
        # an erase, not a blind send (test_slot_table_integration has those)
        scheduler={"kv_parking": kv_parking, "save_idle_slots": False, "blind_handoff": False},
    )
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            events: list[tuple[str, float]] = []
            EraseSpy(host, "tiny", events)

            async def turn(prompt: list[int], session: str) -> dict[str, Any]:
                r = await client.post("/completion", json=_completion(prompt, session))
                assert r.status_code == 200, r.text
                events.append((f"done:{session}", trio.current_time()))
                return r.json()

            a1 = await turn(A_PROMPT, "A")
            assert _cached(a1) == 0
            a2 = await turn([*A_PROMPT, 400, 401], "A")  # same session: keeps its KV
            assert _cached(a2) >= len(A_PROMPT)
            b1 = await turn(B_PROMPT, "B")  # handoff: slot 0 erased first
            assert _cached(b1) == 0
            a3 = await turn(A_PROMPT, "A")  # and back
            names = [e for e, _ in events]
            stats = host.scheduler.statistics().as_dict()  # type: ignore[union-attr]
            parking = host.models["tiny"].statistics().as_dict()["kv_parking"]
            if kv_parking:
                assert _cached(a3) >= len(A_PROMPT) - 1  # A's KV came back from disk
                assert names == ["done:A", "done:A", "erase:0", "done:B", "done:A"]
                assert (parking["saves"], parking["restores"], parking["hits"]) == (2, 1, 1)
            else:
                assert _cached(a3) == 0  # A's KV was erased at the handoff
                assert names == ["done:A", "done:A", "erase:0", "done:B", "erase:0", "done:A"]
                assert parking == {}
                assert stats["erases"]["ok"] == 2
            assert stats["erases"]["failed"] == 0


async def test_two_sessions_hold_their_own_slots_at_once(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    cfg = _one_model(tiny_model, state_dir, engine_binary, parallel=2)
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            engine = host.models["tiny"].engine
            await client.post("/completion", json=_completion(A_PROMPT, "A", 1))
            assert engine.base_url
            seen_both = False

            async def long(prompt: list[int], session: str) -> None:
                body = {**_completion(prompt, session, 800), "ignore_eos": True}
                await client.post("/completion", json=body)

            async with (
                trio.open_nursery() as nursery,
                httpx.AsyncClient(limits=ENGINE_LIMITS) as direct,
            ):
                nursery.start_soon(long, A_PROMPT, "A")
                nursery.start_soon(long, B_PROMPT, "B")
                with trio.move_on_after(30):
                    while not seen_both:
                        slots = (await direct.get(f"{engine.base_url}/slots")).json()
                        seen_both = all(s["is_processing"] for s in slots)
                        await trio.sleep(0.01)
                nursery.cancel_scope.cancel()  # the clients go away mid-generation
            assert seen_both
            # the host notices both disconnects; each cancelled job records its owner
            stats = host.scheduler.statistics().as_dict()  # type: ignore[union-attr]
            with trio.fail_after(10):
                while sum(stats["running"].values()):
                    await trio.sleep(0.02)
                    stats = host.scheduler.statistics().as_dict()  # type: ignore[union-attr]
            owners = stats["slot_owners"]["tiny"]
            assert len(owners) == 2 and len(set(owners.values())) == 2


async def test_disconnect_frees_slot_for_the_next_queued_job(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    cfg = _one_model(tiny_model, state_dir, engine_binary, parallel=1)
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            await client.post("/completion", json=_completion(A_PROMPT, "A", 1))
            got_second = trio.Event()

            async def second() -> None:
                r = await client.post("/completion", json=_completion(B_PROMPT, "B", 2))
                assert r.status_code == 200
                got_second.set()

            async with trio.open_nursery() as nursery:
                body = {**_completion(A_PROMPT, "A", 900), "stream": True, "ignore_eos": True}
                async with client.stream("POST", "/completion", json=body) as resp:
                    n = 0
                    async for line in resp.aiter_lines():
                        n += line.startswith("data: ")
                        if n == 2:
                            nursery.start_soon(second)
                            sched = host.scheduler
                            assert sched is not None
                            with trio.fail_after(10):  # B waits: one slot, taken
                                while sched.statistics().as_dict()["queued"] != 1:  # noqa: ASYNC110
                                    await trio.sleep(0.01)
                            break
                # the stream is closed: B is admitted promptly
                with trio.fail_after(20):
                    await got_second.wait()
            stats = host.scheduler.statistics().as_dict()  # type: ignore[union-attr]
            assert stats["queued"] == 0 and sum(stats["running"].values()) == 0


async def test_two_models_in_swap_mode_take_turns(
    tiny_model: Path, models_dir: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    cfg = make_config(
        [
            ModelConfig(id="tiny", path=str(tiny_model), parallel=2, ctx_per_slot=512),
            ModelConfig(id="tiny2", path=str(tiny_model), parallel=2, ctx_per_slot=512),
        ],
        state_dir=state_dir,
        engine_binary=engine_binary,
        gpu={"policy": "swap"},
    )
    with trio.fail_after(180):
        async with running(cfg) as (host, client):
            order: list[str] = []

            async def ask(model: str, i: int) -> None:
                r = await client.post(
                    "/v1/completions",
                    json={"model": model, "prompt": f"hi {i}", "max_tokens": 8, "temperature": 0},
                )
                assert r.status_code == 200, r.text
                order.append(model)

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(ask, "tiny", i)
                    nursery.start_soon(ask, "tiny2", i)
            assert sorted(order) == ["tiny"] * 4 + ["tiny2"] * 4
            # swap: the resident model changed, the other engine was evicted (stopped)
            e1, e2 = host.models["tiny"].engine, host.models["tiny2"].engine
            assert e1.starts + e2.starts >= 2
            assert host.arbiter.statistics().as_dict()["evictions"] >= 1
            states = {e1.state.value.value, e2.state.value.value}
            assert states == {"ready", "stopped"}  # one resident at a time
            # turns: completions of one model come in runs, not interleaved one by one
            switches = sum(1 for a, b in itertools.pairwise(order) if a != b)
            assert switches <= 3


async def test_benchmark_is_exclusive_and_reports_speed(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """POST /api/models/{id}/benchmark drains the engine, runs alone, and reports
    llama-server's own prefill and decode speed; a completion sent meanwhile waits."""
    cfg = _one_model(tiny_model, state_dir, engine_binary, parallel=2)
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            await client.post("/completion", json=_completion(A_PROMPT, "A", 1))
            seen_active: list[object] = []
            order: list[str] = []
            op_running = trio.Event()

            async def bench() -> None:
                r = await client.post(
                    "/api/models/tiny/benchmark", params={"prompt_tokens": 512, "n_predict": 200}
                )
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["prompt_tokens"] == 512 and body["predicted_tokens"] == 200
                assert body["prompt_tokens_per_s"] > 0 and body["predicted_tokens_per_s"] > 0
                order.append("benchmark")

            async def watch() -> None:
                while not order:
                    active = host.scheduler.statistics().as_dict()["active"]  # type: ignore[union-attr]
                    if active:
                        seen_active.append(active)
                        op_running.set()
                    await trio.sleep(0.005)

            async def completion() -> None:
                await op_running.wait()
                r = await client.post("/completion", json=_completion(B_PROMPT, "B", 2))
                assert r.status_code == 200
                order.append("completion")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch)
                nursery.start_soon(bench)
                nursery.start_soon(completion)
            assert seen_active and seen_active[0] == {"model_id": "tiny", "kind": "benchmark"}
            assert order == ["benchmark", "completion"]  # admitted only after the op
            status = (await client.get("/api/status")).json()
            assert status["engines"][0]["benchmark"]["predicted_tokens"] == 200
            bad = await client.post("/api/models/tiny/benchmark", params={"prompt_tokens": 99999})
            assert bad.status_code == 400
