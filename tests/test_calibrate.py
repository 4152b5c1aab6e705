from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.arch import ArchVerdict, keeps_recurrent_state
from gezel_trio.engine.binary import BuildFacts, EngineBinary, read_build_facts
from gezel_trio.engine.calibrate import (
    PROBE_LENGTHS,
    CalibrationResult,
    LengthDetail,
    decide_ceiling,
    probe_cobatch,
    probe_prompts,
    probe_request,
)
from gezel_trio.engine.client import EngineClient
from gezel_trio.engine.demo_model import write_demo_model
from gezel_trio.engine.supervisor import Engine, EngineState, SupervisorTiming, open_engine
from gezel_trio.errors import QueueFull, SchedulerClosed
from gezel_trio.host.calibration import (
    CalibrationBook,
    Calibrator,
    RetryPolicy,
    apply_verdict,
    calibrate,
    serve_calibration,
)
from gezel_trio.host.runtime import ModelRuntime, ModelSetup

from ._engine_bin import ENGINE_LIMITS, open_llama_server
from .fakes import FakeBehaviour, FakeLauncher

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
    # 3 lengths x (alone before 1 s, co-batched 1 s, alone after 1 s) of virtual time
    assert result.duration_s == pytest.approx(9.0)
    assert len(engine.bodies) == 18
    for body in engine.bodies:
        assert body["temperature"] == 0.0 and body["top_k"] == 1 and body["seed"] == 7
        assert body["cache_prompt"] is False and body["n_probs"] >= 2
        assert set(body["prompt"]) <= set(POOL)
    # every reference is decoded on the untouched engine, then each length
    # co-batched, then every length alone again
    lengths = [len(b["prompt"]) for b in engine.bodies]
    assert lengths == [16, 64, 160] + [16] * 4 + [64] * 4 + [160] * 4 + [16, 64, 160]
    assert all(d.later_mismatches == 0 for d in result.details)
    first, later = engine.bodies[0]["prompt"], engine.bodies[15]["prompt"]
    assert all(b["prompt"] == first for b in engine.bodies[3:7]) and later == first


