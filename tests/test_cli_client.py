"""The client commands against a real host process: ps, status, load, unload, logs (-f),
sessions, and a host that is not there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.supervisor import free_port

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
    assert header.split() == ["MODEL", "STATE", "MEMORY", "BUSY", "SESSIONS", "PARKED", "IDLE"]
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
    try:
        time.sleep(1.5)
        headers = {"Authorization": "Bearer k-user"}
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        r = httpx.post(host_url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200
        time.sleep(1.5)
    finally:
        follow.terminate()
        out, err = follow.communicate(timeout=10)
    lines = out.splitlines()
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
    text = _cli("sessions", url=host_url, key="k-user").stdout.splitlines()
    assert text[0].split() == ["SESSION", "IN", "SLOT", "PARKED"] and "tiny#" in text[1]
