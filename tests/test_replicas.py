"""One model served by several engines: the router (policy) and a real set of replicas (two
plain llama-servers as external replicas plus one the host runs)."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.supervisor import EngineState
from gezel_trio.scheduler.replicas import MemberView, ReplicaRouter, expand_replicas

from ._engine_bin import llama_server_command, open_llama_server, run_llama_server
from .conftest import make_config, running
from .fault_tools import wait_until


def test_expansion_names_members_and_keeps_their_kind() -> None:
    model = ModelConfig(
        id="m", path="/m.gguf", replicas=2, replica_urls=["http://10.0.0.5:8080"], parallel=3
    )
    members = expand_replicas([model, ModelConfig(id="solo", path="/s.gguf")])
    assert [(m.id, m.replica_of, m.external) for m in members] == [
        ("m@0", "m", False),
        ("m@1", "m", False),
        ("m@2", "m", True),
        ("solo", None, False),
    ]
    assert all(m.parallel == 3 for m in members[:3])
    assert members[2].url == "http://10.0.0.5:8080" and members[2].path is None


def test_router_keeps_sessions_and_spreads_keyless_load() -> None:
    router = ReplicaRouter()
    views = [MemberView("a", True, 3), MemberView("b", True, 1), MemberView("c", True, 2)]
    assert router.choose(views, None) == "b"  # least loaded
    assert router.choose(views, "s1") == "b"
    busier = [MemberView("a", True, 0), MemberView("b", True, 9), MemberView("c", True, 0)]
    assert router.choose(busier, "s1") == "b"  # sticks, though b is busy now
    holds = [
        MemberView("a", True, 5),
        MemberView("b", True, 0),
        MemberView("c", True, 5, holds=True),
    ]
    assert router.choose(holds, "s2") == "c"  # where its KV is
    down = [MemberView("a", True, 5), MemberView("b", False, 0), MemberView("c", True, 1)]
    assert router.choose(down, "s1") == "c" and router.moved == 1  # b failed: s1 moves
    assert router.choose(down, "s1") == "c" and router.moved == 1
    assert router.choose(views, None, avoid={"b"}) == "c"
    dead = [MemberView("a", False, 2), MemberView("b", False, 1)]
    assert router.choose(dead, None) == "b"  # none healthy: try the least loaded
    # s1 came back 3 times (b, then c twice), s2 never: kept on c once
    assert (router.returns, router.kept) == (3, 2)
    router.rehome("s1", "a", lost_kv=True)  # the scheduler ran it elsewhere after all
    assert (router.returns, router.kept, router.moved) == (3, 1, 2)
    assert router.member_of("s1") == "a"
    assert router.statistics().affinity_hit_rate == round(1 / 3, 4)


def _body(prompt: list[int], session: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "n_predict": 4,
        "temperature": 0,
        "cache_prompt": True,
    }
    if session:
        body["prompt_cache_key"] = session
    return body


async def test_a_replica_set_keeps_sessions_spreads_load_and_survives_a_lost_replica(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """Two plain llama-servers as external replicas plus one the host runs."""
    prompts = {s: [300 + (i * k) % 200 for i in range(120)] for k, s in enumerate("ABCDEF", 3)}
    # external engines set up for a host: slot actions on, the shared RAM cache off
    saves = state_dir.parent / "external-slots"
    saves.mkdir()
    flags = ["--slot-save-path", str(saves), "--cache-ram", "0"]
    async with (
        open_llama_server(tiny_model, parallel=2, ctx=2048, extra_args=flags) as one,
        open_llama_server(tiny_model, parallel=2, ctx=2048, extra_args=flags) as two,
    ):
        cfg = make_config(
            [
                ModelConfig(
                    id="tiny",
                    path=str(tiny_model),
                    parallel=2,
                    ctx_per_slot=1024,
                    replica_urls=[one.base_url, two.base_url],
                )
            ],
            state_dir=state_dir,
            engine_binary=engine_binary,
            engine={"health_interval": 0.5, "health_failures": 2},
            # a new session of the same (local) caller would start from the prefix it
            # shares (test_caller_prefix); here it stands for anyone else
            scheduler={"share_prefix_within_caller": False},
        )
        with trio.fail_after(120):
            # the revived engine outlives the host, as an external engine does (stopped
            # while the host still used it, llama-server at times ignored SIGTERM for 5 s)
            async with trio.open_nursery() as engines:
                async with running(cfg) as (host, client):
                    ids = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
                    assert ids == ["tiny"]  # one model to clients
                    members = [rt.id for rt in host.replica_members("tiny")]
                    assert members == ["tiny@0", "tiny@1", "tiny@2"]

                    async def turn(session: str, extra: list[int]) -> tuple[int, str]:
                        r = await client.post(
                            "/completion", json=_body(prompts[session] + extra, session)
                        )
                        assert r.status_code == 200, r.text
                        return int(r.json()["timings"]["cache_n"]), r.json().get("model", "")

                    def member_of(name: str) -> str:
                        session = host.sessions.session(host.sessions.caller(None), name)
                        member = host.routers["tiny"].member_of(session)
                        assert member is not None
                        return member

                    where: dict[str, str] = {}
                    for session in "ABCDEF":
                        assert (await turn(session, []))[0] == 0
                        where[session] = member_of(session)
                    assert len(set(where.values())) >= 2  # sessions spread over the replicas
                    for session in "ABCDEF":  # and stick: their second turn reuses their KV
                        cached, _ = await turn(session, [401, 402])
                        assert cached >= len(prompts[session]) - 1, session
                        assert member_of(session) == where[session]

                    routed_before = dict(host.routers["tiny"].routed)

                    async def keyless(i: int) -> None:
                        r = await client.post("/completion", json=_body([5 + i, 6, 7, 8, 9], None))
                        assert r.status_code == 200, r.text

                    async with trio.open_nursery() as nursery:
                        for i in range(6):
                            nursery.start_soon(keyless, i)
                    routed = {
                        m: host.routers["tiny"].routed.get(m, 0) - routed_before.get(m, 0)
                        for m in members
                    }
                    assert sum(routed.values()) == 6 and sum(1 for n in routed.values() if n) >= 2

                    # a replica dies: its sessions move, and nobody gets another's KV
                    lost = "tiny@1"
                    lost_rt = host.models[lost]
                    assert one.process is not None
                    os.kill(one.process.pid, signal.SIGKILL)
                    with trio.fail_after(20):
                        await lost_rt.engine.state.wait_value(EngineState.FAILED)
                    moved_before = host.routers["tiny"].moved
                    for session in "ABCDEF":
                        cached, _ = await turn(session, [401, 402, 403])
                        if where[session] == lost:  # re-prefilled elsewhere
                            assert cached == 0
                            assert member_of(session) != lost
                        else:
                            assert cached >= len(prompts[session]) - 1
                    assert host.routers["tiny"].moved - moved_before == sum(
                        1 for s in where.values() if s == lost
                    )
                    # a new session with another's very prompt shares nothing, on any replica
                    for session in "AB":
                        r = await client.post(
                            "/completion", json=_body(prompts[session], f"new-{session}")
                        )
                        assert r.status_code == 200 and r.json()["timings"]["cache_n"] == 0
                    # it comes back on its port: the host probes it and routes to it again
                    port = int(one.base_url.rsplit(":", 1)[1])
                    binary_env = llama_server_command()[1]
                    log_path = state_dir.parent / "revived.log"
                    await engines.start(_serve_llama_server, one.argv, binary_env, log_path, port)
                    with trio.fail_after(30):
                        await lost_rt.engine.state.wait_value(EngineState.READY)
                    scheduler = host.scheduler
                    assert scheduler is not None
                    # the probe marks it up once its /slots answered too, after READY
                    await wait_until(lambda: not scheduler.is_down(lost), within=30, what="up")
                    before = host.routers["tiny"].routed.get(lost, 0)
                    async with trio.open_nursery() as nursery:
                        for i in range(6):
                            nursery.start_soon(keyless, i)
                    assert host.routers["tiny"].routed.get(lost, 0) > before
                    status = (await client.get("/api/status")).json()
                    assert status["replicas"]["tiny"]["members"] == members
                    metrics = (await client.get("/metrics")).text
                    for member in members:  # per replica
                        assert f'gezel_replica_routed_total{{member="{member}",model="tiny"}}' in (
                            metrics
                        )
                    moved = host.routers["tiny"].moved
                    assert (
                        f'gezel_replica_sessions_moved_total{{model="tiny"}} {moved:.1f}' in metrics
                    )
                    assert 'gezel_replica_jobs_moved_total{why="failovers"}' in metrics
                    assert {
                        e["model"]: e["replica_of"] for e in status["engines"]
                    } == dict.fromkeys(members, "tiny")
                engines.cancel_scope.cancel()


async def _serve_llama_server(
    argv: Sequence[str],
    env: Mapping[str, str],
    log_path: Path,
    port: int,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a llama-server until cancelled; started once it answers ``/health``."""
    async with run_llama_server(argv, env, log_path, port=port):
        task_status.started()
        await trio.sleep_forever()


