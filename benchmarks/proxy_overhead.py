"""Proxy overhead and cold start: the host, llama-server's router mode and a minimal
Python proxy vs the same llama-server directly.

    python -m benchmarks.proxy_overhead [--requests 300] [--streams 8] [--tokens 128]
    python -m benchmarks.proxy_overhead --quick     # smoke run: 40 rounds, 2 streams, 1 cold

One llama-server binary (resolved once, given to the host and the router) and one generated
``tiny`` model serve seven paths:

- ``direct``: the host's own engine, on its own port;
- ``host``: gezel-trio in front of that same engine;
- ``router``: ``llama-server --models-dir DIR`` (router mode), which proxies to a child
  llama-server it spawns for the model (same binary, model, slots and context);
- ``floor``: :mod:`benchmarks._floor_proxy` in front of the host's engine, the least a
  Python proxy on trio does (framing only, one upstream connection per request): what
  Python and trio alone add on this machine, whatever the host does besides;
- ``floor_streamed``: the same with ``--streamed``: a whole-answer completion is asked of
  the engine as a stream and assembled, as the host does for walk-away;
- ``floor_hypercorn``: the same with ``--hypercorn``: ``floor_streamed``'s forwarding as an
  ASGI app that ``hypercorn.trio.serve`` serves: the least any app on hypercorn adds;
- ``floor_front``: the same app served as the host serves its own (``--front``:
  ``serve_front``, hypercorn with the host's settings and write deadline): the least any
  app adds behind the host's front end.

1. Added latency of a non-streamed 1-token chat completion (``/v1/chat/completions``,
   ``max_tokens`` 1, temperature 0), the headline figure, and of a 1-token text completion
   (``/v1/completions``). Each round sends one chat and one text request down every path,
   one after another, warm, the order of the paths rotated each round so drift
   cancels. Reports median and p99 of each path and the added median and p99 of
   every other path minus direct (differences of the percentiles).
   Also counts the TCP connections opened per 100 of those requests: by the benchmark's
   own keep-alive client on each path, and by the host to its engine (``tcp_connect`` in
   the engine's ``upstream_calls`` on ``/api/status``).
2. Throughput of N concurrent streams (``ignore_eos``, fixed length): total tokens per
   second of each path, the median of several rounds (path order rotated each round);
   host / direct (the other paths / direct beside it) is the figure, and each path's
   range of rounds shows how much of a difference is noise.
3. Cold start: a fresh host, first request to first token, minus llama-server's own
   spawn-to-/health-200 time (reported by the supervisor) and minus a warm request's TTFT:
   what the host adds to a cold start.

Prints a table and writes benchmarks/results/proxy_overhead.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import trio

from gezel_bench.errors import BenchError
from gezel_bench.targets import (
    EngineCommand,
    LaunchSettings,
    open_target,
    resolve_llama_server,
)
from gezel_trio.engine.demo_model import write_demo_model

from ._harness import floor_process, host_process, median, pct, rotated, write_result

FLOORS = {
    "floor": "relayed",
    "floor_streamed": "streamed",
    "floor_hypercorn": "hypercorn",
    "floor_front": "front",
}
"""Each floor path, and the mode of :mod:`benchmarks._floor_proxy` it runs."""
PATHS = ("direct", "host", "router", *FLOORS)
PROXIES = PATHS[1:]
KINDS = {"chat": "/v1/chat/completions", "text": "/v1/completions"}
MODEL = "tiny"
CTX_PER_SLOT = 512
WARMUP_ROUNDS = 10
WORKDIR = Path("benchmarks/results/tmp")
TARGET_RATIO = 0.98
"""8 concurrent streams, host tokens/s over direct: the front-end issue's aim."""


def _chat() -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "The quick brown fox"}],
        "max_tokens": 1,
        "temperature": 0,
        "stream": False,
    }


def _completion(n: int, *, stream: bool = False) -> dict[str, object]:
    return {
        "model": MODEL,
        "prompt": "The quick brown fox",
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "cache_prompt": True,
    }


