from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from gezel_trio.engine.calibrate import (
    CalibrationResult,
    LengthDetail,
    decide_ceiling,
    probe_cobatch,
)
from gezel_trio.engine.demo_model import write_demo_model

from ._engine_bin import ENGINE_LIMITS, open_llama_server

# ---------------------------------------------------------------- the verdict (pure)


def _result(
    verdict: str = "passed", *, crashed: bool = False, parallel: int = 4
) -> CalibrationResult:
    return CalibrationResult(
        verdict=verdict,  # type: ignore[arg-type]
        crashed=crashed,
        parallel=parallel,
        prompts_tried=3 * parallel,
        distinct_answers=1 if verdict == "passed" else 2,
        details=(),
        started_at=0.0,
        duration_s=0.0,
        reason="",
    )


@pytest.mark.parametrize(
    ("result", "recurrent", "override", "expected"),
    [
        (None, False, False, 4),  # dense, never calibrated: keeps its slots
        (None, True, False, 1),  # recurrent, not yet calibrated: one at a time
        (_result("passed"), True, False, 4),
        (_result("passed"), False, False, 4),
        (_result("failed"), True, False, 1),
        (_result("failed"), False, False, 1),
        (_result("failed", crashed=True), True, False, 1),
        (_result("passed", crashed=True), True, False, 1),  # a crash is never a pass
        (_result("passed", parallel=2), True, False, 2),  # proven for 2 of 4 slots
        (_result("passed", parallel=2), False, False, 4),
        (_result("failed"), True, True, 4),  # operator override
        (None, True, True, 4),
    ],
)
def test_decide_ceiling(
    result: CalibrationResult | None, recurrent: bool, override: bool, expected: int
) -> None:
    assert (
        decide_ceiling(result, configured_parallel=4, recurrent=recurrent, override=override)
        == expected
    )


def test_decide_ceiling_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        decide_ceiling(None, configured_parallel=0, recurrent=False, override=False)


# ---------------------------------------------------------------- the probe, fake engine

POOL = [11, 12, 13, 14, 15, 16, 17]


class FakeEngine:
    """A llama-server stand-in behind httpx.MockTransport.

    ``answer(index_in_batch, alone)`` gives the generated token ids;
    ``margins`` the alone answer's top-2 margins per position.
    """

    def __init__(
        self,
        *,
        answer: Callable[[int, bool], list[int]] | None = None,
        margins: list[float] | None = None,
        fail: Callable[[int], httpx.Response | None] | None = None,
        latency: float = 1.0,
    ) -> None:
        self.answer = answer or (lambda i, alone: [5, 6, 7, 8])
        self.margins = margins
        self.fail = fail
        self.latency = latency
        self.bodies: list[dict[str, Any]] = []
        self.in_flight: list[dict[str, bool]] = []
        self.max_in_flight = 0
        self.group_arrivals = 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": POOL})
        assert request.url.path == "/completion"
        self.bodies.append(json.loads(request.content))
        n = len(self.bodies)
        # Requests overlapping in time form a batch; index = arrival order within it.
        me = {"overlapped": bool(self.in_flight)}
        for other in self.in_flight:
            other["overlapped"] = True
        index = self.group_arrivals
        self.group_arrivals += 1
        self.in_flight.append(me)
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        try:
            await trio.sleep(self.latency)
            if self.fail is not None and (resp := self.fail(n)) is not None:
                return resp
            alone = not me["overlapped"]
            tokens = self.answer(index, alone)
            margins = self.margins if (alone and self.margins) else [9.0] * len(tokens)
            probs = [
                {"id": t, "top_logprobs": [{"id": t, "logprob": 0.0}, {"id": 0, "logprob": -m}]}
                for t, m in zip(tokens, margins, strict=False)
            ]
            return httpx.Response(
                200,
                json={
                    "content": "x" * len(tokens),
                    "tokens": tokens,
                    "completion_probabilities": probs,
                },
            )
        finally:
            self.in_flight.remove(me)
            if not self.in_flight:
                self.group_arrivals = 0


def _client(engine: FakeEngine) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(engine.handle))


