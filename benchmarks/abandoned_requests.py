"""Of N requests whose client walks away, how many leave a trace: a request-log line, an
``/api/activity`` row and a ``gezel_requests_total`` sample (each should say 499).

    python -m benchmarks.abandoned_requests [--rounds 5]

A host in this process (real hypercorn, real llama-server, the generated ``tiny`` model
on one slot). Each round abandons four requests over raw sockets, left with a reset as a
killed client leaves: a non-streamed request while it is queued (another request holds
the slot), a stream while it is queued (past the keep-alive interval, so its 200 head
went out), a non-streamed request while it generates, and a stream read for a few
events, then dropped. Prints the counts and writes
benchmarks/results/abandoned_requests.json. Aim: every count equals N.
"""

from __future__ import annotations

import argparse
import logging
import re
import tempfile
from pathlib import Path
from typing import Any

import httpx
import trio

from benchmarks._raw_client import post_json, reset
from gezel_trio.config.schema import Config, ModelConfig, validate
from gezel_trio.engine.demo_model import write_demo_model
from gezel_trio.host import Host
from gezel_trio.server import open_served

from ._harness import RESULTS, write_result

CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "max_tokens": 3000,
    "ignore_eos": True,
}
KINDS = ("queued", "queued_stream", "generating", "streamed")


class _Lines(logging.Handler):
    """The request-log lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "fields", None)
        if record.getMessage() == "request" and fields:
            self.lines.append(fields)


async def _until(predicate: Any, within: float, what: str) -> None:
    """Poll ``predicate`` until true; fails (naming ``what``) after ``within`` seconds."""
    deadline = trio.current_time() + within
    while True:
        if await predicate():
            return
        if trio.current_time() > deadline:
            raise RuntimeError(f"{what}: not within {within}s")
        await trio.sleep(0.02)


async def _read_until(stream: trio.SocketStream, marker: bytes, count: int = 1) -> None:
    seen = b""
    while seen.count(marker) < count:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise RuntimeError(f"closed before {marker!r}")
        seen += chunk


async def _traces(client: httpx.AsyncClient, lines: _Lines) -> tuple[int, int, int]:
    """Request-log lines, activity rows and ``gezel_requests_total`` samples so far (any
    status: every request after the warm-up is an abandoned one)."""
    feed = (await client.get("/api/activity")).json()
    text = (await client.get("/metrics")).text
    found = re.findall(r'^gezel_requests_total\{model="tiny",status="\d+"\} (\S+)$', text, re.M)
    return len(lines.lines), len(feed["requests"]), int(sum(float(v) for v in found))


async def _round(host: Host, client: httpx.AsyncClient, url: str) -> None:
    """Abandon one request of each kind; returns once nothing is held."""
    scheduler = host.scheduler
    assert scheduler is not None

    async def queued(n: int) -> bool:
        return scheduler.statistics().queued == n

    async def running() -> bool:
        return sum(scheduler.statistics().running.values()) == 1

    async def idle() -> bool:
        stats = scheduler.statistics()
        return stats.queued == 0 and sum(stats.running.values()) == 0

    holder = await post_json(url, {**CHAT, "stream": True})  # holds the one slot
    await _read_until(holder, b"data: ")
    waiting = await post_json(url, CHAT)
    await _until(lambda: queued(1), 10, "queued")
    await reset(waiting)  # queued, non-streamed
    await _until(lambda: queued(0), 10, "left the queue")
    waiting = await post_json(url, {**CHAT, "stream": True})
    await _read_until(waiting, b": waiting for a slot")
    await reset(waiting)  # queued, streamed, its head out
    await _until(lambda: queued(0), 10, "left the queue")
    await reset(holder)  # streamed, read, then dropped
    await _until(idle, 10, "idle")
    base = host.models["tiny"].engine.base_url

    async def decoding() -> bool:  # the engine has generated a few tokens
        slots = (await client.get(f"{base}/slots")).json()
        return any(s["is_processing"] and s["next_token"][0]["n_decoded"] >= 3 for s in slots)

    generating = await post_json(url, CHAT)
    await _until(running, 10, "granted")
    await _until(decoding, 10, "generating")
    await reset(generating)  # non-streamed, generating
    await _until(idle, 10, "idle")


async def main(rounds: int) -> dict[str, Any]:
    lines = _Lines()
    logging.getLogger("gezel_trio.requests").addHandler(lines)
    logging.getLogger("gezel_trio.requests").setLevel(logging.INFO)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_demo_model(Path(tmp) / "tiny.gguf", size="tiny")
        cfg = Config()
        cfg.server.port = 0
        cfg.server.sse_keepalive_interval = 0.1
        cfg.engine.state_dir = str(Path(tmp) / "state")
        cfg.models = [ModelConfig(id="tiny", path=str(model), parallel=1, ctx_per_slot=4096)]
        validate(cfg)
        async with open_served(cfg) as served:
            url = served.urls[0]
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                warm = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
                warm.raise_for_status()
                before = await _traces(client, lines)
                for _ in range(rounds):
                    await _round(served.host, client, url)
                after = await _traces(client, lines)
    abandoned = rounds * len(KINDS)
    logged, rows, samples = (a - b for a, b in zip(after, before, strict=True))
    new = lines.lines[before[0] :]
    return {
        "abandoned": abandoned,
        "kinds": list(KINDS),
        "log_lines": logged,
        "activity_rows": rows,
        "metric_samples": samples,
        "statuses": sorted(f["status"] for f in new),
        "lines_with_a_slot": sum(1 for f in new if f.get("slot") is not None),
        "tokens_logged": [f.get("completion_tokens") for f in new],
    }


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5, help="requests of each kind (default 5)")
    args = parser.parse_args()
    result = trio.run(main, args.rounds)
    n = result["abandoned"]
    print(f"abandoned requests: {n} ({args.rounds} of each: {', '.join(KINDS)})")
    for key in ("log_lines", "activity_rows", "metric_samples"):
        print(f"  {key.replace('_', ' ')}: {result[key]} of {n}")
    statuses = result["statuses"]
    others = [s for s in statuses if s != 499]
    print(f"  of the lines, status 499: {statuses.count(499)}; other statuses: {others}")
    print(f"  lines naming the slot held: {result['lines_with_a_slot']}")
    write_result("abandoned_requests", result)
    print(f"wrote {RESULTS / 'abandoned_requests.json'}")


if __name__ == "__main__":
    cli()
