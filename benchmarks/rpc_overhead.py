"""A model served through a ``ggml-rpc-server`` worker on loopback, against the same
model served locally: the RPC protocol's overhead.

    python -m benchmarks.rpc_overhead [--size small] [--runs 5] [--n-predict 64] [--threads 1]

One host (in process, the real server on a real socket) serves the demo model twice:
``local`` (a plain engine) and ``remote`` (the same file with ``rpc = [worker]``, its
layers on a ``gezel-trio rpc-worker`` started for the run on loopback). Both run on
this machine's CPU with the same thread count (``--threads``, each count its own run:
the local engine's ``--threads`` and the worker's), so the difference is what the
protocol costs: every layer's tensors cross a TCP socket, and the worker computes them.
On a small machine keep ``--threads`` below its core count: with every core taken by
compute threads, the local engine also competes with its own HTTP thread and the host,
while the worker's threads run in a process of their own, and the comparison measures
that contention instead of the protocol.

Requests alternate between the two, ``--runs`` of each after a warm-up, each a fresh
prompt (nothing cached) of ``--prompt-tokens`` tokens and ``--n-predict`` greedy
tokens. Reported per model: median decode tokens/s and prompt tokens/s from the
engine's own timings, median wall time, the ratio remote/local of each, and whether
the greedy answers matched. Writes benchmarks/results/rpc_overhead.json.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

from gezel_trio.config.schema import Config, ModelConfig, validate
from gezel_trio.engine.demo_model import write_demo_model
from gezel_trio.engine.ports import free_port
from gezel_trio.server import open_server

from ._harness import median, write_result


@contextmanager
def rpc_worker(threads: int) -> Iterator[str]:
    """``gezel-trio rpc-worker`` on a free loopback port; yields ``host:port``."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gezel_trio.cli",
            "rpc-worker",
            "--port",
            str(port),
            "--threads",
            str(threads),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the RPC worker did not start (exit {proc.poll()})")
            time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _config(state: Path, model: Path, worker: str, threads: int) -> Config:
    cfg = Config()
    cfg.server.port = 0
    cfg.server.log_level = "warning"
    cfg.engine.state_dir = str(state)
    cfg.gpu.policy = "coexist"
    cfg.models = [
        ModelConfig(
            id="local",
            path=str(model),
            parallel=1,
            ctx_per_slot=2048,
            args=["--threads", str(threads)],
        ),
        ModelConfig(
            id="remote",
            path=str(model),
            parallel=1,
            ctx_per_slot=2048,
            rpc=[worker],
            args=["--threads", str(threads)],
        ),
    ]
    validate(cfg)
    return cfg


async def run(
    model: Path, *, runs: int, prompt_tokens: int, n_predict: int, threads: int, seed: int = 3
) -> dict[str, Any]:
    rng = random.Random(seed)
    samples: dict[str, list[dict[str, float]]] = {"local": [], "remote": []}
    answers: dict[str, list[str]] = {"local": [], "remote": []}
    with tempfile.TemporaryDirectory(prefix="gezel-rpc-") as tmp, rpc_worker(threads) as worker:
        cfg = _config(Path(tmp) / "state", model, worker, threads)
        async with (
            open_server(cfg) as (host, binds),
            httpx.AsyncClient(base_url=binds[0], timeout=300) as client,
        ):

            async def once(name: str, prompt: list[int]) -> dict[str, float]:
                body = {
                    "model": name,
                    "prompt": prompt,
                    "n_predict": n_predict,
                    "temperature": 0,
                    "cache_prompt": False,
                    "ignore_eos": True,
                }
                started = time.perf_counter()
                r = await client.post("/completion", json=body)
                wall = time.perf_counter() - started
                r.raise_for_status()
                data = r.json()
                answers[name].append(str(data["content"]))
                timings = data["timings"]
                return {
                    "decode_tps": float(timings["predicted_per_second"]),
                    "prompt_tps": float(timings["prompt_per_second"]),
                    "wall_ms": wall * 1000,
                }

            warm = [rng.randrange(300, 500) for _ in range(prompt_tokens)]
            for name in ("local", "remote"):
                await once(name, warm)
            for name in answers:
                answers[name].clear()
            for _ in range(runs):
                prompt = [rng.randrange(300, 500) for _ in range(prompt_tokens)]
                for name in ("local", "remote"):  # side by side, same prompt
                    samples[name].append(await once(name, prompt))
            argv = host.models["remote"].engine.argv
            layers = argv[argv.index("--n-gpu-layers") + 1] if "--n-gpu-layers" in argv else None

    def med(name: str, key: str) -> float:
        return round(median([s[key] for s in samples[name]]), 2)

    out: dict[str, Any] = {"threads": threads, "remote_n_gpu_layers": layers}
    for name in samples:
        out[name] = {key: med(name, key) for key in ("decode_tps", "prompt_tps", "wall_ms")}
    out["remote_vs_local"] = {
        key: round(out["remote"][key] / out["local"][key], 3)
        for key in ("decode_tps", "prompt_tps", "wall_ms")
    }
    out["answers_match"] = answers["local"] == answers["remote"]
    return out


async def main(
    size: str, runs: int, prompt_tokens: int, n_predict: int, threads: list[int]
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gezel-rpc-models-") as d:
        model = write_demo_model(Path(d) / f"{size}.gguf", size=size)  # type: ignore[arg-type]
        results = [
            await run(model, runs=runs, prompt_tokens=prompt_tokens, n_predict=n_predict, threads=n)
            for n in threads
        ]
    return {
        "size": size,
        "worker": "loopback",
        "runs": runs,
        "prompt_tokens": prompt_tokens,
        "n_predict": n_predict,
        "by_threads": results,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--n-predict", type=int, default=64)
    parser.add_argument("--threads", default="1", help="comma-separated thread counts")
    args = parser.parse_args()
    counts = [int(n) for n in args.threads.split(",") if n.strip()]
    out = trio.run(main, args.size, args.runs, args.prompt_tokens, args.n_predict, counts)
    for result in out["by_threads"]:
        print(f"--threads {result['threads']}")
        print(f"  {'':8} {'decode tok/s':>13} {'prompt tok/s':>13} {'wall ms':>9}")
        for name in ("local", "remote"):
            s = result[name]
            print(f"  {name:8} {s['decode_tps']:13.1f} {s['prompt_tps']:13.1f} {s['wall_ms']:9.1f}")
        ratio = result["remote_vs_local"]
        print(
            f"  {'ratio':8} {ratio['decode_tps']:13.3f} {ratio['prompt_tps']:13.3f} "
            f"{ratio['wall_ms']:9.3f}   (remote / local; {result['remote_n_gpu_layers']} layers "
            f"on the worker; greedy answers match: {result['answers_match']})"
        )
    print("wrote", write_result("rpc_overhead", out))
