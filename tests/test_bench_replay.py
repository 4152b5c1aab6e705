"""Replay: stream parsing, progress, closed/open loop timing, and smoke replays.

Timing semantics run in virtual time (``autojump_clock``) against an in-process fake
engine behind an ``httpx`` transport. Streaming over real sockets runs against the same
fake engine served by hypercorn on port 0, and against a real ``llama-server`` with the
tiny demo model where that binary runs on this machine.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tomllib
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve as hyper_serve
from quart import Response, request
from quart_trio import QuartTrio

from gezel_bench.cli import add_bench_arguments, bench, run_bench
from gezel_bench.cli import main as bench_main
from gezel_bench.errors import BenchError
from gezel_bench.metrics import summarize
from gezel_bench.replay import (
    TIE_GAP,
    Progress,
    ReplayConfig,
    StreamParser,
    run_replay,
    session_keys,
    tie_order,
)
from gezel_bench.synth import PromptSynthesizer
from gezel_bench.targets import (
    EngineCommand,
    LaunchSettings,
    direct_argv,
    gezel_config_toml,
    open_target,
    resolve_llama_server,
    router_argv,
)
from gezel_bench.traces import Session, Trace, Turn, load_trace, save_trace
from gezel_trio.engine.demo_model import FIM_TOKEN_IDS

DEMO_VOCAB = max(FIM_TOKEN_IDS.values()) + 1
"""The demo model's vocabulary: its FIM tokens come last."""

# --------------------------------------------------------------------- a fake engine


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class _Slot:
    id: int
    tokens: list[int] = field(default_factory=list)
    owner: str | None = None
    busy: bool = False
    last_used: int = 0


class FakeEngine:
    """A llama-server stand-in with per-slot prompt caches and streamed tokens.

    ``isolate=False`` picks the free slot with the longest common prefix (llama.cpp's
    behaviour, so sessions can reuse each other's tokens); ``isolate=True`` keeps a
    slot per session and erases it when another session takes it over (what gezel
    does). Prefill costs ``prefill`` seconds per uncached token, decode ``decode`` per
    output token. ``bos=True`` counts one token more than it was sent.
    """

    def __init__(
        self,
        *,
        slots: int = 2,
        n_vocab: int = 676,
        n_ctx: int = 4096,
        isolate: bool = False,
        prefill: float = 0.0,
        decode: float = 0.0,
        bos: bool = False,
        fail_session: str | None = None,
    ) -> None:
        self.slots = [_Slot(i) for i in range(slots)]
        self.n_vocab = n_vocab
        self.n_ctx = n_ctx
        self.isolate = isolate
        self.prefill = prefill
        self.decode = decode
        self.bos = bos
        self.fail_session = fail_session
        self.cond = trio.Condition()
        self.clock = 0
        self.received: list[tuple[str, list[int], dict[str, Any], dict[str, str]]] = []

    def models(self) -> dict[str, Any]:
        return {"data": [{"id": "fake", "meta": {"n_vocab": self.n_vocab, "n_ctx": self.n_ctx}}]}

    async def _acquire(self, prompt: list[int], session: str) -> _Slot:
        async with self.cond:
            while not any(not s.busy for s in self.slots):
                await self.cond.wait()
            free = [s for s in self.slots if not s.busy]
            if self.isolate:
                own = [s for s in free if s.owner == session]
                slot = own[0] if own else min(free, key=lambda s: s.last_used)
                if slot.owner != session:
                    slot.tokens, slot.owner = [], session
            else:
                slot = max(free, key=lambda s: (_lcp(prompt, s.tokens), -s.last_used))
            slot.busy = True
            return slot

    async def _release(self, slot: _Slot) -> None:
        async with self.cond:
            self.clock += 1
            slot.busy, slot.last_used = False, self.clock
            self.cond.notify_all()

    async def stream(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> AsyncIterator[bytes]:
        api = "llama" if path == "/completion" else "openai"
        prompt = [int(x) for x in body["prompt"]]
        n_out = int(body["n_predict"] if api == "llama" else body["max_tokens"])
        session = str(body.get("prompt_cache_key", ""))
        self.received.append((session, prompt, body, {k.lower(): v for k, v in headers.items()}))
        if session == self.fail_session:
            yield b'data: {"error": {"code": 500, "message": "boom"}}\n\n'
            return
        slot = await self._acquire(prompt, session)
        try:
            cached = max(0, min(_lcp(prompt, slot.tokens), len(prompt) - 1))
            await trio.sleep(self.prefill * (len(prompt) - cached))
            slot.tokens = list(prompt)
            n_prompt = len(prompt) + (1 if self.bos else 0)
            for k in range(n_out):
                if k:
                    await trio.sleep(self.decode)
                tok = 300 + (len(prompt) * 7 + k * 13) % (self.n_vocab - 300)
                slot.tokens.append(tok)
                if api == "llama":
                    chunk: dict[str, Any] = {
                        "content": "x",
                        "tokens": [tok],
                        "stop": False,
                        "tokens_evaluated": n_prompt,
                    }
                else:
                    chunk = {"choices": [{"text": "x", "index": 0, "finish_reason": None}]}
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            timings = {"cache_n": cached, "prompt_n": n_prompt - cached, "predicted_n": n_out}
            if api == "llama":
                final: dict[str, Any] = {
                    "content": "",
                    "tokens": [],
                    "stop": True,
                    "tokens_predicted": n_out,
                    "tokens_evaluated": n_prompt,
                    "timings": timings,
                }
            else:
                final = {
                    "choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                    "usage": {
                        "prompt_tokens": n_prompt,
                        "completion_tokens": n_out,
                        "prompt_tokens_details": {"cached_tokens": cached},
                    },
                }
            yield b"data: " + json.dumps(final).encode() + b"\n\n"
            if api == "openai":
                yield b"data: [DONE]\n\n"
        finally:
            with trio.CancelScope(shield=True):
                await self._release(slot)


