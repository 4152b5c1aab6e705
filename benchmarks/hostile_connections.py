"""Hostile connections: how long a stuck reader and a slowloris hold what they hold, how
long a shutdown takes while they are connected, and what idle connections cost others.

    python -m benchmarks.hostile_connections [--idle 500] [--stall 3] [--deadline 2] [--shutdown 4]
    python -m benchmarks.hostile_connections --quick     # smoke run: 100 idle, short timeouts

One host in this process (the generated ``tiny`` model on a real llama-server, a real
hypercorn socket) and raw-socket clients:

1. A stuck reader (a long streaming chat, a 4 KiB receive buffer, nothing read after its
   first event): seconds from its write blocking until its slot is free and until its
   connection is reset, against ``[server] stream_stall_timeout``.
2. Slowloris: a request head without its final CRLF (``keep_alive_timeout``) and half a
   declared body (``body_timeout``): seconds until each is cut off.
3. Latency of ``GET /health`` and of a 1-token chat completion, alone (before the idle
   connections open and after they close, pooled) and with N idle keep-alive connections
   open (half of them served once): medians, p99, the ratio.
4. Shutdown while a stuck reader, a slowloris head and half a body are connected (on a
   host with the default client deadlines, so none ends on its own first): seconds from the
   shutdown's start (leaving :func:`gezel_trio.server.open_served`, the path SIGINT takes)
   until the engines are stopped, against ``shutdown_timeout``.

Prints a table and writes benchmarks/results/hostile_connections.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from gezel_bench.errors import BenchError
from gezel_bench.targets import resolve_llama_server
from gezel_trio.config.schema import Config, ModelConfig, validate
from gezel_trio.engine.demo_model import write_demo_model
from gezel_trio.host import Host
from gezel_trio.server import Served, drain_timeout, open_served

from ._harness import median, pct, write_result

CHAT: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "temperature": 0,
    "max_tokens": 16000,
    "ignore_eos": True,
    "stream": True,
}
ONE_TOKEN = {**CHAT, "stream": False, "max_tokens": 1, "ignore_eos": False}
SLOW_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
HALF_BODY = SLOW_HEAD + b"Content-Length: 200\r\n\r\n{" + b" " * 99
SAMPLES = 60


def _config(state_dir: Path, model: Path, binary: Path, args: argparse.Namespace) -> Config:
    cfg = Config()
    cfg.server.port = 0
    cfg.server.log_level = "warning"
    cfg.server.stream_stall_timeout = args.stall
    cfg.server.keep_alive_timeout = args.deadline
    cfg.server.body_timeout = args.deadline
    cfg.server.shutdown_timeout = args.shutdown
    cfg.engine.state_dir = str(state_dir)
    cfg.engine.binary = str(binary)
    cfg.models = [ModelConfig(id="tiny", path=str(model), parallel=2, ctx_per_slot=16384)]
    validate(cfg)
    return cfg


def _request(body: dict[str, Any]) -> bytes:
    payload = json.dumps(body).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )


async def _connect(url: str, *, rcvbuf: int | None = None) -> trio.SocketStream:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await sock.connect((host, int(port)))
    return trio.SocketStream(sock)


async def _read_until(stream: trio.SocketStream, marker: bytes) -> None:
    buf = b""
    while marker not in buf:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise BenchError(f"the host closed the connection before {marker!r}: {buf[:200]!r}")
        buf += chunk


async def _until_closed(stream: trio.SocketStream) -> float:
    """Seconds until the host closes ``stream`` (reading whatever it still sends)."""
    t0 = trio.current_time()
    try:
        while await stream.receive_some(65536):
            pass
    except trio.BrokenResourceError:
        pass
    return trio.current_time() - t0


async def _wait(predicate: Any, *, within: float, what: str) -> float:
    """Seconds until ``predicate()`` holds, polled every 10 ms."""
    t0 = trio.current_time()
    deadline = t0 + within
    while not predicate():  # polled: the figures are host state, with no event to wait on
        if trio.current_time() > deadline:
            raise BenchError(f"{what}: not within {within:g}s")
        await trio.sleep(0.01)
    return trio.current_time() - t0


def _running(host: Host) -> int:
    assert host.scheduler is not None
    return sum(host.scheduler.statistics().running.values())


async def _stuck_reader(url: str) -> trio.SocketStream:
    stream = await _connect(url, rcvbuf=4096)
    await stream.send_all(_request(CHAT))
    await _read_until(stream, b"data: ")
    return stream


async def _wait_blocked(served: Served) -> float:
    """Wait until a response write waits on its client; returns when it began (trio time)."""
    front = served.front
    await _wait(lambda: front.statistics().oldest_write_s > 0.2, within=60, what="a blocked write")
    return trio.current_time() - front.statistics().oldest_write_s


async def _stuck(served: Served, stall: float) -> dict[str, float]:
    stream = await _stuck_reader(served.urls[0])
    front = served.front
    async with stream:
        blocked = await _wait_blocked(served)
        timeouts = front.statistics().write_timeouts
        out: dict[str, float] = {}

        async def slot() -> None:
            await _wait(lambda: _running(served.host) == 0, within=stall + 30, what="slot free")
            out["slot_free_s"] = trio.current_time() - blocked

        async def reset() -> None:
            await _wait(
                lambda: front.statistics().write_timeouts > timeouts,
                within=stall + 30,
                what="the stuck connection reset",
            )
            out["connection_reset_s"] = trio.current_time() - blocked

        async with trio.open_nursery() as nursery:
            nursery.start_soon(slot)
            nursery.start_soon(reset)
        return out


async def _slowloris(url: str) -> dict[str, float]:
    out: dict[str, float] = {}

    async def one(name: str, data: bytes) -> None:
        stream = await _connect(url)
        async with stream:
            await stream.send_all(data)
            out[name] = await _until_closed(stream)

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "head_cut_s", SLOW_HEAD)
            nursery.start_soon(one, "half_body_cut_s", HALF_BODY)
    return out


async def _samples(client: httpx.AsyncClient) -> dict[str, list[float]]:
    """Milliseconds of ``SAMPLES`` health checks and 1-token chats, interleaved."""
    out: dict[str, list[float]] = {"health": [], "chat": []}
    for _ in range(SAMPLES):
        t0 = time.perf_counter()
        r = await client.get("/health")
        out["health"].append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        c = await client.post("/v1/chat/completions", json=ONE_TOKEN)
        out["chat"].append((time.perf_counter() - t0) * 1000)
        if r.status_code != 200 or c.status_code != 200:
            raise BenchError(f"HTTP {r.status_code}/{c.status_code}: {c.text[:300]}")
    return out


def _summary(samples: dict[str, list[float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, values in samples.items():
        out[f"{name}_median_ms"] = median(values)
        out[f"{name}_p99_ms"] = pct(values, 99)
    return out


async def _idle_cost(served: Served, client: httpx.AsyncClient, n: int) -> dict[str, Any]:
    """Latency alone (before the idle connections open and after they close: drift on a
    shared machine cancels), and with ``n`` idle connections open."""
    for _ in range(30):  # warm
        await client.post("/v1/chat/completions", json=ONE_TOKEN)
    before = await _samples(client)
    idle: list[trio.SocketStream] = []
    limit = trio.CapacityLimiter(32)

    async def open_idle(i: int) -> None:
        async with limit:
            stream = await _connect(served.urls[0])
            idle.append(stream)
            if i % 2:  # served once, then idle in keep-alive
                await stream.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                await _read_until(stream, b'"ok"}')

    try:
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(open_idle, i)
        await _wait(
            lambda: served.front.statistics().open >= n,
            within=30,
            what="every idle connection accepted",
        )
        loaded = _summary(await _samples(client))
        held = served.front.statistics().open
    finally:
        for stream in idle:
            await stream.aclose()
    await _wait(lambda: served.front.statistics().open <= 1, within=30, what="idle ones closed")
    after = await _samples(client)
    alone = _summary({k: before[k] + after[k] for k in before})
    return {
        "idle_connections": n,
        "held_during": held,
        "alone": alone,
        "alone_before": _summary(before),
        "alone_after": _summary(after),
        "with_idle": loaded,
        "health_ratio": loaded["health_median_ms"] / alone["health_median_ms"],
        "chat_ratio": loaded["chat_median_ms"] / alone["chat_median_ms"],
    }


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    engine = resolve_llama_server()
    with tempfile.TemporaryDirectory(prefix="gezel-hostile-") as tmp:
        model = write_demo_model(Path(tmp) / "tiny.gguf", size="tiny")
        cfg = _config(Path(tmp) / "state", model, engine.path, args)
        result: dict[str, Any] = {
            "settings": {
                "stream_stall_timeout": args.stall,
                "keep_alive_timeout": args.deadline,
                "body_timeout": args.deadline,
                "shutdown_timeout": args.shutdown,
                "drain_timeout": drain_timeout(cfg),
            }
        }
        clients: list[trio.SocketStream] = []
        try:
            with trio.fail_after(600):
                async with (
                    open_served(cfg) as served,
                    httpx.AsyncClient(base_url=served.urls[0], timeout=120) as client,
                ):
                    warm = await client.post("/v1/chat/completions", json=ONE_TOKEN)
                    if warm.status_code != 200:
                        raise BenchError(f"warm-up: HTTP {warm.status_code}: {warm.text}")
                    result["stuck_reader"] = await _stuck(served, args.stall)
                    result["slowloris"] = await _slowloris(served.urls[0])
                # 3. and 4. on a host with the default client deadlines: the short ones
                # would close idle connections before they are all open, and the hostile
                # ones before the shutdown has to
                long = Config().server
                cfg.server.keep_alive_timeout = long.keep_alive_timeout
                cfg.server.body_timeout = long.body_timeout
                cfg.server.stream_stall_timeout = long.stream_stall_timeout
                async with open_served(cfg) as served:
                    async with httpx.AsyncClient(base_url=served.urls[0], timeout=120) as client:
                        result["idle"] = await _idle_cost(served, client, args.idle)
                    stuck = await _stuck_reader(served.urls[0])
                    clients.append(stuck)
                    await _wait_blocked(served)
                    for data in (SLOW_HEAD, HALF_BODY):
                        clients.append(await _connect(served.urls[0]))
                        await clients[-1].send_all(data)
                    t0 = trio.current_time()
                result["shutdown_s"] = trio.current_time() - t0
                result["reset_at_shutdown"] = served.front.statistics().reset_at_shutdown
        finally:
            for stream in clients:
                await stream.aclose()
    return result


def _table(r: dict[str, Any]) -> str:
    s = r["settings"]
    idle = r["idle"]
    rows = [
        f"stuck reader (stream_stall_timeout {s['stream_stall_timeout']:g}s), after its write "
        "blocked:",
        f"  slot free        {r['stuck_reader']['slot_free_s']:7.2f} s",
        f"  connection reset {r['stuck_reader']['connection_reset_s']:7.2f} s",
        f"slowloris (keep_alive_timeout = body_timeout = {s['keep_alive_timeout']:g}s):",
        f"  head without CRLF cut off {r['slowloris']['head_cut_s']:7.2f} s",
        f"  half a body cut off       {r['slowloris']['half_body_cut_s']:7.2f} s",
        f"shutdown with a stuck reader, a slow head and half a body connected (their own "
        f"deadlines the defaults; shutdown_timeout {s['shutdown_timeout']:g}s, drain "
        f"{s['drain_timeout']:g}s): {r['shutdown_s']:.2f} s to engines stopped, "
        f"{r['reset_at_shutdown']} connections reset",
        f"latency with {idle['idle_connections']} idle connections ({idle['held_during']} held):",
        "                  alone median/p99     with idle median/p99   ratio",
    ]
    for name in ("health", "chat"):
        a, b = idle["alone"], idle["with_idle"]
        rows.append(
            f"  {name:<8} {a[f'{name}_median_ms']:9.2f} /{a[f'{name}_p99_ms']:7.2f} ms"
            f"   {b[f'{name}_median_ms']:9.2f} /{b[f'{name}_p99_ms']:7.2f} ms"
            f"   x{idle[f'{name}_ratio']:.2f}"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--idle", type=int, default=500, help="idle connections (500)")
    ap.add_argument("--stall", type=float, default=3.0, help="stream_stall_timeout (3 s)")
    ap.add_argument("--deadline", type=float, default=2.0, help="keep-alive and body (2 s)")
    ap.add_argument("--shutdown", type=float, default=4.0, help="shutdown_timeout (4 s)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 100 idle, short timeouts")
    args = ap.parse_args()
    if args.quick:
        args.idle, args.stall, args.deadline, args.shutdown = 100, 1.5, 1.0, 3.0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 4 * args.idle + 256  # both ends of every connection live in this process
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    result = trio.run(_run, args)
    path = write_result("hostile_connections", result)
    print(_table(result))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
