"""The client commands against a real host process: ps, status, load, unload, logs (-f),
sessions, and a host that is not there."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.ports import free_port

from .conftest import host_process


@pytest.fixture
def host_url(tmp_path: Path, tiny_model: Path, engine_binary: EngineBinary) -> Iterator[str]:
    port = free_port()
    cfg = tmp_path / "gezel.toml"
    cfg.write_text(
        f'[server]\nport = {port}\napi_keys = ["k-user"]\nadmin_keys = ["k-admin"]\n'
        f'[engine]\nstate_dir = "{tmp_path / "state"}"\nbinary = "{engine_binary.path}"\n'
        f'[[models]]\nid = "tiny"\npath = "{tiny_model}"\nparallel = 2\nctx_per_slot = 512\n'
    )
    with host_process(cfg, port):
        yield f"http://127.0.0.1:{port}"


def _cli(
    *args: str, key: str | None = "k-admin", url: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEZEL_")}
    if url is not None:
        env["GEZEL_URL"] = url
    if key is not None:
        env["GEZEL_API_KEY"] = key
    return subprocess.run(
        [sys.executable, "-m", "gezel_trio.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_ps_load_unload_and_status(host_url: str) -> None:
    result = _cli("ps", url=host_url)
    assert result.returncode == 0, result.stderr
    header, row = result.stdout.splitlines()
    assert header.split() == [
        "MODEL",
        "STATE",
        "MEMORY",
        "BUSY",
        "CONTEXT",
        "SESSIONS",
        "PARKED",
        "IDLE",
    ]
    assert row.split()[:2] == ["tiny", "stopped"]

    loaded = _cli("load", "tiny", url=host_url)
    assert loaded.returncode == 0 and loaded.stdout.strip() == "tiny: ready", loaded.stderr
    rows = json.loads(_cli("ps", "--json", url=host_url).stdout)
    assert rows[0]["MODEL"] == "tiny" and rows[0]["STATE"] == "ready"
    assert rows[0]["BUSY"] == "0/2" and rows[0]["MEMORY"].endswith("MiB")

    status = json.loads(_cli("status", "--json", url=host_url).stdout)
    assert status["engines"][0]["state"] == "ready" and "scheduler" in status
    assert _cli("status", url=host_url).stdout.startswith("gezel-trio ")

    unloaded = _cli("unload", "tiny", url=host_url)
    assert unloaded.returncode == 0 and unloaded.stdout.strip() == "tiny: stopped"


def test_logs_and_logs_follow(host_url: str) -> None:
    assert _cli("load", "tiny", url=host_url).returncode == 0
    logs = _cli("logs", "tiny", "-n", "5", url=host_url)
    assert logs.returncode == 0 and len(logs.stdout.splitlines()) == 5
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEZEL_")}
    env.update(GEZEL_URL=host_url, GEZEL_API_KEY="k-admin")
    follow = subprocess.Popen(
        [sys.executable, "-m", "gezel_trio.cli", "logs", "tiny", "-f", "-n", "1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # Read the follower's lines as they come, and wait on them, not on the clock: a
    # busy machine may take seconds to start it or to pass a line on.
    seen: queue.Queue[str] = queue.Queue()
    assert follow.stdout is not None

    def read_lines() -> None:
        for line in follow.stdout or ():
            seen.put(line)

    reader = threading.Thread(target=read_lines)
    reader.start()
    lines: list[str] = []

    def read_until(done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 60
        while not done() and time.monotonic() < deadline:
            try:
                lines.append(seen.get(timeout=0.2).rstrip("\n"))
            except queue.Empty:
                pass

    try:
        read_until(lambda: len(lines) >= 1)  # the follower is there: its first line
        headers = {"Authorization": "Bearer k-user"}
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        r = httpx.post(host_url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200
        read_until(lambda: any("print_timing" in line or "prompt" in line for line in lines[1:]))
    finally:
        follow.terminate()
        follow.wait(timeout=10)
        reader.join(timeout=10)
        err = follow.stderr.read() if follow.stderr is not None else ""
    assert len(lines) > 1, err  # the first line, then what the request logged
    assert any("print_timing" in line or "prompt" in line for line in lines[1:]), lines


def test_errors_are_one_line(host_url: str, tmp_path: Path) -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    result = _cli("ps", url=nobody)
    assert result.returncode == 1
    assert result.stderr.startswith(f"gezel-trio: no gezel-trio host answers at {nobody}")
    assert len(result.stderr.strip().splitlines()) == 1
    wrong = _cli("ps", url=host_url, key="k-user")  # not an admin key
    assert wrong.returncode == 1 and "403" in wrong.stderr and "admin key" in wrong.stderr
    unknown = _cli("load", "nope", url=host_url)
    assert unknown.returncode == 1 and "does not exist" in unknown.stderr
    assert "Traceback" not in unknown.stderr + wrong.stderr + result.stderr


def test_sessions_of_the_caller(host_url: str) -> None:
    headers = {"Authorization": "Bearer k-user"}
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "prompt_cache_key": "chat-1",
    }
    r = httpx.post(host_url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200
    mine = json.loads(_cli("sessions", "--json", url=host_url, key="k-user").stdout)
    assert len(mine["sessions"]) == 1 and mine["sessions"][0]["slots"]
    assert mine["sessions"][0]["name"] == "chat-1"  # the name its client sent, to its owner
    text = _cli("sessions", url=host_url, key="k-user").stdout.splitlines()
    assert text[0].split() == ["NAME", "SESSION", "IN", "SLOT", "PARKED"]
    assert text[1].startswith("chat-1") and "tiny#" in text[1]
    # the admin sees every caller's sessions, but not their names
    every = json.loads(_cli("sessions", "--json", url=host_url).stdout)["sessions"]
    assert [s["id"] for s in every] == [mine["sessions"][0]["id"]]
    assert every[0]["name"] is None
    # removed by its name; another caller's name of the same chat is not found
    gone = _cli("sessions", "rm", "chat-1", url=host_url, key="k-user")
    assert gone.returncode == 0 and "removed " + mine["sessions"][0]["id"] in gone.stdout
    again = _cli("sessions", "rm", "chat-1", url=host_url, key="k-user")
    assert again.returncode == 1 and "404" in again.stderr
    assert json.loads(_cli("sessions", "--json", url=host_url, key="k-user").stdout) == {
        "sessions": [],
        "kv_parking": True,
    }


def test_ps_says_why_a_model_failed_and_memory_only_while_held(
    tmp_path: Path, tiny_model: Path, engine_binary: EngineBinary
) -> None:
    """A model whose engine refuses its flags shows ``failed`` with the engine's own reason;
    memory shows for the engine that holds it, not for the stopped or failed one; and the
    URL may be given without its scheme."""
    port = free_port()
    cfg = tmp_path / "gezel.toml"
    cfg.write_text(
        f"[server]\nport = {port}\n"
        f'[engine]\nstate_dir = "{tmp_path / "state"}"\nbinary = "{engine_binary.path}"\n'
        f'[[models]]\nid = "tiny"\npath = "{tiny_model}"\nparallel = 2\nctx_per_slot = 512\n'
        f'[[models]]\nid = "broken"\npath = "{tiny_model}"\nparallel = 1\nctx_per_slot = 512\n'
        'args = ["--no-such-flag"]\n'
    )
    bare = f"127.0.0.1:{port}"  # no scheme
    with host_process(cfg, port):
        failed = _cli("load", "broken", url=bare, key=None)
        assert failed.returncode == 1 and "invalid argument: --no-such-flag" in failed.stderr
        assert _cli("load", "tiny", url=bare, key=None).returncode == 0
        result = _cli("ps", url=bare, key=None)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        rows = {line.split()[0]: line.split() for line in lines[1:3]}
        assert rows["tiny"][1] == "ready" and rows["tiny"][3] == "MiB"  # "67.9 MiB"
        assert rows["broken"][1:3] == ["failed", "-"]  # holds no memory
        (why,) = lines[3:]
        assert why.startswith("broken failed: ") and "--no-such-flag" in why, why
        rows_json = {r["MODEL"]: r for r in json.loads(_cli("ps", "--json", url=bare).stdout)}
        assert rows_json["broken"]["MEMORY"] is None and rows_json["tiny"]["REASON"] is None
        assert "--no-such-flag" in rows_json["broken"]["REASON"]
        status = _cli("status", url=bare, key=None)
        assert "broken failed: " in status.stdout and "--no-such-flag" in status.stdout
        assert _cli("unload", "tiny", url=bare, key=None).returncode == 0
        stopped = json.loads(_cli("ps", "--json", url=bare).stdout)
        assert {r["MODEL"]: r["MEMORY"] for r in stopped}["tiny"] is None


def test_a_server_that_is_not_a_host_is_named_so(
    tmp_path: Path, tiny_model: Path, engine_binary: EngineBinary
) -> None:
    """Pointed at a plain llama-server (it answers, but /api/status is 404), every client
    command says that this is not a gezel-trio host, in one line."""
    port = free_port()
    proc = subprocess.Popen(
        [str(engine_binary.path), "-m", str(tiny_model), "--port", str(port), "-c", "256"],
        env=engine_binary.launch_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:  # until the server answers
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        for args in (("ps",), ("status",), ("load", "tiny"), ("sessions",)):
            result = _cli(*args, url=f"127.0.0.1:{port}")
            assert result.returncode == 1, result
            err = result.stderr.strip()
            assert err.startswith(f"gezel-trio: http://127.0.0.1:{port} is not a gezel-trio host")
            assert "a plain llama-server answers there" in err and len(err.splitlines()) == 1
    finally:
        proc.terminate()
        proc.wait(30)


def test_ps_rows_from_a_status() -> None:
    from gezel_trio.cli.client import failure_of, normalize_url, ps_json, ps_text

    plan = {"total_bytes": 71_248_128}
    status = {
        "engines": [
            {"model": "a", "state": "ready", "plan": plan, "parallel": 2, "idle_seconds": 3},
            {"model": "b", "state": "stopped", "plan": plan},
            {"model": "c", "state": "failed", "plan": plan, "failure": "exited (code 1): boom"},
            {"model": "d", "state": "starting", "plan": plan, "failure": "restart backoff 2.0s"},
            {"model": "e", "state": "ready", "external": True},
        ]
    }
    rows = {r["MODEL"]: r for r in ps_json(status)}
    assert rows["a"]["MEMORY"] == "67.9 MiB" and rows["d"]["MEMORY"] == "67.9 MiB"
    assert rows["b"]["MEMORY"] is None and rows["c"]["MEMORY"] is None
    assert rows["e"]["MEMORY"] == "external"
    assert rows["c"]["REASON"] == "exited (code 1): boom" and rows["a"]["REASON"] is None
    assert failure_of({"state": "failed", "last_crash": "x"}) == "x"
    assert ps_text(status).splitlines()[-2:] == [
        "c failed: exited (code 1): boom",
        "d starting: restart backoff 2.0s",
    ]
    assert normalize_url("127.0.0.1:8080/") == "http://127.0.0.1:8080"
    assert normalize_url("https://h:1") == "https://h:1"
