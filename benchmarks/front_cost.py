"""What serving one small HTTP request costs the server, by the way it is served: the
CPU the host spends on the front half of a request, before any of its own work.

    python -m benchmarks.front_cost [--requests 2000]

Three servers answer every ``POST`` with the same small JSON body (a 1-token chat
completion's size), each in a process of its own, one after another:

- ``h11 + socket``: h11 over a bare trio socket (the floor);
- ``hypercorn``: ``hypercorn.trio.serve`` with a trivial ASGI app;
- ``serve_front``: the host's own front (``gezel_trio/front_guard.py``: hypercorn's
  connections with a deadline on every write) with the same app.

A keep-alive client sends the requests one after another. Prints the client's median
latency and the server process's CPU time per request (user + system), and writes
benchmarks/results/front_cost.json.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx
import psutil
import trio

from ._harness import free_port, write_result

BODY = (
    b'{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"tiny",'
    b'"choices":[{"index":0,"finish_reason":"length","message":{"role":"assistant",'
    b'"content":"The"}}],"usage":{"prompt_tokens":14,"completion_tokens":1,"total_tokens":15}}'
)
REQUEST = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
SERVERS = ("h11 + socket", "hypercorn", "serve_front")


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    while (await receive()).get("more_body"):
        pass
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(BODY))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": BODY, "more_body": False})


async def _h11_connection(stream: trio.SocketStream) -> None:
    import h11

    conn = h11.Connection(h11.SERVER)
    head = h11.Response(
        status_code=200,
        headers=[("content-type", "application/json"), ("content-length", str(len(BODY)))],
    )
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(65536)
            if not data:
                return
            conn.receive_data(data)
        elif isinstance(event, h11.EndOfMessage):
            out = conn.send(head) + conn.send(h11.Data(data=BODY)) + conn.send(h11.EndOfMessage())
            await stream.send_all(out)
            conn.start_next_cycle()
        elif isinstance(event, h11.ConnectionClosed):
            return


async def _serve(server: str, port: int) -> None:
    """The server process: serve until killed."""
    if server == "h11 + socket":
        await trio.serve_tcp(_h11_connection, port, host="127.0.0.1")
    from hypercorn.config import Config as HypercornConfig

    config = HypercornConfig()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    if server == "hypercorn":
        from hypercorn.trio import serve

        await serve(_app, config)  # type: ignore[arg-type]
    else:
        from gezel_trio.front_guard import FrontGuard, serve_front

        await serve_front(_app, config, FrontGuard(write_timeout=30, drain_timeout=1))  # type: ignore[arg-type]


def _measure(server: str, requests: int) -> dict[str, float]:
    port = free_port()
    code = "import trio; from benchmarks.front_cost import _serve; "
    code += f"trio.run(_serve, {server!r}, {port})"
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            deadline = time.monotonic() + 30
            while True:
                try:
                    client.post("/v1/chat/completions", json=REQUEST)
                    break
                except httpx.HTTPError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            for _ in range(200):  # warm
                client.post("/v1/chat/completions", json=REQUEST)
            process = psutil.Process(proc.pid)
            before = process.cpu_times()
            latencies = []
            for _ in range(requests):
                t0 = time.perf_counter()
                client.post("/v1/chat/completions", json=REQUEST)
                latencies.append(time.perf_counter() - t0)
            after = process.cpu_times()
    finally:
        proc.kill()
        proc.wait()
    cpu = (after.user + after.system) - (before.user + before.system)
    return {
        "median_ms": statistics.median(latencies) * 1000,
        "server_cpu_ms": cpu / requests * 1000,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    args = ap.parse_args()
    figures = {server: _measure(server, args.requests) for server in SERVERS}
    print(f"one small POST answered, keep-alive, {args.requests} requests each")
    print(f"{'server':14s} {'median ms':>10s} {'server CPU ms':>14s}")
    for server, f in figures.items():
        print(f"{server:14s} {f['median_ms']:10.3f} {f['server_cpu_ms']:14.3f}")
    path = write_result("front_cost", {"requests": args.requests, "servers": figures})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