class _Body(httpx.AsyncByteStream):
    def __init__(self, agen: AsyncIterator[bytes]) -> None:
        self._agen = agen

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._agen:
            yield chunk

    async def aclose(self) -> None:
        await self._agen.aclose()  # type: ignore[attr-defined]


class FakeTransport(httpx.AsyncBaseTransport):
    """The fake engine in-process: no sockets, so virtual time works."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    async def handle_async_request(self, req: httpx.Request) -> httpx.Response:
        if req.method == "GET" and req.url.path == "/v1/models":
            return httpx.Response(200, json=self.engine.models())
        body = json.loads(await req.aread())
        gen = self.engine.stream(req.url.path, body, dict(req.headers))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Body(gen))


def fake_client(engine: FakeEngine) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url="http://fake", transport=FakeTransport(engine))


def fake_app(engine: FakeEngine) -> QuartTrio:
    app = QuartTrio("fake-llama")

    @app.get("/health")
    async def health() -> Any:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> Any:
        return engine.models()

    async def complete() -> Any:
        body = await request.get_json()
        gen = engine.stream(request.path, body, dict(request.headers))
        return Response(gen, mimetype="text/event-stream")

    app.add_url_rule("/completion", "completion", complete, methods=["POST"])
    app.add_url_rule("/v1/completions", "v1_completions", complete, methods=["POST"])
    return app


@asynccontextmanager
async def serve_fake(engine: FakeEngine) -> AsyncIterator[str]:
    """Serve the fake engine with hypercorn on 127.0.0.1, port 0; yield its base URL."""
    config = HyperConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(hyper_serve, fake_app(engine), config, shutdown_trigger=trio.sleep_forever)
        )
        yield binds[0]
        nursery.cancel_scope.cancel()


# ------------------------------------------------------------------------ trace helpers


def _chat_trace(
    sessions: int = 3, turns: int = 3, *, block: int = 4, out: int = 3, gap: float = 1.0
) -> Trace:
    """Sessions whose turns grow a shared prefix: turn i has the blocks of turn i-1 plus
    two new ones and a 2-token tail; sessions share nothing."""
    out_sessions = []
    for k in range(sessions):
        sid = f"s{k}"
        blocks: list[int] = []
        ts = []
        for i in range(turns):
            blocks = [*blocks, 1000 * k + 2 * i, 1000 * k + 2 * i + 1]
            ts.append(
                Turn(sid, i, gap * i + 0.1 * k, 0.5, tuple(blocks), len(blocks) * block + 2, out)
            )
        out_sessions.append(Session(sid, tuple(ts)))
    return Trace(block, "unit", tuple(out_sessions), {"time_scale": 1.0})


def _config(**kw: Any) -> ReplayConfig:
    base: dict[str, Any] = {"base_url": "http://fake", "warmup": False}
    base.update(kw)
    return ReplayConfig(**base)


def _by_key(records: Iterable[Any]) -> dict[tuple[str, int], Any]:
    return {(r.session, r.turn): r for r in records}


# ---------------------------------------------------------------------- stream parser


def test_stream_parser_llama_chunks() -> None:
    p = StreamParser("llama")
    p.feed({"content": "", "tokens": [], "stop": False}, 0.5)  # no token yet
    p.feed({"content": "a", "tokens": [401], "stop": False, "tokens_evaluated": 9}, 1.0)
    p.feed({"content": "", "tokens": [402], "stop": False}, 1.5)  # a token with no text
    p.feed(
        {
            "content": "",
            "tokens": [],
            "stop": True,
            "tokens_predicted": 2,
            "tokens_evaluated": 9,
            "timings": {"cache_n": 4, "prompt_n": 5},
        },
        1.6,
    )
    assert p.token_times == [1.0, 1.5]
    assert p.output_ids == [401, 402] and p.ids_complete
    assert (p.prompt_tokens, p.cached_tokens, p.output_tokens) == (9, 4, 2)
    assert p.finished and p.error is None


def test_stream_parser_openai_chunks_and_errors() -> None:
    p = StreamParser("openai")
    p.feed({"choices": [{"text": "a", "finish_reason": None}]}, 1.0)
    p.feed({"choices": [{"text": "", "finish_reason": None}]}, 2.0)
    p.feed(
        {
            "choices": [{"text": "", "finish_reason": "length"}],
            "usage": {
                "prompt_tokens": 7,
                "completion_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 3},
            },
        },
        2.5,
    )
    p.feed({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}}, 2.6)
    assert p.token_times == [1.0, 2.0]
    assert (p.prompt_tokens, p.cached_tokens, p.output_tokens) == (7, 3, 2)
    assert not p.ids_complete and p.finished

    bad = StreamParser("openai")
    bad.feed({"error": {"code": 500, "message": "boom"}}, 1.0)
    assert bad.error == "stream error: boom"
    timings = StreamParser("openai")
    timings.feed({"choices": [], "timings": {"cache_n": 5}}, 1.0)
    assert timings.cached_tokens == 5


# --------------------------------------------------------------------------- progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_prints_tenths_off_a_terminal() -> None:
    now = [0.0]
    out = io.StringIO()
    p = Progress(total=20, label="direct", stream=out, clock=lambda: now[0])
    for i in range(20):
        now[0] += 0.5
        p.done += 1
        p.failed += 1 if i == 3 else 0
        p.update()
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 10  # one per tenth: 10%, 20%, ..., 100%
    assert lines[-1] == "[direct] 20/20 requests (100%), 1 failed, 0 in flight, 10.0s"


def test_progress_rewrites_one_line_on_a_terminal() -> None:
    now = [0.0]
    out = _Tty()
    p = Progress(total=3, stream=out, interval=1.0, clock=lambda: now[0])
    p.update()
    now[0] = 0.5
    p.done = 1
    p.update()  # throttled
    now[0] = 1.5
    p.update()
    p.close()
    text = out.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n")
    assert "1/3 requests (33%)" in text
    silent = Progress(total=1, stream=None)
    silent.update(force=True)
    silent.close()
    assert silent.lines_written == 0


# --------------------------------------------------------------- virtual-time replays


async def test_closed_loop_sends_after_response_plus_think(autojump_clock: Any) -> None:
    engine = FakeEngine(slots=4, isolate=True, prefill=0.01, decode=0.1)
    trace = _chat_trace(sessions=2, turns=3, out=3)
    async with fake_client(engine) as client:
        result = await run_replay(
            trace, _config(mode="closed", time_scale=2.0), client=client, progress_stream=None
        )
    recs = _by_key(result.records)
    for sid in ("s0", "s1"):
        first = recs[(sid, 0)]
        assert first.t_sent == pytest.approx(trace.session(sid).start * 2.0)
        for i in (1, 2):
            prev, cur = recs[(sid, i - 1)], recs[(sid, i)]
            # previous response end + think_time (0.5) * time_scale (2.0)
            assert cur.t_sent == pytest.approx(prev.t_sent + prev.e2el + 1.0)
    for r in result.records:
        assert r.cached_tokens is not None and r.ttft is not None
        uncached = r.prompt_tokens_sent - r.cached_tokens
        assert r.ttft == pytest.approx(0.01 * uncached)
        assert r.itl == pytest.approx([0.1, 0.1])
        assert r.e2el == pytest.approx(r.ttft + 0.2)


async def test_open_loop_keeps_the_trace_clock(autojump_clock: Any) -> None:
    engine = FakeEngine(slots=1, prefill=0.0, decode=2.0)  # each response takes 4 s
    trace = _chat_trace(sessions=1, turns=3, out=3, gap=1.0)
    async with fake_client(engine) as client:
        result = await run_replay(
            trace, _config(mode="open", time_scale=0.5), client=client, progress_stream=None
        )
    sent = [r.t_sent for r in result.records]
    assert sent == pytest.approx([0.0, 0.5, 1.0])  # t * time_scale, not after responses
    # one slot: the later two queue inside the engine, which shows as TTFT
    ttft = [r.ttft for r in result.records]
    assert ttft == pytest.approx([0.0, 3.5, 7.0])
    assert result.duration == pytest.approx(12.0)


def _burst_trace(sessions: int) -> Trace:
    """Sessions that all start at 0, two turns each, sharing nothing."""
    out = tuple(
        Session(
            f"s{k}",
            (
                Turn(f"s{k}", 0, 0.0, 0.0, (1000 * k,), 6, 2),
                Turn(f"s{k}", 1, 1.0, 0.1, (1000 * k, 1000 * k + 1), 10, 2),
            ),
        )
        for k in range(sessions)
    )
    return Trace(4, "unit", out, {"time_scale": 1.0})


def test_requests_due_together_follow_the_trace_order() -> None:
    trace = _burst_trace(3)
    # closed: the first turns of sessions that start together; later turns are not due
    # at a trace instant but after their own answers
    assert tie_order(trace, "closed") == {("s1", 0): ("s0", 0), ("s2", 0): ("s1", 0)}
    assert tie_order(trace, "open") == {
        ("s1", 0): ("s0", 0),
        ("s2", 0): ("s1", 0),
        ("s1", 1): ("s0", 1),
        ("s2", 1): ("s1", 1),
    }
    assert tie_order(_chat_trace(sessions=3), "closed") == {}  # staggered starts: no ties


async def test_a_burst_leaves_in_the_trace_order(autojump_clock: Any) -> None:
    engine = FakeEngine(slots=4)
    trace = _burst_trace(4)
    async with fake_client(engine) as client:
        result = await run_replay(
            trace, _config(mode="closed"), client=client, progress_stream=None
        )
    first = [r for r in result.records if r.turn == 0]
    assert [r.session for r in sorted(first, key=lambda r: r.t_sent or 0.0)] == [
        "s0",
        "s1",
        "s2",
        "s3",
    ]
    assert [r.t_sent for r in first] == pytest.approx([k * TIE_GAP for k in range(4)])
    assert all(r.t_scheduled == 0.0 for r in first)  # what the trace wanted


async def test_a_burst_reaches_a_real_server_in_the_trace_order() -> None:
    """Over hypercorn: Trio wakes the tasks of a burst in an order it reverses at random
    (about every other run), and each run must still arrive in the trace's order."""
    trace = _burst_trace(6)
    keys = session_keys(trace)
    expected = [keys[s.id] for s in trace.sessions]
    for _ in range(5):
        engine = FakeEngine(slots=6)
        with trio.fail_after(30):
            async with serve_fake(engine) as url:
                await run_replay(
                    trace,
                    ReplayConfig(base_url=url, api="llama", mode="closed", warmup=False),
                    progress_stream=None,
                )
        firsts = [key for key, prompt, _, _ in engine.received if len(prompt) <= 6]
        assert firsts == expected


