"""Every request leaves a trace: one request-log line, one ``/api/activity`` row and one
``gezel_requests_total`` sample, also when its client leaves (status 499, with the slot
it held and the tokens generated before it stopped); the time to first token is the
engine's, never a keep-alive comment; a KV save that fails says why, and a cancelled one
is no failure and leaves no file. Real hypercorn, real llama-server, the tiny model; raw
sockets for the clients that leave (a reset, as a killed client leaves)."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from benchmarks._raw_client import post_json, reset
from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.assemble import Shape
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.usage import tail_counts
from gezel_trio.errors import EngineFailed
from gezel_trio.host import Host
from gezel_trio.host.completion import Progress

from .conftest import make_config, running
from .fault_tools import slots_busy, wait_nothing_held, wait_until

CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "temperature": 0,
    "max_tokens": 4000,
    "ignore_eos": True,
}
RELEASE = re.compile(rb"release: id +(\d+) \| task \d+ \| stop processing: n_tokens = (\d+)")


def _cfg(tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, **server: Any) -> Any:
    return make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=1, ctx_per_slot=4096)],
        state_dir=state_dir,
        engine_binary=engine_binary,
        server=server,
    )


def _lines(caplog: pytest.LogCaptureFixture, status: int | None = None) -> list[dict[str, Any]]:
    return [
        r.fields  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "gezel_trio.requests"
        and r.getMessage() == "request"
        and (status is None or r.fields["status"] == status)  # type: ignore[attr-defined]
    ]


async def _rows(client: httpx.AsyncClient, status: int) -> int:
    feed = (await client.get("/api/activity")).json()
    return sum(1 for r in feed["requests"] if r["status"] == status)


async def _samples(client: httpx.AsyncClient, status: int) -> float:
    text = (await client.get("/metrics")).text
    series = f'gezel_requests_total{{model="tiny",status="{status}"}} '
    found = re.search("^" + re.escape(series) + r"(\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


class Traces:
    """The three traces of status 499 so far: log lines, activity rows, metric samples."""

    def __init__(self, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture) -> None:
        self.client = client
        self.caplog = caplog

    async def now(self) -> tuple[int, int, float]:
        return (
            len(_lines(self.caplog, 499)),
            await _rows(self.client, 499),
            await _samples(self.client, 499),
        )

    async def one_more(self, before: tuple[int, int, float], host: Host) -> dict[str, Any]:
        """Wait for the next 499 line; once nothing is held any more, exactly one line, one
        row and one sample have been added. Returns the line."""
        n = before[0]
        await wait_until(lambda: len(_lines(self.caplog, 499)) > n, within=15, what="a 499 line")
        await wait_nothing_held(host, within=10)
        after = await self.now()
        assert after == (before[0] + 1, before[1] + 1, before[2] + 1), (before, after)
        return _lines(self.caplog, 499)[-1]


def _engine_generated(host: Host, prompt_tokens: int) -> int:
    """The tokens the engine generated for its last task, from its own log line at the
    slot's release (``n_tokens``: what the slot holds, prompt and generated)."""
    text = "\n".join(host.models["tiny"].engine.log.tail(400)).encode()
    releases = RELEASE.findall(text)
    assert releases, "the engine logged no slot release"
    return int(releases[-1][1]) - prompt_tokens


