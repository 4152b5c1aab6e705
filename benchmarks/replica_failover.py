"""One replica of a model killed mid-run: what was lost, and how soon its chats were served.

    python -m benchmarks.replica_failover [--before 6] [--after 10] [--chats 8] [--size tiny]
                                          [--repeats 1] [--fault kill|hang]

One host (in process, the real server on a real socket) serves one model from three
engines: one it runs and two plain llama-servers it is given as external replicas
(``replica_urls``, started with ``--slot-save-path`` and ``--cache-ram 0``), one slot
each, so requests queue. ``--chats`` chats send turn after turn (each turn the last
prompt plus a few tokens, with ``prompt_cache_key``) and two clients send keyless
requests, for ``--before`` seconds; then one external replica is SIGKILLed (``--fault
hang``: SIGSTOPped, so it keeps its sockets and answers nothing), and they go on for
``--after`` seconds. The host's ``request_timeout`` is 5 s.

Reported:

- every request, and how many failed;
- ``reached``: the requests the killed replica was running at the kill (the only ones
  allowed to fail: they had reached it), and ``lost``: failures beyond those;
- how many queued requests moved to another replica (``failovers``), how many a replica
  with a free slot took from a busy one (``pooled``), how many chats moved, and how
  many of the chats routed to the killed replica had their KV there (each of those must
  count as moved);
- per chat that lived on the killed replica, the time from the kill to its first answer
  from another replica (median and max): the figure the issue names;
- median latency before the kill and after it (two replicas left of three);
- cached tokens beyond what a request's own chat had sent before (isolation: 0).

Aim (issue 14): 0 lost. Writes benchmarks/results/replica_failover.json
(``replica_failover_hang.json`` for a hang).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from gezel_trio.config.schema import Config, ModelConfig, validate
from gezel_trio.engine.binary import resolve_engine
from gezel_trio.engine.demo_model import write_demo_model
from gezel_trio.engine.ports import free_port
from gezel_trio.engine.supervisor import EngineState
from gezel_trio.server import open_server

from ._harness import median, write_result

MODEL = "m"
N_PREDICT = 4


@dataclass(frozen=True, slots=True)
class Outcome:
    chat: str | None
    started: float
    ended: float
    status: int
    cached: int
    member: str | None
    """The replica the chat was last routed to, read right after its answer."""
    own_prefix: int = 0
    """What its owner's KV may hold of this prompt: a chat's previous prompt and answer;
    for a keyless request, what it shares with an earlier keyless prompt (the keyless
    requests of one caller are one owner). The most it may find cached."""
    error: str | None = None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True, slots=True)
class PlainServer:
    process: trio.Process
    base_url: str


@asynccontextmanager
async def plain_llama_server(model: Path, saves: Path) -> AsyncIterator[PlainServer]:
    """A llama-server set up as a host's external replica, on a free port: slot actions
    on, its shared RAM prompt cache off. Yields once ``/health`` answers; killed on exit."""
    found = resolve_engine()
    port = free_port()
    argv = [
        str(found.path),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--parallel",
        "1",
        "-c",
        "2048",
        "--slot-save-path",
        str(saves),
        "--cache-ram",
        "0",
    ]
    async with trio.open_nursery() as nursery:
        proc: trio.Process = await nursery.start(
            partial(
                trio.run_process,
                argv,
                env=dict(found.launch_env()),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                check=False,
            )
        )
        server = PlainServer(proc, f"http://127.0.0.1:{port}")
        try:
            async with httpx.AsyncClient(timeout=2) as client:
                with trio.fail_after(60):
                    while True:
                        try:
                            if (await client.get(f"{server.base_url}/health")).status_code == 200:
                                break
                        except httpx.TransportError:
                            pass
                        if proc.returncode is not None:
                            raise RuntimeError(f"llama-server exited with {proc.returncode}")
                        await trio.sleep(0.05)
            yield server
        finally:
            nursery.cancel_scope.cancel()


REQUEST_TIMEOUT = 5.0
"""The host's ``request_timeout`` here: how long a request on a hung replica waits."""

