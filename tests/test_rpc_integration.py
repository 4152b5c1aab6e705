"""A managed engine backed by a real ``ggml-rpc-server`` worker on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.ports import free_port
from gezel_trio.engine.rpc import unreachable, worker_binary
from gezel_trio.engine.supervisor import EngineState

from .conftest import make_config, running
from .fault_tools import wait_until

PROMPTS = [[10 + i, 20 + i, 30, 40, 50 + 2 * i] for i in range(4)]


class Worker:
    """``gezel-trio rpc-worker`` as a user starts it."""

    def __init__(self, port: int, engine_binary: EngineBinary) -> None:
        self.port = port
        self.engine_binary = engine_binary
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gezel_trio.cli", "rpc-worker", "--port", str(self.port),
             "--engine-binary", str(self.engine_binary.path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            assert self.proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(10)


@pytest.fixture
def worker(engine_binary: EngineBinary) -> Iterator[Worker]:
    if worker_binary(engine_binary.path) is None:
        pytest.fail(f"no ggml-rpc-server beside {engine_binary.path}", pytrace=False)
    w = Worker(free_port(), engine_binary)
    w.start()
    try:
        yield w
    finally:
        w.kill()


async def test_rpc_engine_answers_as_the_local_one_and_names_a_lost_worker(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, worker: Worker
) -> None:
    endpoint = f"127.0.0.1:{worker.port}"
    cfg = make_config(
        [
            ModelConfig(id="local", path=str(tiny_model), parallel=1, ctx_per_slot=256),
            ModelConfig(
                id="remote", path=str(tiny_model), parallel=1, ctx_per_slot=256, rpc=[endpoint]
            ),
        ],
        state_dir=state_dir,
        engine_binary=engine_binary,
    )

    async def answer(client: object, model: str, prompt: list[int]) -> str:
        body = {"model": model, "prompt": prompt, "n_predict": 8, "temperature": 0}
        r = await client.post("/completion", json=body)  # type: ignore[attr-defined]
        assert r.status_code == 200, r.text
        return str(r.json()["content"])

    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            local = [await answer(client, "local", p) for p in PROMPTS]
            remote = [await answer(client, "remote", p) for p in PROMPTS]
            assert remote == local  # greedy answers through the worker match the local engine
            rt = host.models["remote"]
            argv = rt.engine.argv
            assert argv[argv.index("--rpc") + 1] == endpoint
            assert int(argv[argv.index("--n-gpu-layers") + 1]) > 0  # layers go to the worker
            assert endpoint in (rt.plan or {}).get("rpc_workers", "")

            worker.kill()

            # the worker's socket closes as the kernel reaps it
            async def worker_gone() -> bool:
                return await unreachable([endpoint]) == [endpoint]

            await wait_until(worker_gone, within=10, what="the worker gone")
            body = {"model": "remote", "prompt": PROMPTS[0], "n_predict": 8, "temperature": 0}
            r = await client.post("/completion", json=body)
            assert r.status_code in (502, 503), r.text
            with trio.fail_after(10):
                await rt.engine.state.wait_value(lambda s: s is not EngineState.READY)
            r = await client.post("/completion", json=body)  # the restart cannot reach it
            assert r.status_code == 503
            assert f"RPC worker {endpoint} is unreachable" in r.json()["error"]["message"]
            assert f"RPC worker {endpoint} is unreachable" in (
                rt.engine.failure or rt.engine.last_crash or ""
            )
            assert await answer(client, "local", PROMPTS[0]) == local[0]  # the rest serves on

            worker.start()  # it comes back: so does the engine, on the next request
            with trio.fail_after(60):
                while True:
                    r = await client.post("/completion", json=body)
                    if r.status_code == 200:
                        break
                    await trio.sleep(0.5)
            assert r.json()["content"] == local[0]
