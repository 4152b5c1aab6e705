"""Added latency against the idle time before each request: the host and the floor behind
the host's front end, back to back and after pauses.

    python -m benchmarks.request_gaps [--requests 200] [--gaps 0,5,30] [--path /v1/chat/completions]
    python -m benchmarks.request_gaps --requests 20      # smoke run

``proxy_overhead`` sends one request down each of its seven paths in turn, so every request
reaches a process that sat idle while the others were served. This asks how much of an
added latency is the work a request does, and how much is the state it finds the machine
in. It runs ``gezel-trio serve`` (the generated ``tiny`` model, 8 slots, as in
``proxy_overhead``) and :mod:`benchmarks._floor_proxy` ``--front`` (the least any app adds
behind the host's front end) in front of the host's engine, and sends warm 1-token
requests over keep-alive connections to three paths: ``direct`` (the engine), ``host``
and ``floor_front``. For each gap, the client sleeps that long before every request;
the paths take turns in blocks (the order rotated each block, so drift cancels).

Prints, for each gap, each path's median latency, the host's and the floor's added
median (path minus direct), and the CPU per request of the host's and the floor's main
thread, where the request path runs (``/proc/PID/schedstat``, over their blocks, less
what the process spends idle in that time, measured first over :data:`IDLE_S`): a
process that spends more CPU on the same request after a pause runs colder, not longer.
Writes benchmarks/results/request_gaps.json.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from ._harness import (
    ONE_TOKEN_BODIES,
    floor_process,
    host_process,
    hot_path_models,
    median,
    post_ok,
    rotated,
    write_result,
)

PATHS = ("direct", "host", "floor_front")
BLOCKS = 4
"""Blocks per path and gap: the paths take turns this many times."""
WARMUP = 50
IDLE_S = 3.0
"""Seconds of silence over which each process's idle CPU (health checks, timers) is measured."""


def _cpu_s(pid: int) -> float | None:
    """The CPU time the process's main thread has run so far, in nanoseconds' resolution
    (the first field of ``/proc/PID/schedstat``; None without it)."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def _idle_cpu(pids: dict[str, int]) -> dict[str, float]:
    """Each process's CPU seconds per second while no request comes, over :data:`IDLE_S`
    (0 without ``/proc``)."""
    before = {path: _cpu_s(pid) for path, pid in pids.items()}
    started = time.perf_counter()
    time.sleep(IDLE_S)
    elapsed = time.perf_counter() - started
    rates = {}
    for path, pid in pids.items():
        first, last = before[path], _cpu_s(pid)
        rates[path] = 0.0 if first is None or last is None else (last - first) / elapsed
    return rates


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--requests", type=int, default=200, help="timed requests per path and gap")
    ap.add_argument("--gaps", default="0,5,30", help="ms the client idles before each request")
    ap.add_argument("--path", default="/v1/chat/completions", choices=sorted(ONE_TOKEN_BODIES))
    args = ap.parse_args()
    if args.requests < BLOCKS:
        ap.error(f"--requests: at least {BLOCKS}")
    try:
        args.gaps = [float(g) for g in args.gaps.split(",")]
    except ValueError:
        ap.error("--gaps: milliseconds, comma-separated, e.g. 0,5,30")
    if min(args.gaps) < 0:
        ap.error("--gaps: none below 0")
    return args


def _measure(
    client: httpx.Client,
    urls: dict[str, str],
    pids: dict[str, int],
    idle: dict[str, float],
    body: dict[str, object],
    gap_s: float,
    requests: int,
) -> dict[str, float | None]:
    """One gap: each path's median latency, added median and CPU per request (less
    ``idle``, each process's idle CPU seconds per second, over the time of its blocks)."""
    per_block = requests // BLOCKS
    latencies: dict[str, list[float]] = {path: [] for path in PATHS}
    cpu_s = dict.fromkeys(pids, 0.0)
    counted = True  # /proc was there for every block
    for block in range(BLOCKS):
        for path in rotated(PATHS, block):
            before = _cpu_s(pids[path]) if path in pids else None
            block_started = time.perf_counter()
            for _ in range(per_block):
                time.sleep(gap_s)
                started = time.perf_counter()
                post_ok(client, urls[path], body)
                latencies[path].append((time.perf_counter() - started) * 1000)
            if path in pids:
                after = _cpu_s(pids[path])
                if before is None or after is None:
                    counted = False
                else:
                    cpu_s[path] += after - before
                    cpu_s[path] -= idle[path] * (time.perf_counter() - block_started)
    out: dict[str, float | None] = {f"{p}_median_ms": median(latencies[p]) for p in PATHS}
    for path in PATHS[1:]:
        added = median(latencies[path]) - median(latencies["direct"])
        out[f"{path}_added_median_ms"] = added
        per_request = cpu_s[path] * 1000 / (per_block * BLOCKS)
        out[f"{path}_cpu_ms_per_request"] = per_request if counted else None
    return out


def _table(path: str, rows: Sequence[tuple[float, dict[str, float | None]]]) -> str:
    lines = [
        f"{path}: median ms of each path, added median over direct, CPU ms per request",
        f"{'gap ms':>7}{'direct':>9}{'host':>9}{'floor':>9}{'+host':>9}{'+floor':>9}"
        f"{'host cpu':>10}{'floor cpu':>10}",
    ]
    for gap, r in rows:
        lines.append(
            f"{gap:>7g}{_cell(r, 'direct_median_ms', 9)}{_cell(r, 'host_median_ms', 9)}"
            f"{_cell(r, 'floor_front_median_ms', 9)}{_cell(r, 'host_added_median_ms', 9, '+')}"
            f"{_cell(r, 'floor_front_added_median_ms', 9, '+')}"
            f"{_cell(r, 'host_cpu_ms_per_request', 10)}"
            f"{_cell(r, 'floor_front_cpu_ms_per_request', 10)}"
        )
    return "\n".join(lines)


def _cell(row: dict[str, float | None], key: str, width: int, sign: str = "") -> str:
    value = row[key]
    return f"{'-':>{width}}" if value is None else f"{value:>{sign}{width}.2f}"


def main() -> None:
    args = _parse_args()
    body = ONE_TOKEN_BODIES[args.path]
    with host_process(hot_path_models()) as (base, host), httpx.Client(timeout=60) as client:
        post_ok(client, base + args.path, body)  # the engine starts
        engine = client.get(base + "/api/status").json()["engines"][0]["url"]
        with floor_process(engine, mode="front") as (floor, floor_proc):
            urls = {"direct": engine, "host": base, "floor_front": floor}
            urls = {path: url + args.path for path, url in urls.items()}
            pids = {"host": host.pid, "floor_front": floor_proc.pid}
            for url in urls.values():
                for _ in range(WARMUP):
                    post_ok(client, url, body)
            idle = _idle_cpu(pids)
            rows = [
                (gap, _measure(client, urls, pids, idle, body, gap / 1000, args.requests))
                for gap in args.gaps
            ]
    result = {
        "path": args.path,
        "requests": args.requests // BLOCKS * BLOCKS,
        "idle_cpu_ms_per_s": {path: rate * 1000 for path, rate in idle.items()},
        "gaps": [{"gap_ms": gap, **row} for gap, row in rows],
    }
    out = write_result("request_gaps", result)
    print(_table(args.path, rows))
    rates = ", ".join(f"{path} {rate * 1000:.2f}" for path, rate in idle.items())
    print(f"idle CPU, ms per s (taken out of the CPU per request): {rates}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