SIGNALS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}


def _config(state: Path, model: Path, urls: Sequence[str]) -> Config:
    cfg = Config()
    cfg.server.port = 0
    cfg.server.log_level = "warning"
    cfg.engine.state_dir = str(state)
    cfg.engine.request_timeout = REQUEST_TIMEOUT
    cfg.engine.health_interval = 0.5
    cfg.engine.health_failures = 2
    cfg.gpu.policy = "coexist"
    cfg.models = [
        ModelConfig(
            id=MODEL, path=str(model), parallel=1, ctx_per_slot=2048, replica_urls=list(urls)
        )
    ]
    validate(cfg)
    return cfg


async def run(
    model: Path, *, before: float, after: float, chats: int, seed: int = 1, fault: str = "kill"
) -> dict[str, Any]:
    """The whole scenario on ``model``; returns the figures (see the module docstring).
    ``fault``: ``kill`` (SIGKILL) or ``hang`` (SIGSTOP: the replica keeps its sockets
    open and answers nothing; SIGCONT and SIGKILL at the end)."""
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="gezel-failover-") as tmp:
        saves = Path(tmp) / "external-slots"
        saves.mkdir()
        async with (
            plain_llama_server(model, saves) as victim,
            plain_llama_server(model, saves) as survivor,
        ):
            urls = [victim.base_url, survivor.base_url]
            cfg = _config(Path(tmp) / "state", model, urls)
            async with (
                open_server(cfg) as (host, binds),
                httpx.AsyncClient(base_url=binds[0], timeout=120) as client,
            ):
                lost_member = f"{MODEL}@1"  # the first replica_urls entry
                assert host.models[lost_member].config.url == urls[0]
                t0 = time.monotonic()
                kill_at = t0 + before
                stop_at = kill_at + after

                def session_of(chat: str) -> str:
                    return host.sessions.session(host.sessions.caller(None), chat)

                def member_of(chat: str) -> str | None:
                    router = host.routers.get(MODEL)
                    return None if router is None else router.member_of(session_of(chat))

                async def request(chat: str | None, prompt: list[int], own_prefix: int) -> None:
                    body: dict[str, Any] = {
                        "model": MODEL,
                        "prompt": prompt,
                        "n_predict": N_PREDICT,
                        "temperature": 0,
                        "cache_prompt": True,
                    }
                    if chat is not None:
                        body["prompt_cache_key"] = chat
                    started = time.monotonic()
                    try:
                        r = await client.post("/completion", json=body)
                        status, text = r.status_code, r.text
                    except httpx.HTTPError as exc:
                        status, text = 599, repr(exc)
                    ended = time.monotonic()
                    ok = status == 200
                    outcomes.append(
                        Outcome(
                            chat,
                            started - kill_at,
                            ended - kill_at,
                            status,
                            int(r.json()["timings"]["cache_n"]) if ok else 0,
                            member_of(chat) if chat is not None and ok else None,
                            own_prefix,
                            None if ok else text[:300],
                        )
                    )

                async def chat_loop(name: str) -> None:
                    prompt = [rng.randrange(300, 500) for _ in range(200)]
                    sent = 0
                    while time.monotonic() < stop_at:
                        await request(name, prompt, sent)
                        sent = len(prompt) + N_PREDICT  # its KV: the prompt and the answer
                        prompt = prompt + [rng.randrange(300, 500) for _ in range(8)]

                keyless_sent: list[list[int]] = []

                async def keyless_loop(i: int) -> None:
                    while time.monotonic() < stop_at:
                        prompt = [5 + i, *(rng.randrange(300, 500) for _ in range(40))]
                        # the keyless requests share one owner (``keyless = "shared"``):
                        # the most one may find cached is what it shares with another's
                        own = max((_common_prefix(prompt, p) for p in keyless_sent), default=0)
                        keyless_sent.append(prompt)
                        await request(None, prompt, own)

                at_kill: dict[str, Any] = {}

                async def killer() -> None:
                    await trio.sleep(max(0.0, kill_at - time.monotonic()))
                    assert host.scheduler is not None
                    stats = host.scheduler.statistics()
                    at_kill["running"] = stats.running.get(lost_member, 0)
                    at_kill["queued"] = stats.waiting_model_ids.get(lost_member, 0)
                    at_kill["chats"] = sorted(
                        c
                        for c in (f"chat-{i}" for i in range(chats))
                        if member_of(c) == lost_member
                    )
                    # the chats the router must count as moved: those whose KV is
                    # on it (a chat only routed there, or whose KV another chat's
                    # took, loses nothing there)
                    lost_rt = host.models[lost_member]
                    at_kill["chats_with_kv"] = sorted(
                        c for c in at_kill["chats"] if host.holds(lost_rt, session_of(c))
                    )
                    at_kill["moved_before"] = host.routers[MODEL].moved
                    os.kill(victim.process.pid, SIGNALS[fault])
                    with trio.fail_after(30):
                        await host.models[lost_member].engine.state.wait_value(EngineState.FAILED)
                    at_kill["detected_s"] = round(time.monotonic() - kill_at, 3)

                async with trio.open_nursery() as nursery:
                    for i in range(chats):
                        nursery.start_soon(chat_loop, f"chat-{i}")
                    for i in range(2):
                        nursery.start_soon(keyless_loop, i)
                    nursery.start_soon(killer)
                if fault == "hang":
                    os.kill(victim.process.pid, signal.SIGCONT)
                    victim.process.kill()
                assert host.scheduler is not None
                pool = dict(host.scheduler.statistics().pool)
                moved = host.routers[MODEL].moved - at_kill["moved_before"]
                routed = dict(host.routers[MODEL].routed)
    figures = _figures(outcomes, at_kill, pool=pool, moved=moved, routed=routed, lost=lost_member)
    return {"fault": fault, **figures}


