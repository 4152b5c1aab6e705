"""Ollama's API on the host: what the official client gets, and what the translation costs.

    python -m benchmarks.ollama_api [--rounds 200] [--streams 4] [--tokens 128]
    python -m benchmarks.ollama_api --quick     # smoke run: 30 rounds, 2 streams, 2 rounds

One host (``gezel-trio serve`` in its own process) serves the generated ``tiny`` model
and, for the embedding routes, the same file as ``tiny-embed`` (``embeddings = true``).

1. Client calls that work: every call the official ``ollama`` Python client makes
   (``Client(host=...)``, each of its methods once, streamed and not where it can; the
   version through its HTTP client, which has no method for it), tried in order. A call
   works when it returns what the client's types parse. The model-management calls
   (``pull``, ``push``, ``create``, ``copy``, ``delete``) answer 501 by design, and are
   counted apart. The issue's seven (``list``, ``chat``, ``chat`` streamed, ``generate``,
   ``ps``, ``show``, the version) are reported on their own as well.
2. Added latency of a non-streamed 1-token chat: ``/api/chat`` (``num_predict`` 1)
   against ``/v1/chat/completions`` (``max_tokens`` 1), same messages, temperature 0,
   interleaved in one run (which goes first alternates each round); median and p99 of
   each and their differences.
3. Tokens per second of streamed chats: N concurrent streams of ``--tokens`` tokens on
   each route (NDJSON vs SSE), the routes alternating over several rounds; tokens are the
   engine's own counts (``eval_count``, ``usage.completion_tokens``) over the wall time of
   the whole round. On a shared machine the rounds spread widely, so the host process's
   own CPU time per streamed token (its engines are other processes) is reported too:
   what the translation costs, whatever the neighbours do.

Prints a table and writes benchmarks/results/ollama_api.json.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import ollama
import psutil
import trio

from gezel_bench.errors import BenchError
from gezel_trio.engine.demo_model import write_demo_model

from ._harness import host_process, median, pct, write_result

MODEL = "tiny"
EMBED_MODEL = "tiny-embed"
CTX_PER_SLOT = 512
WARMUP_ROUNDS = 10
WORKDIR = Path("benchmarks/results/tmp")
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]
ISSUE_CALLS = ("list", "chat", "chat (stream)", "generate", "ps", "show", "version")
MANAGEMENT = ("pull", "push", "create", "copy", "delete")


def _client_calls(client: ollama.Client) -> dict[str, Callable[[], object]]:
    """Every call the client makes, by name, each as a user would write it."""
    opts = {"num_predict": 4, "temperature": 0}

    def drained(it: Iterator[Any]) -> list[Any]:
        parts = list(it)
        if not parts or parts[-1].done is not True:
            raise BenchError("the stream did not end with done: true")
        return parts

    return {
        "version": lambda: client._client.get("/api/version").raise_for_status().json(),
        "list": client.list,
        "show": lambda: client.show(MODEL),
        "ps": client.ps,
        "chat": lambda: client.chat(model=MODEL, messages=MESSAGES, options=opts),
        "chat (stream)": lambda: drained(
            client.chat(model=MODEL, messages=MESSAGES, options=opts, stream=True)
        ),
        "chat (format json)": lambda: client.chat(
            model=MODEL, messages=MESSAGES, format="json", options=opts
        ),
        "chat (tools)": lambda: client.chat(
            model=MODEL,
            messages=MESSAGES,
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": "The weather in a city",
                        "parameters": {
                            "type": "object",
                            "properties": {"city": {"type": "string"}},
                            "required": ["city"],
                        },
                    },
                }
            ],
            options=opts,
        ),
        "chat (load)": lambda: client.chat(model=MODEL, messages=[]),
        "generate": lambda: client.generate(model=MODEL, prompt="Once upon", options=opts),
        "generate (stream)": lambda: drained(
            client.generate(model=MODEL, prompt="Once upon", options=opts, stream=True)
        ),
        "generate (raw)": lambda: client.generate(
            model=MODEL, prompt="Once upon", raw=True, options=opts
        ),
        "generate (suffix)": lambda: client.generate(
            model=MODEL, prompt="def f(x):\n    ", suffix="\n    return y", options=opts
        ),
        "embed": lambda: client.embed(model=EMBED_MODEL, input=["hello", "world"]),
        "embeddings": lambda: client.embeddings(model=EMBED_MODEL, prompt="hello"),
        "pull": lambda: client.pull(MODEL),
        "push": lambda: client.push(MODEL),
        "create": lambda: client.create(model="copy", from_=MODEL),
        "copy": lambda: client.copy(MODEL, "copy"),
        "delete": lambda: client.delete("copy"),
    }


def _client_figures(base: str) -> dict[str, Any]:
    outcomes: dict[str, str] = {}
    with ollama.Client(host=base, timeout=120) as client:
        for name, call in _client_calls(client).items():
            try:
                call()
                outcomes[name] = "ok"
            except ollama.ResponseError as exc:
                outcomes[name] = f"{exc.status_code}: {exc.error[:120]}"
            except Exception as exc:
                outcomes[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
    api = [n for n in outcomes if n not in MANAGEMENT]
    return {
        "outcomes": outcomes,
        "works": sum(outcomes[n] == "ok" for n in api),
        "calls": len(api),
        "issue_works": sum(outcomes[n] == "ok" for n in ISSUE_CALLS),
        "issue_calls": len(ISSUE_CALLS),
        "management_501": sum(outcomes[n].startswith("501") for n in MANAGEMENT),
        "management_calls": len(MANAGEMENT),
    }


ROUTES = {
    "ollama": (
        "/api/chat",
        {
            "model": MODEL,
            "messages": MESSAGES,
            "stream": False,
            "options": {"num_predict": 1, "temperature": 0},
        },
    ),
    "openai": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, "temperature": 0},
    ),
}


def _latency(base: str, rounds: int) -> dict[str, Any]:
    samples: dict[str, list[float]] = {name: [] for name in ROUTES}
    order = list(ROUTES)
    with httpx.Client(base_url=base, timeout=60) as client:
        for i in range(WARMUP_ROUNDS + rounds):
            for name in order if i % 2 == 0 else order[::-1]:
                path, body = ROUTES[name]
                t0 = time.perf_counter()
                r = client.post(path, json=body)
                elapsed = (time.perf_counter() - t0) * 1000
                if r.status_code != 200:
                    raise BenchError(f"{path}: HTTP {r.status_code}: {r.text[:300]}")
                if i >= WARMUP_ROUNDS:
                    samples[name].append(elapsed)
    out: dict[str, Any] = {"rounds": rounds}
    for name in ROUTES:
        out[f"{name}_median_ms"] = median(samples[name])
        out[f"{name}_p99_ms"] = pct(samples[name], 99)
    out["added_median_ms"] = out["ollama_median_ms"] - out["openai_median_ms"]
    out["added_p99_ms"] = out["ollama_p99_ms"] - out["openai_p99_ms"]
    return out


async def _one_stream(client: httpx.AsyncClient, route: str, tokens: int) -> int:
    """One streamed chat; the tokens the engine says it generated."""
    if route == "ollama":
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": MESSAGES,
            "options": {"num_predict": tokens, "temperature": 0},
        }
        path = "/api/chat"
    else:
        body = {
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        path = "/v1/chat/completions"
    counted = 0
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raise BenchError(f"{path}: HTTP {r.status_code} on a stream")
        async for line in r.aiter_lines():
            if route == "ollama" and line.strip():
                part = json.loads(line)
                if part.get("done"):
                    counted = int(part.get("eval_count", 0))
            elif line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if isinstance(usage, dict):
                    counted = int(usage.get("completion_tokens", 0))
    if not counted:
        raise BenchError(f"{path}: the stream carried no token count")
    return counted


async def _round(
    base: str, host: psutil.Process, route: str, streams: int, tokens: int
) -> tuple[float, int, float]:
    """One round of ``streams`` concurrent streams: tokens per second, tokens, and the
    host process's own CPU seconds (its engines are other processes)."""
    counts: list[int] = []

    async def one(client: httpx.AsyncClient) -> None:
        counts.append(await _one_stream(client, route, tokens))

    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        cpu0 = sum(host.cpu_times()[:2])
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(streams):
                nursery.start_soon(one, client)
        elapsed = time.perf_counter() - t0
        cpu = sum(host.cpu_times()[:2]) - cpu0
    return sum(counts) / elapsed, sum(counts), cpu