@pytest.mark.parametrize("fault", ["kill", "hang"])
async def test_killing_a_replica_mid_replay_loses_nothing_that_had_not_reached_it(
    tiny_model: Path, fault: str
) -> None:
    """The failover benchmark's scenario, short: chats and keyless clients on three
    replicas (one spawned, two plain llama-servers), one external replica SIGKILLed
    mid-run, or SIGSTOPped (it keeps its sockets open and answers nothing)."""
    from benchmarks.replica_failover import REQUEST_TIMEOUT, run

    with trio.fail_after(180):
        out = await run(tiny_model, before=3.0, after=5.0, chats=6, fault=fault)
    summary = {k: v for k, v in out.items() if k != "failures"}
    print("failover run:", summary, out["failures"])  # shown when an assertion fails
    assert out["requests"] > 50
    assert out["failed"] <= out["reached"], out["failures"]  # only what had reached it
    assert out["lost"] == 0 and out["late_failures"] == 0
    assert out["chats_on_killed_replica"], "no chat lived on the killed replica"
    assert out["chats_never_served_elsewhere"] == []  # its chats moved ...
    # ... and those whose KV was on it were counted (a chat only routed there, its first
    # request still queued, or whose KV another chat's replaced, re-prefills nothing)
    assert out["chats_with_kv_on_killed_replica"], "no chat had its KV on the killed replica"
    assert out["chats_moved"] >= len(out["chats_with_kv_on_killed_replica"])
    assert out["cross_session_tokens"] == 0  # nobody got another chat's KV
    served = {m: n for m, n in out["routed"].items() if n}
    assert len(served) == 3  # every replica served before the kill
    # a hung replica is given up on when its health checks fail, not after the
    # request timeout: its chats are answered elsewhere sooner
    assert out["served_elsewhere_max_s"] < REQUEST_TIMEOUT


