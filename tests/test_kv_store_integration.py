"""Parked KV outlives engines: swap eviction, idle and pressure release, unload and a host
restart, against a real llama-server. Each test measures the engine's own truth first
(a session's second turn on an engine that never stopped) and checks that the host
gives a returning session exactly that, and another session on its slot nothing."""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from gezel_trio.config.schema import Config, ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.supervisor import EngineState
from gezel_trio.gpu.probe import GpuReading, StaticProbe
from gezel_trio.host import Host
from gezel_trio.host.completion import Completion, Owner
from gezel_trio.scheduler.slots import Content

from .conftest import make_config, running
from .fault_tools import wait_until

GIB = 1024**3
# Token-id prompts with no shared prefix: cached tokens can only come from the session.
REF = [300 + (i * 7) % 200 for i in range(200)]
PROMPT = [310 + (i * 11) % 180 for i in range(200)]
MORE = [401, 402, 403, 404]


def _body(prompt: list[int], session: str | None, model: str = "tiny") -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "n_predict": 4,
        "temperature": 0,
        "cache_prompt": True,
    }
    if session is not None:
        body["prompt_cache_key"] = session
    return body


async def _cached(
    client: httpx.AsyncClient, prompt: list[int], session: str | None, **kw: Any
) -> int:
    r = await client.post("/completion", json=_body(prompt, session, **kw))
    assert r.status_code == 200, r.text
    return int(r.json()["timings"]["cache_n"])


def _config(
    tiny_model: Path,
    state_dir: Path,
    engine_binary: EngineBinary,
    *,
    extra: list[ModelConfig] = (),  # type: ignore[assignment]
    args: list[str] | None = None,
    idle_ttl: float = 0.0,
    **sections: dict[str, object],
) -> Config:
    # B, of the same (local) caller as A, would start from the prefix it shares with
    # A (test_caller_prefix); here it stands for anyone else, who gets none of it
    sections["scheduler"] = {"share_prefix_within_caller": False, **sections.get("scheduler", {})}
    return make_config(
        [
            ModelConfig(
                id="tiny",
                path=str(tiny_model),
                parallel=1,
                ctx_per_slot=1024,
                idle_ttl=idle_ttl,
                args=args or [],
            ),
            *extra,
        ],
        state_dir=state_dir,
        engine_binary=engine_binary,
        **sections,
    )


async def _reference(client: httpx.AsyncClient) -> int:
    """The engine's truth: a session's second turn on an engine that kept its slot."""
    assert await _cached(client, REF, "ref") == 0
    return await _cached(client, [*REF, *MORE], "ref")


async def _saves_settled(host: Host) -> None:
    """Wait until no job runs and no background save is in flight. An owner's slot is
    saved in the background once its job ends (``save_idle_slots``; on one slot a
    handoff is always likely), and the engine writes the file a moment before the store
    indexes it. The save begins in the same step as the job's release."""
    scheduler = host.scheduler
    assert scheduler is not None

    def settled() -> bool:
        stats = scheduler.statistics().as_dict()
        return not stats["running"] and all(t["saving"] == 0 for t in stats["slots"].values())

    await wait_until(settled, within=60, what="background saves settled")


def _kv(host: Host, model: str = "tiny") -> dict[str, Any]:
    return host.models[model].statistics().as_dict()["kv_parking"]


async def _returns_after(
    host: Host, client: httpx.AsyncClient, stop: Callable[[], Awaitable[None]]
) -> None:
    """Session A parks across ``stop()``; its next turn gets the reference's cached
    tokens; then B, with A's very prompt, gets none."""
    expected = await _reference(client)
    assert expected >= len(REF) - 1
    assert await _cached(client, PROMPT, "A") == 0  # the handoff parked "ref", erased
    engine = host.models["tiny"].engine
    starts = engine.starts
    await stop()
    assert engine.state.value is not EngineState.READY
    saved = _kv(host)["stop_parks"]
    assert saved >= 1
    assert await _cached(client, [*PROMPT, *MORE], "A") == expected  # restored, verified
    assert engine.starts == starts + 1
    kv = _kv(host)
    assert kv["hits"] >= 1 and kv["ineffective"] == 0
    assert await _cached(client, [*PROMPT, *MORE], "B") == 0  # never A's KV