def _figures(
    outcomes: list[Outcome],
    at_kill: dict[str, Any],
    *,
    pool: dict[str, int],
    moved: int,
    routed: dict[str, int],
    lost: str,
) -> dict[str, Any]:
    failed = [o for o in outcomes if o.status != 200]
    reached = int(at_kill["running"])
    served_elsewhere: dict[str, float | None] = {}
    for chat in at_kill["chats"]:
        after = [
            o.ended
            for o in outcomes
            if o.chat == chat and o.status == 200 and o.ended > 0 and o.member not in (None, lost)
        ]
        served_elsewhere[chat] = round(min(after), 3) if after else None
    times = [t for t in served_elsewhere.values() if t is not None]
    before = [o.ended - o.started for o in outcomes if o.status == 200 and o.ended < 0]
    later = [o.ended - o.started for o in outcomes if o.status == 200 and o.started > 1.0]
    return {
        "requests": len(outcomes),
        "failed": len(failed),
        "reached": reached,
        "lost": max(0, len(failed) - reached),
        "failures": [asdict(o) for o in failed],
        "queued_on_killed_replica": at_kill["queued"],
        "killed_replica_failed_after_s": at_kill["detected_s"],
        "failovers": pool.get("failovers", 0),
        "pooled": pool.get("pooled", 0),
        "chats_on_killed_replica": at_kill["chats"],
        "chats_with_kv_on_killed_replica": at_kill["chats_with_kv"],
        "chats_moved": moved,
        "served_elsewhere_after_s": served_elsewhere,
        "served_elsewhere_median_s": round(median(times), 3) if times else None,
        "served_elsewhere_max_s": round(max(times), 3) if times else None,
        "chats_never_served_elsewhere": sorted(c for c, t in served_elsewhere.items() if t is None),
        "routed": routed,
        "latency_median_before_ms": round(median(before) * 1000, 1) if before else None,
        "latency_median_after_ms": round(median(later) * 1000, 1) if later else None,
        "late_failures": sum(1 for o in failed if o.started > 1.0),
        "cross_session_tokens": sum(max(0, o.cached - o.own_prefix) for o in outcomes),
    }