async def _throughput(
    base: str, host_pid: int, streams: int, tokens: int, rounds: int
) -> dict[str, Any]:
    host = psutil.Process(host_pid)
    await _round(base, host, "ollama", streams, 8)  # warm both paths
    await _round(base, host, "openai", streams, 8)
    tps: dict[str, list[float]] = {"ollama": [], "openai": []}
    generated: dict[str, list[int]] = {"ollama": [], "openai": []}
    cpu_us: dict[str, list[float]] = {"ollama": [], "openai": []}
    for i in range(rounds):
        for route in ("ollama", "openai") if i % 2 == 0 else ("openai", "ollama"):
            rate, count, cpu = await _round(base, host, route, streams, tokens)
            tps[route].append(rate)
            generated[route].append(count)
            cpu_us[route].append(cpu / count * 1e6)
    out: dict[str, Any] = {"streams": streams, "tokens_per_stream": tokens, "rounds": rounds}
    for route in tps:
        out[f"{route}_tok_s"] = median(tps[route])
        out[f"{route}_tok_s_range"] = [min(tps[route]), max(tps[route])]
        out[f"{route}_tokens_per_round"] = median([float(c) for c in generated[route]])
        out[f"{route}_host_cpu_us_per_token"] = median(cpu_us[route])
    out["ratio"] = out["ollama_tok_s"] / out["openai_tok_s"]
    return out