async def test_every_abandoned_request_leaves_one_trace_with_its_slot_and_tokens(
    tiny_model: Path,
    state_dir: Path,
    engine_binary: EngineBinary,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gezel_trio.requests")
    cfg = _cfg(tiny_model, state_dir, engine_binary)
    with trio.fail_after(180):
        async with running(cfg) as (host, client):
            url = str(client.base_url).rstrip("/")
            warm = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
            assert warm.status_code == 200
            prompt_tokens = warm.json()["usage"]["prompt_tokens"]
            base_url = host.models["tiny"].engine.base_url
            assert base_url is not None
            traces = Traces(client, caplog)

            # 1. A stream read, then dropped.
            before = await traces.now()
            stream = await post_json(url, {**CHAT, "stream": True})
            seen = b""
            try:
                while seen.count(b'"content":"') < 5:
                    chunk = await stream.receive_some(65536)
                    assert chunk, seen[:300]
                    seen += chunk
            finally:
                await reset(stream)
            line = await traces.one_more(before, host)
            generated = _engine_generated(host, prompt_tokens)
            assert line["path"] == "/v1/chat/completions" and line["slot"] == 0
            assert seen.count(b'"content":"') <= line["completion_tokens"] <= generated + 1
            assert line["duration_ms"] > 0

            # 2. A request abandoned while queued: the one slot generates for another.
            async def generating() -> bool:
                return await slots_busy(base_url) == [0]

            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: client.post("/v1/chat/completions", json=CHAT))

                await wait_until(generating, within=10, what="the engine generating")
                before = await traces.now()
                queued = await post_json(url, CHAT)
                try:
                    await wait_until(
                        lambda: (
                            host.scheduler is not None and host.scheduler.statistics().queued == 1
                        ),
                        within=10,
                        what="the second request queued",
                    )
                finally:
                    await reset(queued)
                n = before[0]
                await wait_until(lambda: len(_lines(caplog, 499)) > n, within=10, what="a 499")
                line = _lines(caplog, 499)[-1]
                assert line["slot"] is None and line["completion_tokens"] == 0
                assert line["ttft_ms"] is None
                assert (await traces.now()) == (before[0] + 1, before[1] + 1, before[2] + 1)

                # 3. A non-streamed request abandoned while generating (the one above).
                before = await traces.now()
                nursery.cancel_scope.cancel()
            line = await traces.one_more(before, host)
            generated = _engine_generated(host, prompt_tokens)
            assert line["slot"] == 0 and line["ttft_ms"] is not None
            assert 1 <= line["completion_tokens"] <= generated + 1

            # 4. The same through Quart (Ollama's route): its front records it too.
            before = await traces.now()
            ollama = {
                "model": "tiny",
                "messages": CHAT["messages"],
                "stream": False,
                "options": {"num_predict": 4000, "temperature": 0},
            }
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: client.post("/api/chat", json=ollama))
                await wait_until(generating, within=10, what="the engine generating")
                nursery.cancel_scope.cancel()
            line = await traces.one_more(before, host)
            assert line["path"] == "/api/chat" and line["slot"] == 0

            # Each left its own row: none was recorded as answered (200) on top.
            assert len(_lines(caplog, 200)) == 1  # the warm-up only