async def test_concurrency_limit_holds_requests_back(autojump_clock: Any) -> None:
    engine = FakeEngine(slots=4, decode=1.0)
    sessions = tuple(Session(f"s{k}", (Turn(f"s{k}", 0, 0.0, 0.0, (k,), 6, 2),)) for k in range(3))
    trace = Trace(4, "unit", sessions, {})
    async with fake_client(engine) as client:
        result = await run_replay(
            trace, _config(mode="open", concurrency=1), client=client, progress_stream=None
        )
    assert sorted(r.t_sent or 0.0 for r in result.records) == pytest.approx([0.0, 1.0, 2.0])
    assert all(r.t_scheduled == 0.0 for r in result.records)


async def test_sub_agents_start_after_their_spawn_point_and_block_the_parent(
    autojump_clock: Any,
) -> None:
    engine = FakeEngine(slots=4, decode=1.0)
    parent = Session(
        "p",
        (
            Turn("p", 0, 0.0, 0.0, (1,), 4, 2),  # 1 s
            Turn("p", 1, 5.0, 0.5, (1, 2), 8, 2),
        ),
    )
    child = Session(
        "p/a",
        (Turn("p/a", 0, 2.0, 0.25, (9,), 4, 3), Turn("p/a", 1, 4.0, 0.0, (9, 8), 8, 2)),
        parent="p",
        spawn_after=1,
    )
    trace = Trace(4, "unit", (parent, child), {})
    async with fake_client(engine) as client:
        result = await run_replay(
            trace, _config(mode="closed"), client=client, progress_stream=None
        )
    recs = _by_key(result.records)
    assert recs[("p", 0)].t_sent == 0.0
    # the sub-agent spawns when p's turn 0 ends (1 s), then its own think time 0.25
    assert recs[("p/a", 0)].t_sent == pytest.approx(1.25)
    assert recs[("p/a", 1)].t_sent == pytest.approx(1.25 + 2.0)
    # p's turn 1 waits for the sub-agent to finish (3.25 + 1) and then thinks 0.5
    assert recs[("p", 1)].t_sent == pytest.approx(4.25 + 0.5)