async def test_identical_cobatched_answers_pass(autojump_clock: trio.testing.MockClock) -> None:
    engine = FakeEngine()
    async with _client(engine) as client:
        result = await probe_cobatch(client, "http://engine/", parallel=4, seed=7)
    assert result.passed and result.verdict == "passed" and not result.crashed
    assert (result.prompts_tried, result.distinct_answers, result.parallel) == (12, 1, 4)
    assert [d.prompt_tokens for d in result.details] == [16, 64, 160]
    assert all(d.alone_mismatches == 0 and d.answers == 4 for d in result.details)
    # all four co-batched requests were in flight at once (the barrier)
    assert engine.max_in_flight == 4
    # 3 lengths x (alone 1 s, then the co-batched 1 s) of virtual time
    assert result.duration_s == pytest.approx(6.0)
    assert len(engine.bodies) == 15
    for body in engine.bodies:
        assert body["temperature"] == 0.0 and body["top_k"] == 1 and body["seed"] == 7
        assert body["cache_prompt"] is False and body["n_probs"] >= 2
        assert set(body["prompt"]) <= set(POOL)
    lengths = [len(b["prompt"]) for b in engine.bodies]
    assert lengths == [16] * 5 + [64] * 5 + [160] * 5
    assert all(b["prompt"] == engine.bodies[0]["prompt"] for b in engine.bodies[:5])


async def test_differing_cobatched_answers_fail(autojump_clock: trio.testing.MockClock) -> None:
    # The first sequence of a batch is right; the others get a bled state.
    engine = FakeEngine(answer=lambda i, alone: [5, 6, 7, 8] if i == 0 else [5, 6, 9 + i, 8])
    async with _client(engine) as client:
        result = await probe_cobatch(client, "http://engine", parallel=4)
    assert result.verdict == "failed" and not result.crashed and not result.passed
    assert result.distinct_answers == 4
    assert result.details[0].alone_mismatches == 3
    assert "4 distinct answers among 4 identical co-batched" in result.reason


