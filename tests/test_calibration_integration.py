"""Calibration through the host, on real llama-server engines, against the engine's truth.

Whether co-batching corrupts a recurrent model depends on the engine build and the CPU
(the bundled AVX-512 build has been measured to corrupt Mamba and Qwen3.5-style models;
AVX2 builds were clean). So the truth is measured in the test itself, on a second
llama-server with the host engine's own argv: the probe's prompts decoded alone on the
untouched engine, co-batched, and alone again. Then:

- the engine corrupts -> calibration failed, the engine process it ran on was
  restarted, the host serves one sequence at a time;
- it does not -> calibration passed and the host co-batches;

and either way, concurrent load through the host gives 0 answers that differ from the
same prompts decoded alone on a fresh engine. The test runs on any CPU and can fail on
either.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.calibrate import (
    CalibrationResult,
    probe_cobatch,
    probe_prompts,
    probe_request,
)
from gezel_trio.engine.demo_model import write_demo_model
from gezel_trio.engine.ports import free_port
from gezel_trio.errors import QueueFull
from gezel_trio.host import Host
from gezel_trio.host.calibration import RetryPolicy

from ._engine_bin import ENGINE_LIMITS, LlamaServer, run_llama_server
from .conftest import make_config, pids_alive, running

PARALLEL = 4
LOAD_N = 12


@pytest.fixture(scope="module")
def recurrent_models(models_dir: Path) -> dict[str, Path]:
    return {
        arch: write_demo_model(models_dir / f"cal-{arch}.gguf", size="tiny", arch=arch)
        for arch in ("mamba", "qwen35")
    }


def _load_prompts() -> list[list[int]]:
    return [[300 + ((i * 37 + j * 11) % 300) for j in range(24)] for i in range(8)]


Answer = tuple[tuple[int, ...], str]


def _answer(body: dict[str, Any]) -> Answer:
    return tuple(int(t) for t in body.get("tokens") or ()), str(body.get("content", ""))


async def _complete(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Answer:
    r = await client.post(url, json=body)
    assert r.status_code == 200, r.text
    return _answer(r.json())


@asynccontextmanager
async def _run_like(
    argv: list[str], env: dict[str, str], log_path: Path
) -> AsyncIterator[LlamaServer]:
    """A second llama-server with ``argv`` (the host engine's), on another port."""
    argv = list(argv)
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    async with run_llama_server(argv, env, log_path, port=port, ready_timeout=30) as server:
        yield server


@dataclass
class Truth:
    """What the engine does, measured directly (no probe code judges it)."""

    alone: list[Answer]
    """The probe prompts, then the load prompts, each decoded alone on a fresh engine."""
    cobatched_wrong: int
    cobatched_sent: int
    later_wrong: int
    later_sent: int

    @property
    def corrupts(self) -> bool:
        return self.cobatched_wrong + self.later_wrong > 0


async def _measure_truth(
    base_url: str, load: list[list[int]], *, parallel: int
) -> tuple[Truth, list[list[int]]]:
    url = base_url + "/completion"
    async with httpx.AsyncClient(limits=ENGINE_LIMITS, timeout=30) as client:
        probes = await probe_prompts(client, base_url)
        bodies = [probe_request(p) for p in probes] + [
            probe_request(p, n_predict=LOAD_N) for p in load
        ]
        alone = [await _complete(client, url, b) for b in bodies]
        wrong = 0
        for body, reference in zip(bodies[: len(probes)], alone[: len(probes)], strict=True):
            got: list[Answer] = []

            async def one(body: dict[str, Any] = body, got: list[Answer] = got) -> None:
                got.append(await _complete(client, url, body))

            async with trio.open_nursery() as nursery:
                for _ in range(parallel):
                    nursery.start_soon(one)
            wrong += sum(a != reference for a in got)
        later = [await _complete(client, url, b) for b in bodies]
    truth = Truth(
        alone=alone,
        cobatched_wrong=wrong,
        cobatched_sent=parallel * len(probes),
        later_wrong=sum(a != b for a, b in zip(later, alone, strict=True)),
        later_sent=len(bodies),
    )
    return truth, probes


async def _wait_for_verdict(host: Host, model: str) -> dict[str, Any]:
    cal = host.models[model].calibration
    while cal.result is None:  # noqa: ASYNC110 - polling a plain attribute
        await trio.sleep(0.05)
    return cal.result


@pytest.mark.parametrize("arch", ["mamba", "qwen35"])
async def test_calibration_agrees_with_the_engine_truth(
    arch: str,
    recurrent_models: dict[str, Path],
    state_dir: Path,
    engine_binary: EngineBinary,
    tmp_path: Path,
) -> None:
    cfg = make_config(
        [
            ModelConfig(
                id="rec", path=str(recurrent_models[arch]), parallel=PARALLEL, ctx_per_slot=256
            )
        ],
        state_dir=state_dir,
        engine_binary=engine_binary,
    )
    load = _load_prompts()
    with trio.fail_after(90):
        async with running(cfg) as (host, client):
            rt = host.models["rec"]
            cal = rt.calibration
            assert cal.arch is not None and cal.arch.recurrent
            assert rt.parallel == 1, "uncalibrated: one sequence at a time"

            # The first request starts the engine, which starts the calibration.
            r = await client.post(
                "/completion", json={"model": "rec", **probe_request(load[0], n_predict=LOAD_N)}
            )
            assert r.status_code == 200, r.text
            verdict = await _wait_for_verdict(host, "rec")

            # The truth, on a second engine with the same argv.
            twin_env, twin_log = engine_binary.launch_env(), tmp_path / "twin.log"
            async with _run_like(list(rt.engine.argv), twin_env, twin_log) as twin:
                truth, probes = await _measure_truth(twin.base_url, load, parallel=PARALLEL)
            summary = (
                f"{arch}: co-batched wrong {truth.cobatched_wrong}/{truth.cobatched_sent}, "
                f"later alone wrong {truth.later_wrong}/{truth.later_sent}; "
                f"calibration {verdict['verdict']}: {verdict['reason']}"
            )
            print(summary)
            assert verdict["prompts_tried"] == PARALLEL * len(probes)

            status = (await client.get("/api/status")).json()
            (eng,) = status["engines"]
            if truth.corrupts:
                assert verdict["verdict"] == "failed", summary
                assert rt.parallel == 1 and "calibration failed" in (rt.ceiling_reason or "")
                assert eng["admission_ceiling"] == 1
                restart = eng["calibration"]["last_restart"]
                assert eng["calibration"]["restarts_after_failure"] == 1
                assert restart["error"] is None and restart["new_pid"] == rt.engine.pid
                assert restart["old_pid"] != restart["new_pid"]
                assert pids_alive([restart["old_pid"]]) == []
            else:
                assert verdict["verdict"] == "passed", summary
                assert rt.parallel == PARALLEL and eng["admission_ceiling"] == PARALLEL
                assert eng["calibration"]["restarts_after_failure"] == 0

            # Concurrent load through the host: 0 wrong answers against the same
            # prompts decoded alone on a fresh engine.
            bodies = [probe_request(p) for p in probes] + [
                probe_request(p, n_predict=LOAD_N) for p in load
            ]
            got: dict[tuple[int, int], Answer] = {}

            async def ask(round_: int, i: int) -> None:
                got[round_, i] = await _complete(
                    client, "/completion", {"model": "rec", **bodies[i]}
                )

            async with trio.open_nursery() as nursery:
                for round_ in range(2):
                    for i in range(len(bodies)):
                        nursery.start_soon(ask, round_, i)
            wrong = [k for k, v in got.items() if v != truth.alone[k[1]]]
            assert wrong == [], f"{len(wrong)} of {len(got)} wrong under load; {summary}"
            assert rt.engine.crashes == 0 or verdict["crashed"]


def _with(monkeypatch: pytest.MonkeyPatch, **changes: Any) -> None:
    """Every Calibrator the host builds gets ``changes`` (a probe, a scheduler, ...)."""
    original = Host.calibrator

    def calibrator(self: Host) -> Any:
        ctx = original(self)
        resolved = {k: (v(ctx) if k == "scheduler" else v) for k, v in changes.items()}
        return dataclasses.replace(ctx, **resolved)

    monkeypatch.setattr(Host, "calibrator", calibrator)


async def test_a_failed_calibration_restarts_the_real_engine_before_it_serves(
    recurrent_models: dict[str, Path],
    state_dir: Path,
    engine_binary: EngineBinary,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A probe that co-batches for real, then reports failure: the process it ran on
    is gone before the request that arrived meanwhile is served."""
    caplog.set_level(logging.INFO, logger="gezel_trio.host.calibration")
    probing = trio.Event()
    probed: dict[str, Any] = {}

    async def failing_probe(
        client: httpx.AsyncClient,
        base_url: str,
        *,
        parallel: int,
        engine_alive: Callable[[], bool] | None = None,
    ) -> CalibrationResult:
        real = await probe_cobatch(client, base_url, parallel=parallel, engine_alive=engine_alive)
        probed["url"] = base_url
        probing.set()
        await trio.sleep(0.5)  # a request arrives now: it must wait for the restart
        return dataclasses.replace(real, verdict="failed", reason="the test says so")

    _with(monkeypatch, probe=failing_probe)
    cfg = make_config(
        [ModelConfig(id="rec", path=str(recurrent_models["mamba"]), parallel=PARALLEL)],
        state_dir=state_dir,
        engine_binary=engine_binary,
    )
    body = {"model": "rec", **probe_request(_load_prompts()[0], n_predict=LOAD_N)}
    with trio.fail_after(60):
        async with running(cfg) as (host, client):
            rt = host.models["rec"]
            first = await _complete(client, "/completion", body)  # starts the engine
            old_pid, old_url = rt.engine.pid, rt.engine.base_url
            assert old_pid is not None
            await probing.wait()
            assert probed["url"] == old_url
            raced = await _complete(client, "/completion", body)
            # By the time it was answered the old process was gone and a new one served it.
            restart = rt.calibration.last_restart
            assert restart is not None and restart["old_pid"] == old_pid
            assert restart["new_pid"] == rt.engine.pid != old_pid
            assert rt.engine.base_url != old_url and pids_alive([old_pid]) == []
            assert raced == first  # the fresh process answers as the first one did fresh
            assert rt.parallel == 1

            status = (await client.get("/api/status")).json()
            (eng,) = status["engines"]
    c = eng["calibration"]
    assert (c["status"], c["restarts_after_failure"], c["phase"]) == ("failed", 1, "idle")
    assert c["last_restart"]["old_generation"] == 1 and c["last_restart"]["new_generation"] == 2
    assert eng["generation"] == 2 and eng["admission_ceiling"] == 1 and eng["crashes"] == 0
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "calibration failed: restarting the engine process before it serves anything" in text
    assert "engine restarted after calibration failed" in text


class _RefusingScheduler:
    """The host's scheduler, but the first ``refuse`` calibrate ops meet a full queue."""

    def __init__(self, inner: Any, refuse: int) -> None:
        self.inner = inner
        self.refuse = refuse

    def slot(self, model_id: str, **kw: Any) -> AbstractAsyncContextManager[Any]:
        if kw.get("kind") == "calibrate" and self.refuse > 0:
            self.refuse -= 1
            return _raising(QueueFull("the scheduler queue is full (4 of 4 waiting)"))
        slot: AbstractAsyncContextManager[Any] = self.inner.slot(model_id, **kw)
        return slot


@asynccontextmanager
async def _raising(exc: Exception) -> AsyncIterator[None]:
    raise exc
    yield  # pragma: no cover


async def test_calibration_errors_never_take_the_host_down(
    recurrent_models: dict[str, Path],
    state_dir: Path,
    engine_binary: EngineBinary,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """QueueFull at first READY (twice), then a probe that raises: logged, in status,
    retried with backoff; the host serves throughout and finally calibrates."""
    calls = {"n": 0}

    async def flaky_probe(
        client: httpx.AsyncClient,
        base_url: str,
        *,
        parallel: int,
        engine_alive: Callable[[], bool] | None = None,
    ) -> CalibrationResult:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("probe bug")
        return await probe_cobatch(client, base_url, parallel=parallel, engine_alive=engine_alive)

    _with(
        monkeypatch,
        scheduler=lambda ctx: _RefusingScheduler(ctx.scheduler, refuse=2),
        probe=flaky_probe,
        retry=RetryPolicy(base=0.1, cap=0.4),
    )
    cfg = make_config(
        [ModelConfig(id="rec", path=str(recurrent_models["mamba"]), parallel=PARALLEL)],
        state_dir=state_dir,
        engine_binary=engine_binary,
    )
    body = {"model": "rec", **probe_request(_load_prompts()[1], n_predict=LOAD_N)}
    seen: list[dict[str, Any]] = []
    answers: set[Answer] = set()
    with trio.fail_after(60):
        async with running(cfg) as (host, client):
            rt = host.models["rec"]
            while rt.calibration.result is None:
                # traffic keeps (re)starting the engine; the host answers throughout
                answers.add(await _complete(client, "/completion", body))
                seen.append((await client.get("/api/status")).json()["engines"][0]["calibration"])
                await trio.sleep(0.05)
            assert len(answers) == 1
            final = (await client.get("/api/status")).json()["engines"][0]
    assert any(s["last_error"] and s["last_error"].startswith("QueueFull") for s in seen)
    assert any(s["next_retry_in"] is not None for s in seen)
    c = final["calibration"]
    assert (c["errors"], c["consecutive_errors"], c["last_error"]) == (
        3,
        0,
        "RuntimeError: probe bug",
    )
    assert c["status"] == "passed" and final["admission_ceiling"] == PARALLEL
    assert calls["n"] == 2


async def test_dense_model_calibrates_on_demand_and_passes(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=3, ctx_per_slot=256)],
        state_dir=state_dir,
        engine_binary=engine_binary,
    )
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            rt = host.models["tiny"]
            assert rt.calibration.arch is not None and not rt.calibration.arch.recurrent
            assert rt.parallel == 3  # dense attention: no ceiling before calibration
            resp = await client.post("/api/models/tiny/calibrate")
            assert resp.status_code == 200, resp.text
            result = resp.json()
            assert result["verdict"] == "passed" and not result["crashed"]
            assert result["admission_ceiling"] == 3
            assert result["distinct_answers"] == 1
            assert rt.parallel == 3 and rt.ceiling is None
            assert rt.calibration.restarts_after_failure == 0
            # remembered per model file and engine build
            fingerprint = rt.calibration.fingerprint
            assert fingerprint is not None and "None:None" not in fingerprint
            book = host.calibration_book.get(
                host.calibration_book.key(str(tiny_model), fingerprint)
            )
            assert book is not None and book["verdict"] == "passed"