async def test_replay_refuses_what_cannot_fit(autojump_clock: Any) -> None:
    engine = FakeEngine(n_ctx=10)
    async with fake_client(engine) as client:
        with pytest.raises(BenchError, match="slot holds 10"):
            await run_replay(_chat_trace(), _config(), client=client, progress_stream=None)
    async with fake_client(FakeEngine()) as client:
        with pytest.raises(BenchError, match="beyond the model's vocabulary"):
            await run_replay(
                _chat_trace(), _config(vocab_hi=5000), client=client, progress_stream=None
            )
    with pytest.raises(BenchError, match="no requests"):
        await run_replay(Trace(4, "x", (), {}), _config(), progress_stream=None)


async def test_failures_are_recorded_and_the_replay_goes_on(autojump_clock: Any) -> None:
    engine = FakeEngine(slots=2, fail_session="s1")
    trace = _chat_trace(sessions=2, turns=2)
    async with fake_client(engine) as client:
        result = await run_replay(trace, _config(), client=client, progress_stream=None)
    m = summarize(result.records, duration=result.duration)
    assert m["completed"] == 2 and m["failed"] == 2
    assert {r.error for r in result.records if r.session == "s1"} == {"stream error: boom"}


# ------------------------------------------------------------ smoke over real sockets


def _check_invariants(
    trace: Trace, result: Any, engine: FakeEngine | None, api: str
) -> dict[str, Any]:
    m = summarize(result.records, duration=result.duration)
    assert m["failed"] == 0, [r.error for r in result.records if r.error]
    assert m["completed"] == trace.n_requests == len(result.records)
    assert m["prompt_token_mismatch"] == 0
    assert m["output_token_mismatch"] == 0
    assert m["total_output_tokens"] == sum(t.output_tokens for t in trace.requests())
    assert m["total_input_tokens"] == sum(t.prompt_tokens for t in trace.requests())
    assert m["cross_session_reuse"] is not None and m["cache_hit_ratio"] is not None
    for r in result.records:
        assert r.prompt_tokens == r.prompt_tokens_sent
        assert len(r.itl) == r.output_tokens - 1
        assert r.cached_tokens is not None and 0 <= r.cached_tokens < r.prompt_tokens
    if engine is not None:
        synth = PromptSynthesizer.for_trace(trace, vocab_hi=engine.n_vocab, seed=0)
        sent = {(s, tuple(p)) for s, p, _, _ in engine.received}
        for turn in trace.requests():
            assert (turn.session, tuple(synth.prompt(turn))) in sent
        for session, _, body, headers in engine.received:
            assert headers.get("x-session-id") == session == body["prompt_cache_key"]
            assert body["stream"] is True and body["ignore_eos"] is True
            assert body["cache_prompt"] is True
    return m


