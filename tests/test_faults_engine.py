"""Engine faults against real processes: SIGKILL mid-stream, a hung engine, failed starts.

Every test runs a real host on a real hypercorn socket. After each fault the
host must answer clearly (an SSE error event, or a 5xx JSON error that names
the cause), recover lazily, and hold nothing: no queued or running job, no GPU
lease, no busy engine.

"Port in use" cannot happen by configuration: the supervisor asks the kernel
for a free port (bind to port 0) right before each spawn, so the only way to
collide is a race with another process. The test below forces that race by
handing the supervisor a port that a socket of the test holds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from gezel_trio.config.schema import Config, ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.supervisor import EngineState
from gezel_trio.host import Host

from .conftest import make_config, pids_alive, running
from .fake_engine import open_fake_engine
from .fault_tools import (
    resume_and_kill,
    slots_busy,
    wait_nothing_held,
    wait_until,
)

CHAT = {"messages": [{"role": "user", "content": "Tell me a long story."}], "temperature": 0}
LONG = {**CHAT, "max_tokens": 4000, "ignore_eos": True}


def _tiny(tiny_model: Path, **kw: Any) -> ModelConfig:
    return ModelConfig(id="tiny", path=str(tiny_model), parallel=2, ctx_per_slot=4096, **kw)


def _cfg(
    models: list[ModelConfig], state_dir: Path, engine_binary: EngineBinary | None, **engine: object
) -> Config:
    return make_config(models, state_dir=state_dir, engine_binary=engine_binary, engine=engine)


async def _warm(client: httpx.AsyncClient, model: str = "tiny") -> None:
    resp = await client.post("/v1/chat/completions", json={**CHAT, "model": model, "max_tokens": 2})
    assert resp.status_code == 200, resp.text


def _error_of(payload: str) -> dict[str, Any]:
    parsed = json.loads(payload)
    assert isinstance(parsed, dict) and "error" in parsed, payload
    err = parsed["error"]
    assert isinstance(err, dict)
    return err


async def _status(client: httpx.AsyncClient) -> dict[str, Any]:
    resp = await client.get("/api/status")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert isinstance(body, dict)
    return body


def _engine_status(status: dict[str, Any], model: str) -> dict[str, Any]:
    for eng in status["engines"]:
        if eng["model"] == model:
            assert isinstance(eng, dict)
            return eng
    raise AssertionError(f"{model} not in status: {status['engines']}")


async def _expect_recovers(host: Host, client: httpx.AsyncClient, old_pid: int | None) -> None:
    resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
    assert resp.status_code == 200, resp.text
    engine = host.models["tiny"].engine
    assert engine.state.value is EngineState.READY
    assert engine.pid is not None and engine.pid != old_pid
    await wait_nothing_held(host)


# --------------------------------------------------------------------------- SIGKILL


async def test_sigkill_mid_stream_and_mid_request(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """One SIGKILL while a stream and a non-streaming request are both generating."""
    with trio.fail_after(90):
        async with running(_cfg([_tiny(tiny_model)], state_dir, engine_binary)) as (host, client):
            engine = host.models["tiny"].engine
            await _warm(client)
            pid = engine.pid
            assert pid is not None and engine.base_url is not None
            unary: dict[str, httpx.Response] = {}

            async def non_streaming() -> None:
                unary["resp"] = await client.post("/v1/chat/completions", json=LONG)

            events: list[str] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(non_streaming)
                async with client.stream(
                    "POST", "/v1/chat/completions", json={**LONG, "stream": True}
                ) as sresp:
                    assert sresp.status_code == 200
                    lines = sresp.aiter_lines()
                    async for line in lines:
                        if line.startswith("data: "):
                            events.append(line[6:])
                        if len(events) >= 3:
                            break
                    # both requests are on the engine now
                    await wait_until(
                        lambda: _both_busy(engine.base_url), within=10, what="two busy slots"
                    )
                    os.kill(pid, signal.SIGKILL)
                    async for line in lines:
                        if line.startswith("data: "):
                            events.append(line[6:])
            # streaming: tokens, then one error event, then the end (no [DONE])
            assert events[-1] != "[DONE]", events[-3:]
            err = _error_of(events[-1])
            assert err["code"] == "engine_crashed", err
            assert "tiny" in err["message"]
            assert all("error" not in json.loads(e) for e in events[:-1])
            # non-streaming: a 502/503 with an OpenAI-shaped error naming the model
            resp = unary["resp"]
            assert resp.status_code in (502, 503), resp.text
            uerr = resp.json()["error"]
            assert uerr["code"] in ("engine_crashed", "engine_failed"), uerr
            assert "tiny" in uerr["message"]

            await engine.state.wait_value(EngineState.FAILED)
            eng = _engine_status(await _status(client), "tiny")
            assert eng["state"] == "failed" and "SIGKILL" in (eng["last_crash"] or ""), eng
            assert eng["crashes"] == 1
            await wait_nothing_held(host)
            assert pids_alive([pid]) == []
            await _expect_recovers(host, client, pid)
            assert engine.starts == 2


async def _both_busy(base_url: str | None) -> bool:
    assert base_url is not None
    return len(await slots_busy(base_url)) == 2


async def test_sigkill_while_queued_requests_wait(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """Requests queued behind a crashing engine are not stranded: each gets an answer."""
    with trio.fail_after(90):
        model = ModelConfig(id="tiny", path=str(tiny_model), parallel=1, ctx_per_slot=4096)
        async with running(_cfg([model], state_dir, engine_binary)) as (host, client):
            engine = host.models["tiny"].engine
            await _warm(client)
            pid = engine.pid
            assert pid is not None
            statuses: list[int] = []

            async def one(body: dict[str, Any]) -> None:
                resp = await client.post("/v1/chat/completions", json=body)
                statuses.append(resp.status_code)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, LONG)
                await wait_until(
                    lambda: _running(host) == 1, within=10, what="the long request running"
                )
                # killed once its answer has begun (before that, the host sends it again)
                base_url = engine.base_url
                assert base_url is not None
                await wait_until(lambda: _decoding(base_url), within=10, what="tokens generated")
                for _ in range(3):
                    nursery.start_soon(one, {**CHAT, "max_tokens": 4})
                scheduler = host.scheduler
                assert scheduler is not None
                await wait_until(
                    lambda: scheduler.statistics().queued == 3,
                    within=10,
                    what="three queued",
                )
                os.kill(pid, signal.SIGKILL)
            # the killed request fails; the queued ones never reached the engine and are
            # served by the lazily restarted one
            assert sorted(statuses) == [200, 200, 200, 502], statuses
            await wait_nothing_held(host)
            await _expect_recovers(host, client, pid)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_the_engine_died_before_answering_is_sent_again(
    models_dir: Path, state_dir: Path, engine_binary: EngineBinary, stream: bool
) -> None:
    """SIGKILL during the prefill of a long prompt, before any token: nothing of the answer
    reached the client, so the host sends the request again to the restarted engine, and
    the client gets a whole answer (a stream ends with [DONE])."""
    from gezel_trio.engine.demo_model import write_demo_model

    small = write_demo_model(models_dir / "small.gguf", size="small")
    model = ModelConfig(id="small", path=str(small), parallel=1, ctx_per_slot=4096)
    body = {"model": "small", "prompt": [300 + i % 300 for i in range(3000)], "n_predict": 4}
    with trio.fail_after(120):
        async with running(_cfg([model], state_dir, engine_binary)) as (host, client):
            engine = host.models["small"].engine
            await _warm(client, "small")
            pid, base_url = engine.pid, engine.base_url
            assert pid is not None and base_url is not None
            outcome: dict[str, Any] = {}

            async def send() -> None:
                if not stream:
                    outcome["resp"] = await client.post("/completion", json=body)
                    return
                async with client.stream(
                    "POST", "/completion", json={**body, "stream": True}
                ) as resp:
                    outcome["resp"] = resp
                    outcome["lines"] = [line async for line in resp.aiter_lines() if line]

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send)
                # its prefill runs (about a second on this model): kill before any token
                await wait_until(
                    lambda: _one_busy(base_url), within=10, interval=0.01, what="prefill"
                )
                os.kill(pid, signal.SIGKILL)
            resp = outcome["resp"]
            assert resp.status_code == 200
            if stream:
                events = [json.loads(line[6:]) for line in outcome["lines"]]
                assert not any("error" in e for e in events), events[-1]
                assert events[-1].get("stop") is True
            else:
                assert resp.json()["tokens_predicted"] == 4, resp.text
            assert engine.starts == 2 and engine.pid != pid  # on the restarted engine
            await wait_nothing_held(host)
            # counted, so a soak can tell a resend from a duplicate
            status = (await client.get("/api/status")).json()
            assert status["completions"]["resent"] == 1


async def _decoding(base_url: str) -> bool:
    """The engine's busy slot has generated tokens (its own ``/slots``)."""
    async with httpx.AsyncClient(timeout=2.0) as direct:
        rows = (await direct.get(base_url + "/slots")).json()
    for row in rows:
        nxt = row.get("next_token")
        decoded = [t.get("n_decoded", 0) for t in (nxt if isinstance(nxt, list) else [nxt or {}])]
        if row.get("is_processing") and max(decoded, default=0) >= 8:
            return True
    return False


