"""Proxy overhead and cold start, host vs the same llama-server directly.

    python -m benchmarks.proxy_overhead [--requests 300] [--streams 8] [--tokens 128]

1. Added latency of a non-streamed 1-token completion: requests alternate
   between the engine's own port and the host (same engine, warm), so drift
   cancels; reports median and p99 of each and their difference.
2. Throughput of 8 concurrent streams (`ignore_eos`, fixed length): total
   tokens per second through the host over direct.
3. Cold start: a fresh host, first request to first token, minus llama-server's
   own spawn-to-/health-200 time (reported by the supervisor) and minus a warm
   request's TTFT: what the host adds to a cold start.

Prints the figures and writes benchmarks/results/proxy_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx
import trio

from gezel_trio.engine.demo_model import write_demo_model

from ._harness import host_process, median, pct, write_result


def _completion(n: int, *, stream: bool = False) -> dict[str, object]:
    return {
        "model": "tiny",
        "prompt": "The quick brown fox",
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "cache_prompt": True,
    }


async def _latency(host: str, direct: str, n: int) -> dict[str, float]:
    via_host: list[float] = []
    via_direct: list[float] = []
    async with httpx.AsyncClient(timeout=60) as client:
        for _ in range(10):  # warm both paths
            await client.post(host + "/v1/completions", json=_completion(1))
            await client.post(direct + "/v1/completions", json=_completion(1))
        for _ in range(n):
            for base, out in ((direct, via_direct), (host, via_host)):
                t0 = time.perf_counter()
                r = await client.post(base + "/v1/completions", json=_completion(1))
                out.append((time.perf_counter() - t0) * 1000)
                assert r.status_code == 200, r.text
    return {
        "direct_median_ms": median(via_direct),
        "direct_p99_ms": pct(via_direct, 99),
        "host_median_ms": median(via_host),
        "host_p99_ms": pct(via_host, 99),
        "added_median_ms": median(via_host) - median(via_direct),
        "added_p99_ms": pct(via_host, 99) - pct(via_direct, 99),
        "requests": n,
    }


async def _streams(base: str, streams: int, tokens: int) -> float:
    counted = 0

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal counted
        async with client.stream(
            "POST", base + "/v1/completions", json=_completion(tokens, stream=True)
        ) as r:
            assert r.status_code == 200
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--cold-runs", type=int, default=3)
    args = ap.parse_args()
    model = write_demo_model(Path("benchmarks/results/tmp/tiny.gguf"), size="tiny")
    spec = [{"id": "tiny", "path": str(model), "parallel": args.streams, "ctx_per_slot": 512}]
    result: dict[str, object] = {}
    with host_process(spec) as (base, _):
        httpx.post(base + "/v1/completions", json=_completion(1), timeout=120)
        engine = httpx.get(base + "/api/status").json()["engines"][0]
        direct = engine["url"]
        result["latency"] = trio.run(_latency, base, direct, args.requests)
        host_tps = []
        direct_tps = []
        for _ in range(3):
            direct_tps.append(trio.run(_streams, direct, args.streams, args.tokens))
            host_tps.append(trio.run(_streams, base, args.streams, args.tokens))
        result["throughput"] = {
            "streams": args.streams,
            "tokens_per_stream": args.tokens,
            "direct_tok_s": median(direct_tps),
            "host_tok_s": median(host_tps),
            "ratio": median(host_tps) / median(direct_tps),
        }
    colds = []
    for _ in range(args.cold_runs):
        with host_process(spec) as (base, _):
            colds.append(trio.run(_cold_start, base))
    result["cold_start"] = {k: median([c[k] for c in colds]) for k in colds[0]} | {
        "runs": len(colds)
    }
    path = write_result("proxy_overhead", result)
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