async def test_cobatched_differences_fail_even_without_alone_comparison(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = FakeEngine(answer=lambda i, alone: [1, 2] if i % 2 else [1, 3])
    async with _client(engine) as client:
        result = await probe_cobatch(
            client, "http://engine", parallel=2, prompt_lengths=(8,), compare_alone=False
        )
    assert result.verdict == "failed" and result.distinct_answers == 2
    assert result.details[0].alone_mismatches is None
    assert len(engine.bodies) == 2


@pytest.mark.parametrize(("margin", "verdict"), [(0.01, "passed"), (3.0, "failed")])
async def test_flip_against_alone_is_tolerated_only_at_a_near_tie(
    autojump_clock: trio.testing.MockClock, margin: float, verdict: str
) -> None:
    # Co-batched answers agree with each other but differ from the alone one at
    # position 2, where the alone answer's top-2 margin is `margin`.
    engine = FakeEngine(
        answer=lambda i, alone: [5, 6, 7, 8] if alone else [5, 6, 0, 1],
        margins=[5.0, 5.0, margin, 5.0],
    )
    async with _client(engine) as client:
        result = await probe_cobatch(client, "http://engine", parallel=3, prompt_lengths=(16,))
    assert result.verdict == verdict
    detail = result.details[0]
    assert detail.distinct_answers == 1
    assert detail.min_flip_margin == pytest.approx(margin)
    if verdict == "passed":
        assert (detail.near_tie_flips, detail.alone_mismatches) == (3, 0)
    else:
        assert (detail.near_tie_flips, detail.alone_mismatches) == (0, 3)
        assert "differ from the prompt decoded alone" in result.reason


async def test_engine_crash_during_cobatch_is_a_crashed_failure(
    autojump_clock: trio.testing.MockClock,
) -> None:
    def fail(n: int) -> httpx.Response | None:
        if n >= 3:  # the second co-batched request onwards: the process is gone
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return None

    engine = FakeEngine(fail=fail)
    async with _client(engine) as client:
        result = await probe_cobatch(client, "http://engine", parallel=4)
    assert result.verdict == "failed" and result.crashed and not result.passed
    assert result.prompts_tried == 4  # stopped after the first length
    assert len(result.details) == 1
    assert result.details[0].answers == 1
    assert "3 of 4 co-batched requests failed" in result.reason
    assert "RemoteProtocolError" in result.reason


async def test_refused_connection_is_a_crash(autojump_clock: trio.testing.MockClock) -> None:
    async def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as client:
        result = await probe_cobatch(client, "http://engine", parallel=2)
    assert result.crashed and result.verdict == "failed"
    assert result.prompts_tried == 0 and "could not build probe prompts" in result.reason


async def test_http_error_fails_without_crash(autojump_clock: trio.testing.MockClock) -> None:
    engine = FakeEngine(fail=lambda n: httpx.Response(500, json={"error": "boom"}))
    async with _client(engine) as client:
        result = await probe_cobatch(client, "http://engine", parallel=2)
    assert result.verdict == "failed" and not result.crashed
    assert "answered 500" in result.reason


async def test_timeout_fails_without_crash(autojump_clock: trio.testing.MockClock) -> None:
    def fail(n: int) -> httpx.Response | None:
        raise httpx.ReadTimeout("timed out")

    engine = FakeEngine(fail=fail)
    async with _client(engine) as client:
        result = await probe_cobatch(client, "http://engine", parallel=2, compare_alone=False)
    assert result.verdict == "failed" and not result.crashed
    assert "timed out" in result.reason


async def test_engine_process_gone_marks_crash(autojump_clock: trio.testing.MockClock) -> None:
    engine = FakeEngine()
    async with _client(engine) as client:
        result = await probe_cobatch(
            client, "http://engine", parallel=2, prompt_lengths=(4,), engine_alive=lambda: False
        )
    assert result.crashed and result.verdict == "failed"
    assert "exited" in result.reason


def test_result_serializes_for_status() -> None:
    detail = LengthDetail(16, 4, 1, 0, 0, None)
    result = CalibrationResult("passed", False, 4, 4, 1, (detail,), 1.0, 2.0, "ok")
    d = result.to_dict()
    assert d["verdict"] == "passed" and d["details"][0]["prompt_tokens"] == 16
    assert json.loads(json.dumps(d)) == d


# ---------------------------------------------------------------- the real engine


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("cal")
    return {
        a: write_demo_model(d / f"{a}.gguf", size="tiny", arch=a)
        for a in ("llama", "mamba", "qwen35")
    }


@pytest.mark.engine
async def test_calibration_passes_for_llama_on_the_real_engine(
    tiny_models: dict[str, Path],
) -> None:
    with trio.fail_after(30):
        async with (
            open_llama_server(tiny_models["llama"], parallel=4, ctx=4 * 512) as server,
            httpx.AsyncClient(limits=ENGINE_LIMITS, timeout=20) as client,
        ):
            result = await probe_cobatch(
                client,
                server.base_url,
                parallel=4,
                engine_alive=lambda: server.returncode is None,
            )
    assert result.passed, result.reason
    assert (result.prompts_tried, result.distinct_answers) == (12, 1)
    assert all(d.alone_mismatches == 0 and d.answers == 4 for d in result.details)
    assert decide_ceiling(result, configured_parallel=4, recurrent=False, override=False) == 4


@pytest.mark.engine
@pytest.mark.parametrize("arch", ["mamba", "qwen35"])
async def test_recurrent_models_run_and_the_probe_is_bounded(
    tiny_models: dict[str, Path], arch: str
) -> None:
    """Both generated recurrent models load in the real engine and answer the probe.

    Whether co-batching corrupts them depends on the engine build and CPU (see the
    calibration notes): the probe's verdict must match its own numbers either way,
    and an engine still uncalibrated or failed stays at one sequence.
    """
    with trio.fail_after(30):
        async with (
            open_llama_server(tiny_models[arch], parallel=4, ctx=4 * 512) as server,
            httpx.AsyncClient(limits=ENGINE_LIMITS, timeout=20) as client,
        ):
            result = await probe_cobatch(
                client,
                server.base_url,
                parallel=4,
                engine_alive=lambda: server.returncode is None,
            )
    corrupt = any(d.distinct_answers > 1 or d.alone_mismatches or d.error for d in result.details)
    assert result.passed is not (corrupt or result.crashed), result
    if not result.crashed:
        assert result.prompts_tried == 12 and len(result.details) == 3
        assert all(d.answers == 4 for d in result.details)
    ceiling = decide_ceiling(result, configured_parallel=4, recurrent=True, override=False)
    assert ceiling == (4 if result.passed else 1)


class _KillOnCobatch(httpx.AsyncBaseTransport):
    """Forwards to the real engine; SIGKILLs it as the co-batched requests go out."""

    def __init__(self, pid: int, *, after: int) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self._pid = pid
        self._after = after
        self._seen = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/completion":
            self._seen += 1
            if self._seen == self._after:
                os.kill(self._pid, signal.SIGKILL)
                await trio.sleep(0.2)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


@pytest.mark.engine
async def test_engine_killed_mid_probe_is_reported_as_crash(
    tiny_models: dict[str, Path],
) -> None:
    with trio.fail_after(30):
        async with open_llama_server(tiny_models["mamba"], parallel=4, ctx=4 * 512) as server:
            assert server.process is not None
            transport = _KillOnCobatch(server.process.pid, after=3)  # alone, then 2 co-batched
            async with httpx.AsyncClient(transport=transport, timeout=10) as client:
                result = await probe_cobatch(
                    client,
                    server.base_url,
                    parallel=4,
                    engine_alive=lambda: server.returncode is None,
                )
            assert server.returncode is not None
    assert result.crashed and result.verdict == "failed"
    assert result.prompts_tried == 4 and len(result.details) == 1
    assert decide_ceiling(result, configured_parallel=4, recurrent=True, override=False) == 1
