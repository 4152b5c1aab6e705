"""Device capacity ledger: shared SQLite file, denial reasons, release, reclaim of the dead."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from gezel_trio.errors import NoCapacity
from gezel_trio.gpu.ledger import (
    DeviceLedger,
    ProcessIdentity,
    default_capacities,
    open_ledger,
    process_alive,
    process_start_token,
)
from gezel_trio.gpu.probe import DeviceHealth, GpuReading

GIB = 1024**3
REPO = Path(__file__).resolve().parents[1]
CAPS = {"gpu:0": 10 * GIB, "cpu": 32 * GIB}


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "state" / "ledger.sqlite"


async def test_reserve_release_and_snapshot(db: Path) -> None:
    async with open_ledger(db, capacities=CAPS) as ledger:
        assert await trio.Path(db).exists()
        async with ledger.reservation("gpu:0", 3 * GIB, owner="pool", model="a") as r:
            assert r.pid == os.getpid() and r.nbytes == 3 * GIB
            snap = await ledger.snapshot()
            gpu = snap.devices["gpu:0"]
            assert (gpu.capacity, gpu.reserved, gpu.free) == (10 * GIB, 3 * GIB, 7 * GIB)
            [h] = gpu.holders
            assert (h.model, h.owner, h.pid, h.nbytes) == ("a", "pool", os.getpid(), 3 * GIB)
            assert snap.devices["cpu"].reserved == 0
            assert await ledger.reserved_bytes("gpu:0") == 3 * GIB
            assert await ledger.reserved_bytes("gpu:0", exclude_owner="pool") == 0
            assert ledger.statistics().held_bytes == 3 * GIB
        snap = await ledger.snapshot()
        assert snap.devices["gpu:0"].reserved == 0 and snap.devices["gpu:0"].holders == ()
        stats = ledger.statistics()
        assert (stats.admitted, stats.released, stats.held) == (1, 1, 0)


async def test_resize_replaces_an_estimate_by_a_measurement(db: Path) -> None:
    """A measured footprint replaces the estimate in the same row: others see it, a
    later reservation is admitted against it, and scope exit releases it."""
    async with open_ledger(db, capacities=CAPS) as ledger:
        async with ledger.reservation("gpu:0", 8 * GIB, owner="img", model="img") as r:
            with pytest.raises(NoCapacity):
                await ledger.reserve("gpu:0", 4 * GIB, owner="b", model="b")
            measured = await ledger.resize(r, 1 * GIB)
            assert (measured.id, measured.nbytes) == (r.id, 1 * GIB)
            assert await ledger.reserved_bytes("gpu:0") == 1 * GIB
            assert ledger.statistics().held_bytes == 1 * GIB
            async with ledger.reservation("gpu:0", 4 * GIB, owner="b", model="b"):
                assert await ledger.reserved_bytes("gpu:0") == 5 * GIB
        assert await ledger.reserved_bytes("gpu:0") == 0
        assert await ledger.resize(r, 2 * GIB) == r  # released: stays released
        assert await ledger.reserved_bytes("gpu:0") == 0


async def test_two_instances_share_the_file_and_deny_with_reasons(db: Path) -> None:
    async with (
        open_ledger(db, capacities=CAPS) as one,
        open_ledger(db, capacities=CAPS) as two,
        one.reservation("gpu:0", 6 * GIB, owner="pool/a", model="model-a"),
    ):
        with pytest.raises(NoCapacity) as err:
            async with two.reservation("gpu:0", 5 * GIB, owner="pool/b", model="model-b"):
                pytest.fail("must not be admitted")
        msg = err.value.message
        assert "cannot reserve 5.00 GiB (5368709120 bytes) on gpu:0 for model 'model-b'" in msg
        assert "4.00 GiB (4294967296 bytes) free of 10.00 GiB (10737418240 bytes)" in msg
        assert f"pid {os.getpid()} (model 'model-a', owner 'pool/a') holds 6.00 GiB" in msg
        assert err.value.status == 503
        detail = err.value.detail
        assert isinstance(detail, dict)
        assert detail["needed_bytes"] == 5 * GIB and detail["free_bytes"] == 4 * GIB
        assert detail["holders"] == [
            {"pid": os.getpid(), "model": "model-a", "owner": "pool/a", "nbytes": 6 * GIB}
        ]
        assert two.statistics().denied == 1
        # Exactly the free bytes fit; other devices are independent.
        async with two.reservation("gpu:0", 4 * GIB, owner="pool/b", model="model-b"):
            snap = await one.snapshot()
            assert snap.devices["gpu:0"].free == 0
            assert [h.model for h in snap.devices["gpu:0"].holders] == ["model-a", "model-b"]
            async with one.reservation("cpu", 30 * GIB, owner="pool/c", model="model-c"):
                pass


async def test_concurrent_admissions_cannot_both_see_the_same_free_bytes(db: Path) -> None:
    admitted: list[str] = []
    denied: list[str] = []
    gate = trio.Event()
    all_answered = trio.Event()

    def answered() -> None:
        if len(admitted) + len(denied) == 4:
            all_answered.set()

    async def try_reserve(ledger: DeviceLedger, name: str) -> None:
        try:
            async with ledger.reservation("gpu:0", 6 * GIB, owner=name, model=name):
                admitted.append(name)
                answered()
                await gate.wait()
        except NoCapacity:
            denied.append(name)
            answered()

    async with trio.open_nursery() as n:
        ledgers = []
        for _ in range(4):
            ledgers.append(await n.start(_open_in_task, db))
        for i, ledger in enumerate(ledgers):
            n.start_soon(try_reserve, ledger, f"m{i}")
        with trio.fail_after(30):
            await all_answered.wait()
        assert len(admitted) == 1 and len(denied) == 3
        gate.set()
        n.cancel_scope.cancel()


async def _open_in_task(db: Path, task_status: trio.TaskStatus[DeviceLedger]) -> None:
    async with open_ledger(db, capacities=CAPS) as ledger:
        task_status.started(ledger)
        await trio.sleep_forever()


async def test_release_on_cancellation(db: Path) -> None:
    async with open_ledger(db, capacities=CAPS) as ledger:
        entered = trio.Event()

        async def job(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
            with trio.CancelScope() as scope:
                task_status.started(scope)
                async with ledger.reservation("gpu:0", 8 * GIB, owner="o", model="m"):
                    entered.set()
                    await trio.sleep_forever()

        async with trio.open_nursery() as n:
            scope = await n.start(job)
            await entered.wait()
            assert (await ledger.snapshot()).devices["gpu:0"].reserved == 8 * GIB
            scope.cancel()
        assert (await ledger.snapshot()).devices["gpu:0"].reserved == 0


async def test_reserve_cancelled_while_its_transaction_runs_holds_nothing(
    db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_ledger(db, capacities=CAPS) as ledger:
        started, go = threading.Event(), threading.Event()
        original = ledger._reserve_sync

        def slow(*args: Any) -> Any:
            started.set()
            go.wait(30)
            return original(*args)

        monkeypatch.setattr(ledger, "_reserve_sync", slow)
        scope = trio.CancelScope()

        async def reserve() -> None:
            with scope:
                await ledger.reserve("gpu:0", GIB, owner="o", model="m")
                pytest.fail("reserve must not return into a cancelled scope")

        async with trio.open_nursery() as n:
            n.start_soon(reserve)
            await trio.to_thread.run_sync(started.wait)
            scope.cancel()  # the transaction is running in its thread
            go.set()
        assert scope.cancelled_caught
        assert (await ledger.snapshot()).devices["gpu:0"].holders == ()
        stats = ledger.statistics()
        assert (stats.admitted, stats.released, stats.held) == (1, 1, 0)


async def test_unknown_device_and_oversized_request(db: Path) -> None:
    async with open_ledger(db, capacities=CAPS) as ledger:
        with pytest.raises(
            NoCapacity, match=r"device 'gpu:7' has no budget .*known devices: cpu, gpu:0"
        ):
            await ledger.reserve("gpu:7", 1, owner="o", model="m")
        with pytest.raises(NoCapacity, match="needs more than the whole device budget"):
            await ledger.reserve("gpu:0", 11 * GIB, owner="o", model="huge")
        with pytest.raises(ValueError):
            await ledger.reserve("gpu:0", -1, owner="o", model="m")


async def test_closing_the_ledger_releases_leftovers(db: Path) -> None:
    async with open_ledger(db, capacities=CAPS) as watcher:
        async with open_ledger(db, capacities=CAPS) as leaky:
            await leaky.reserve("gpu:0", 2 * GIB, owner="o", model="forgotten")
            assert (await watcher.snapshot()).devices["gpu:0"].reserved == 2 * GIB
        assert (await watcher.snapshot()).devices["gpu:0"].reserved == 0


async def test_reused_pid_does_not_keep_a_dead_process_bytes(db: Path) -> None:
    # Same pid as this process, but recorded with another start time: that process is
    # gone and its pid was reused (by us).
    ghost = ProcessIdentity(os.getpid(), "some-other-boot:12345")
    async with (
        open_ledger(db, capacities=CAPS, identity=ghost) as old,
        open_ledger(db, capacities=CAPS) as new,
    ):
        await old.reserve("gpu:0", 9 * GIB, owner="o", model="ghost-model")
        async with new.reservation("gpu:0", 9 * GIB, owner="o", model="live-model"):
            snap = await new.snapshot()
            assert [h.model for h in snap.devices["gpu:0"].holders] == ["live-model"]
        assert new.statistics().reclaimed == 1


def test_process_liveness() -> None:
    me = os.getpid()
    token = process_start_token(me)
    # the process's start time, to the millisecond: /proc's field 22 (clock ticks after
    # boot) plus the boot time, as the kernel and psutil count them
    assert token is not None and abs(float(token) - _started_at(me)) < 0.02
    assert process_alive(me, token)
    assert process_alive(me, None)
    assert not process_alive(me, f"{float(token) - 1:.3f}")  # another process's start
    assert not process_alive(0, None) and not process_alive(-5, None)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not process_alive(child.pid, None)


def _started_at(pid: int) -> float:
    raw = Path(f"/proc/{pid}/stat").read_text()
    ticks = int(raw[raw.rfind(")") + 2 :].split()[19])
    btime = next(
        int(line.split()[1])
        for line in Path("/proc/stat").read_text().splitlines()
        if line.startswith("btime ")
    )
    return btime + ticks / os.sysconf("SC_CLK_TCK")


CHILD = """
import sys, trio
from gezel_trio.gpu.ledger import open_ledger