async def _one_busy(base_url: str) -> bool:
    return len(await slots_busy(base_url)) == 1


def _running(host: Host) -> int:
    assert host.scheduler is not None
    return sum(host.scheduler.statistics().running.values())


# --------------------------------------------------------------------------- hang (SIGSTOP)


async def test_hung_engine_times_out_with_a_clear_error(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """SIGSTOP: a request gets 504 after the configured time; SIGCONT and it serves again."""
    timeout = 2.0
    cfg = _cfg(
        [_tiny(tiny_model)],
        state_dir,
        engine_binary,
        request_timeout=timeout,
        health_interval=0.5,
        health_failures=1000,  # this test is about the request timeout, not the restart
        stop_grace=1.0,
    )
    pid: int | None = None
    try:
        with trio.fail_after(90):
            async with running(cfg) as (host, client):
                engine = host.models["tiny"].engine
                await _warm(client)
                pid = engine.pid
                assert pid is not None
                events: list[str] = []
                async with client.stream(
                    "POST", "/v1/chat/completions", json={**LONG, "stream": True}
                ) as sresp:
                    assert sresp.status_code == 200
                    lines = sresp.aiter_lines()
                    async for line in lines:
                        if line.startswith("data: "):
                            events.append(line[6:])
                        if len(events) >= 2:
                            break
                    os.kill(pid, signal.SIGSTOP)
                    t0 = trio.current_time()
                    async for line in lines:
                        if line.startswith("data: "):
                            events.append(line[6:])
                    stream_took = trio.current_time() - t0
                err = _error_of(events[-1])
                assert err["code"] == "engine_timeout", err
                assert f"{timeout:g}s" in err["message"], err
                assert timeout - 0.5 <= stream_took <= timeout + 3, stream_took

                t0 = trio.current_time()
                resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
                took = trio.current_time() - t0
                assert resp.status_code == 504, resp.text
                uerr = resp.json()["error"]
                assert uerr["code"] == "engine_timeout" and f"{timeout:g}s" in uerr["message"]
                # the request timeout, plus at most one bounded /slots measurement
                assert timeout - 0.5 <= took <= timeout + 2 + 2, took
                await wait_nothing_held(host)
                assert engine.state.value is EngineState.READY  # never judged dead here

                os.kill(pid, signal.SIGCONT)
                resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
                assert resp.status_code == 200, resp.text
                assert engine.pid == pid  # the same process serves again
                await wait_nothing_held(host)
    finally:
        resume_and_kill([pid])


async def test_hung_engine_is_noticed_and_restarted(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """SIGSTOP: failed health checks make the supervisor kill and (lazily) restart it."""
    cfg = _cfg(
        [_tiny(tiny_model)],
        state_dir,
        engine_binary,
        request_timeout=3.0,
        health_interval=0.5,
        health_failures=2,
        stop_grace=1.0,
    )
    pid: int | None = None
    try:
        with trio.fail_after(90):
            async with running(cfg) as (host, client):
                engine = host.models["tiny"].engine
                await _warm(client)
                pid = engine.pid
                assert pid is not None
                result: dict[str, httpx.Response] = {}

                async def in_flight() -> None:
                    result["resp"] = await client.post("/v1/chat/completions", json=LONG)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(in_flight)
                    await wait_until(lambda: _running(host) == 1, within=10, what="running")
                    base_url = engine.base_url
                    assert base_url is not None
                    await wait_until(
                        lambda: _decoding(base_url), within=10, what="tokens generated"
                    )
                    os.kill(pid, signal.SIGSTOP)
                    t0 = trio.current_time()
                    await engine.state.wait_value(EngineState.FAILED)
                    noticed = trio.current_time() - t0
                # two failed checks, 0.5 s apart, each bounded by 0.5 s
                assert noticed <= 4.0, noticed
                assert "/health" in (engine.last_crash or ""), engine.last_crash
                resp = result["resp"]
                if host.completions.statistics().resent:
                    # On a starved machine the host may not have read a single event
                    # before the stop: then nothing of the answer reached anyone, and it
                    # is sent again, by design, once, to the restarted engine.
                    assert host.completions.statistics().resent == 1
                    assert resp.status_code == 200, resp.text
                else:
                    assert resp.status_code in (502, 503, 504), resp.text
                    assert resp.json()["error"]["code"] in (
                        "engine_crashed",
                        "engine_timeout",
                        "engine_failed",
                    )
                await wait_until(lambda: not pids_alive([pid or -1]), within=5, what="old pid gone")
                eng = _engine_status(await _status(client), "tiny")
                assert eng["crashes"] == 1 and "/health" in eng["last_crash"], eng
                await wait_nothing_held(host)
                await _expect_recovers(host, client, pid)
    finally:
        resume_and_kill([pid])


async def test_hung_engine_does_not_stall_another_model(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """While one model's engine hangs, requests for another model keep flowing."""
    pid: int | None = None
    try:
        async with open_fake_engine(parallel=2) as (fake_url, _fake):
            cfg = _cfg(
                [_tiny(tiny_model), ModelConfig(id="fake", url=fake_url, parallel=2)],
                state_dir,
                engine_binary,
                request_timeout=3.0,
                health_interval=0.5,
                health_failures=1000,
                stop_grace=1.0,
            )
            with trio.fail_after(90):
                async with running(cfg) as (host, client):
                    await _warm(client)
                    await _warm(client, "fake")
                    pid = host.models["tiny"].engine.pid
                    assert pid is not None
                    os.kill(pid, signal.SIGSTOP)
                    latencies: list[float] = []
                    hung: list[httpx.Response] = []

                    async def hung_request() -> None:
                        body = {**CHAT, "model": "tiny", "max_tokens": 4}
                        hung.append(await client.post("/v1/chat/completions", json=body))

                    async with trio.open_nursery() as nursery:
                        for _ in range(3):
                            nursery.start_soon(hung_request)
                        await trio.sleep(0.2)
                        for i in range(10):
                            t0 = trio.current_time()
                            resp = await client.post(
                                "/v1/chat/completions",
                                json={
                                    **CHAT,
                                    "model": "fake",
                                    "max_tokens": 2,
                                    "x_marker": f"m{i}",
                                },
                            )
                            latencies.append(trio.current_time() - t0)
                            assert resp.status_code == 200, resp.text
                    assert [r.status_code for r in hung] == [504, 504, 504]
                    # a hung engine must not hold up the dispatcher for everyone
                    assert max(latencies) < 1.0, latencies
                    os.kill(pid, signal.SIGCONT)
                    await wait_nothing_held(host)
    finally:
        resume_and_kill([pid])


# --------------------------------------------------------------------------- failed starts


def _engine_rejecting_copy(tiny_model: Path, dest: Path) -> Path:
    """A copy of the tiny model that parses as GGUF but that llama-server refuses to load
    (its tokenizer model is renamed to one llama.cpp does not know)."""
    data = bytearray(tiny_model.read_bytes())
    key = b"tokenizer.ggml.model"
    at = data.find(key) + len(key) + 4 + 8  # value type (u32), string length (u64)
    assert data[at : at + 5] == b"llama", "the demo model's tokenizer is not 'llama'"
    data[at : at + 5] = b"zzzzz"
    dest.write_bytes(bytes(data))
    return dest


async def test_bad_model_files_are_clear_503s_and_others_keep_serving(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, tmp_path: Path
) -> None:
    """A non-GGUF file (refused before spawn) and a GGUF the engine cannot load (it exits
    during start): each a 503 naming the cause; the model configured alongside serves."""
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"this is not a GGUF file\n" * 64)
    bad_tok = _engine_rejecting_copy(tiny_model, tmp_path / "badtok.gguf")
    cfg = _cfg(
        [
            ModelConfig(id="notgguf", path=str(not_gguf), parallel=1, ctx_per_slot=256),
            ModelConfig(id="badtok", path=str(bad_tok), parallel=1, ctx_per_slot=256),
            _tiny(tiny_model),
        ],
        state_dir,
        engine_binary,
    )
    with trio.fail_after(90):
        async with running(cfg) as (host, client):
            resp = await client.post("/v1/chat/completions", json={**CHAT, "model": "notgguf"})
            assert resp.status_code == 503, resp.text
            err = resp.json()["error"]
            assert err["code"] == "engine_failed", err
            assert "'notgguf'" in err["message"] and "GGUF" in err["message"], err

            resp = await client.post("/v1/chat/completions", json={**CHAT, "model": "badtok"})
            assert resp.status_code == 503, resp.text
            err = resp.json()["error"]
            assert err["code"] == "engine_failed", err
            msg = err["message"]
            assert "'badtok'" in msg and "exited during start" in msg, msg
            assert "failed to load model" in msg, msg  # the engine's own words
            # a streaming ask gets the same clear 503 (no stream is opened)
            async with client.stream(
                "POST", "/v1/chat/completions", json={**CHAT, "model": "badtok", "stream": True}
            ) as sresp:
                assert sresp.status_code == 503
                body = json.loads(await sresp.aread())
                assert body["error"]["code"] == "engine_failed"
            # the other model serves
            await _warm(client, "tiny")
            status = await _status(client)
            for bad in ("notgguf", "badtok"):
                eng = _engine_status(status, bad)
                assert eng["state"] == "failed" and eng["failure"], eng
                assert host.models[bad].engine.pid is None
            await wait_nothing_held(host)


async def test_engine_exiting_at_start_names_its_output(
    state_dir: Path, tmp_path: Path, tiny_model: Path
) -> None:
    """A binary that exits at once: 503 with its exit code and its last output lines."""
    script = tmp_path / "llama-server"
    script.write_text("#!/bin/sh\necho 'fatal: simulated engine start failure' >&2\nexit 3\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    async with open_fake_engine(parallel=1) as (fake_url, _):
        cfg = make_config(
            [_tiny(tiny_model), ModelConfig(id="fake", url=fake_url, parallel=1)],
            state_dir=state_dir,
            engine={"binary": str(script)},
        )
        with trio.fail_after(60):
            async with running(cfg) as (host, client):
                resp = await client.post("/v1/chat/completions", json={**CHAT, "model": "tiny"})
                assert resp.status_code == 503, resp.text
                msg = resp.json()["error"]["message"]
                assert "code 3" in msg and "simulated engine start failure" in msg, msg
                await _warm(client, "fake")
                await wait_nothing_held(host)


async def test_missing_binary_is_a_clear_503_and_external_models_serve(
    state_dir: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No llama-server anywhere: 503 ``engine_not_found`` listing what was tried."""
    import gezel_trio.engine.binary as binary_mod

    missing = "/nonexistent/gezel-test/llama-server"
    monkeypatch.setenv("GEZEL_LLAMA_SERVER", missing)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    monkeypatch.setattr(binary_mod, "_wheel_binary", lambda: (None, "disabled by the test"))
    monkeypatch.setattr(binary_mod, "built_engine_path", lambda: tmp_path / "no-built-engine")
    async with open_fake_engine(parallel=1) as (fake_url, _):
        cfg = make_config(
            [_tiny(tiny_model), ModelConfig(id="fake", url=fake_url, parallel=1)],
            state_dir=state_dir,
        )
        with trio.fail_after(60):
            async with running(cfg) as (host, client):
                resp = await client.post("/v1/chat/completions", json={**CHAT, "model": "tiny"})
                assert resp.status_code == 503, resp.text
                err = resp.json()["error"]
                assert err["code"] == "engine_not_found", err
                assert missing in err["message"] and "Tried" in err["message"], err
                await _warm(client, "fake")
                status = await _status(client)
                assert status["engine_binary"]["error"], status["engine_binary"]
                await wait_nothing_held(host)


async def test_port_taken_at_spawn_is_a_clear_503_then_recovers(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Force the free-port race: the port the supervisor picked is taken before the bind."""
    import gezel_trio.engine.supervisor as supervisor_mod

    real_free_port = supervisor_mod.free_port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(1)
        taken = squatter.getsockname()[1]
        monkeypatch.setattr(supervisor_mod, "free_port", lambda: taken)
        cfg = _cfg([_tiny(tiny_model)], state_dir, engine_binary)
        with trio.fail_after(90):
            async with running(cfg) as (host, client):
                resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
                assert resp.status_code == 503, resp.text
                msg = resp.json()["error"]["message"]
                assert "bind" in msg.lower() or "address" in msg.lower(), msg
                monkeypatch.setattr(supervisor_mod, "free_port", real_free_port)
                squatter.close()
                with trio.fail_after(30):
                    while True:  # the supervisor backs off after repeated failures
                        resp = await client.post(
                            "/v1/chat/completions", json={**CHAT, "max_tokens": 4}
                        )
                        if resp.status_code == 200:
                            break
                        assert resp.status_code == 503, resp.text
                        await trio.sleep(0.5)
                await wait_nothing_held(host)


def test_port_in_use_sees_a_listener_and_nothing_else() -> None:
    from gezel_trio.engine.ports import free_port, port_in_use

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        assert port_in_use(port)
    assert not port_in_use(port)
    assert not port_in_use(free_port())


async def test_no_room_in_the_ledger_is_a_clear_503_then_recovers(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """Another daemon holds the whole device budget in the shared ledger: the engine is
    not started, the 503 says who holds the bytes, the external model keeps serving, and
    the engine starts once the bytes are released."""
    from gezel_trio.gpu.ledger import open_ledger, system_ram_bytes

    everything = system_ram_bytes()
    async with (
        open_fake_engine(parallel=1) as (fake_url, _),
        open_ledger(state_dir / "ledger.sqlite", capacities={"cpu": everything}) as other,
    ):
        held = await other.reserve("cpu", everything, owner="other-daemon", model="huge-model")
        cfg = _cfg(
            [_tiny(tiny_model), ModelConfig(id="fake", url=fake_url, parallel=1)],
            state_dir,
            engine_binary,
        )
        with trio.fail_after(60):
            async with running(cfg) as (host, client):
                resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
                assert resp.status_code == 503, resp.text
                err = resp.json()["error"]
                assert err["code"] == "no_capacity", err
                assert "'tiny'" in err["message"] and "reserved" in err["message"], err
                assert host.models["tiny"].engine.pid is None  # never spawned
                status = await _status(client)
                assert status["ledger"]["held"] == 0, status["ledger"]
                await _warm(client, "fake")
                await wait_nothing_held(host)

                await other.release(held)
                with trio.fail_after(30):
                    while True:  # the supervisor may back off after the failure
                        resp = await client.post(
                            "/v1/chat/completions", json={**CHAT, "max_tokens": 2}
                        )
                        if resp.status_code == 200:
                            break
                        assert resp.status_code == 503, resp.text
                        await trio.sleep(0.5)
                status = await _status(client)
                assert status["ledger"]["held"] == 1, status["ledger"]
                await wait_nothing_held(host)


async def test_no_capacity_names_who_holds_the_bytes(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """The ledger's own denial names every holder (pid, model, owner, bytes); the 503 an
    engine start gets when the planner finds no room must say as much, and never show a
    negative amount of free memory."""
    from gezel_trio.gpu.ledger import open_ledger, system_ram_bytes

    everything = system_ram_bytes()
    async with open_ledger(state_dir / "ledger.sqlite", capacities={"cpu": everything}) as other:
        await other.reserve("cpu", everything, owner="other-daemon", model="huge-model")
        cfg = _cfg([_tiny(tiny_model)], state_dir, engine_binary)
        with trio.fail_after(60):
            async with running(cfg) as (_host, client):
                resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
    assert resp.status_code == 503, resp.text
    msg = resp.json()["error"]["message"]
    assert "huge-model" in msg and "other-daemon" in msg, msg
    assert " -" not in msg.replace(" - ", ""), msg  # no negative byte counts