def _table(result: dict[str, Any]) -> str:
    c = result["client"]
    lines = [
        f"ollama client calls that work: {c['works']} of {c['calls']} "
        f"(the issue's {c['issue_calls']}: {c['issue_works']} of {c['issue_calls']}); "
        f"model management: {c['management_501']} of {c['management_calls']} answer 501 "
        "as designed",
    ]
    failed = {k: v for k, v in c["outcomes"].items() if v != "ok" and k not in MANAGEMENT}
    for name, why in failed.items():
        lines.append(f"  failed: {name}: {why}")
    lat = result["latency"]
    lines.append(f"1-token chat, {lat['rounds']} rounds interleaved:  median ms   p99 ms")
    for name, label in (("openai", "/v1/chat/completions"), ("ollama", "/api/chat")):
        lines.append(f"  {label:<28}{lat[name + '_median_ms']:>10.2f}{lat[name + '_p99_ms']:>9.2f}")
    added = f"{lat['added_median_ms']:>+10.2f}{lat['added_p99_ms']:>+9.2f}"
    lines.append(f"  {'added by /api/chat':<28}{added}")
    tp = result["throughput"]
    lines.append(
        f"{tp['streams']} streams x {tp['tokens_per_stream']} tokens, {tp['rounds']} rounds: "
        f"/api/chat {tp['ollama_tok_s']:.0f} tok/s "
        f"(rounds {tp['ollama_tok_s_range'][0]:.0f}-{tp['ollama_tok_s_range'][1]:.0f}), "
        f"/v1/chat/completions {tp['openai_tok_s']:.0f} tok/s "
        f"(rounds {tp['openai_tok_s_range'][0]:.0f}-{tp['openai_tok_s_range'][1]:.0f}): "
        f"{tp['ratio']:.3f}"
    )
    lines.append(
        f"  host CPU per streamed token: /api/chat {tp['ollama_host_cpu_us_per_token']:.0f} us, "
        f"/v1/chat/completions {tp['openai_host_cpu_us_per_token']:.0f} us"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--rounds", type=int, default=None, help="latency rounds (default 200)")
    ap.add_argument("--streams", type=int, default=None, help="concurrent streams (default 4)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    ap.add_argument(
        "--stream-rounds", type=int, default=None, help="throughput rounds per route (default 6)"
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: 30 rounds, 2 streams")
    args = ap.parse_args()
    quick = {"rounds": 30, "streams": 2, "stream_rounds": 2}
    full = {"rounds": 200, "streams": 4, "stream_rounds": 6}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.rounds, args.streams, args.tokens, args.stream_rounds) < 1:
        ap.error("--rounds, --streams, --tokens, --stream-rounds: at least 1")

    model = write_demo_model(WORKDIR / f"{MODEL}.gguf", size="tiny")
    spec = [
        {"id": MODEL, "path": str(model), "parallel": args.streams, "ctx_per_slot": CTX_PER_SLOT},
        {
            "id": EMBED_MODEL,
            "path": str(model),
            "parallel": 1,
            "ctx_per_slot": 256,
            "embeddings": True,
            "args": ["--pooling", "mean"],
        },
    ]
    with host_process(spec) as (base, proc):
        result: dict[str, Any] = {
            "setup": {
                "model": MODEL,
                "parallel": args.streams,
                "ctx_per_slot": CTX_PER_SLOT,
                "ollama_client": metadata.version("ollama"),
                "quick": args.quick,
            },
            "client": _client_figures(base),
            "latency": _latency(base, args.rounds),
        }
        result["throughput"] = trio.run(
            _throughput, base, proc.pid, args.streams, args.tokens, args.stream_rounds
        )
    path = write_result("ollama_api", result)
    print(_table(result))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