@pytest.mark.parametrize("api", ["llama", "openai"])
async def test_smoke_replay_over_hypercorn(api: str) -> None:
    engine = FakeEngine(slots=3, isolate=True)
    trace = _chat_trace(sessions=3, turns=3)
    with trio.fail_after(30):
        async with serve_fake(engine) as url:
            result = await run_replay(
                trace,
                ReplayConfig(base_url=url, api=api, mode="closed", time_scale=0.01),  # type: ignore[arg-type]
                progress_stream=None,
            )
    m = _check_invariants(trace, result, engine, api)
    # a slot per session and no eviction: exactly what the session itself had
    for r in result.records:
        assert r.cached_tokens == r.self_reusable_tokens
    assert m["cross_session_reuse"] == 0
    assert m["cache_efficiency"] is not None and m["cache_efficiency"] >= 1.0
    assert len(engine.received) == trace.n_requests + 1  # + the warm-up


async def test_cross_session_reuse_is_detected() -> None:
    """Two sessions share a leading block (say, a system prompt). An engine that hands
    one session's slot to the other reuses it; one that erases on hand-over does not."""
    sessions = []
    for k in range(2):
        sid = f"s{k}"
        turns = (
            Turn(sid, 0, 0.0, 0.0, (7, 10 + k), 10, 2),
            Turn(sid, 1, 1.0, 0.0, (7, 10 + k, 20 + k), 14, 2),
        )
        sessions.append(Session(sid, turns))
    trace = Trace(4, "unit", tuple(sessions), {"time_scale": 0.001})
    got = {}
    for isolate in (False, True):
        engine = FakeEngine(slots=1, isolate=isolate)
        with trio.fail_after(30):
            async with serve_fake(engine) as url:
                result = await run_replay(
                    trace, ReplayConfig(base_url=url, mode="closed"), progress_stream=None
                )
        got[isolate] = _check_invariants(trace, result, engine, "llama")["cross_session_reuse"]
    assert got[False] > 0
    assert got[True] == 0