@pytest.mark.parametrize("policy", ["swap", "coexist"])
async def test_an_exclusive_op_on_one_replica_waits_for_every_replica_to_drain(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, policy: str
) -> None:
    """Two spawned replicas: a calibration of one waits while the other answers, runs
    with both idle, and admin calls on the model's id act on both members."""
    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=2, ctx_per_slot=2048, replicas=2)],
        state_dir=state_dir,
        engine_binary=engine_binary,
        gpu={"policy": policy},
    )
    long = {"model": "tiny", "prompt": [5, 6, 7], "n_predict": 1500, "ignore_eos": True}
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            r = await client.post("/api/models/tiny/load")
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "tiny" and r.json()["state"] == "ready"
            assert [m["model"] for m in r.json()["members"]] == ["tiny@0", "tiny@1"]
            assert all(host.models[m].ready for m in ("tiny@0", "tiny@1"))
            scheduler = host.scheduler
            assert scheduler is not None
            times: dict[str, float] = {}

            async def generate() -> None:
                r = await client.post("/completion", json=long)
                assert r.status_code == 200, r.text
                times["generated"] = trio.current_time()

            async def calibrate(member: str) -> None:
                r = await client.post(f"/api/models/{member}/calibrate")
                assert r.status_code == 200, r.text
                times["calibrated"] = trio.current_time()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(generate)
                await wait_until(
                    lambda: sum(scheduler.statistics().running.values()) == 1,
                    within=10,
                    what="the long request running",
                )
                busy = next(iter(scheduler.statistics().running))
                idle = "tiny@1" if busy == "tiny@0" else "tiny@0"
                nursery.start_soon(calibrate, idle)  # the other replica is idle ...
                await trio.sleep(0.5)
                stats = scheduler.statistics()
                assert stats.active_ops == () and stats.running == {busy: 1}  # ... yet it waits
            assert times["generated"] < times["calibrated"]
            r = await client.post("/api/models/tiny/unload")
            assert r.status_code == 200, r.text
            assert [m["state"] for m in r.json()["members"]] == ["stopped", "stopped"]
            assert r.json()["state"] == "stopped"


async def test_a_free_replica_takes_a_request_queued_behind_a_busy_one(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """Two spawned replicas of one slot each: a long answer on one, a short one on the
    other, then two keyless requests routed one to each. The replica that frees first
    runs both: it takes the one queued behind the long answer (pooled)."""
    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=1, ctx_per_slot=4096, replicas=2)],
        state_dir=state_dir,
        engine_binary=engine_binary,
    )

    def body(n_predict: int, first: int) -> dict[str, Any]:
        return {
            "model": "tiny",
            "prompt": [first, 6, 7],
            "n_predict": n_predict,
            "ignore_eos": True,
        }

    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            assert (await client.post("/api/models/tiny/load")).status_code == 200
            scheduler = host.scheduler
            assert scheduler is not None
            done: dict[str, float] = {}

            async def ask(name: str, n_predict: int, first: int) -> None:
                r = await client.post("/completion", json=body(n_predict, first))
                assert r.status_code == 200, r.text
                done[name] = trio.current_time()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask, "long", 3500, 5)
                await wait_until(
                    lambda: sum(scheduler.statistics().running.values()) == 1,
                    within=10,
                    what="the long answer running",
                )
                nursery.start_soon(ask, "short", 1500, 8)
                await wait_until(
                    lambda: sum(scheduler.statistics().running.values()) == 2,
                    within=10,
                    what="both replicas busy",
                )
                routed = dict(host.routers["tiny"].routed)
                for i in range(2):
                    nursery.start_soon(ask, f"keyless-{i}", 4, 20 + i)
                    # Each request reaches the router over a real socket: wait until it
                    # has queued (on a busy machine that takes longer than any sleep).
                    await wait_until(
                        lambda n=i + 1: sum(scheduler.statistics().waiting_model_ids.values()) == n,
                        within=20,
                        what=f"keyless request {i} queued",
                    )
                assert "short" not in done, "the short answer ended before both were queued"
                queued = scheduler.statistics().waiting_model_ids
                assert sorted(queued.values()) == [1, 1], queued  # routed one to each
            assert scheduler.statistics().pool["pooled"] == 1
            assert sum(host.routers["tiny"].routed.values()) - sum(routed.values()) == 2
            assert max(done["keyless-0"], done["keyless-1"]) < done["long"]
