"""The engine pool against the GPU layer: memory pressure, thermal wait, ledger, planner."""

from __future__ import annotations

from pathlib import Path

import trio

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.supervisor import EngineState
from gezel_trio.gpu.probe import GpuReading, StaticProbe

from .conftest import make_config, running

GIB = 1024**3
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def _gpu(used_gib: float, *, temp: float = 50.0) -> GpuReading:
    return GpuReading(
        index=0,
        name="Fake GPU",
        temperature_c=temp,
        memory_used_bytes=int(used_gib * GIB),
        memory_total_bytes=24 * GIB,
    )


async def test_memory_pressure_releases_idle_engines_after_the_grace(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    probe = StaticProbe([_gpu(4.0)])
    cfg = make_config(
        [
            ModelConfig(id="idle", path=str(tiny_model), parallel=1, ctx_per_slot=256),
            ModelConfig(id="busy", path=str(tiny_model), parallel=1, ctx_per_slot=256),
        ],
        state_dir=state_dir,
        engine_binary=engine_binary,
        gpu={"pressure_grace": 1.0},
    )
    with trio.fail_after(90):
        async with running(cfg, probe=probe) as (host, client):
            for model in ("idle", "busy"):
                r = await client.post("/v1/chat/completions", json={**CHAT, "model": model})
                assert r.status_code == 200, r.text
            # planned and reserved against the GPU's budget in the ledger
            status = (await client.get("/api/status")).json()
            assert {e["plan"]["device"] for e in status["engines"]} == {"gpu"}
            assert status["ledger"]["held"] == 2

            busy = host.models["busy"].engine
            idle = host.models["idle"].engine
            probe.set_readings([_gpu(23.5)])  # 0.5 GiB free: under max(1 GiB, 8%)
            with busy.in_use():  # active inference always finishes
                await idle.state.wait_value(EngineState.STOPPED)
                assert busy.state.value is EngineState.READY
            assert host.pressure_releases == 1
            status = (await client.get("/api/status")).json()
            assert status["ledger"]["held"] == 1  # the released engine's bytes are back

            # pressure gone: the released model restarts lazily on its next request
            probe.set_readings([_gpu(4.0)])
            r = await client.post("/v1/chat/completions", json={**CHAT, "model": "idle"})
            assert r.status_code == 200
            assert idle.starts == 2


async def test_a_hot_gpu_holds_admission_until_it_cools(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    probe = StaticProbe([_gpu(4.0, temp=90.0)])
    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=1, ctx_per_slot=256)],
        state_dir=state_dir,
        engine_binary=engine_binary,
        gpu={"temp_limit_c": 85.0, "temp_margin_c": 5.0},
    )
    with trio.fail_after(90):
        async with running(cfg, probe=probe) as (host, client):
            done: list[int] = []

            async def ask() -> None:
                r = await client.post("/v1/chat/completions", json=CHAT)
                done.append(r.status_code)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask)
                await trio.sleep(1.0)
                assert done == []  # 90 °C >= 85 °C: waiting
                waiters = host.health_gate.statistics().as_dict()["waiters"]
                assert waiters, "the thermal wait shows in status"
                probe.set_temperature(82.0)  # below the limit but not below limit - margin
                await trio.sleep(2.5)
                assert done == []
                probe.set_temperature(79.0)
            assert done == [200]