async def test_a_session_returns_after_a_swap_eviction(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    other = ModelConfig(id="other", path=str(tiny_model), parallel=1, ctx_per_slot=256)
    cfg = _config(tiny_model, state_dir, engine_binary, extra=[other], gpu={"policy": "swap"})
    with trio.fail_after(120):
        async with running(cfg) as (host, client):

            async def swap() -> None:
                assert await _cached(client, REF[:20], None, model="other") == 0

            await _returns_after(host, client, swap)
            stopped = host.models["tiny"].statistics().as_dict()["kv_parking"]
            assert stopped["stop_park_ms"] > 0  # the eviction's added time shows


async def test_a_session_returns_after_an_idle_release(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    cfg = _config(tiny_model, state_dir, engine_binary, idle_ttl=1.0)
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            engine = host.models["tiny"].engine

            async def idle() -> None:
                await engine.state.wait_value(EngineState.STOPPED)

            await _returns_after(host, client, idle)


async def test_a_session_returns_after_a_pressure_release(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    probe = StaticProbe([_gpu(4.0)])
    cfg = _config(tiny_model, state_dir, engine_binary, gpu={"pressure_grace": 0.5})
    with trio.fail_after(120):
        async with running(cfg, probe=probe) as (host, client):
            engine = host.models["tiny"].engine

            async def pressure() -> None:
                probe.set_readings([_gpu(23.5)])
                await engine.state.wait_value(EngineState.STOPPED)
                probe.set_readings([_gpu(4.0)])
                assert host.pressure_releases == 1

            await _returns_after(host, client, pressure)


async def test_a_session_returns_after_an_unload(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    cfg = _config(tiny_model, state_dir, engine_binary)
    with trio.fail_after(120):
        async with running(cfg) as (host, client):

            async def unload() -> None:
                r = await client.post("/api/models/tiny/unload")
                assert r.status_code == 200 and r.json()["state"] == "stopped"

            await _returns_after(host, client, unload)


async def test_a_session_returns_after_a_host_restart(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    cfg = _config(tiny_model, state_dir, engine_binary)
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            expected = await _reference(client)
            assert await _cached(client, PROMPT, "A") == 0
            assert host.models["tiny"].engine.state.value is EngineState.READY
        # the host shut down: its slot was parked before the engine's SIGTERM
        async with running(cfg) as (host, client):
            assert host.kv is not None and host.kv.sessions()
            assert await _cached(client, [*PROMPT, *MORE], "A") == expected
            assert _kv(host)["hits"] == 1
            assert await _cached(client, [*PROMPT, *MORE], "B") == 0


async def test_the_completion_service_verifies_a_restore_without_http(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """Verifying a KV restore is the completion service's: a completion run through it
    directly (no HTTP front, no request log) that the restore served counts as a hit,
    streamed or not."""
    cfg = _config(tiny_model, state_dir, engine_binary)
    with trio.fail_after(120):
        async with running(cfg) as (host, _client):
            service = host.completions
            runtime = host.models["tiny"]
            owner = Owner(session="A", keyless=False)
            prompt = list(PROMPT)

            def completion(stream: bool) -> Completion:
                body = {**_body(prompt, None), "stream": stream}
                return Completion("/completion", body, "native", stream=stream)

            answer = await service.complete(runtime, completion(False), owner)
            assert isinstance(answer.result, dict)
            assert answer.result["timings"]["cache_n"] == 0
            assert answer.grant.restored_tokens == 0

            await runtime.engine.stop()  # A's slot is parked first
            assert _kv(host)["stop_parks"] >= 1
            prompt += MORE
            answer = await service.complete(runtime, completion(False), owner)
            assert isinstance(answer.result, dict)
            assert answer.grant.restored_tokens > 0
            assert answer.result["timings"]["cache_n"] > 0
            kv = _kv(host)
            assert kv["hits"] == 1 and kv["ineffective"] == 0

            await runtime.engine.stop()
            prompt += MORE
            job = service.start_stream(runtime, completion(True), owner)
            job.reading.set()
            chunks = [item async for item in job.recv]
            assert job.error is None and job.grant is not None
            assert job.grant.restored_tokens > 0
            assert any(isinstance(c, bytes) and b'"cache_n"' in c for c in chunks)
            kv = _kv(host)
            assert kv["hits"] == 2 and kv["ineffective"] == 0


@pytest.mark.parametrize("change", ["cache-type-k", "model-file"])
async def test_an_incompatible_file_is_dropped_not_restored(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, tmp_path: Path, change: str
) -> None:
    model = tmp_path / "tiny-copy.gguf"
    shutil.copyfile(tiny_model, model)
    cfg = _config(model, state_dir, engine_binary)
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            assert await _cached(client, PROMPT, "A") == 0
        if change == "cache-type-k":
            cfg = _config(model, state_dir, engine_binary, args=["--cache-type-k", "f32"])
        else:
            st = model.stat()
            os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        async with running(cfg) as (host, client):
            kv = host.kv
            assert kv is not None and len(kv.sessions()) == 1
            assert await _cached(client, [*PROMPT, *MORE], "A") == 0  # re-prefilled
            stats = _kv(host)
            assert stats["dropped_incompatible"] == 1 and stats["restores"] == 0
            assert stats["hits"] == 0
            await _saves_settled(host)  # the new copy, saved once its request ended
            files = list(kv.dirs["tiny"].iterdir())
            assert [f.name for f in files] == [e.file for e in kv.sessions()]  # only the new one


async def test_sessions_api_lists_own_sessions_and_deletes_everywhere(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    cfg = _config(
        tiny_model,
        state_dir,
        engine_binary,
        server={"api_keys": ["key-a", "key-b"], "admin_keys": ["key-admin"]},
    )
    a = {"Authorization": "Bearer key-a"}
    b = {"Authorization": "Bearer key-b"}
    admin = {"Authorization": "Bearer key-admin"}
    with trio.fail_after(120):
        async with running(cfg) as (host, client):

            async def turn(prompt: list[int], headers: dict[str, str]) -> int:
                r = await client.post("/completion", json=_body(prompt, "chat"), headers=headers)
                assert r.status_code == 200, r.text
                return int(r.json()["timings"]["cache_n"])

            await turn(PROMPT, a)
            await turn(REF, b)  # same chat name, another key: parks A's chat, takes the slot
            mine = (await client.get("/api/sessions", headers=a)).json()["sessions"]
            theirs = (await client.get("/api/sessions", headers=b)).json()["sessions"]
            every = (await client.get("/api/sessions", headers=admin)).json()["sessions"]
            assert len(mine) == 1 and mine[0]["parked"] and not mine[0]["slots"]
            assert len(theirs) == 1 and theirs[0]["slots"] == [{"model": "tiny", "slot": 0}]
            assert mine[0]["id"] != theirs[0]["id"]
            assert mine[0]["name"] == theirs[0]["name"] == "chat"  # each sees its own name
            assert all(s["name"] is None for s in every)  # the admin: no one's name
            assert {s["id"] for s in every} == {mine[0]["id"], theirs[0]["id"]}
            # a caller cannot remove another's session, nor see whether it exists
            r = await client.delete(f"/api/sessions/{mine[0]['id']}", headers=b)
            assert r.status_code == 404
            # by the name its client sent: only the caller's own session of that name
            r = await client.delete("/api/sessions/chat", headers=b)
            assert r.status_code == 200, r.text
            assert r.json()["id"] == theirs[0]["id"] and r.json()["slots_erased"] == 1
            assert (await client.get("/api/sessions", headers=a)).json()["sessions"] == mine
            r = await client.delete("/api/sessions/no-such-chat", headers=b)
            assert r.status_code == 404
            assert r.json()["error"]["type"] == "invalid_request_error"
            table = host.scheduler.policy.table("tiny")  # type: ignore[union-attr]
            assert table.slots[0].content is Content.CLEAN
            assert await turn([*REF, *MORE], b) == 0  # its KV is gone everywhere
            r = await client.delete(f"/api/sessions/{mine[0]['id']}", headers=a)
            assert r.status_code == 200 and r.json()["files_deleted"] == 1
            assert host.kv is not None and host.kv.by_id(mine[0]["id"]) == []
            assert (await client.delete("/api/sessions/ffff", headers=a)).status_code == 404


def _gpu(used_gib: float) -> GpuReading:
    return GpuReading(
        index=0,
        name="Fake GPU",
        temperature_c=50.0,
        memory_used_bytes=int(used_gib * GIB),
        memory_total_bytes=24 * GIB,
    )


@pytest.mark.parametrize("arch", ["mamba", "llama"])
async def test_restores_that_do_not_take_are_never_hits_and_turn_parking_off(
    models_dir: Path, state_dir: Path, engine_binary: EngineBinary, arch: str
) -> None:
    """A recurrent model's restore is acknowledged in full (``n_restored``), yet the
    next completion may re-prefill (no checkpoint to roll the state back: upstream
    28194). Whatever the engine does here, the host's counters must say it: a hit only
    when the next completion reused the tokens, and parking off for the model after
    three restores in a row that did not take."""
    from gezel_trio.engine.demo_model import write_demo_model
    from gezel_trio.host.runtime import INEFFECTIVE_RESTORES_LIMIT

    path = models_dir / f"kv-{arch}.gguf"
    if not path.exists():
        write_demo_model(path, size="tiny", arch=arch)
    cfg = make_config(
        [ModelConfig(id="tiny", path=str(path), parallel=1, ctx_per_slot=1024)],
        state_dir=state_dir,
        engine_binary=engine_binary,
    )
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            observed: list[int] = []
            history = {"A": list(PROMPT), "B": list(REF)}
            for _ in range(5):
                for session in ("A", "B"):
                    history[session] += MORE
                    observed.append(await _cached(client, history[session], session))
            kv = _kv(host)
            returns = observed[2:]  # every turn after the first of each session
            streak = longest = 0
            for cached in returns[: 2 * INEFFECTIVE_RESTORES_LIMIT]:
                streak = streak + 1 if cached == 0 else 0
                longest = max(longest, streak)
            if longest >= INEFFECTIVE_RESTORES_LIMIT:
                assert kv["disabled"] and "did not take" in kv["disabled"]
                assert kv["hits"] == sum(1 for c in returns if c > 0)
                assert not host.models["tiny"].parking_enabled
                saves = kv["saves"]
                history["A"] += MORE
                await _cached(client, history["A"], "A")
                assert _kv(host)["saves"] == saves  # erased on handoff, not parked
            else:
                assert kv["disabled"] is None
                assert all(c > 0 for c in returns)
                assert kv["hits"] == len(returns) and kv["ineffective"] == 0


@pytest.mark.parametrize("step", ["save", "restore", "index"])
async def test_cancellation_at_each_step_leaves_table_and_index_consistent(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, step: str
) -> None:
    """A client walks away while its handoff's save, its restore, or the indexing of a
    save is in flight (the engine has carried the action out; its answer is slow).
    Afterwards every indexed file exists, no file of ours is unindexed, and each
    session still gets exactly its own KV."""
    # every save at its handoff (none in the background)
    cfg = _config(tiny_model, state_dir, engine_binary, scheduler={"save_idle_slots": False})
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            rt = host.models["tiny"]
            kv = host.kv
            assert kv is not None
            expected = await _reference(client)  # "ref" owns the slot
            assert await _cached(client, PROMPT, "A") == 0  # parks "ref"
            real_action = rt.client.slot_action
            real_put = kv._put_sync
            stuck = trio.Event()

            async def slow_action(slot: int, action: str, **kw: Any) -> dict[str, Any]:
                answer = await real_action(slot, action, **kw)
                if action == step:
                    stuck.set()
                    await trio.sleep_forever()
                return answer

            def slow_put(entry: Any, *rest: Any) -> None:
                trio.from_thread.run_sync(stuck.set)
                import time

                time.sleep(0.5)  # a slow disk: the write finishes, cancelled or not
                real_put(entry, *rest)

            if step == "index":
                kv._put_sync = slow_put  # type: ignore[method-assign]
            else:
                rt.client.slot_action = slow_action  # type: ignore[method-assign]
            # save/index: B displaces A (A is parked); restore: "ref" comes back
            who, prompt = ("ref", [*REF, *MORE]) if step == "restore" else ("B", REF)
            with trio.move_on_after(5) as scope:
                async with trio.open_nursery() as nursery:

                    async def walk_away() -> None:
                        await stuck.wait()
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(walk_away)
                    await _cached(client, prompt, who)
            assert not scope.cancelled_caught and stuck.is_set()
            rt.client.slot_action = real_action  # type: ignore[method-assign]
            kv._put_sync = real_put  # type: ignore[method-assign]
            scheduler = host.scheduler
            assert scheduler is not None
            # the server side notices the client left, and its job ends (after a slow
            # write: it finishes, cancelled or not) and unpins the slot
            await wait_until(
                lambda: scheduler.policy.table("tiny").slots[0].pin is None,
                within=30,
                what="the walked-away job's slot unpinned",
            )
            table = scheduler.policy.table("tiny")
            ours = {p.name for p in kv.dirs["tiny"].iterdir()}
            assert ours == {e.file for e in kv.sessions()}  # no orphan, no dangling entry
            if step == "restore":
                assert table.slots[0].content is Content.UNKNOWN  # erased before next use
            # every session still gets its own KV, and only its own ("ref" repeats the
            # prompt of its second turn: all of it but the last token is reused)
            assert await _cached(client, [*REF, *MORE], "ref") == len(REF) + len(MORE) - 1
            assert await _cached(client, [*PROMPT, *MORE], "A") == expected
            assert await _cached(client, [*PROMPT, *MORE], "C") == 0


async def test_a_crash_loses_only_what_was_not_parked(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    cfg = _config(tiny_model, state_dir, engine_binary)
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            expected = await _reference(client)
            assert await _cached(client, PROMPT, "A") == 0  # "ref" parked; A in the slot
            engine = host.models["tiny"].engine
            assert engine.pid is not None
            os.kill(engine.pid, signal.SIGKILL)
            await engine.state.wait_value(EngineState.FAILED)
            assert _kv(host)["stop_parks"] == 0  # a crash saves nothing
            assert await _cached(client, [*PROMPT, *MORE], "A") == 0  # A was only in the slot
            history = [*REF, *MORE]
            assert await _cached(client, history, "ref") == len(history) - 1  # parked before
            assert expected >= len(REF) - 1


async def test_a_models_own_slot_save_path_is_honoured_by_its_last_occurrence(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, tmp_path: Path
) -> None:
    first, last = tmp_path / "ignored", tmp_path / "mine"
    first.mkdir()  # llama-server checks every occurrence is a directory, and uses the last
    cfg = _config(
        tiny_model,
        state_dir,
        engine_binary,
        args=["--slot-save-path", str(first), "--slot-save-path", str(last)],
    )
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            await _reference(client)
            assert await _cached(client, PROMPT, "A") == 0  # parks "ref"
            kv = host.kv
            assert kv is not None and kv.dirs["tiny"] == last
            files = sorted(p.name for p in last.iterdir())
            assert files == [e.file for e in kv.sessions()] and len(files) == 1
            assert not any(first.iterdir())


async def test_a_chat_that_starts_over_under_its_name_is_not_a_failed_restore(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    cfg = _config(tiny_model, state_dir, engine_binary)
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            assert await _cached(client, PROMPT, "A") == 0
            assert await _cached(client, REF, "B") == 0  # A parked, B on the slot
            for i in range(4):  # A starts over each time: short prompts of its own
                fresh = [450 + i, *[460 + (j * 3) % 40 for j in range(30)]]
                await _cached(client, fresh, "A")
                await _cached(client, REF[: 40 + i], "B")
            kv = _kv(host)
            assert kv["diverged"] >= 1 and kv["ineffective"] == 0
            assert kv["disabled"] is None and host.models["tiny"].parking_enabled


@pytest.mark.parametrize("blind_handoff", [False, True])
async def test_a_session_slot_that_holds_no_token_is_handed_over(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, blind_handoff: bool
) -> None:
    """A session's job that ends before the engine evaluated anything (a client that left
    at once) on a slot erased for it leaves the slot owned by the session but empty:
    saving it saves nothing, and the next job on that slot must not wait for a save that
    never comes (it once looped to a 503 'could not be prepared'). Granted blind
    instead of an erase (``blind_handoff``), it leaves the slot unknown: the engine
    never said it cleared it."""
    cfg = _config(tiny_model, state_dir, engine_binary, scheduler={"blind_handoff": blind_handoff})
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            assert await _cached(client, REF[:20], None) == 0  # the engine is up
            session = host.sessions.session(host.sessions.caller(None), "E")
            async with host.slot(host.models["tiny"], session=session) as grant:
                assert grant.slot_id == 0  # held, and nothing sent
                assert grant.blind == blind_handoff
            table = host.scheduler.policy.table("tiny")  # type: ignore[union-attr]
            assert table.owner(0) == (None if blind_handoff else session)
            for who in (None, "F"):  # a keyless job, then another session, take the slot
                r = await client.post("/completion", json=_body(REF[:30], who))
                assert r.status_code == 200, r.text
            assert host.kv is not None and host.kv.entry("tiny", session) is None
