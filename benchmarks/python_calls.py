"""Python calls per 1-token request, the host's and the floor proxy's: a cost that does not
move with the machine's speed.

    python -m benchmarks.python_calls [--requests 400] [--path /v1/chat/completions]
    python -m benchmarks.python_calls --requests 50     # smoke run

On a shared 2-core machine a latency figure moves by half from one hour to the next; the
work a request makes the host's interpreter do does not. This runs ``gezel-trio serve``
(the generated ``tiny`` model, 8 slots, as in ``proxy_overhead``) and, in front of the
host's engine, :mod:`benchmarks._floor_proxy` with ``--streamed`` (the least a Python proxy
does that streams from the engine, as the host does), each under :mod:`cProfile`, switched
on (``SIGUSR1``) for the timed requests only. Warm 1-token requests go down each one after
another over one keep-alive connection; the figure is cProfile's call count per request
(Python functions and C built-ins) in the process's main thread over that window, the
host's background work included (its health checks and the like: about 2,800 calls a
second when idle, under 1% of 400 requests' count), with the host's count over the
floor's beside it.

Prints a table and writes benchmarks/results/python_calls.json.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ._harness import (
    ONE_TOKEN_BODIES,
    floor_process,
    host_process,
    hot_path_models,
    parse_hot_path_args,
    post_ok,
    read_json_when_written,
    write_result,
)

WARMUP = 50
STOP_TIMEOUT_S = 30.0

PROFILED = """
import cProfile, json, os, pstats, runpy, signal, sys
out, module = sys.argv[1], sys.argv[2]
profile, running = cProfile.Profile(), []
def toggle(signum, frame):
    if not running:
        running.append(True)
        profile.enable()
        return
    profile.disable()
    with open(out + ".part", "w") as f:
        json.dump({"calls": pstats.Stats(profile).total_calls}, f)
    os.replace(out + ".part", out)
signal.signal(signal.SIGUSR1, toggle)
sys.argv = [module, *sys.argv[3:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""
"""Runs a module as ``python -m`` would, with cProfile switched on by the first
``SIGUSR1`` and off by the second, which writes ``{"calls": N}`` to the file named first."""


def _profiled(out: Path, module: str) -> list[str]:
    return [sys.executable, "-c", PROFILED, str(out), module]


def _calls_per_request(
    proc: subprocess.Popen[bytes],
    out: Path,
    client: httpx.Client,
    url: str,
    args: argparse.Namespace,
) -> float:
    body = ONE_TOKEN_BODIES[args.path]
    for _ in range(WARMUP):
        post_ok(client, url, body)
    proc.send_signal(signal.SIGUSR1)
    time.sleep(0.5)  # the handler runs at the process's next wakeup
    for _ in range(args.requests):
        post_ok(client, url, body)
    time.sleep(0.5)  # let the last answer's bookkeeping finish
    proc.send_signal(signal.SIGUSR1)
    profiled = read_json_when_written(
        out, within=STOP_TIMEOUT_S, what="call count from the profiled process"
    )
    calls: int = profiled["calls"]
    requests: int = args.requests
    return calls / requests


def main() -> None:
    args = parse_hot_path_args(__doc__, requests=400, help="timed requests per process")
    spec = hot_path_models()
    with tempfile.TemporaryDirectory(prefix="gezel-calls-") as tmp:
        host_out, floor_out = Path(tmp) / "host.json", Path(tmp) / "floor.json"
        host_program = _profiled(host_out, "gezel_trio.cli")
        with (
            host_process(spec, program=host_program) as (base, host),
            httpx.Client(timeout=60) as client,
        ):
            post_ok(client, base + args.path, ONE_TOKEN_BODIES[args.path])  # the engine starts
            engine = client.get(base + "/api/status").json()["engines"][0]["url"]
            floor_program = _profiled(floor_out, "benchmarks._floor_proxy")
            with floor_process(engine, mode="streamed", program=floor_program) as (floor, proc):
                floor_calls = _calls_per_request(proc, floor_out, client, floor + args.path, args)
            host_calls = _calls_per_request(host, host_out, client, base + args.path, args)
    result = {
        "path": args.path,
        "requests": args.requests,
        "host_calls_per_request": host_calls,
        "floor_streamed_calls_per_request": floor_calls,
        "ratio": host_calls / floor_calls,
    }
    path = write_result("python_calls", result)
    print(f"{args.path}, {args.requests} requests each: Python calls per request (cProfile)")
    print(f"  host            {host_calls:8.0f}")
    print(f"  floor_streamed  {floor_calls:8.0f}")
    print(f"  host / floor    {host_calls / floor_calls:8.2f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
