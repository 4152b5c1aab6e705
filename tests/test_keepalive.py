"""A streaming request that waits gets SSE keep-alive comments; every answer says how long
it waited (``X-Gezel-Queue-Wait-Ms``, or a comment once a waiting stream's head is out)."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import trio

from gezel_trio.config.schema import Config, ModelConfig
from gezel_trio.engine.binary import EngineBinary

from .conftest import make_config, running

LONG = {
    "model": "tiny",
    "prompt": "Once upon a time",
    "max_tokens": 400,
    "ignore_eos": True,
    "temperature": 0,
}


def _one_slot(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, **sections: dict[str, object]
) -> Config:
    """The tiny model on one slot: a second request has to wait for the first."""
    return make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=1, ctx_per_slot=1024)],
        state_dir=state_dir,
        engine_binary=engine_binary,
        **sections,
    )


async def test_a_queued_stream_gets_keepalives_then_its_answer(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    cfg = _one_slot(tiny_model, state_dir, engine_binary, server={"sse_keepalive_interval": 0.2})
    with trio.fail_after(120):
        async with running(cfg) as (_host, client):
            r = await client.post("/v1/completions", json={**LONG, "max_tokens": 2})
            assert r.status_code == 200
            assert float(r.headers["X-Gezel-Queue-Wait-Ms"]) >= 0  # a unary answer's header
            lines: list[tuple[float, str]] = []
            hold_started = trio.Event()

            async def hold_the_slot() -> None:
                # one line read, then nothing for 1.5 s: the relay's channel fills and
                # the job keeps its slot (well within the stall timeout), then it leaves
                async with client.stream(
                    "POST", "/v1/completions", json={**LONG, "max_tokens": 900, "stream": True}
                ) as resp:
                    async for _ in resp.aiter_lines():
                        hold_started.set()
                        await trio.sleep(1.5)
                        return

            async with trio.open_nursery() as nursery:
                nursery.start_soon(hold_the_slot)
                await hold_started.wait()
                t0 = time.monotonic()
                body = {**LONG, "max_tokens": 4, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    assert "X-Gezel-Queue-Wait-Ms" not in resp.headers  # the head left early
                    async for line in resp.aiter_lines():
                        if line:
                            lines.append((time.monotonic() - t0, line))
            comments = [(t, line) for t, line in lines if line.startswith(":")]
            waiting = [t for t, line in comments if line == ": waiting for a slot"]
            assert len(waiting) >= 3, lines  # the other stream held the slot for a while
            assert all(b - a < 1.0 for a, b in itertools.pairwise(waiting))
            wait_ms = [line for _, line in comments if line.startswith(": queue_wait_ms=")]
            assert len(wait_ms) == 1 and float(wait_ms[0].split("=")[1]) > 400
            data = [line for _, line in lines if line.startswith("data:")]
            assert data[-1] == "data: [DONE]" and len(data) >= 2
            assert '"text"' in data[0]


async def test_an_answer_that_comes_at_once_has_the_header_and_no_comment(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    cfg = _one_slot(tiny_model, state_dir, engine_binary)
    with trio.fail_after(120):
        async with running(cfg) as (_host, client):
            await client.post("/v1/completions", json={**LONG, "max_tokens": 1})  # loaded
            body: dict[str, Any] = {**LONG, "max_tokens": 4, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                assert float(resp.headers["X-Gezel-Queue-Wait-Ms"]) < 5000
                lines = [line async for line in resp.aiter_lines() if line]
            assert not any(line.startswith(":") for line in lines)
            assert lines[-1] == "data: [DONE]"
