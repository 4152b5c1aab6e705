"""``gezel-trio serve`` as a user runs it: a real process, signals, no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.supervisor import free_port

from .conftest import pids_alive


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
    """The quick start's command: no config serves the demo model. A second Ctrl-C and a
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
                "model": "demo",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
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
        body = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
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
