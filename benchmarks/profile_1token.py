"""Where a 1-token request's time goes in the host: a py-spy flame graph.

    python -m benchmarks.profile_1token [--seconds 15] [--path /v1/chat/completions] [--label after]

Runs ``gezel-trio serve`` as a user would (its own process, the generated ``tiny``
model, 8 slots as in proxy_overhead), sends 1-token requests to it back to back over one keep-alive
connection, and records the host process with ``py-spy record`` meanwhile (the
engine is another process: only the host's own Python shows). Writes
``benchmarks/results/flame-1token-<route>[-<label>].svg`` and prints the request rate and the
median latency seen by the client. Needs ``py-spy`` (``pip install py-spy``) and,
as root or with ptrace allowed, permission to attach.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from gezel_trio.engine.demo_model import write_demo_model

from ._harness import RESULTS, host_process

BODIES = {
    "/v1/chat/completions": {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 1,
        "temperature": 0,
    },
    "/v1/completions": {"model": "tiny", "prompt": "hello", "max_tokens": 1, "temperature": 0},
    "/v1/messages": {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 1,
        "temperature": 0,
    },
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--path", default="/v1/chat/completions", choices=sorted(BODIES))
    ap.add_argument("--format", default="flamegraph", choices=("flamegraph", "raw"))
    ap.add_argument("--parallel", type=int, default=8, help="slots (proxy_overhead's engine has 8)")
    ap.add_argument(
        "--label", default="", help="appended to the figure's name (keep an earlier one)"
    )
    args = ap.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    name = args.path.strip("/").replace("/", "-")
    suffix = "svg" if args.format == "flamegraph" else "txt"
    label = f"-{args.label}" if args.label else ""
    out = RESULTS / f"flame-1token-{name}{label}.{suffix}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    model = write_demo_model(RESULTS / "tmp" / "tiny.gguf", size="tiny")
    spec = [{"id": "tiny", "path": str(model), "parallel": args.parallel, "ctx_per_slot": 512}]
    body = BODIES[args.path]
    with host_process(spec) as (base, host), httpx.Client(base_url=base, timeout=60) as client:
        for _ in range(50):  # the engine starts, then warm
            r = client.post(args.path, json=body)
            assert r.status_code == 200, r.text
        record = [py_spy, "record", "--pid", str(host.pid), "--rate", "400", "--nonblocking"]
        record += ["--duration", str(int(args.seconds)), "--output", str(out)]
        spy = subprocess.Popen(
            [*record, "--format", args.format],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        times: list[float] = []
        t0 = time.monotonic()
        while spy.poll() is None:
            start = time.perf_counter()
            r = client.post(args.path, json=body)
            times.append(time.perf_counter() - start)
            assert r.status_code == 200, r.text
        elapsed = time.monotonic() - t0
    print(f"{args.path}: {len(times)} requests in {elapsed:.1f} s ({len(times) / elapsed:.0f}/s)")
    print(f"client median {statistics.median(times) * 1000:.2f} ms")
    print(f"flame graph: {out}")


if __name__ == "__main__":
    main()