def _body(kind: str) -> dict[str, object]:
    return _chat() if kind == "chat" else _completion(1)


class _Poster:
    """Times one request; retries once (untimed attempt discarded) when the server had
    closed the pooled keep-alive connection, and counts those reconnects, and the TCP
    connections the benchmark's own client opened, by base URL."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.reconnects = 0
        self.connections: Counter[str] = Counter()

    async def timed(self, url: str, body: dict[str, object]) -> float:
        base = url.split("/v1/", 1)[0]

        async def trace(name: str, info: object) -> None:
            if name == "connection.connect_tcp.complete":
                self.connections[base] += 1

        for attempt in range(2):
            t0 = time.perf_counter()
            try:
                r = await self.client.post(url, json=body, extensions={"trace": trace})
            except (httpx.RemoteProtocolError, httpx.ReadError):
                if attempt:
                    raise
                self.reconnects += 1
                continue
            elapsed = (time.perf_counter() - t0) * 1000
            if r.status_code != 200:
                raise BenchError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
            return elapsed
        raise AssertionError("unreachable")


def _summary(samples: dict[str, list[float]], rounds: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for path in PATHS:
        out[f"{path}_median_ms"] = median(samples[path])
        out[f"{path}_p99_ms"] = pct(samples[path], 99)
    for path in PROXIES:
        out[f"{path}_added_median_ms"] = out[f"{path}_median_ms"] - out["direct_median_ms"]
        out[f"{path}_added_p99_ms"] = out[f"{path}_p99_ms"] - out["direct_p99_ms"]
    out["requests"] = rounds
    return out


async def _upstream_connections(host: str, client: httpx.AsyncClient) -> int | None:
    """TCP connections the host has opened to its engine (None: it does not count them)."""
    status = (await client.get(host + "/api/status")).json()
    opened = status["engines"][0].get("upstream_calls", {}).get("tcp_connect")
    return opened if isinstance(opened, int) else None


async def _latency(bases: dict[str, str], rounds: int) -> dict[str, Any]:
    samples: dict[str, dict[str, list[float]]] = {
        kind: {path: [] for path in PATHS} for kind in KINDS
    }
    async with httpx.AsyncClient(timeout=60) as client:
        poster = _Poster(client)
        for i in range(WARMUP_ROUNDS):  # warm every path (the router loads its child here)
            for kind, route in KINDS.items():
                for path in rotated(PATHS, i):
                    await poster.timed(bases[path] + route, _body(kind))
        poster.connections.clear()
        upstream_before = await _upstream_connections(bases["host"], client)
        for i in range(rounds):
            for kind, route in KINDS.items():
                for path in rotated(PATHS, i):
                    ms = await poster.timed(bases[path] + route, _body(kind))
                    samples[kind][path].append(ms)
        upstream_after = await _upstream_connections(bases["host"], client)
    unary = rounds * len(KINDS)  # requests down each path
    per_100 = {f"{path}_client": 100 * poster.connections[bases[path]] / unary for path in PATHS}
    if upstream_before is not None and upstream_after is not None:
        per_100["host_to_engine"] = 100 * (upstream_after - upstream_before) / unary
    return {
        "chat": _summary(samples["chat"], rounds),
        "text": _summary(samples["text"], rounds),
        "reconnects": poster.reconnects,
        "connections_per_100_unary": per_100,
    }


async def _streams(base: str, streams: int, tokens: int) -> float:
    counted = 0

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal counted
        async with client.stream(
            "POST", base + "/v1/completions", json=_completion(tokens, stream=True)
        ) as r:
            if r.status_code != 200:
                raise BenchError(f"{base}: HTTP {r.status_code} on a stream")
            async for line in r.aiter_lines():
                data = line[6:] if line.startswith("data: ") else "[DONE]"
                if data != "[DONE]" and json.loads(data).get("choices"):
                    counted += 1

    async with httpx.AsyncClient(timeout=120) as client:
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(streams):
                nursery.start_soon(one, client)
        return counted / (time.perf_counter() - t0)


async def _throughput(
    bases: dict[str, str], streams: int, tokens: int, rounds: int
) -> dict[str, Any]:
    tps: dict[str, list[float]] = {path: [] for path in PATHS}
    for i in range(rounds):
        for path in rotated(PATHS, i):
            tps[path].append(await _streams(bases[path], streams, tokens))
    out: dict[str, Any] = {"streams": streams, "tokens_per_stream": tokens}
    out |= {f"{path}_tok_s": median(tps[path]) for path in PATHS}
    out["ratio"] = out["host_tok_s"] / out["direct_tok_s"]
    out |= {f"{path}_ratio": out[f"{path}_tok_s"] / out["direct_tok_s"] for path in PROXIES[1:]}
    out["rounds"] = rounds
    # the spread of one path's rounds: how far apart two medians can be by noise alone
    out |= {f"{path}_tok_s_range": [min(tps[path]), max(tps[path])] for path in PATHS}
    return out


def _host_engine(host: str, engine: EngineCommand) -> dict[str, Any]:
    """The running host's engine (its status entry), after one request has warmed it.
    Raises :class:`BenchError` unless it runs the binary the router will run."""
    r = httpx.post(host + "/v1/completions", json=_completion(1), timeout=120)
    if r.status_code != 200:
        raise BenchError(f"{host}: HTTP {r.status_code}: {r.text[:300]}")
    status = httpx.get(host + "/api/status", timeout=10).json()
    host_binary = Path(status["engine_binary"]["path"]).resolve()
    if host_binary != engine.path.resolve():
        raise BenchError(f"the host runs {host_binary}, the router would run {engine.path}")
    engine_status: dict[str, Any] = status["engines"][0]
    return engine_status


async def _warm_paths(
    host: str,
    floors: dict[str, str],
    host_engine: dict[str, Any],
    engine: EngineCommand,
    settings: LaunchSettings,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Latency and throughput of every path, with the host and the floors already running."""
    async with open_target("router", settings=settings, engine=engine) as router:
        bases = {"direct": host_engine["url"], "host": host, "router": router.base_url}
        bases |= floors
        latency = await _latency(bases, args.requests)
        throughput = await _throughput(bases, args.streams, args.tokens, args.stream_rounds)
    return {
        "setup": {
            "binary": str(engine.path),
            "binary_found_by": engine.found_by,
            "engine_version": router.description.get("engine_version", ""),
            "model": MODEL,
            "parallel": settings.parallel,
            "ctx_per_slot": settings.ctx_per_slot,
            "direct_argv": host_engine.get("argv"),
            "router_argv": router.description.get("argv"),
            "quick": args.quick,
        },
        "chat_latency": latency["chat"],
        "text_latency": latency["text"],
        "reconnects": latency["reconnects"],
        "connections_per_100_unary": latency["connections_per_100_unary"],
        "throughput": throughput,
    }


