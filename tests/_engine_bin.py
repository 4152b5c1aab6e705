"""Test helpers: find the llama-server binary and run a real one (or an sd-server) under
Trio.

``llama_server_command`` looks the binary up the way the host does.
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx
import trio

from gezel_trio.engine.binary import resolve_engine
from gezel_trio.engine.ports import free_port

# llama-server closes keep-alive connections on its own schedule; a direct client
# that reuses one can meet "server disconnected without sending a response".
ENGINE_LIMITS = httpx.Limits(max_keepalive_connections=0)


def llama_server_command() -> tuple[Path, dict[str, str]]:
    """The llama-server binary the host would use, and the environment to exec it with."""
    found = resolve_engine()
    return found.path, found.launch_env()


@dataclass
class LlamaServer:
    base_url: str
    log_path: Path
    argv: list[str]
    process: trio.Process | None = field(default=None, repr=False)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.returncode


@asynccontextmanager
async def open_llama_server(
    model: Path,
    *,
    parallel: int,
    ctx: int,
    extra_args: Sequence[str] = (),
    ready_timeout: float = 60.0,
) -> AsyncIterator[LlamaServer]:
    """Start a real llama-server on a free port; yield once ``/health`` is 200.

    On exit (or cancellation) the process gets SIGTERM and, 5 s later, SIGKILL;
    the block does not return before the process is gone.
    """
    binary, env = llama_server_command()
    port = free_port()
    argv = [
        str(binary),
        "-m",
        str(model),
        "--parallel",
        str(parallel),
        "-c",
        str(ctx),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra_args,
    ]
    with tempfile.TemporaryDirectory(prefix="gezel-llama-test-") as tmp:
        async with run_llama_server(
            argv, env, Path(tmp) / "server.log", port=port, ready_timeout=ready_timeout
        ) as server:
            yield server


@asynccontextmanager
async def run_llama_server(
    argv: Sequence[str],
    env: Mapping[str, str],
    log_path: Path,
    *,
    port: int,
    ready_timeout: float = 60.0,
    ready_path: str = "/health",
) -> AsyncIterator[LlamaServer]:
    """Run ``argv`` (a llama-server listening on ``port``, or another engine: sd-server
    has no ``/health``, ``ready_path`` names what answers 200 once it is ready), logging
    to ``log_path``; yield once ``ready_path`` is 200. Leaving the block (or
    cancellation) stops it."""
    argv = list(argv)
    server = LlamaServer(base_url=f"http://127.0.0.1:{port}", log_path=log_path, argv=argv)
    with log_path.open("wb") as log:
        async with trio.open_nursery() as nursery:
            server.process = await nursery.start(
                partial(
                    trio.run_process,
                    argv,
                    env=dict(env),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    check=False,
                )
            )
            try:
                with trio.fail_after(ready_timeout):
                    await _wait_healthy(server, ready_path)
                yield server
            finally:
                nursery.cancel_scope.cancel()


async def _wait_healthy(server: LlamaServer, ready_path: str) -> None:
    async with httpx.AsyncClient(limits=ENGINE_LIMITS, timeout=2.0) as client:
        while True:
            if server.returncode is not None:
                raise RuntimeError(
                    f"{Path(server.argv[0]).name} exited with {server.returncode} while "
                    "loading:\n" + server.log_tail()
                )
            try:
                r = await client.get(server.base_url + ready_path)
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await trio.sleep(0.05)