async def test_prompt_token_mismatch_is_counted() -> None:
    engine = FakeEngine(slots=2, bos=True)
    trace = _chat_trace(sessions=1, turns=2)
    with trio.fail_after(30):
        async with serve_fake(engine) as url:
            result = await run_replay(
                trace, ReplayConfig(base_url=url, time_scale=0.001), progress_stream=None
            )
    assert summarize(result.records, duration=1.0)["prompt_token_mismatch"] == 2


# ---------------------------------------------------------------------- CLI, report


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    return parser.parse_args(argv)


def _write_native(tmp_path: Path, trace: Trace) -> Path:
    return save_trace(trace, tmp_path / "trace.jsonl")


async def test_cli_replays_a_url_and_writes_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    engines = [FakeEngine(slots=2, isolate=True), FakeEngine(slots=2, isolate=False)]
    trace_path = _write_native(tmp_path, _chat_trace(sessions=2, turns=3, block=4))
    out = tmp_path / "out"
    with trio.fail_after(60):
        async with serve_fake(engines[0]) as url, serve_fake(engines[1]) as url2:
            argv = [
                "--trace",
                str(trace_path),
                "--tokens-per-block",
                "2",
                "--time-scale",
                "0.001",
                "--url",
                f"fake={url}",
                "--url",
                url2,
                "--compare",
                "--check",
                "--no-progress",
                "--out",
                str(out),
            ]
            code = await bench(_parse(argv), ["gezel-trio", "bench", *argv])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["format"] == "gezel-bench-report"
    assert report["trace"]["scaling"]["block_size"] == 2
    assert report["trace"]["scaling"]["token_ratio"] == 0.5
    assert report["trace"]["scaling"]["time_scale"] == 0.001
    assert report["command"][:3] == ["gezel-trio", "bench", "--trace"]
    names = [t["name"] for t in report["targets"]]
    assert names == ["fake", "url2"]
    for t in report["targets"]:
        assert t["status"] == "ok"
        assert t["metrics"]["completed"] == 6 and t["metrics"]["failed"] == 0
        assert t["metrics"]["cross_session_reuse"] == 0
        assert len(t["ttft_ms"]) == 6
        assert [r["turn"] for r in t["cache_hit_by_turn"]] == [0, 1, 2]
    assert set(report["compare"]["ratios"]) == {"fake", "url2"}
    assert report["compare"]["ratios"]["fake"]["median_ttft_ms"] == 1.0
    for png in ("ttft_cdf.png", "cache_hit_per_turn.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = (out / "requests-fake.jsonl").read_text().splitlines()
    assert len(lines) == 6 and json.loads(lines[0])["prompt_tokens_sent"] > 0
    assert load_trace(out / "trace.jsonl").block_size == 2
    md = (out / "report.md").read_text()
    assert "| fake | 6 | 0 |" in md and "token_ratio=0.5" in md
    printed = capsys.readouterr().out
    assert "ratios to fake" in printed and "| url2 | 6 | 0 |" in printed


async def test_cli_check_fails_on_broken_invariants(tmp_path: Path) -> None:
    engine = FakeEngine(slots=2, fail_session="s0")
    trace_path = _write_native(tmp_path, _chat_trace(sessions=2, turns=1))
    with trio.fail_after(60):
        async with serve_fake(engine) as url:
            argv = ["--trace", str(trace_path), "--url", url, "--check", "--no-plots"]
            argv += ["--no-progress", "--out", str(tmp_path / "o")]
            assert await bench(_parse(argv)) == 3


async def test_cli_import_only_saves_the_scaled_trace(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1000, "output_length": 50, "hash_ids": [0, 1]},
        {"timestamp": 500, "input_length": 1600, "output_length": 40, "hash_ids": [0, 1, 2, 3]},
        {"timestamp": 900, "input_length": 600, "output_length": 9, "hash_ids": [0, 7]},
    ]
    src = tmp_path / "mc.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    saved = tmp_path / "scaled.jsonl"
    argv = ["--trace", f"mooncake:{src}", "--tokens-per-block", "4", "--max-sessions", "1"]
    argv += ["--import-only", "--save-trace", str(saved)]
    assert await bench(_parse(argv)) == 0
    trace = load_trace(saved)
    assert trace.block_size == 4 and trace.scaling["source_block_size"] == 512
    assert [t.prompt_tokens for t in trace.requests()] == [8, 13]  # ceil(1000/128), ...
    assert trace.scaling["max_sessions"] == 1 and trace.scaling["min_shared_blocks"] == 2


