"""``gezel-trio serve`` and ``check-config`` on a user's mistake: one line, no traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gezel_trio.engine.binary import EngineBinary


@pytest.fixture
def env(tmp_path: Path, engine_binary: EngineBinary) -> dict[str, str]:
    return dict(
        os.environ,
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        XDG_STATE_HOME=str(tmp_path / "state"),
        GEZEL_LLAMA_SERVER=str(engine_binary.path),
    )


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port on 127.0.0.1 that someone else is listening on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def gezel(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gezel_trio.cli", *args],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )


def short_error(result: subprocess.CompletedProcess[str]) -> str:
    """The stderr of a failed run: non-zero, at most 3 lines, no traceback."""
    err = result.stderr
    assert result.returncode != 0, err
    assert "Traceback" not in err and "ExceptionGroup" not in err, err
    assert 1 <= len(err.strip().splitlines()) <= 3, err
    return err


def test_taken_port_names_the_port_and_what_to_change(env: dict[str, str], taken_port: int) -> None:
    result = gezel(env, "serve", "--port", str(taken_port))
    err = short_error(result)
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{taken_port}: address already in use" in err
    assert "[server] port or --port" in err


def test_taken_port_from_the_config_file(
    env: dict[str, str], taken_port: int, tmp_path: Path
) -> None:
    cfg = tmp_path / "gezel.toml"
    cfg.write_text(f"[server]\nport = {taken_port}\n")
    err = short_error(gezel(env, "serve", "--config", str(cfg)))
    assert f"127.0.0.1:{taken_port}" in err


@pytest.mark.parametrize("command", ["serve", "check-config"])
def test_missing_config_file_is_named(env: dict[str, str], tmp_path: Path, command: str) -> None:
    missing = tmp_path / "nope.toml"
    result = gezel(env, command, "--config", str(missing))
    assert str(missing) in short_error(result)
    assert result.returncode == 2


@pytest.mark.parametrize("command", ["serve", "check-config"])
def test_invalid_toml_names_the_file(env: dict[str, str], tmp_path: Path, command: str) -> None:
    cfg = tmp_path / "broken.toml"
    cfg.write_text("[server\nport = 1\n")
    result = gezel(env, command, "--config", str(cfg))
    err = short_error(result)
    assert str(cfg) in err and "not valid TOML" in err
    assert result.returncode == 2


@pytest.mark.parametrize("command", ["serve", "check-config"])
def test_invalid_value_names_the_key(env: dict[str, str], tmp_path: Path, command: str) -> None:
    cfg = tmp_path / "gezel.toml"
    cfg.write_text('[server]\nport = "eighty"\n')
    result = gezel(env, command, "--config", str(cfg))
    if command == "check-config":  # its report, with every other problem, on stdout
        assert "problem: server.port: expected an integer" in result.stdout, result.stdout
        assert "Traceback" not in result.stderr
    else:
        assert "server.port" in short_error(result)
    assert result.returncode == 2


@pytest.mark.parametrize("command", ["serve", "check-config"])
@pytest.mark.parametrize("kind", ["directory", "not-utf8"])
def test_unreadable_config_file_is_named(
    env: dict[str, str], tmp_path: Path, command: str, kind: str
) -> None:
    cfg = tmp_path / "gezel.toml"
    if kind == "directory":
        cfg.mkdir()
    else:
        cfg.write_bytes(b"[server]\nhost = '\xff\xfe'\n")
    result = gezel(env, command, "--config", str(cfg))
    err = short_error(result)
    assert str(cfg) in err and "cannot read" in err
    assert result.returncode == 2


@pytest.mark.parametrize(
    "args", [["serve", "--no-such-flag"], ["serve", "--port", "eighty"], ["check-config", "-x"]]
)
def test_bad_flag_is_a_usage_error(env: dict[str, str], args: list[str]) -> None:
    result = gezel(env, *args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("usage: gezel-trio")
    assert "Traceback" not in result.stderr
