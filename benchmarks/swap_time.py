"""Time to swap between two models in ``swap`` mode, with its breakdown.

    python -m benchmarks.swap_time [--size small] [--runs 3]

A host serves models A and B (two copies of the demo model, so both are
real files of the same size) under ``[gpu] policy = "swap"``. A is made
resident, then a streaming request for B is sent; the figure is from that
request to B's first token. The breakdown comes from the host's own status:
A's stop (SIGTERM to exit), B's load (spawn to /health 200, llama-server's
own time), and the rest (scheduling, eviction bookkeeping, B's first
prefill and token). Writes benchmarks/results/swap_time.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import httpx

from gezel_trio.engine.demo_model import write_demo_model

from ._harness import host_process, median, write_result


def _first_token(client: httpx.Client, base: str, model: str) -> float:
    body = {"model": model, "prompt": "Hello there", "max_tokens": 4, "stream": True}
    t0 = time.perf_counter()
    with client.stream("POST", base + "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                return time.perf_counter() - t0
    raise RuntimeError("no token")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=["tiny", "small"], default="small")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    tmp = Path("benchmarks/results/tmp")
    a = write_demo_model(tmp / f"swap-a-{args.size}.gguf", size=args.size)
    b = tmp / f"swap-b-{args.size}.gguf"
    if not b.exists():
        shutil.copy(a, b)
    models = [
        {"id": "A", "path": str(a), "parallel": 2, "ctx_per_slot": 2048},
        {"id": "B", "path": str(b), "parallel": 2, "ctx_per_slot": 2048},
    ]
    runs = []
    with host_process(models, extra='[gpu]\npolicy = "swap"') as (base, _):
        client = httpx.Client(timeout=300)
        for _ in range(args.runs):
            _first_token(client, base, "A")  # A resident and warm
            swap = _first_token(client, base, "B")
            engines = {e["model"]: e for e in client.get(base + "/api/status").json()["engines"]}
            load_b = engines["B"]["load_seconds"]
            stop_a = engines["A"]["stop_seconds"]
            runs.append(
                {
                    "swap_to_first_token_ms": swap * 1000,
                    "a_stop_ms": stop_a * 1000,
                    "b_llama_server_load_ms": load_b * 1000,
                    "rest_ms": (swap - load_b - stop_a) * 1000,
                }
            )
            _first_token(client, base, "B")
    result = {
        "size": args.size,
        "runs": runs,
        "median": {k: median([r[k] for r in runs]) for k in runs[0]},
    }
    path = write_result("swap_time", result)
    print(json.dumps(result["median"], indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