def test_cli_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace_path = _write_native(tmp_path, _chat_trace(sessions=1, turns=1))
    assert run_bench(_parse(["--trace", str(trace_path)]), argv=[]) == 2
    assert "no targets" in capsys.readouterr().err
    args = _parse(["--trace", str(trace_path), "--targets", "direct"])
    assert run_bench(args, argv=[]) == 2
    assert "--model" in capsys.readouterr().err
    args = _parse(["--trace", str(trace_path), "--targets", "nginx"])
    assert run_bench(args, argv=[]) == 2
    assert "unknown target 'nginx'" in capsys.readouterr().err
    args = _parse(["--trace", str(trace_path), "--max-sessions", "0", "--url", "http://x"])
    assert run_bench(args, argv=[]) == 2
    with pytest.raises(SystemExit) as exc:
        bench_main(["--help"])
    assert exc.value.code == 0


def test_gezel_config_is_accepted_by_the_host_config(tmp_path: Path) -> None:
    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"GGUF")
    settings = LaunchSettings(model_path=model, parallel=3, ctx_per_slot=1024, workdir=tmp_path)
    engine = EngineCommand(Path("/opt/llama server/llama-server"), {})
    text = gezel_config_toml(
        settings=settings,
        engine=engine,
        port=8123,
        affinity=False,
        kv_parking=False,
    )
    data = tomllib.loads(text)
    assert data["server"] == {"host": "127.0.0.1", "port": 8123}
    assert data["engine"] == {
        "binary": "/opt/llama server/llama-server",
        "state_dir": str(tmp_path / "state-8123"),  # its own: nothing restored from before
    }
    assert data["models"] == [
        {"id": "tiny", "path": str(model), "parallel": 3, "ctx_per_slot": 1024, "args": []}
    ]
    assert data["scheduler"] == {"affinity": False, "kv_parking": False}
    assert "gpu" not in data
    from gezel_trio.config.schema import load_config, validate

    path = tmp_path / "g.toml"
    path.write_text(text)
    config = load_config(path)
    validate(config)
    assert config.server.port == 8123 and config.scheduler.affinity is False
    assert config.scheduler.kv_parking is False
    assert [(m.id, m.parallel, m.ctx_per_slot) for m in config.models] == [("tiny", 3, 1024)]


def test_two_models_swap_with_the_engine_args(tmp_path: Path) -> None:
    model = tmp_path / "small.gguf"
    model.write_bytes(b"GGUF")
    settings = LaunchSettings(
        model_path=model,
        workdir=tmp_path,
        models=2,
        engine_args=("--cache-ram", "48", "--threads", "2"),
    )
    engine = EngineCommand(Path("/bin/llama-server"), {})
    data = tomllib.loads(gezel_config_toml(settings=settings, engine=engine, port=1, affinity=True))
    assert data["gpu"] == {"policy": "swap"}
    assert [m["id"] for m in data["models"]] == ["small-a", "small-b"]
    # the host owns --cache-ram (it keeps llama-server's cross-session RAM cache off)
    assert all(m["args"] == ["--threads", "2"] for m in data["models"])
    assert direct_argv(engine, settings, 2)[-4:] == ["--cache-ram", "48", "--threads", "2"]
    assert router_argv(engine, settings, 3, tmp_path)[-4:] == [
        "--cache-ram",
        "48",
        "--threads",
        "2",
    ]


def test_launch_argv_keep_the_engine_defaults(tmp_path: Path) -> None:
    settings = LaunchSettings(
        model_path=tmp_path / "m.gguf", parallel=2, ctx_per_slot=512, workdir=tmp_path
    )
    engine = EngineCommand(Path("/bin/llama-server"), {})
    assert direct_argv(engine, settings, 9000) == [
        "/bin/llama-server", "-m", str(tmp_path / "m.gguf"), "--host", "127.0.0.1",
        "--port", "9000", "--parallel", "2", "-c", "1024",
    ]  # fmt: skip
    routed = router_argv(engine, settings, 9001, tmp_path / "models")
    assert "--models-dir" in routed and "-m" not in routed and routed[-2:] == ["-c", "1024"]
    assert settings.model_id == "m"


# --------------------------------------------------------- a real llama-server smoke


@pytest.fixture
def tiny_model(tmp_path: Path) -> Path:
    from gezel_trio.engine.demo_model import write_demo_model

    return write_demo_model(tmp_path / "tiny.gguf", size="tiny")


