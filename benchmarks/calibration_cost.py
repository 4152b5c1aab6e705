"""Calibration figures on recurrent and hybrid demo models.

    python -m benchmarks.calibration_cost [--requests 100] [--parallel 4]

For the tiny ``mamba`` and ``qwen35`` (gated-delta-net hybrid) demo models:

- calibration time at engine start (the probe, as the host runs it);
- corrupted responses and crashes per N concurrent greedy requests, through
  the host and directly against llama-server with ``--parallel N``: a
  response is corrupted when it differs from the same prompt decoded alone;
- throughput (requests/s) through the host with the admission ceiling at 1
  (what an engine that failed calibration gets) and at the configured
  parallelism: what safety costs.

Writes benchmarks/results/calibration_cost.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from gezel_trio.engine.demo_model import write_demo_model

from ._harness import host_process, write_result


def _prompts(n: int) -> list[list[int]]:
    return [[300 + ((i * 37 + j * 11) % 300) for j in range(24)] for i in range(n)]


def _body(prompt: list[int], model: str = "rec") -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "n_predict": 16,
        "temperature": 0,
        "top_k": 1,
        "seed": 7,
        "cache_prompt": False,
    }


async def _burst(
    base: str, prompts: list[list[int]], concurrency: int
) -> tuple[list[str | None], float]:
    out: list[str | None] = [None] * len(prompts)
    limit = trio.CapacityLimiter(concurrency)

    async def one(i: int, client: httpx.AsyncClient) -> None:
        async with limit:
            try:
                r = await client.post(base + "/completion", json=_body(prompts[i]))
                out[i] = r.json()["content"] if r.status_code == 200 else None
            except httpx.HTTPError:
                out[i] = None

    async with httpx.AsyncClient(timeout=120) as client:
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i, client)
        return out, time.perf_counter() - t0


async def _alone(base: str, prompts: list[list[int]]) -> list[str | None]:
    out, _ = await _burst(base, prompts, 1)
    return out


def _count(answers: list[str | None], reference: list[str | None]) -> dict[str, int]:
    failed = sum(1 for a in answers if a is None)
    corrupted = sum(1 for a, r in zip(answers, reference, strict=True) if a is not None and a != r)
    return {"requests": len(answers), "corrupted": corrupted, "failed": failed}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--parallel", type=int, default=4)
    args = ap.parse_args()
    prompts = _prompts(args.requests)
    result: dict[str, Any] = {"requests": args.requests, "parallel": args.parallel}
    for arch in ("mamba", "qwen35"):
        model = write_demo_model(
            Path(f"benchmarks/results/tmp/{arch}.gguf"), size="tiny", arch=arch
        )
        row: dict[str, Any] = {}
        for label, parallel in (("ceiling_1", 1), ("configured", args.parallel)):
            spec = [{"id": "rec", "path": str(model), "parallel": parallel, "ctx_per_slot": 256}]
            with host_process(spec) as (base, _):
                client = httpx.Client(timeout=120)
                client.post(base + "/completion", json=_body(prompts[0]))  # start + calibrate
                t0 = time.perf_counter()
                while True:
                    (eng,) = client.get(base + "/api/status").json()["engines"]
                    if eng["calibration"]["result"] is not None or parallel == 1:
                        break
                    if time.perf_counter() - t0 > 120:
                        raise RuntimeError("no calibration result")
                    time.sleep(0.05)
                direct = eng["url"]
                reference = trio.run(_alone, direct, prompts)
                answers, took = trio.run(_burst, base, prompts, 2 * args.parallel)
                row[label] = {
                    "through_host": _count(answers, reference),
                    "requests_per_s": args.requests / took,
                    "admission_ceiling": eng["admission_ceiling"],
                    "calibration": eng["calibration"]["status"],
                    "calibration_s": (eng["calibration"]["result"] or {}).get("duration_s"),
                }
                if parallel > 1:
                    direct_answers, _ = trio.run(_burst, direct, prompts, 2 * args.parallel)
                    row[label]["direct"] = _count(direct_answers, reference)
                    (eng,) = client.get(base + "/api/status").json()["engines"]
                    row[label]["engine_crashes"] = eng["crashes"]
        row["safety_cost"] = (
            row["configured"]["requests_per_s"] / row["ceiling_1"]["requests_per_s"]
        )
        result[arch] = row
    path = write_result("calibration_cost", result)
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
