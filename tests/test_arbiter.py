"""GpuArbiter: policies, evictors, leases, the stale-lease breaker (virtual time)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing

from gezel_trio.errors import ConfigError
from gezel_trio.gpu.arbiter import GpuArbiter, Lease, LeaseBook, resolve_policy
from gezel_trio.gpu.health import DeviceSafetyPolicy, HealthGate
from gezel_trio.gpu.probe import GpuReading, StaticProbe

GIB = 1024**3


@dataclass
class Recorder:
    """Evictors that record (slot class, owner, virtual time)."""

    calls: list[tuple[str, str, float]] = field(default_factory=list)

    def evictor(
        self, slot_class: str, owner: str, *, fail: bool = False
    ) -> Callable[[], Awaitable[None]]:
        async def evict() -> None:
            self.calls.append((slot_class, owner, trio.current_time()))
            await trio.lowlevel.checkpoint()
            if fail:
                raise RuntimeError(f"{slot_class}/{owner} exploded")

        return evict


class Holder:
    """A task holding a lease until told to release; records when it got it."""

    def __init__(self, arbiter: GpuArbiter, slot_class: str) -> None:
        self.arbiter = arbiter
        self.slot_class = slot_class
        self.release = trio.Event()
        self.granted_at: float | None = None
        self.lease: Lease | None = None
        self.exited_at: float | None = None
        self.cancel_scope = trio.CancelScope()

    async def run(self) -> None:
        with self.cancel_scope:
            async with self.arbiter.lease(self.slot_class) as lease:
                self.lease = lease
                self.granted_at = trio.current_time()
                await self.release.wait()
        self.exited_at = trio.current_time()


async def start_holder(nursery: trio.Nursery, arbiter: GpuArbiter, slot_class: str) -> Holder:
    h = Holder(arbiter, slot_class)
    nursery.start_soon(h.run)
    await trio.testing.wait_all_tasks_blocked()
    return h


# --- policy resolution and the pure book ---------------------------------------------


def test_resolve_policy() -> None:
    assert resolve_policy("auto") == "coexist"
    assert resolve_policy("coexist") == "coexist"
    assert resolve_policy("swap") == "swap"
    with pytest.raises(ConfigError, match="'auto', 'coexist', 'swap'"):
        resolve_policy("exclusive")


def test_constructor_resolves_auto_and_validates() -> None:
    assert GpuArbiter(policy="auto").policy == "coexist"
    with pytest.raises(ConfigError):
        GpuArbiter(stale_lease_ceiling=0)
    with pytest.raises(ConfigError):
        GpuArbiter(lease_wait_poll=-1)


def test_lease_book_rules() -> None:
    book = LeaseBook()
    assert book.may_take("A")
    a1 = book.take("A", 0.0, policy="swap")
    assert book.may_take("A")  # same class shares
    assert not book.may_take("B")  # foreign class waits
    b = book.enqueue("B", 1.0, takes_lease=True)
    # A new A request queues behind the foreign B request: no starvation.
    assert not book.may_take("A")
    a2 = book.enqueue("A", 2.0, takes_lease=True)
    assert not book.may_take("A", a2)
    # A bare acquire of A is not blocked by queued requests, only by foreign holders.
    assert not book.blocked_acquire("A")
    assert book.blocked_acquire("B")
    assert book.release(a1)
    assert not book.release(a1)  # exactly once
    assert book.may_take("B", b)
    assert not book.may_take("A", a2)  # B is still queued ahead
    book.dequeue(b)
    assert book.may_take("A", a2)


def test_lease_book_breaks_only_stale_foreign_holders() -> None:
    book = LeaseBook()
    old_a = book.take("A", 0.0, policy="swap")
    young_a = book.take("A", 50.0, policy="swap")
    assert book.break_stale(99.9, 100.0, foreign_to="B") == []
    assert book.break_stale(100.0, 100.0, foreign_to="A") == []  # not foreign
    broken = book.break_stale(100.0, 100.0, foreign_to="B")
    assert [h.token for h in broken] == [old_a]
    assert book.counts() == {"A": 1}
    assert not book.release(old_a)  # a broken holder's release is a no-op
    assert book.release(young_a)
    assert book.counts() == {}


# --- coexist ------------------------------------------------------------------------


async def test_coexist_lease_returns_at_once_and_never_evicts(autojump_clock: object) -> None:
    rec = Recorder()
    arb = GpuArbiter(policy="coexist")
    arb.register_evictor("A", rec.evictor("A", "e1"))
    arb.register_evictor("B", rec.evictor("B", "e1"))
    t0 = trio.current_time()
    async with arb.lease("A") as a, arb.lease("B") as b:
        assert trio.current_time() == t0
        assert a.policy == b.policy == "coexist"
        assert arb.statistics().holders == {"A": 1, "B": 1}
        assert arb.statistics().active_class is None  # mixed classes
    await arb.acquire("A")
    assert rec.calls == []
    assert arb.statistics().holders == {}
    assert not arb.is_held(a)


async def test_coexist_lease_passes_the_health_gate(autojump_clock: object) -> None:
    probe = StaticProbe([GpuReading(0, "H", 90.0, 0, 80 * GIB)])
    gate = HealthGate(probe, policy=DeviceSafetyPolicy(poll_interval=2.0))
    arb = GpuArbiter(policy="coexist", health_gate=gate)
    t0 = trio.current_time()
    entered: list[float] = []

    async def job() -> None:
        async with arb.lease("A"):
            entered.append(trio.current_time() - t0)

    async with trio.open_nursery() as n:
        n.start_soon(job)
        await trio.sleep(5)
        probe.set_temperature(70.0)
    # Polls at 2, 4, 6: the first one after the change admits.
    assert entered == [6.0]


# --- evictors and acquire in swap ----------------------------------------------------


async def test_swap_acquire_evicts_every_other_class_and_owner(autojump_clock: object) -> None:
    rec = Recorder()
    arb = GpuArbiter(policy="swap")
    arb.register_evictor("A", rec.evictor("A", "r0"), owner_id="r0")
    arb.register_evictor("B", rec.evictor("B", "r0"), owner_id="r0")
    arb.register_evictor("B", rec.evictor("B", "r1"), owner_id="r1")
    arb.register_evictor("C", rec.evictor("C", "default"))
    await arb.acquire("A")
    assert sorted((c, o) for c, o, _ in rec.calls) == [("B", "r0"), ("B", "r1"), ("C", "default")]
    assert arb.statistics().evictions == 3


async def test_reregister_replaces_and_unregister_removes(autojump_clock: object) -> None:
    rec = Recorder()
    arb = GpuArbiter(policy="swap")
    arb.register_evictor("B", rec.evictor("B", "old"), owner_id="x")
    arb.register_evictor("B", rec.evictor("B", "new"), owner_id="x")
    arb.register_evictor("B", rec.evictor("B", "other"), owner_id="y")
    assert arb.statistics().evictors == {"B": ("x", "y")}
    await arb.acquire("A")
    assert sorted(o for _, o, _ in rec.calls) == ["new", "other"]
    arb.unregister_evictor("B", "y")
    arb.unregister_evictor("B", "unknown")  # no-op
    arb.unregister_evictor("Z", "x")  # no-op
    rec.calls.clear()
    await arb.acquire("A")
    assert [o for _, o, _ in rec.calls] == ["new"]
    arb.unregister_evictor("B", "x")
    assert arb.statistics().evictors == {}
    rec.calls.clear()
    await arb.acquire("A")
    assert rec.calls == []


async def test_acquire_with_nothing_registered_is_a_no_op(autojump_clock: object) -> None:
    arb = GpuArbiter(policy="swap")
    t0 = trio.current_time()
    await arb.acquire("image")
    assert trio.current_time() == t0
    assert arb.statistics().evictions == 0


async def test_evictor_errors_are_logged_and_swallowed(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    rec = Recorder()
    arb = GpuArbiter(policy="swap")
    arb.register_evictor("B", rec.evictor("B", "bad", fail=True), owner_id="bad")
    arb.register_evictor("B", rec.evictor("B", "good"), owner_id="good")
    with caplog.at_level(logging.WARNING, logger="gezel_trio.gpu.arbiter"):
        async with arb.lease("A") as lease:
            assert arb.is_held(lease)
    assert [o for _, o, _ in rec.calls] == ["bad", "good"]
    stats = arb.statistics()
    assert stats.evictions == 2 and stats.eviction_errors == 1
    assert "B/bad exploded" in caplog.text


async def test_acquire_never_evicts_a_class_that_took_a_lease_meanwhile(
    autojump_clock: object,
) -> None:
    rec = Recorder()
    arb = GpuArbiter(policy="swap")

    async def slow_c() -> None:
        rec.calls.append(("C", "slow", trio.current_time()))
        await trio.sleep(10)

    arb.register_evictor("C", slow_c)
    arb.register_evictor("B", rec.evictor("B", "e"))
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        n.start_soon(arb.acquire, "A")  # evicts C (10 s), then would evict B
        await trio.sleep(1)
        b = await start_holder(n, arb, "B")  # no foreign holder: B takes its lease at 1
        assert arb.statistics().holders == {"B": 1}  # then evicts C (slow) itself
        await trio.sleep(20)
        assert b.granted_at == t0 + 11
        b.release.set()
    assert ("B", "e") not in [(c, o) for c, o, _ in rec.calls]


async def test_swap_acquire_waits_for_foreign_lease_not_own(autojump_clock: object) -> None:
    rec = Recorder()
    arb = GpuArbiter(policy="swap")
    arb.register_evictor("A", rec.evictor("A", "e"))
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        a = await start_holder(n, arb, "A")
        await arb.acquire("A")  # same class: no wait
        assert trio.current_time() == t0
        done: list[float] = []

        async def acquire_b() -> None:
            await arb.acquire("B")
            done.append(trio.current_time() - t0)

        n.start_soon(acquire_b)
        await trio.sleep(7)
        assert done == []
        assert [w.takes_lease for w in arb.statistics().waiters] == [False]
        a.release.set()
    assert done == [7.0]
    assert [(c, t - t0) for c, _, t in rec.calls] == [("A", 7.0)]


# --- swap leases --------------------------------------------------------------------


async def test_swap_lease_waits_for_foreign_holder_then_evicts(autojump_clock: object) -> None:
    rec = Recorder()
    arb = GpuArbiter(policy="swap")
    arb.register_evictor("A", rec.evictor("A", "e"))
    arb.register_evictor("B", rec.evictor("B", "e"))
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        a = await start_holder(n, arb, "A")
        assert a.granted_at == t0
        assert [(c, t - t0) for c, _, t in rec.calls] == [("B", 0.0)]
        b = await start_holder(n, arb, "B")
        assert b.granted_at is None
        stats = arb.statistics()
        assert stats.active_class == "A" and stats.holders == {"A": 1}
        assert [(w.slot_class, w.since - t0, w.takes_lease) for w in stats.waiters] == [
            ("B", 0.0, True)
        ]
        await trio.sleep(10)
        a.release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert b.granted_at == t0 + 10
        assert [(c, t - t0) for c, _, t in rec.calls] == [("B", 0.0), ("A", 10.0)]
        assert arb.statistics().active_class == "B"
        b.release.set()
    assert arb.statistics().holders == {}
    assert arb.statistics().waiters == ()


async def test_same_class_leases_share_and_foreign_waits_for_all(autojump_clock: object) -> None:
    arb = GpuArbiter(policy="swap")
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        a1 = await start_holder(n, arb, "A")
        a2 = await start_holder(n, arb, "A")
        assert a1.granted_at == a2.granted_at == t0
        assert a2.lease is not None and a2.lease.shared
        assert arb.statistics().holders == {"A": 2}
        b = await start_holder(n, arb, "B")
        await trio.sleep(3)
        a1.release.set()
        await trio.sleep(4)
        assert b.granted_at is None  # one A still holds
        assert arb.statistics().holders == {"A": 1}
        a2.release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert b.granted_at == t0 + 7
        b.release.set()


async def test_queued_foreign_request_is_not_starved(autojump_clock: object) -> None:
    arb = GpuArbiter(policy="swap")
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        a1 = await start_holder(n, arb, "A")
        b = await start_holder(n, arb, "B")
        await trio.sleep(1)
        a2 = await start_holder(n, arb, "A")  # arrives after B: queues behind it
        assert a2.granted_at is None
        await trio.sleep(1)
        a1.release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert b.granted_at == t0 + 2 and a2.granted_at is None
        await trio.sleep(5)
        b.release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert a2.granted_at == t0 + 7
        a2.release.set()


async def test_lease_released_exactly_once(autojump_clock: object) -> None:
    arb = GpuArbiter(policy="swap")
    async with arb.lease("A") as lease:
        assert arb.is_held(lease)
        assert arb.statistics().leases_granted == 1
    assert not arb.is_held(lease)
    assert arb.statistics().holders == {}
    with pytest.raises(ValueError, match="boom"):
        async with arb.lease("A") as lease2:
            raise ValueError("boom")
    assert not arb.is_held(lease2)
    assert arb.statistics().holders == {}


# --- the stale-lease breaker ---------------------------------------------------------


async def test_breaker_fires_at_exactly_the_ceiling(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    arb = GpuArbiter(policy="swap")  # 90 min ceiling, 60 s poll
    t0 = trio.current_time()
    with caplog.at_level(logging.ERROR, logger="gezel_trio.gpu.arbiter"):
        async with trio.open_nursery() as n:
            leak = await start_holder(n, arb, "A")  # never released
            b = await start_holder(n, arb, "B")
            await trio.sleep(90 * 60 - 1)
            assert b.granted_at is None
            await trio.sleep(1)
            await trio.testing.wait_all_tasks_blocked()
            assert b.granted_at == t0 + 90 * 60
            stats = arb.statistics()
            assert stats.broken_leases == 1
            assert stats.holders == {"B": 1}
            assert leak.lease is not None and not arb.is_held(leak.lease)
            # The leaked holder finally exits: it must not release B's lease.
            leak.cancel_scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert b.lease is not None and arb.is_held(b.lease)
            assert arb.statistics().holders == {"B": 1}
            b.release.set()
    assert "breaking stale A lease held 5400s (ceiling 5400s)" in caplog.text
    assert arb.statistics().holders == {}


async def test_breaker_fires_at_the_first_poll_after_the_ceiling(autojump_clock: object) -> None:
    arb = GpuArbiter(policy="swap", stale_lease_ceiling=100.0, lease_wait_poll=30.0)
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        leak = await start_holder(n, arb, "A")
        await trio.sleep(15)
        b = await start_holder(n, arb, "B")  # re-checks at 45, 75, 105 (since t0)
        await trio.sleep(200)
        assert b.granted_at == t0 + 105
        leak.cancel_scope.cancel()
        b.release.set()
    assert arb.statistics().broken_leases == 1


async def test_breaker_poll_never_exceeds_the_ceiling(autojump_clock: object) -> None:
    arb = GpuArbiter(policy="swap", stale_lease_ceiling=20.0, lease_wait_poll=60.0)
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        leak = await start_holder(n, arb, "A")
        b = await start_holder(n, arb, "B")
        await trio.sleep(100)
        assert b.granted_at == t0 + 20
        leak.cancel_scope.cancel()
        b.release.set()


# --- cancellation ----------------------------------------------------------------------


async def test_cancelled_waiter_leaves_nothing_held(autojump_clock: object) -> None:
    arb = GpuArbiter(policy="swap")
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        a = await start_holder(n, arb, "A")
        b = await start_holder(n, arb, "B")
        await trio.sleep(5)
        b.cancel_scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert b.lease is None and b.exited_at == t0 + 5
        stats = arb.statistics()
        assert stats.holders == {"A": 1} and stats.waiters == ()
        a.release.set()
    assert arb.statistics().holders == {}
    assert arb.statistics().leases_granted == 1


async def test_cancelled_queued_request_unblocks_the_ones_behind(autojump_clock: object) -> None:
    arb = GpuArbiter(policy="swap")
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        a1 = await start_holder(n, arb, "A")
        b = await start_holder(n, arb, "B")
        a2 = await start_holder(n, arb, "A")  # blocked by B queued ahead
        await trio.sleep(3)
        b.cancel_scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert a2.granted_at == t0 + 3  # joins A at once, no poll wait
        assert arb.statistics().holders == {"A": 2}
        a1.release.set()
        a2.release.set()


async def test_cancelled_holder_releases(autojump_clock: object) -> None:
    arb = GpuArbiter(policy="swap")
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        a = await start_holder(n, arb, "A")
        b = await start_holder(n, arb, "B")
        await trio.sleep(4)
        a.cancel_scope.cancel()  # e.g. the client disconnected mid-generation
        await trio.testing.wait_all_tasks_blocked()
        assert a.lease is not None and not arb.is_held(a.lease)
        assert b.granted_at == t0 + 4
        assert arb.statistics().holders == {"B": 1}
        b.release.set()
    assert arb.statistics().broken_leases == 0


async def test_cancelled_during_eviction_releases(autojump_clock: object) -> None:
    arb = GpuArbiter(policy="swap")

    async def slow_evict() -> None:
        await trio.sleep(100)

    arb.register_evictor("B", slow_evict)
    with trio.move_on_after(5):
        async with arb.lease("A"):
            pytest.fail("the body must not run while eviction is still going")
    assert arb.statistics().holders == {}


# --- live policy changes ---------------------------------------------------------------


async def test_switch_to_coexist_wakes_every_waiter(autojump_clock: object) -> None:
    rec = Recorder()
    arb = GpuArbiter(policy="swap")
    arb.register_evictor("A", rec.evictor("A", "e"))
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        a = await start_holder(n, arb, "A")
        b = await start_holder(n, arb, "B")
        c = await start_holder(n, arb, "C")
        await trio.sleep(30)
        arb.set_policy("auto")
        await trio.testing.wait_all_tasks_blocked()
        assert b.granted_at == c.granted_at == t0 + 30  # not at the 60 s poll
        assert b.lease is not None and b.lease.policy == "coexist"
        assert rec.calls == []  # coexist never evicts
        assert arb.statistics().holders == {"A": 1, "B": 1, "C": 1}
        for h in (a, b, c):
            h.release.set()
    assert arb.statistics().holders == {}


async def test_switch_to_swap_respects_coexist_era_holders(autojump_clock: object) -> None:
    rec = Recorder()
    arb = GpuArbiter(policy="coexist")
    arb.register_evictor("A", rec.evictor("A", "e"))
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        a = await start_holder(n, arb, "A")
        arb.set_policy("swap")
        b = await start_holder(n, arb, "B")
        await trio.sleep(12)
        assert b.granted_at is None and rec.calls == []  # A's job is not evicted mid-way
        a.release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert b.granted_at == t0 + 12
        assert [(cls, t - t0) for cls, _, t in rec.calls] == [("A", 12.0)]
        b.release.set()


# --- health delegation -----------------------------------------------------------------


async def test_swap_lease_holds_while_the_gate_waits(autojump_clock: object) -> None:
    probe = StaticProbe([GpuReading(0, "H", 86.0, 70 * GIB, 80 * GIB)])
    gate = HealthGate(probe, policy=DeviceSafetyPolicy(poll_interval=1.0))
    arb = GpuArbiter(policy="swap", health_gate=gate)
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        a = await start_holder(n, arb, "A")
        assert a.granted_at is None
        assert arb.statistics().holders == {"A": 1}  # the lease is taken, then the gate waits
        assert [w.what for w in gate.statistics().waiters] == ["A workload"]
        await trio.sleep(2.5)
        arb.set_device_safety_policy(DeviceSafetyPolicy(temp_limit_c=95.0, poll_interval=1.0))
        await trio.testing.wait_all_tasks_blocked()
        assert a.granted_at == t0 + 2.5
        a.release.set()
    health = await arb.device_health(0)
    assert health is not None and health.readings[0].temperature_c == 86.0
    pressure = await arb.memory_pressure(0)
    assert not pressure.pressured and pressure.free_bytes == 10 * GIB


async def test_without_gate_health_calls_are_neutral() -> None:
    arb = GpuArbiter()
    assert await arb.device_health() is None
    pressure = await arb.memory_pressure()
    assert not pressure.pressured and pressure.total_bytes is None
    arb.set_device_safety_policy(DeviceSafetyPolicy())  # no-op, no error


async def test_statistics_dict_is_json_ready(autojump_clock: object) -> None:
    arb = GpuArbiter(policy="swap")
    async with trio.open_nursery() as n:
        a = await start_holder(n, arb, "A")
        b = await start_holder(n, arb, "B")
        d = arb.statistics().as_dict()
        assert d["policy"] == "swap" and d["active_class"] == "A"
        assert d["holders"] == {"A": 1}
        assert [w["slot_class"] for w in d["waiters"]] == ["B"]
        assert d["waiters"][0]["kind"] == "lease"
        assert "policy=swap" in repr(arb)
        a.release.set()
        await trio.testing.wait_all_tasks_blocked()
        b.release.set()