async def test_first_token_time_is_the_engines_not_a_keepalive(
    tiny_model: Path,
    state_dir: Path,
    engine_binary: EngineBinary,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stream whose prefill outlasts the keep-alive interval gets a keep-alive comment
    first; its logged time to first token is still at least the prefill the engine
    reports (``timings.prompt_ms``), measured on the same request."""
    caplog.set_level(logging.INFO, logger="gezel_trio.requests")
    cfg = _cfg(tiny_model, state_dir, engine_binary, sse_keepalive_interval=0.01)
    long_prompt = " ".join(f"word{i}" for i in range(600))
    body = {
        **CHAT,
        "messages": [{"role": "user", "content": long_prompt}],
        "max_tokens": 4,
        "stream": True,
        "cache_prompt": False,
    }
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            lines: list[str] = []
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                assert resp.status_code == 200
                async for text in resp.aiter_lines():
                    if text:
                        lines.append(text)
            first_data = next(i for i, text in enumerate(lines) if text.startswith("data:"))
            assert any(text.startswith(":") for text in lines[:first_data]), lines[:3]
            timings = [
                json.loads(text[5:])["timings"]
                for text in lines
                if text.startswith("data: {") and '"timings"' in text
            ]
            assert timings, [t for t in lines if not t.startswith(":")]
            prompt_ms = timings[-1]["prompt_ms"]
            await wait_nothing_held(host, within=10)
            (line,) = _lines(caplog, 200)
            assert line["ttft_ms"] >= prompt_ms, (line, prompt_ms)
            assert line["completion_tokens"] == 4


async def test_a_failed_kv_save_says_why_and_a_cancelled_one_is_no_failure(
    tiny_model: Path,
    state_dir: Path,
    engine_binary: EngineBinary,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="gezel_trio.host.runtime")
    cfg = _cfg(tiny_model, state_dir, engine_binary)
    # no save of the host's own after a request (it would fail too, in the second part)
    cfg.scheduler.save_idle_delay = math.inf
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
            assert r.status_code == 200
            await wait_nothing_held(host, within=10)
            rt = host.models["tiny"]
            stats = rt.kv_stats

            # Cut short: a cancellation while the engine saves (frozen, so that the save
            # cannot end first on a fast CPU).
            pid = rt.engine.pid
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            try:
                with trio.CancelScope() as scope:
                    scope.deadline = trio.current_time() + 0.2
                    await rt.park_slot(0, "trace-session")
            finally:
                os.kill(pid, signal.SIGCONT)
            assert scope.cancelled_caught
            assert stats.save_cancelled == 1 and stats.save_failures == 0
            assert any("cancelled: not a failure" in r.getMessage() for r in caplog.records)
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

            # Resumed, the engine runs the save it was sent: its file, which nothing
            # indexes, is deleted by the next save's sweep.
            save_dir = trio.Path(rt.engine.argv[rt.engine.argv.index("--slot-save-path") + 1])
            kv = host.kv
            assert kv is not None

            async def stray() -> set[str]:
                indexed = {e.file for e in kv.sessions()}
                return {p.name for p in await save_dir.iterdir()} - indexed

            async def written() -> bool:
                return bool(await stray())

            await wait_until(written, within=30, what="the cut save's file")
            assert await rt.park_slot(0, "trace-session", within=30) > 0
            assert stats.saves == 1 and await stray() == set()

            # A failure: the engine cannot write its file (its save directory is gone).
            gone = save_dir.with_name(save_dir.name + ".gone")
            await save_dir.rename(gone)
            with pytest.raises(EngineFailed):
                await rt.park_slot(0, "trace-session", within=30)
            assert stats.save_failures == 1 and stats.save_cancelled == 1
            (warning,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert "KV save of tiny slot 0 failed: " in warning.getMessage()
            assert len(warning.getMessage()) > len("KV save of tiny slot 0 failed: ") + 5
            await gone.rename(save_dir)


async def test_tokens_in_a_stream_are_counted_as_the_engine_counts_them(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """What a cut request's line says it generated is read from the engine's stream as it
    passes (:func:`generated_in`): on every engine route the host streams, the count over
    a whole stream is the engine's own ``completion_tokens`` / ``predicted_n``."""
    cfg = _cfg(tiny_model, state_dir, engine_binary)
    cases: list[tuple[Shape, str, dict[str, Any]]] = [
        ("chat", "/v1/chat/completions", {"messages": CHAT["messages"], "max_tokens": 12}),
        ("text", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 12}),
        ("native", "/completion", {"prompt": "Once upon a time", "n_predict": 12}),
        ("responses", "/v1/responses", {"input": "Once upon a time", "max_output_tokens": 12}),
    ]
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            warm = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
            assert warm.status_code == 200  # the engine runs
            base_url = host.models["tiny"].engine.base_url
            assert base_url is not None
            # a new connection each time: llama-server closes one after a streamed answer,
            # and a pooled one can be reused before its close is seen
            fresh = httpx.Limits(max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=fresh) as engine:
                for shape, path, body in cases:
                    progress = Progress()
                    raw = b""
                    wire = {**body, "stream": True, "ignore_eos": True, "temperature": 0}
                    async with engine.stream("POST", path, json=wire) as resp:
                        assert resp.status_code == 200, path
                        async for chunk in resp.aiter_raw():
                            progress.add(chunk, shape)
                            raw += chunk
                    assert progress.tokens == tail_counts(raw)[2] == 12, (path, progress)
                    assert progress.first_token_at is not None
