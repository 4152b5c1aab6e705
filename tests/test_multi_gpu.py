"""Several GPUs on one box: placement, tensor splits, the per-device ledger, and the thermal
gate and memory pressure per device (fake NVML readings, the real planner and ledger)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.gguf_meta import read_gguf_info
from gezel_trio.engine.planner import plan_engine
from gezel_trio.gpu.health import HealthGate, memory_pressure_from
from gezel_trio.gpu.ledger import open_ledger
from gezel_trio.gpu.placement import Placement, device_flags, place, shares
from gezel_trio.gpu.probe import DeviceHealth, GpuReading, StaticProbe
from gezel_trio.host.placement import reservation_for
from gezel_trio.host.runtime import ModelSetup

GIB = 1024**3
LAYERS = 33


@dataclass(frozen=True)
class FakePlan:
    """A 10 GiB model of 33 layers: a budget offloads as many whole layers as it holds."""

    budget: int

    @property
    def n_gpu_layers(self) -> int:
        return min(LAYERS, self.budget * LAYERS // (10 * GIB))

    @property
    def fits(self) -> bool:
        return self.n_gpu_layers >= 1

    @property
    def total_bytes(self) -> int:
        return self.n_gpu_layers * 10 * GIB // LAYERS


def test_the_roomiest_gpu_takes_a_model_that_fits_it_whole() -> None:
    placed = place({"gpu:0": 11 * GIB, "gpu:1": 16 * GIB}, FakePlan)
    assert placed is not None
    assert placed.devices == ("gpu:1",) and placed.split is None
    assert placed.plan.n_gpu_layers == LAYERS
    assert shares(placed) == {"gpu:1": placed.plan.total_bytes}


def test_a_model_bigger_than_each_gpu_is_split_over_them() -> None:
    placed = place({"gpu:0": 6 * GIB, "gpu:1": 8 * GIB, "gpu:2": 0}, FakePlan)
    assert placed is not None
    assert placed.devices == ("gpu:0", "gpu:1")  # the full one takes no layers
    assert placed.split == pytest.approx((6 / 14, 8 / 14))
    assert placed.plan.n_gpu_layers == LAYERS  # whole, rather than part of it on one GPU
    reserved = shares(placed)
    assert sum(reserved.values()) == placed.plan.total_bytes
    assert reserved["gpu:1"] > reserved["gpu:0"]


def test_too_big_for_all_gpus_offloads_what_fits_on_one() -> None:
    placed = place({"gpu:0": 3 * GIB, "gpu:1": 4 * GIB}, FakePlan)
    assert placed is not None and placed.fits
    assert placed.devices == ("gpu:1",) and placed.plan.n_gpu_layers < LAYERS
    assert place({}, FakePlan) is None
    nothing = place({"gpu:0": 0, "gpu:1": 0}, FakePlan)
    assert nothing is not None and not nothing.fits


def test_device_flags_name_the_devices_by_backend() -> None:
    one = Placement(FakePlan(20 * GIB), ("gpu:1",))
    two = Placement(FakePlan(20 * GIB), ("gpu:0", "gpu:1"), (0.25, 0.75))
    assert device_flags(one, "cuda") == ["--device", "CUDA1"]
    assert device_flags(two, "vulkan") == [
        "--device", "Vulkan0,Vulkan1", "--split-mode", "layer", "--tensor-split", "0.250,0.750",
    ]  # fmt: skip
    assert device_flags(two, "cpu") == [] and device_flags(two, None) == []


def _reading(index: int, *, temp: float = 50.0, used: int = 0, total: int = 24 * GIB) -> GpuReading:
    return GpuReading(index, f"GPU{index}", temp, used, total)


async def test_a_hot_gpu_holds_only_the_engines_on_it(autojump_clock: object) -> None:
    probe = StaticProbe([_reading(0, temp=60.0), _reading(1, temp=90.0)])
    gate = HealthGate(probe)
    with trio.fail_after(1):
        await gate.admit("on gpu 0", devices=[0])  # gpu 1 is hot: no matter
    waited: list[str] = []

    async def on(devices: list[int] | None, name: str) -> None:
        await gate.admit(name, devices=devices)
        waited.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(on, [1], "on gpu 1")
        nursery.start_soon(on, None, "anywhere")
        await trio.sleep(30)
        assert waited == []
        assert {w.what for w in gate.statistics().waiters} == {"on gpu 1", "anywhere"}
        assert "GPU 1" in gate.statistics().waiters[0].reason
        probe.set_readings([_reading(0, temp=60.0), _reading(1, temp=70.0)])
    assert sorted(waited) == ["anywhere", "on gpu 1"]


def test_memory_pressure_is_judged_on_an_engines_own_gpus() -> None:
    full = _reading(1, used=int(23.5 * GIB))
    health = DeviceHealth((_reading(0), full), True, None, 0.0)
    assert memory_pressure_from(health, [1]).pressured
    assert not memory_pressure_from(health, [0]).pressured
    assert not memory_pressure_from(health).pressured  # 24.5 GiB free over both


async def test_an_engine_is_reserved_on_the_gpu_with_room_or_split_over_both(
    tmp_path: Path, tiny_model: Path
) -> None:
    info = read_gguf_info(str(tiny_model))
    model = ModelConfig(id="m", path=str(tiny_model), parallel=1, ctx_per_slot=256)
    whole = plan_engine(
        info,
        budget_bytes=1 << 40,
        already_reserved_bytes=0,
        requested_ctx_per_slot=256,
        requested_parallel=1,
        gpu=True,
    )
    need = whole.total_bytes
    runtime = ModelSetup(config=model)  # what the reservation plans (a runtime's setup)
    runtime.gguf = info
    for caps, expect in (
        ({"gpu:0": need // 2, "gpu:1": need * 2}, ("gpu:1",)),
        ({"gpu:0": need * 6 // 10, "gpu:1": need * 6 // 10}, ("gpu:0", "gpu:1")),
    ):
        async with open_ledger(
            tmp_path / f"l{len(expect)}.sqlite", capacities={**caps, "cpu": 1 << 34}
        ) as ledger:
            reserve = reservation_for(runtime, ledger=ledger, device=lambda: "gpu:0")
            async with reserve():
                assert runtime.placement is not None
                assert runtime.placement.devices == expect
                assert runtime.gpu_indices == tuple(int(d[4:]) for d in expect)
                snap = await ledger.snapshot()
                held = {d: sum(h.nbytes for h in u.holders) for d, u in snap.devices.items()}
                assert {d for d, n in held.items() if n} == set(expect)
                assert sum(held.values()) == runtime.placement.plan.total_bytes
                assert (runtime.plan or {})["devices"] == list(expect)
            assert runtime.placement is None
            snap = await ledger.snapshot()
            assert all(not u.holders for u in snap.devices.values())  # released on exit