async def main():
    async with open_ledger(sys.argv[1], capacities={"gpu:0": 10 * 1024**3}) as ledger:
        async with ledger.reservation("gpu:0", 6 * 1024**3, owner="child", model="child-model"):
            print("held", flush=True)
            await trio.sleep_forever()

trio.run(main)
"""


async def test_killed_process_reservation_is_reclaimed(db: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", CHILD, str(db)], stdout=subprocess.PIPE, cwd=REPO, env=env
    )
    try:
        assert proc.stdout is not None
        out = b""
        with trio.fail_after(60):
            while b"\n" not in out:
                chunk = await proc.stdout.receive_some()
                assert chunk, "the child exited before it reserved"
                out += chunk
        assert out.strip() == b"held"
        async with open_ledger(db, capacities=CAPS) as ledger:
            with pytest.raises(NoCapacity) as err:
                await ledger.reserve("gpu:0", 8 * GIB, owner="parent", model="big")
            assert f"pid {proc.pid} (model 'child-model', owner 'child')" in err.value.message
            os.kill(proc.pid, signal.SIGKILL)
            # Wait until it has exited but leave it unreaped: a zombie must count as dead.
            await trio.to_thread.run_sync(os.waitid, os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
            async with ledger.reservation("gpu:0", 8 * GIB, owner="parent", model="big"):
                snap = await ledger.snapshot()
                assert [h.model for h in snap.devices["gpu:0"].holders] == ["big"]
            assert ledger.statistics().reclaimed == 1
    finally:
        proc.kill()
        with trio.move_on_after(10, shield=True):
            await proc.wait()
        if proc.stdout is not None:
            await proc.stdout.aclose()


def test_default_capacities() -> None:
    health = DeviceHealth(
        (
            GpuReading(0, "A", 40.0, GIB, 24 * GIB),
            GpuReading(1, "B", 40.0, GIB, 0),  # unreadable memory: no budget
            GpuReading(2, "C", 40.0, GIB, 80 * GIB),
        ),
        True,
        None,
        0.0,
    )
    caps = default_capacities(health, ram_bytes=64 * GIB, ram_fraction=0.5)
    assert caps == {"gpu:0": 24 * GIB, "gpu:2": 80 * GIB, "cpu": 32 * GIB}
    cpu_only = default_capacities(
        DeviceHealth((), False, "no NVML", 0.0), ram_bytes=10 * GIB, ram_fraction=0.8
    )
    assert cpu_only == {"cpu": 8 * GIB}
    assert default_capacities(None)["cpu"] > 0