async def main(
    size: str, before: float, after: float, chats: int, repeats: int, fault: str
) -> dict[str, Any]:
    """``repeats`` runs (each with its own seed: the kill lands on other work); the
    totals, the worst time to be served elsewhere, and every run's figures."""
    with tempfile.TemporaryDirectory(prefix="gezel-failover-models-") as d:
        model = write_demo_model(Path(d) / f"{size}.gguf", size=size)  # type: ignore[arg-type]
        runs = [
            await run(model, before=before, after=after, chats=chats, seed=1 + i, fault=fault)
            for i in range(repeats)
        ]
    worst = [r["served_elsewhere_max_s"] for r in runs if r["served_elsewhere_max_s"] is not None]
    totals = {
        key: sum(r[key] for r in runs)
        for key in (
            "requests",
            "failed",
            "reached",
            "lost",
            "late_failures",
            "failovers",
            "pooled",
            "chats_moved",
            "cross_session_tokens",
        )
    }
    for key in ("chats_on_killed_replica", "chats_with_kv_on_killed_replica"):
        totals[key] = sum(len(r[key]) for r in runs)
    totals["chats_never_served_elsewhere"] = sum(
        len(r["chats_never_served_elsewhere"]) for r in runs
    )
    return {
        "size": size,
        "fault": fault,
        "before_s": before,
        "after_s": after,
        "chats": chats,
        "repeats": repeats,
        **totals,
        "served_elsewhere_median_s": median(
            [r["served_elsewhere_median_s"] for r in runs if r["served_elsewhere_median_s"]]
            or [float("nan")]
        ),
        "served_elsewhere_max_s": max(worst) if worst else None,
        "killed_replica_failed_after_s": median([r["killed_replica_failed_after_s"] for r in runs]),
        "latency_median_before_ms": median([r["latency_median_before_ms"] or 0.0 for r in runs]),
        "latency_median_after_ms": median([r["latency_median_after_ms"] or 0.0 for r in runs]),
        "runs": runs,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--before", type=float, default=6.0)
    parser.add_argument("--after", type=float, default=10.0)
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--fault", choices=sorted(SIGNALS), default="kill")
    args = parser.parse_args()
    out = trio.run(main, args.size, args.before, args.after, args.chats, args.repeats, args.fault)
    print(
        f"{out['repeats']} run(s) of {out['chats']} chats, {out['size']} model, one replica "
        f"{'SIGKILLed' if args.fault == 'kill' else 'hung (SIGSTOP)'}; totals:"
    )
    print(
        f"requests {out['requests']}, failed {out['failed']} "
        f"(the killed replica was running {out['reached']}), lost {out['lost']}"
    )
    print(f"queued jobs moved off it {out['failovers']}; taken by a free replica {out['pooled']}")
    print(
        f"chats on it {out['chats_on_killed_replica']} (its KV held "
        f"{out['chats_with_kv_on_killed_replica']}), moved {out['chats_moved']}, never "
        f"served elsewhere {out['chats_never_served_elsewhere']}; "
        f"served elsewhere after median {out['served_elsewhere_median_s']:.3f} s, "
        f"max {out['served_elsewhere_max_s']} s (engine marked failed after "
        f"{out['killed_replica_failed_after_s']:.3f} s)"
    )
    print(
        f"median latency {out['latency_median_before_ms']} ms before, "
        f"{out['latency_median_after_ms']} ms after; late failures {out['late_failures']}"
    )
    print(f"cached tokens beyond a chat's own prefix: {out['cross_session_tokens']}")
    name = "replica_failover" if args.fault == "kill" else f"replica_failover_{args.fault}"
    print("wrote", write_result(name, out))