async def test_engine_left_corrupt_after_cobatching_fails(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Co-batched answers agree with each other and with the reference, but the engine
    answers differently one at a time afterwards (the Mamba case): failed."""
    cobatched = {"yet": False}

    def answer(i: int, alone: bool) -> list[int]:
        if not alone:
            cobatched["yet"] = True
            return [5, 6, 7, 8]
        return [5, 6, 9, 9] if cobatched["yet"] else [5, 6, 7, 8]

    engine = FakeEngine(answer=answer)
    async with _client(engine) as client:
        result = await probe_cobatch(client, "http://engine", parallel=4)
    assert result.verdict == "failed" and not result.crashed
    assert result.distinct_answers == 1
    assert [d.alone_mismatches for d in result.details] == [0, 0, 0]
    assert [d.later_mismatches for d in result.details] == [1, 1, 1]
    assert "stayed corrupt: 3 of 3 prompts decoded alone" in result.reason


async def test_probe_prompts_are_the_prompts_the_probe_sends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = FakeEngine()
    async with _client(engine) as client:
        prompts = await probe_prompts(client, "http://engine")
        await probe_cobatch(client, "http://engine", parallel=2)
    assert [len(p) for p in prompts] == list(PROBE_LENGTHS)
    assert [b["prompt"] for b in engine.bodies[:3]] == prompts
    assert engine.bodies[0] == probe_request(prompts[0])


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
        if n >= 5:  # 3 alone, then the second co-batched request onwards: the process is gone
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
    assert all(d.later_mismatches == 0 for d in result.details)
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
    corrupt = any(
        d.distinct_answers > 1 or d.alone_mismatches or d.later_mismatches or d.error
        for d in result.details
    )
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
            # 3 alone (one per length), then 2 co-batched
            transport = _KillOnCobatch(server.process.pid, after=5)
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


# ---------------------------------------------------------------- remembered = live


def _never_proxied(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"calibration never proxies: {request.method} {request.url}")


def _runtime(engine: Engine, *, path: Path | None = None, **config: Any) -> ModelRuntime:
    rt = ModelRuntime(
        setup=ModelSetup(ModelConfig(id="m", path=None if path is None else str(path), **config)),
        engine=engine,
        client=EngineClient(
            httpx.MockTransport(_never_proxied), engine, read_timeout=None, model_id="m"
        ),
    )
    return rt


def _fake_engine(launcher: FakeLauncher, parallel: int = 4) -> AbstractAsyncContextManager[Engine]:
    def argv(port: int) -> tuple[list[str], int]:
        return ["fake-llama-server", "--port", str(port), "--parallel", str(parallel)], parallel

    return open_engine(
        key="m",
        model_id="m",
        http=launcher.http,
        argv_builder=argv,
        timing=TIMING,
        launcher=launcher,
    )


TIMING = SupervisorTiming(
    load_timeout=30.0, health_interval=1.0, health_timeout=0.5, stop_grace=10.0
)


@pytest.mark.parametrize("override", [False, True])
@pytest.mark.parametrize("recurrent", [False, True])
@pytest.mark.parametrize(
    "result",
    [
        _result("passed"),
        _result("passed", parallel=2),
        _result("failed"),
        _result("failed", crashed=True),
        _result("passed", crashed=True),
    ],
    ids=["passed", "passed-2-of-4", "failed", "crashed", "passed-but-crashed"],
)
async def test_a_remembered_verdict_sets_the_same_ceiling_as_the_live_one(
    tiny_models: dict[str, Path],
    tmp_path: Path,
    result: CalibrationResult,
    recurrent: bool,
    override: bool,
) -> None:
    model = tiny_models["mamba" if recurrent else "llama"]
    book = CalibrationBook(tmp_path / "calibration.json")
    book.put(CalibrationBook.key(str(model), "fp"), result.to_dict() | {"finished_at": 1.0})
    launcher = FakeLauncher()
    async with _fake_engine(launcher) as engine:
        live = _runtime(engine, path=model, parallel=4, allow_unsafe_batching=override)
        live.calibration.arch = keeps_recurrent_state(model)
        apply_verdict(live, result)

        remembered = _runtime(engine, path=model, parallel=4, allow_unsafe_batching=override)
        ctx = Calibrator(
            scheduler=None,  # type: ignore[arg-type]  # a remembered verdict runs no probe
            http=launcher.http,
            book=CalibrationBook(tmp_path / "calibration.json"),
            fingerprint=lambda: "fp",
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_calibration, ctx, remembered)
        assert launcher.processes == []
    expected = decide_ceiling(result, configured_parallel=4, recurrent=recurrent, override=override)
    assert remembered.calibration.source == "remembered"
    assert remembered.parallel == live.parallel == expected
    assert remembered.ceiling == live.ceiling


def test_result_reads_back_from_a_remembered_dict() -> None:
    detail = LengthDetail(16, 4, 2, 1, 0, 0.5, None, 1)
    result = CalibrationResult("failed", True, 3, 12, 2, (detail,), 10.0, 1.5, "why")
    back = CalibrationResult.from_dict(result.to_dict() | {"finished_at": 12.0, "new": 1})
    assert back == result
    # an entry from before `later_mismatches` existed still reads
    old = result.to_dict()
    del old["details"][0]["later_mismatches"]
    assert CalibrationResult.from_dict(old).details[0].later_mismatches is None
    for bad in (
        {},
        {"verdict": "maybe", "crashed": False, "parallel": 4},
        {"verdict": "passed", "crashed": False, "parallel": 0},
        {"verdict": "passed", "crashed": "no", "parallel": 4},
    ):
        with pytest.raises(ValueError):
            CalibrationResult.from_dict(bad)


# ---------------------------------------------------------------- the host's calibration


class ExclusiveScheduler:
    """The scheduler's ``slot(kind="calibrate")`` as a test sees it: one block at a time,
    every entry and exit recorded with the engine's pid and generation; the first
    ``refuse`` entries raise QueueFull (a burst filled the queue)."""

    def __init__(self, engine: Engine, *, refuse: int = 0) -> None:
        self.engine = engine
        self.refuse = refuse
        self.inside = False
        self.events: list[tuple[str, float, int | None, int]] = []

    def slot(self, model_id: str, *, kind: str = "completion") -> AbstractAsyncContextManager[None]:
        return self._slot(kind)

    @asynccontextmanager
    async def _slot(self, kind: str) -> AsyncIterator[None]:
        assert kind == "calibrate" and not self.inside
        if self.refuse:
            self.refuse -= 1
            self.events.append(("refused", trio.current_time(), None, self.engine.generation))
            raise QueueFull("the scheduler queue is full (4 of 4 waiting)", retry_after=1)
        self.inside = True
        self.events.append(("enter", trio.current_time(), self.engine.pid, self.engine.generation))
        try:
            yield
        finally:
            self.inside = False
            self.events.append(
                ("exit", trio.current_time(), self.engine.pid, self.engine.generation)
            )


class ScriptedProbe:
    """A probe that answers from a script: a result factory, or an exception to raise."""

    def __init__(self, scheduler: ExclusiveScheduler, *steps: Any, duration: float = 2.0) -> None:
        self.scheduler = scheduler
        self.steps = list(steps)
        self.duration = duration
        self.calls: list[dict[str, Any]] = []

    async def __call__(
        self,
        client: httpx.AsyncClient,
        base_url: str,
        *,
        parallel: int,
        engine_alive: Callable[[], bool] | None = None,
    ) -> CalibrationResult:
        engine = self.scheduler.engine
        self.calls.append(
            {
                "at": trio.current_time(),
                "pid": engine.pid,
                "generation": engine.generation,
                "inside": self.scheduler.inside,
                "parallel": parallel,
                "url": base_url,
            }
        )
        step = self.steps.pop(0)
        await trio.sleep(self.duration)
        if isinstance(step, BaseException):
            raise step
        if callable(step):
            step = step()
        assert isinstance(step, CalibrationResult)
        return step


def _calibrator(
    launcher: FakeLauncher, scheduler: ExclusiveScheduler, probe: ScriptedProbe, tmp_path: Path
) -> Calibrator:
    return Calibrator(
        scheduler=scheduler,  # type: ignore[arg-type]  # the part of Scheduler calibrate uses
        http=launcher.http,
        book=CalibrationBook(tmp_path / "calibration.json"),
        fingerprint=lambda: "fp",
        probe=probe,
    )


@pytest.mark.parametrize("crashed", [False, True])
async def test_failed_probe_restarts_the_engine_inside_the_exclusive_block(
    autojump_clock: trio.testing.MockClock,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    crashed: bool,
) -> None:
    caplog.set_level(logging.INFO, logger="gezel_trio.host.calibration")
    launcher = FakeLauncher(FakeBehaviour(load_time=1.0))
    async with _fake_engine(launcher) as engine:
        rt = _runtime(engine, parallel=4)
        rt.calibration.arch = ArchVerdict(True, "mamba", "test")
        apply_verdict(rt, None)
        assert rt.parallel == 1
        scheduler = ExclusiveScheduler(engine)

        def failed() -> CalibrationResult:
            if crashed:  # the probe took the process down with it
                launcher.processes[0].exit(-signal.SIGSEGV)
            return _result("failed", crashed=crashed)

        probe = ScriptedProbe(scheduler, failed, duration=2.0)
        await engine.ensure_ready()
        load = trio.current_time()  # the fake's 1 s load, seen by the health poll
        assert (engine.generation, engine.pid) == (1, 1001)
        assert load == pytest.approx(1.0, abs=0.1)

        result = await calibrate(_calibrator(launcher, scheduler, probe, tmp_path), rt)

        assert not result.passed and result.crashed is crashed
        (call,) = probe.calls
        assert call == {
            "at": load,
            "pid": 1001,
            "generation": 1,
            "inside": True,
            "parallel": 4,
            "url": engine.base_url and call["url"],
        }
        old, new = launcher.processes
        if crashed:
            assert old.signals == [] and old.returncode == -signal.SIGSEGV
        else:  # stopped at once (SIGTERM) when the 2 s probe returned
            assert old.signals == [(load + 2, signal.SIGTERM)]
        # The fresh process was READY (another load) before the exclusive block let
        # go: nothing reached the engine in between.
        assert scheduler.events == [
            ("enter", load, 1001, 1),
            ("exit", pytest.approx(load + 2 + load), 1002, 2),
        ]
        assert engine.state.value is EngineState.READY and new.returncode is None
        assert rt.parallel == 1 and "calibration failed" in (rt.ceiling_reason or "")
        status = rt.calibration.as_dict()
    assert status["status"] == "failed" and status["phase"] == "idle"
    assert status["restarts_after_failure"] == 1
    restart = status["last_restart"]
    assert (restart["old_pid"], restart["new_pid"]) == (1001, 1002)
    assert (restart["old_generation"], restart["new_generation"]) == (1, 2)
    assert restart["error"] is None
    assert "calibration failed" in restart["reason"]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "restarting the engine process before it serves anything" in text
    assert "engine restarted after calibration failed" in text


async def test_a_passed_probe_keeps_the_engine(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    launcher = FakeLauncher()
    async with _fake_engine(launcher) as engine:
        rt = _runtime(engine, parallel=4)
        rt.calibration.arch = ArchVerdict(True, "mamba", "test")
        scheduler = ExclusiveScheduler(engine)
        probe = ScriptedProbe(scheduler, _result("passed"))
        await calibrate(_calibrator(launcher, scheduler, probe, tmp_path), rt)
        assert len(launcher.processes) == 1 and launcher.processes[0].signals == []
        assert rt.parallel == 4 and rt.calibration.restarts_after_failure == 0


async def test_a_restart_that_fails_leaves_the_engine_down_and_the_verdict_standing(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    launcher = FakeLauncher()
    async with _fake_engine(launcher) as engine:
        rt = _runtime(engine, parallel=4)
        rt.calibration.arch = ArchVerdict(True, "mamba", "test")
        scheduler = ExclusiveScheduler(engine)

        def failed() -> CalibrationResult:
            launcher.fail_spawn = OSError("no such file")
            return _result("failed")

        probe = ScriptedProbe(scheduler, failed)
        result = await calibrate(_calibrator(launcher, scheduler, probe, tmp_path), rt)
        assert not result.passed
        assert engine.state.value is EngineState.FAILED and len(launcher.processes) == 1
        assert launcher.processes[0].returncode is not None
        restart = rt.calibration.last_restart
        assert restart is not None and restart["new_pid"] is None
        assert "could not start" in restart["error"]
        assert rt.parallel == 1 and rt.calibration.result is not None


async def test_cancelling_mid_probe_stops_the_engine_before_the_block_exits(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    launcher = FakeLauncher()
    async with _fake_engine(launcher) as engine:
        rt = _runtime(engine, parallel=4)
        rt.calibration.arch = ArchVerdict(True, "mamba", "test")
        apply_verdict(rt, None)
        scheduler = ExclusiveScheduler(engine)
        probe = ScriptedProbe(scheduler, _result("passed"), duration=100.0)
        with trio.move_on_after(5):
            await calibrate(_calibrator(launcher, scheduler, probe, tmp_path), rt)
        (proc,) = launcher.processes
        assert proc.signals == [(5.0, signal.SIGTERM)] and proc.returncode is not None
        assert scheduler.events[-1][:2] == ("exit", 5.0)
        assert engine.state.value is EngineState.STOPPED
        assert rt.calibration.result is None and rt.parallel == 1
        assert rt.calibration.phase == "idle"


async def test_cancelling_during_the_restart_never_leaves_the_old_process_ready(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    launcher = FakeLauncher(FakeBehaviour(load_time=1.0, term_exit_delay=0.5))
    async with _fake_engine(launcher) as engine:
        rt = _runtime(engine, parallel=4)
        rt.calibration.arch = ArchVerdict(True, "mamba", "test")
        scheduler = ExclusiveScheduler(engine)
        probe = ScriptedProbe(scheduler, _result("failed"), duration=2.0)
        await engine.ensure_ready()
        load = trio.current_time()
        # cancelled 0.1 s after the probe returned: the old process is still exiting
        with trio.move_on_at(load + 2.1):
            await calibrate(_calibrator(launcher, scheduler, probe, tmp_path), rt)
        old = launcher.processes[0]
        exit_event = scheduler.events[-1]
        assert exit_event[0] == "exit" and exit_event[1] == pytest.approx(load + 2.5)
        assert old.returncode is not None  # gone before the block let go
        assert exit_event[2] != old.pid and engine.state.value is not EngineState.READY
        assert rt.parallel == 1 and rt.calibration.restarts_after_failure == 1
        await engine.ensure_ready()  # the new start went on
        assert engine.pid == launcher.processes[1].pid and engine.generation == 2


async def test_calibration_errors_are_retried_with_backoff_and_never_escape(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """QueueFull from the scheduler twice, then a probe that raises, then a verdict.

    Virtual time (the fake engine loads at once): the engine is READY at 0; refused
    at 0 (retry in 1 s) and at 1 (retry in 2 s); at 3 the probe starts and raises
    after 2 s (the engine it ran on is stopped; retry in 4 s, once the engine is
    READY again); traffic starts the engine at 19, and the calibration passes at 21.
    """
    launcher = FakeLauncher(FakeBehaviour(load_time=0.0))
    async with _fake_engine(launcher) as engine:
        rt = _runtime(engine, parallel=4)
        rt.calibration.arch = ArchVerdict(True, "mamba", "test")
        scheduler = ExclusiveScheduler(engine, refuse=2)
        probe = ScriptedProbe(scheduler, RuntimeError("probe bug"), _result("passed"))
        ctx = _calibrator(launcher, scheduler, probe, tmp_path)
        state = rt.calibration
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_calibration, ctx, rt)
            assert rt.parallel == 1 and state.phase == "waiting for engine"
            await engine.ensure_ready()
            await trio.sleep(0.5)  # t = 0.5: refused once
            s = state.as_dict()
            assert (s["phase"], s["errors"], s["next_retry_in"]) == ("retry wait", 1, 0.5)
            assert s["last_error"].startswith("QueueFull: the scheduler queue is full")
            await trio.sleep(2.0)  # t = 2.5: refused twice
            assert (state.errors, state.as_dict()["next_retry_in"]) == (2, 0.5)
            await trio.sleep(3.0)  # t = 5.5: the probe raised at 5
            s = state.as_dict()
            assert (s["errors"], s["consecutive_errors"], s["next_retry_in"]) == (3, 3, 3.5)
            assert s["last_error"] == "RuntimeError: probe bug"
            assert engine.state.value is EngineState.STOPPED  # its process was suspect
            await trio.sleep(13.5)  # t = 19: no retry loads an engine nobody uses
            assert len(probe.calls) == 1 and len(launcher.processes) == 1
            assert state.as_dict()["phase"] == "waiting for engine"
            await engine.ensure_ready()
        assert trio.current_time() == 21.0
    assert [(e[0], e[1]) for e in scheduler.events] == [
        ("refused", 0.0),
        ("refused", 1.0),
        ("enter", 3.0),
        ("exit", 5.0),
        ("enter", 19.0),
        ("exit", 21.0),
    ]
    assert state.as_dict()["status"] == "passed" and rt.parallel == 4
    assert (state.errors, state.consecutive_errors, state.next_retry_at) == (3, 0, None)
    assert "retrying in 4.0s" in "\n".join(r.getMessage() for r in caplog.records)


async def test_serve_calibration_ends_quietly_when_the_scheduler_closes(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    launcher = FakeLauncher()
    async with _fake_engine(launcher) as engine:
        rt = _runtime(engine, parallel=4)
        rt.calibration.arch = ArchVerdict(True, "mamba", "test")
        scheduler = ExclusiveScheduler(engine)
        scheduler.slot = lambda *a, **kw: _raises(SchedulerClosed("closed"))  # type: ignore[method-assign]
        ctx = _calibrator(launcher, scheduler, ScriptedProbe(scheduler), tmp_path)
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_calibration, ctx, rt)
            await engine.ensure_ready()
    assert rt.calibration.result is None and rt.parallel == 1


@asynccontextmanager
async def _raises(exc: Exception) -> AsyncIterator[None]:
    raise exc
    yield  # pragma: no cover


async def test_setup_errors_keep_one_sequence_and_never_escape(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, tiny_models: dict[str, Path]
) -> None:
    def broken() -> str:
        raise OSError("cannot read the binary")

    launcher = FakeLauncher()
    async with _fake_engine(launcher) as engine:
        rt = _runtime(engine, path=tiny_models["mamba"], parallel=4)
        scheduler = ExclusiveScheduler(engine)
        probe = ScriptedProbe(scheduler, _result("passed"))
        ctx = dataclasses.replace(
            _calibrator(launcher, scheduler, probe, tmp_path), fingerprint=broken
        )
        async with trio.open_nursery() as nursery:
            # (no deadline around the GGUF read: the autojump clock skips ahead
            # while a thread runs)
            await nursery.start(serve_calibration, ctx, rt)
            assert rt.parallel == 1
            assert rt.calibration.last_error == "OSError: cannot read the binary"
            with trio.fail_after(10):
                await engine.ensure_ready()
                await rt.engine.state.wait_value(EngineState.READY)
                while rt.calibration.result is None:  # noqa: ASYNC110 - a plain attribute
                    await trio.sleep(0.5)
        # calibrated all the same; the verdict is only not remembered
        assert rt.calibration.as_dict()["status"] == "passed" and rt.parallel == 4
        assert rt.calibration.fingerprint is None
        assert not (tmp_path / "calibration.json").exists()


def test_retry_policy_doubles_up_to_the_cap() -> None:
    policy = RetryPolicy()
    assert [policy.delay(n) for n in range(9)] == [0, 1, 2, 4, 8, 16, 32, 60, 60]
    assert RetryPolicy(base=0.5, cap=3).delay(4) == 3
    assert policy.delay(10_000) == 60


# ---------------------------------------------------------------- the build fingerprint


def test_fingerprint_is_never_none_none(tmp_path: Path) -> None:
    assert BuildFacts(source="version", revision="abc", build_number=7).fingerprint == (
        "llama-cpp:abc:7:None"  # unchanged: verdicts remembered under it stay valid
    )
    for facts in (BuildFacts(source="unknown"), BuildFacts(source="unknown", version_text="x")):
        assert "None:None" not in facts.fingerprint
    assert (
        BuildFacts(source="unknown", version_text="a").fingerprint
        != BuildFacts(source="unknown", version_text="b").fingerprint
    )


def test_unidentified_build_falls_back_to_a_hash_of_the_binary(tmp_path: Path) -> None:
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\necho 'no version here'\n")
    binary.chmod(0o755)
    lib = binary.parent / "libllama.so"
    lib.write_bytes(b"one")
    engine = EngineBinary(binary, "test")

    facts = read_build_facts(engine)
    assert facts.source == "unknown" and facts.revision is None and facts.build_number is None
    assert facts.binary_sha256 is not None
    assert facts.fingerprint == f"llama-cpp:sha256:{facts.binary_sha256[:16]}"
    assert read_build_facts(engine).fingerprint == facts.fingerprint  # stable

    lib.write_bytes(b"two")  # the code lives in the libraries of a split build
    after_lib = read_build_facts(engine).fingerprint
    binary.write_text("#!/bin/sh\necho 'still no version'\n")
    after_binary = read_build_facts(engine).fingerprint
    assert len({facts.fingerprint, after_lib, after_binary}) == 3

    versioned = tmp_path / "v" / "llama-server"
    versioned.parent.mkdir()
    versioned.write_text("#!/bin/sh\necho 'version: 10434 (7e4c0a9)' >&2\n")
    versioned.chmod(0o755)
    vfacts = read_build_facts(EngineBinary(versioned, "test"))
    assert vfacts.fingerprint == "llama-cpp:7e4c0a9:10434:None" and vfacts.binary_sha256 is None
