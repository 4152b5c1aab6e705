"""What one streamed 1-token completion costs the client that sends it to llama-server,
by the way it is sent: the CPU the host spends on the upstream half of a request.

    python -m benchmarks.transport_cost [--requests 800] [--rounds 2]

Four clients, in one trio process, take turns (order rotated each round) sending the
same streamed chat completion (``max_tokens`` 1) to one llama-server, each on a new
connection (llama-server closes it after a streamed answer):

- ``httpx.AsyncClient``: the plain client;
- ``httpx pool``: httpx's transport (httpcore's pool) driven directly, as the host did;
- ``EngineTransport``: the host's transport now (``gezel_trio/engine/transport.py``);
- ``h11 + socket``: h11 over a bare trio socket, no httpx at all: the floor.

Prints, for each, the wall time and the client's CPU time per request (the process's
user + system time over the round), and writes benchmarks/results/transport_cost.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Awaitable, Callable
from typing import Any

import h11
import httpx
import trio

from gezel_trio.engine.transport import EngineTransport

from ._harness import llama_server_process, median, write_result

PATH = "/v1/chat/completions"
BODY = {
    "messages": [{"role": "user", "content": "The quick brown fox"}],
    "max_tokens": 1,
    "temperature": 0,
    "stream": True,
}
TIMEOUT = httpx.Timeout(connect=10.0, read=60.0, write=60.0, pool=None).as_dict()


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _via_client(client: httpx.AsyncClient, url: str) -> None:
    async with client.stream("POST", url, json=BODY) as resp:
        async for _ in resp.aiter_raw():
            pass


async def _via_transport(transport: httpx.AsyncBaseTransport, url: str) -> None:
    headers = {"Connection": "close"}
    request = httpx.Request(
        "POST", url, json=BODY, headers=headers, extensions={"timeout": TIMEOUT}
    )
    resp = await transport.handle_async_request(request)
    try:
        async for _ in resp.aiter_raw():
            pass
    finally:
        await resp.aclose()


async def _via_h11(port: int) -> None:
    raw = json.dumps(BODY).encode()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        head = h11.Request(
            method="POST",
            target=PATH,
            headers=[
                ("host", f"127.0.0.1:{port}"),
                ("content-type", "application/json"),
                ("content-length", str(len(raw))),
                ("connection", "close"),
            ],
        )
        out = conn.send(head) + conn.send(h11.Data(data=raw)) + conn.send(h11.EndOfMessage())
        await stream.send_all(out)
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return


async def _measure(port: int, requests: int, rounds: int) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}{PATH}"
    no_keepalive = httpx.Limits(max_keepalive_connections=0)
    async with (
        httpx.AsyncClient(limits=no_keepalive, timeout=60) as client,
        httpx.AsyncHTTPTransport(limits=no_keepalive) as pool,
        EngineTransport(httpx.AsyncHTTPTransport()) as lean,
    ):
        ways: dict[str, Callable[[], Awaitable[None]]] = {
            "httpx.AsyncClient": lambda: _via_client(client, url),
            "httpx pool": lambda: _via_transport(pool, url),
            "EngineTransport": lambda: _via_transport(lean, url),
            "h11 + socket": lambda: _via_h11(port),
        }
        for send in ways.values():  # warm
            for _ in range(30):
                await send()
        walls: dict[str, list[float]] = {name: [] for name in ways}
        cpus: dict[str, list[float]] = {name: [] for name in ways}
        names = list(ways)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                c0, t0 = _cpu(), time.perf_counter()
                for _ in range(requests):
                    await ways[name]()
                walls[name].append((time.perf_counter() - t0) / requests * 1000)
                cpus[name].append((_cpu() - c0) / requests * 1000)
    return {
        name: {"wall_ms": median(walls[name]), "client_cpu_ms": median(cpus[name])} for name in ways
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with llama_server_process(parallel=8, ctx_size=4096) as (port, binary):
        figures = trio.run(_measure, port, args.requests, args.rounds)
    print(f"streamed 1-token chat, new connection each, {args.requests} x {args.rounds} rounds")
    print(f"{'client':20s} {'wall ms':>8s} {'client CPU ms':>14s}")
    for name, f in figures.items():
        print(f"{name:20s} {f['wall_ms']:8.2f} {f['client_cpu_ms']:14.3f}")
    setup = {"binary": str(binary), "requests": args.requests, "rounds": args.rounds}
    path = write_result("transport_cost", {"setup": setup, "clients": figures})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
