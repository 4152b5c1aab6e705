"""A long session returning after its engine stopped: how much of its KV comes back.

    python -m benchmarks.kv_return [--tokens 3000] [--model-size small]

One host (the real server on a real socket, the bundled llama-server) serves the demo
``small`` model (1 slot, 4096 tokens) and, in swap mode, ``tiny`` to evict it with. A
session sends a ``--tokens``-token prompt, its engine stops, and the session sends its next
turn (the same prompt plus a few tokens). For each way the engine stops:

- ``swap``: a request to ``tiny`` evicts ``small``;
- ``idle``: ``small``'s idle TTL (2 s) releases it;
- ``restart``: the host shuts down and starts again on the same state dir;

it reports the returning turn's cached tokens (of the prompt) and its TTFT, against a cold
session as long after the same kind of stop (what every return cost before: the engine
start plus a full prefill), and an 8-token request after that stop (the engine start
alone), all measured in the same run; ``x cold-start`` is the ratio with the engine start
taken out of both. Also the time the planned stop spent saving the slot before SIGTERM,
and save and restore cost per 1,000 tokens, from the host's own counters.

Aims (issue 13): >= 95 % of the tokens back, TTFT <= 10 % of cold. Writes
benchmarks/results/kv_return.json.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

from gezel_trio.config.schema import Config, ModelConfig, validate
from gezel_trio.engine.demo_model import write_demo_model
from gezel_trio.engine.supervisor import EngineState
from gezel_trio.host import Host
from gezel_trio.kv.store import KvParkingStats
from gezel_trio.server import open_server

from ._harness import median, write_result


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 600) for _ in range(n)]


async def _turn(client: httpx.AsyncClient, prompt: list[int], session: str) -> tuple[float, int]:
    """(TTFT seconds, cached tokens) of one streamed turn."""
    body = {
        "model": "small",
        "prompt": prompt,
        "n_predict": 8,
        "temperature": 0,
        "cache_prompt": True,
        "prompt_cache_key": session,
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft: float | None = None
    cached = -1
    async with client.stream("POST", "/completion", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            if '"timings"' in line:
                event = json.loads(line[5:])
                cached = int(event.get("timings", {}).get("cache_n", cached))
    assert ttft is not None
    return ttft, cached


def _config(state: Path, models: dict[str, Path], *, idle_ttl: float) -> Config:
    cfg = Config()
    cfg.server.port = 0
    cfg.server.log_level = "warning"
    cfg.engine.state_dir = str(state)
    cfg.engine.load_timeout = 120
    cfg.gpu.policy = "swap"
    cfg.models = [
        ModelConfig(
            id="small", path=str(models["small"]), parallel=1, ctx_per_slot=4096, idle_ttl=idle_ttl
        ),
        ModelConfig(id="tiny", path=str(models["tiny"]), parallel=1, ctx_per_slot=256),
    ]
    validate(cfg)
    return cfg


async def _scenario(kind: str, models: dict[str, Path], tokens: int, seed: int) -> dict[str, Any]:
    """Four turns, each after a stop of ``kind``: the agent's first turn (before any
    stop), its return, a cold session as long (nothing parked for it), and an 8-token
    request (what the engine start alone costs)."""
    extra = [7, 8, 9, 10, 11, 12, 13, 14]
    prompt = _prompt(seed, tokens)
    turns = [
        (prompt, "agent"),
        ([*prompt, *extra], "agent"),
        (_prompt(seed + 1, tokens + len(extra)), "cold"),
        (_prompt(seed + 2, len(extra)), "start-only"),
    ]
    measured: list[tuple[float, int]] = []
    stop_park_ms: list[float] = []
    kv: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gezel-kvret-") as tmp:
        cfg = _config(Path(tmp) / "state", models, idle_ttl=2.0 if kind == "idle" else 0.0)
        if kind == "restart":
            for body, session in turns:  # a host start before each turn
                async with _serving(cfg) as (host, client):
                    measured.append(await _turn(client, body, session))
                    kv = _parking(host.models["small"].statistics().kv_parking)
        else:
            async with _serving(cfg) as (host, client):
                rt = host.models["small"]
                for i, (body, session) in enumerate(turns):
                    if i:
                        before = rt.kv_stats.stop_park_ms
                        await _stop(kind, client, rt.engine)
                        stop_park_ms.append(rt.kv_stats.stop_park_ms - before)
                    measured.append(await _turn(client, body, session))
                kv = _parking(rt.statistics().kv_parking)
    (_, _), (ttft, cached), (cold, cold_cached), (start, _) = measured
    return {
        "stop": kind,
        "prompt_tokens": tokens + len(extra),
        "cached_tokens": cached,
        "tokens_back_pct": round(100 * cached / tokens, 1),
        "ttft_ms": round(ttft * 1000, 1),
        "cold_ttft_ms": round(cold * 1000, 1),
        "cold_cached": cold_cached,
        "start_only_ttft_ms": round(start * 1000, 1),
        "ttft_vs_cold": round(ttft / cold, 3),
        "ttft_vs_cold_without_start": round(max(ttft - start, 0.0) / max(cold - start, 1e-9), 3),
        "stop_park_ms": round(stop_park_ms[0], 1) if stop_park_ms else None,
        "save_ms_per_1k_tokens": _per_1k(kv.get("save_ms"), kv.get("saved_tokens")),
        "restore_ms_per_1k_tokens": _per_1k(kv.get("restore_ms"), kv.get("restored_tokens")),
        "hits": kv.get("hits"),
    }


@asynccontextmanager
async def _serving(cfg: Config) -> AsyncIterator[tuple[Host, httpx.AsyncClient]]:
    async with (
        open_server(cfg) as (host, binds),
        httpx.AsyncClient(base_url=binds[0], timeout=300) as client,
    ):
        yield host, client


async def _stop(kind: str, client: httpx.AsyncClient, engine: Any) -> None:
    if kind == "swap":
        r = await client.post("/completion", json={"model": "tiny", "prompt": [5], "n_predict": 1})
        assert r.status_code == 200
    else:
        await engine.state.wait_value(EngineState.STOPPED)
    assert engine.state.value is not EngineState.READY


def _parking(stats: KvParkingStats | None) -> dict[str, Any]:
    return stats.as_dict() if stats is not None else {}


def _per_1k(ms: object, tokens: object) -> float | None:
    if isinstance(ms, int | float) and isinstance(tokens, int) and tokens > 0:
        return round(ms * 1000 / tokens, 2)
    return None


async def main(tokens: int, repeats: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gezel-kvret-models-") as d:
        models = {
            "small": write_demo_model(Path(d) / "small.gguf", size="small"),
            "tiny": write_demo_model(Path(d) / "tiny.gguf", size="tiny"),
        }
        runs: list[dict[str, Any]] = []
        for i in range(repeats):
            for kind in ("swap", "idle", "restart"):
                runs.append(await _scenario(kind, models, tokens, seed=10 * i))
    summary: dict[str, Any] = {}
    for kind in ("swap", "idle", "restart"):
        mine = [r for r in runs if r["stop"] == kind]
        summary[kind] = {
            "tokens_back_pct": min(r["tokens_back_pct"] for r in mine),
            "ttft_vs_cold_median": median([r["ttft_vs_cold"] for r in mine]),
            "ttft_vs_cold_without_start_median": median(
                [r["ttft_vs_cold_without_start"] for r in mine]
            ),
            "ttft_ms_median": median([r["ttft_ms"] for r in mine]),
            "cold_ttft_ms_median": median([r["cold_ttft_ms"] for r in mine]),
            "start_only_ttft_ms_median": median([r["start_only_ttft_ms"] for r in mine]),
            "stop_park_ms_median": median(
                [r["stop_park_ms"] for r in mine if r["stop_park_ms"] is not None] or [0.0]
            ),
        }
    return {"tokens": tokens, "repeats": repeats, "runs": runs, "summary": summary}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    result = trio.run(main, args.tokens, args.repeats)
    print(
        f"{'stop':8} {'back %':>7} {'TTFT ms':>8} {'cold ms':>8} {'start ms':>8} "
        f"{'x cold':>7} {'x cold-start':>12} {'park ms':>8}"
    )
    for kind, s in result["summary"].items():
        print(
            f"{kind:8} {s['tokens_back_pct']:7.1f} {s['ttft_ms_median']:8.1f} "
            f"{s['cold_ttft_ms_median']:8.1f} {s['start_only_ttft_ms_median']:8.1f} "
            f"{s['ttft_vs_cold_median']:7.3f} {s['ttft_vs_cold_without_start_median']:12.3f} "
            f"{s['stop_park_ms_median']:8.1f}"
        )
    for r in result["runs"][:3]:
        print(
            f"  {r['stop']}: save {r['save_ms_per_1k_tokens']} ms / 1k tokens, "
            f"restore {r['restore_ms_per_1k_tokens']} ms / 1k tokens"
        )
    print("wrote", write_result("kv_return", result))
