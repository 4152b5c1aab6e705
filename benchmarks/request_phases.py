"""Where a 1-token request's added latency goes, by wall clock: the phases between the
host's seams, and whose task steps fill them.

    python -m benchmarks.request_phases [--requests 300] [--path /v1/chat/completions]
    python -m benchmarks.request_phases --requests 30      # smoke run

``proxy_overhead`` says how much the host adds; ``python_calls`` and ``profile_1token``
say which Python runs, but not when, nor what a request waits for. This runs
``gezel-trio serve`` (the generated ``tiny`` model, 8 slots, as in ``proxy_overhead``)
under :mod:`benchmarks._phase_tracer`, which marks the entry and exit of each seam of a
completion (hypercorn's parse, the lean front, the body, the route, the scheduler's
grant and release, the engine exchange, the response's send) with ``perf_counter``.
Warm 1-token requests go to the host and to its engine directly, alternately, one
after another over keep-alive connections.

Prints the client's median latency of each and the difference; the median of each
phase between consecutive marks (every record has the same marks, or the run fails);
and, for each part of a request (before the engine has it, while it works, after its
answer), the task steps per request of the request's own task and of every other task,
and the time they ran (wall clock: CPU, and any preemption by other processes). The
marks add a few microseconds each. Writes
benchmarks/results/request_phases.json.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from gezel_bench.errors import BenchError

from ._harness import (
    ONE_TOKEN_BODIES,
    host_process,
    hot_path_models,
    median,
    parse_hot_path_args,
    post_ok,
    read_json_when_written,
    write_result,
)

WARMUP = 50
DUMP_TIMEOUT_S = 30.0

WHAT: dict[tuple[str, str], str] = {
    ("bytes in", "app task"): "hypercorn: h11 reads the request head",
    ("app task", "front>"): "hypercorn: the app's task starts",
    ("front>", "body>"): "lean front: headers, API key",
    ("body>", "body<"): "the body, through hypercorn's channel",
    ("body<", "complete>"): "route: parse, validate, resolve the model",
    ("complete>", "grant>"): "limits, prompt blocks",
    ("grant>", "grant<"): "scheduler: queue, grant, lease, prepare",
    ("grant<", "upstream>"): "the engine request built",
    ("upstream>", "write>"): "connect to the engine",
    ("write>", "write<"): "the request written",
    ("head>", "head<"): "engine: until the answer's head",
    ("upstream<", "release>"): "engine: the answer's events, assembled",
    ("release>", "release<"): "scheduler: release",
    ("complete<", "respond>"): "relay: response, metrics, request log",
    ("respond>", "respond<"): "hypercorn: the response sent",
}
"""What happens between two consecutive marks (the rest take microseconds)."""


def _records(
    proc: subprocess.Popen[bytes],
    out: Path,
    client: httpx.Client,
    base: str,
    engine: str,
    args: argparse.Namespace,
) -> tuple[dict[str, list[float]], dict[str, Any]]:
    body = ONE_TOKEN_BODIES[args.path]
    for _ in range(WARMUP):
        post_ok(client, base + args.path, body)
    proc.send_signal(signal.SIGUSR1)
    time.sleep(0.5)  # the handler runs at the process's next wakeup
    latency: dict[str, list[float]] = {"host": [], "direct": []}
    for _ in range(args.requests):
        for name, url in (("host", base), ("direct", engine)):
            t0 = time.perf_counter()
            post_ok(client, url + args.path, body)
            latency[name].append(time.perf_counter() - t0)
    time.sleep(0.5)  # the last answer's bookkeeping
    proc.send_signal(signal.SIGUSR2)
    traced = read_json_when_written(out, within=DUMP_TIMEOUT_S, what="marks from the traced host")
    return latency, traced


def _phases(requests: list[list[list[Any]]]) -> list[dict[str, Any]]:
    sequences = Counter(tuple(mark for mark, _ in r) for r in requests)
    if len(sequences) != 1:
        raise BenchError(f"the requests took different paths through the seams: {sequences}")
    (marks,) = sequences
    phases = []
    for i in range(1, len(marks)):
        a, b = marks[i - 1], marks[i]
        ms = median([(r[i][1] - r[i - 1][1]) * 1000 for r in requests])
        phases.append({"from": a, "to": b, "what": WHAT.get((a, b), ""), "median_ms": ms})
    total = median([(r[-1][1] - r[0][1]) * 1000 for r in requests])
    phases.append({"from": marks[0], "to": marks[-1], "what": "in all", "median_ms": total})
    return phases


def main() -> None:
    args = parse_hot_path_args(__doc__, requests=300, help="timed requests to each")
    spec = hot_path_models()
    with tempfile.TemporaryDirectory(prefix="gezel-phases-") as tmp:
        out = Path(tmp) / "marks.json"
        program = [sys.executable, "-m", "benchmarks._phase_tracer", str(out)]
        with (
            host_process(spec, program=program) as (base, host),
            httpx.Client(timeout=60) as client,
        ):
            post_ok(client, base + args.path, ONE_TOKEN_BODIES[args.path])  # the engine starts
            engine = client.get(base + "/api/status").json()["engines"][0]["url"]
            latency, traced = _records(host, out, client, base, engine, args)
    requests = traced["requests"]
    if len(requests) != args.requests:
        raise BenchError(f"{len(requests)} records for {args.requests} requests")
    host_ms, direct_ms = (median(latency[k]) * 1000 for k in ("host", "direct"))
    steps = [
        {"part": part, "tasks": who, "steps": n / len(requests), "ran_ms": s * 1000 / len(requests)}
        for part, who, n, s in traced["steps"]
    ]
    result = {
        "path": args.path,
        "requests": args.requests,
        "host_median_ms": host_ms,
        "direct_median_ms": direct_ms,
        "added_median_ms": host_ms - direct_ms,
        "phases": _phases(requests),
        "task_steps_per_request": steps,
    }
    path = write_result("request_phases", result)
    print(f"{args.path}, {args.requests} requests each, medians")
    added = host_ms - direct_ms
    print(f"  client: host {host_ms:.3f} ms, direct {direct_ms:.3f}, added {added:.3f}")
    for p in result["phases"]:
        print(f"  {p['from']:>10} -> {p['to']:<10} {p['median_ms']:7.3f} ms  {p['what']}")
    print("  per request: task steps and the ms they ran")
    for s in sorted(steps, key=lambda s: (s["part"], s["tasks"])):
        print(f"    {s['part']:<24}{s['tasks']:<20}{s['steps']:6.2f} {s['ran_ms']:7.3f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