async def _cold_start(base: str) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=120) as client:
        t0 = time.perf_counter()
        async with client.stream(
            "POST", base + "/v1/completions", json=_completion(1, stream=True)
        ) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
        cold_ttft = time.perf_counter() - t0
        status = (await client.get(base + "/api/status")).json()
        load = status["engines"][0]["load_seconds"]
        warm = []
        for _ in range(5):
            t1 = time.perf_counter()
            async with client.stream(
                "POST", base + "/v1/completions", json=_completion(1, stream=True)
            ) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break
            warm.append(time.perf_counter() - t1)
    return {
        "cold_ttft_ms": cold_ttft * 1000,
        "engine_load_ms": load * 1000,
        "warm_ttft_ms": median(warm) * 1000,
        "host_added_ms": (cold_ttft - load - median(warm)) * 1000,
    }


def _table(result: dict[str, Any]) -> str:
    rounds = result["chat_latency"]["requests"]
    lines = [
        f"{'1-token latency, ' + str(rounds) + ' rounds':<30}"
        f"{'median ms':>10}{'p99 ms':>10}{'+median':>10}{'+p99':>10}"
    ]
    for kind in KINDS:
        lat = result[f"{kind}_latency"]
        for path in PATHS:
            row = f"  {kind:<5}{path:<23}{lat[path + '_median_ms']:>10.2f}"
            row += f"{lat[path + '_p99_ms']:>10.2f}"
            if path != "direct":
                row += f"{lat[path + '_added_median_ms']:>+10.2f}"
                row += f"{lat[path + '_added_p99_ms']:>+10.2f}"
            lines.append(row)
    conns = result["connections_per_100_unary"]
    lines.append(
        "TCP connections opened per 100 unary requests: "
        + ", ".join(f"{name.replace('_', ' ')} {n:.0f}" for name, n in conns.items())
    )
    tp = result["throughput"]
    lo, hi = tp["direct_tok_s_range"]
    lines.append(
        f"{tp['streams']} streams x {tp['tokens_per_stream']} tokens, {tp['rounds']} rounds: "
        f"direct {tp['direct_tok_s']:.0f} tok/s (rounds {lo:.0f}-{hi:.0f}), "
        f"host {tp['host_tok_s']:.0f} "
        f"({tp['ratio']:.3f} of direct, target >= {TARGET_RATIO}), "
        + ", ".join(
            f"{path} {tp[path + '_tok_s']:.0f} ({tp[path + '_ratio']:.3f})" for path in PROXIES[1:]
        )
    )
    cs = result["cold_start"]
    lines.append(
        f"cold start ({cs['runs']} runs): first token {cs['cold_ttft_ms']:.1f} ms = "
        f"llama-server load {cs['engine_load_ms']:.1f} + warm TTFT {cs['warm_ttft_ms']:.1f} "
        f"+ host {cs['host_added_ms']:.1f}"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--requests", type=int, default=None, help="timed rounds (default 300)")
    ap.add_argument("--streams", type=int, default=None, help="concurrent streams (default 8)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    ap.add_argument(
        "--stream-rounds", type=int, default=None, help="throughput rounds per path (default 6)"
    )
    ap.add_argument("--cold-runs", type=int, default=None, help="fresh hosts (default 3)")
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 40 rounds, 2 streams, 1 cold run"
    )
    args = ap.parse_args()
    quick = {"requests": 40, "streams": 2, "stream_rounds": 3, "cold_runs": 1}
    full = {"requests": 300, "streams": 8, "stream_rounds": 6, "cold_runs": 3}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.requests, args.streams, args.tokens, args.stream_rounds, args.cold_runs) < 1:
        ap.error("--requests, --streams, --tokens, --stream-rounds, --cold-runs: at least 1")

    engine = resolve_llama_server()
    model = write_demo_model(WORKDIR / f"{MODEL}.gguf", size="tiny")
    spec = [
        {"id": MODEL, "path": str(model), "parallel": args.streams, "ctx_per_slot": CTX_PER_SLOT}
    ]
    settings = LaunchSettings(
        model_path=model,
        parallel=args.streams,
        ctx_per_slot=CTX_PER_SLOT,
        workdir=WORKDIR / "proxy-overhead",
        startup_timeout=60.0,
    )
    with host_process(spec) as (base, _):
        host_engine = _host_engine(base, engine)
        with contextlib.ExitStack() as stack:
            floors = {
                path: stack.enter_context(floor_process(host_engine["url"], mode=mode))[0]
                for path, mode in FLOORS.items()
            }
            result = trio.run(_warm_paths, base, floors, host_engine, engine, settings, args)
    colds = []
    for _ in range(args.cold_runs):
        with host_process(spec) as (base, _):
            colds.append(trio.run(_cold_start, base))
    result["cold_start"] = {k: median([c[k] for c in colds]) for k in colds[0]} | {
        "runs": len(colds)
    }
    path = write_result("proxy_overhead", result)
    print(_table(result))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