@pytest.mark.engine
async def test_smoke_replay_against_a_real_llama_server(tmp_path: Path, tiny_model: Path) -> None:
    """Three sessions of three turns on two slots, through both API styles.

    Invariants, not timings: no failures, counts that add up, the engine counted
    exactly the synthesized prompt tokens, cached counts are reported and within the
    prompt, cross-session reuse is reported. Each API style gets its own seed, so the
    second run cannot reuse the first run's prompts.
    """
    engine = resolve_llama_server()
    settings = LaunchSettings(
        model_path=tiny_model,
        parallel=2,
        ctx_per_slot=512,
        workdir=tmp_path / "w",
        startup_timeout=60.0,
    )
    trace = _chat_trace(sessions=3, turns=3, block=2, out=4)
    results = []
    with trio.fail_after(120):
        async with open_target("direct", settings=settings, engine=engine) as endpoint:
            for seed, api in enumerate(("llama", "openai")):
                config = ReplayConfig(
                    base_url=endpoint.base_url,
                    api=api,  # type: ignore[arg-type]
                    mode="closed",
                    time_scale=0.001,
                    seed=seed,
                )
                results.append(await run_replay(trace, config, progress_stream=None))
    for api, result in zip(("llama", "openai"), results, strict=True):
        m = _check_invariants(trace, result, None, api)
        assert isinstance(m["cross_session_reuse"], int) and m["cross_session_reuse"] >= 0
        assert result.config["vocab_hi"] == DEMO_VOCAB  # n_vocab of the demo model, probed
        assert result.model_info["n_ctx"] == 512
        assert m["cache_unreported"] == 0
    # /completion streams the output ids: the self-reuse bound is exact there
    assert all(r.output_ids is not None and len(r.output_ids) == 4 for r in results[0].records)
    assert all(r.output_ids is None for r in results[1].records)


@pytest.mark.parametrize("api", ["llama", "openai"])
async def test_smoke_replay_through_gezel(
    api: str, tiny_model: Path, state_dir: Path, engine_binary: Any
) -> None:
    """The CI smoke replay through the host itself: a few sessions on the tiny model,
    more sessions than slots. Invariants, not timings: no failures, counts add up,
    the engine's prompt counts match the synthesis, no cross-session reuse; the
    vocabulary comes from the host's own /v1/models (no --vocab-hi)."""
    from gezel_trio.config.schema import ModelConfig

    from .conftest import make_config, running

    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=2, ctx_per_slot=512)],
        state_dir=state_dir,
        engine_binary=engine_binary,
    )
    trace = _chat_trace(sessions=4, turns=3, block=2, out=4)
    with trio.fail_after(120):
        async with running(cfg) as (host, _client):
            config = ReplayConfig(
                base_url=host.urls[0],
                api=api,  # type: ignore[arg-type]
                model="tiny",
                mode="closed",
                time_scale=0.001,
                seed=11,
            )
            result = await run_replay(trace, config, progress_stream=None)
    m = _check_invariants(trace, result, None, api)
    assert m["cross_session_reuse"] == 0
    assert result.config["vocab_hi"] == DEMO_VOCAB  # n_vocab from the host's /v1/models
    assert m["cache_hit_ratio"] > 0  # sessions reuse their own prefixes through the host


def test_run_all_runs_every_benchmark_script() -> None:
    """``tox -e bench`` (benchmarks/run_all.py) must not forget a benchmark."""
    import importlib.util

    root = Path(__file__).resolve().parent.parent / "benchmarks"
    spec = importlib.util.spec_from_file_location("run_all", root / "run_all.py")
    assert spec is not None and spec.loader is not None
    run_all = importlib.util.module_from_spec(spec)
    sys.modules["run_all"] = run_all  # its dataclasses look their module up
    try:
        spec.loader.exec_module(run_all)
    finally:
        del sys.modules["run_all"]
    scripts = {p.stem for p in root.glob("*.py") if not p.stem.startswith("_")} - {"run_all"}
    modules = {b.full[1].removeprefix("benchmarks.") for b in run_all.BENCHES if b.full[0] == "-m"}
    assert scripts <= modules, scripts - modules
    for entry in run_all.BENCHES:  # each has a smoke form for --quick
        assert entry.quick and entry.full


def test_check_allows_a_fresh_session_of_the_caller_where_the_host_shares_its_prefix() -> None:
    """A fresh session of the replay's caller may start from that caller's prefix where
    the host shares within a caller (issue 37); a second API key's probe never may."""
    from gezel_bench.cli import _invariants

    def report(shares: bool, owner: int, caller: int) -> dict[str, Any]:
        metrics = {
            "failed": 0,
            "prompt_token_mismatch": 0,
            "cross_session_reuse": 0,
            "cross_owner_reuse": 0,
            "cross_owner_probe_tokens": owner,
            "cross_caller_tokens": caller,
        }
        description = {"kind": "gezel", "shares_within_caller": shares}
        return {"targets": [{"name": "gezel", "metrics": metrics, "description": description}]}

    assert _invariants(report(True, 255, 0)) == []
    assert _invariants(report(False, 255, 0)) == [
        "gezel: 255 cross-owner tokens to the leak probes"
    ]
    assert _invariants(report(True, 0, 3)) == ["gezel: 3 cross-caller tokens to the leak probes"]
