"""Dispatcher cost: 10,000 queued jobs across 8 models on fake engines.

    python benchmarks/dispatcher_cost.py [--jobs 10000] [--models 8] [--parallel 4]

Figures (aim: at most 50 µs of dispatcher time per admission):

1. *Dispatcher time per admission*, through the real Trio scheduler: every job is
   queued first (the engines are held "loading"), then the queue drains through
   fake engines whose jobs take no time. The time is what the dispatch passes
   spend deciding and starting jobs (``statistics().dispatch_seconds``, which
   excludes the awaited ``/slots`` sample) divided by admissions; the slowest
   pass is reported too (the queued objects are frozen out of the cyclic GC
   first, so that a full collection of the process heap does not land in it).
   Run in ``swap`` (one turn at a time over all 8 models) and ``coexist`` (8
   lanes). Half the keyed chats hold a slot at any time, so affinity picks jobs
   out of FIFO order, which exercises the lazy-deletion queues.
2. *End-to-end per job*: wall time to drain the whole queue / jobs, including
   Trio's task spawns, the fake engine and the submitters waking up.
3. *Policy only*: the same workload through ``SchedulerPolicy`` with no event
   loop, per admission.
4. *Peak memory per queued job* (tracemalloc): the scheduler's own share (job
   record, queue entries, wake event), and the total with the ``submit()`` task
   that waits on it.

Prints the figures and writes benchmarks/results/dispatcher_cost.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import tracemalloc
from functools import partial
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

import contextlib  # noqa: E402
from contextlib import AbstractAsyncContextManager, AbstractContextManager  # noqa: E402

from gezel_trio.scheduler import (  # noqa: E402
    Grant,
    SchedulerSettings,
    SlotMeasurement,
    open_scheduler,
)
from gezel_trio.scheduler.admission import Admit, Load, RunExclusive  # noqa: E402
from gezel_trio.scheduler.jobs import JobState, Residency  # noqa: E402
from gezel_trio.scheduler.policy import SchedulerPolicy  # noqa: E402
from gezel_trio.scheduler.queues import Job  # noqa: E402
from gezel_trio.scheduler.trio_job import _TrioJob  # noqa: E402

RESULTS = Path(os.environ.get("GEZEL_BENCH_RESULTS") or ROOT / "results")
SESSIONS_PER_MODEL = 50  # keyed chats per model; every 5th job is keyless


class FakeLane:
    """An in-memory engine the host spawned (free slots come from the slot table);
    nothing takes time."""

    def __init__(self, model_id: str, parallel: int, gate: trio.Event | None) -> None:
        self.model_id = model_id
        self.display_name = model_id.upper()
        self._parallel = parallel
        self._generation = 1
        self.gate = gate
        self.busy: set[int] = set()
        self.erases = 0
        self.double_booked = 0

    @property
    def parallel(self) -> int:
        return self._parallel

    @property
    def slot_count(self) -> int:
        return self._parallel

    @property
    def generation(self) -> int:
        return self._generation

    sole_client = True
    family: str | None = None
    ready = True

    def hold(self) -> AbstractContextManager[object]:
        return contextlib.nullcontext()

    def lease(self) -> AbstractAsyncContextManager[object]:
        return contextlib.nullcontext()

    async def wait_failed(self) -> None:
        await trio.sleep_forever()

    def resident_now(self) -> bool:
        return self.gate is None or self.gate.is_set()

    async def ensure_resident(self) -> None:
        if self.gate is not None:
            await self.gate.wait()
        await trio.lowlevel.checkpoint()

    async def measure_slots(self) -> SlotMeasurement | None:
        idle = tuple(i for i in range(self._parallel) if i not in self.busy)
        return SlotMeasurement(idle=len(idle), ids=idle)

    async def erase_slot(self, slot_id: int) -> None:
        self.erases += 1

    async def run(self, grant: Grant) -> None:
        slot = grant.slot_id
        if slot is not None:
            if slot in self.busy:
                self.double_booked += 1
            self.busy.add(slot)
        await trio.lowlevel.checkpoint()
        if slot is not None:
            self.busy.discard(slot)


def _session(i: int, model: int) -> str | None:
    return None if i % 5 == 0 else f"m{model}-chat{i % SESSIONS_PER_MODEL}"


async def _scheduler_run(
    *, jobs: int, models: int, parallel: int, residency: Residency, measure_memory: bool
) -> dict[str, Any]:
    gate = trio.Event()
    lanes = {f"model-{m}": FakeLane(f"model-{m}", parallel, gate) for m in range(models)}
    names = list(lanes)
    done = 0
    pass_times: list[float] = []
    async with open_scheduler(
        lanes=lanes, settings=SchedulerSettings(residency=residency, max_queue=jobs)
    ) as scheduler:
        policy = scheduler.policy
        original = policy.note_pass

        def note_pass(seconds: float) -> None:
            pass_times.append(seconds)
            original(seconds)

        policy.note_pass = note_pass  # type: ignore[method-assign]

        async def one(i: int) -> None:
            nonlocal done
            lane = lanes[names[i % models]]
            await scheduler.submit(lane.model_id, lane.run, session=_session(i, i % models))
            done += 1

        gc.collect()
        if measure_memory:
            tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0] if measure_memory else 0
        async with trio.open_nursery() as nursery:
            for i in range(jobs):
                nursery.start_soon(one, i)
            while scheduler.statistics().queued < jobs:
                await trio.lowlevel.checkpoint()
            memory: dict[str, float] = {}
            if measure_memory:
                current, peak = tracemalloc.get_traced_memory()
                memory = {
                    "total_bytes_per_queued_job": (current - base) / jobs,
                    "peak_bytes_per_queued_job": (peak - base) / jobs,
                }
                tracemalloc.stop()
            # Freeze what exists now (the parked submitters, their jobs) out of the
            # cyclic GC: its full collections scale with the process's whole heap
            # and would otherwise land inside whichever pass happens to trigger one.
            gc.collect()
            gc.freeze()
            queued_at = time.perf_counter()
            passes_before = len(pass_times)
            seconds_before = policy.dispatch_seconds
            admissions_before = policy.admissions
            gate.set()
        drained = time.perf_counter() - queued_at
        gc.unfreeze()
        stats = scheduler.statistics()
    admissions = stats.admissions - admissions_before
    spent = stats.dispatch_seconds - seconds_before
    drain_passes = pass_times[passes_before:]
    assert done == jobs, (done, jobs)
    assert admissions == jobs, (admissions, jobs)
    assert all(lane.double_booked == 0 for lane in lanes.values())
    return {
        "residency": residency,
        "jobs": jobs,
        "admissions": admissions,
        "dispatch_passes": len(drain_passes),
        "dispatcher_us_per_admission": spent / admissions * 1e6,
        "slowest_pass_ms": max(drain_passes) * 1e3 if drain_passes else 0.0,
        "end_to_end_us_per_job": drained / jobs * 1e6,
        "switches": stats.switches,
        "erases": sum(lane.erases for lane in lanes.values()),
        **memory,
    }


class _InfoLane:
    def __init__(self, model_id: str, parallel: int) -> None:
        self.model_id = model_id
        self.display_name = model_id
        self.parallel = parallel
        self.slot_count = parallel
        self.generation = 1
        self.sole_client = True
        self.family: str | None = None


def _policy_run(*, jobs: int, models: int, parallel: int, residency: Residency) -> dict[str, Any]:
    lanes = [_InfoLane(f"model-{m}", parallel) for m in range(models)]
    policy = SchedulerPolicy(lanes, residency=residency, max_queue=jobs)
    names = [lane.model_id for lane in lanes]
    for i in range(jobs):
        policy.enqueue(Job(model_id=names[i % models], session=_session(i, i % models)), now=0.0)
    running: dict[str, list[Job]] = {name: [] for name in names}
    admitted = 0
    started = time.perf_counter()
    while admitted < jobs:
        for action in policy.plan():
            if isinstance(action, Load):
                policy.load_done(action.model_id)
            elif isinstance(action, Admit):
                got = policy.admit(action.model_id, None, now=0.0).jobs
                running[action.model_id].extend(got)
                admitted += len(got)
            elif isinstance(action, RunExclusive):  # pragma: no cover - none submitted
                raise AssertionError(action)
        for name in names:  # every running job finishes before the next pass
            for job in running[name]:
                job.ran = True
                policy.settle(job, now=0.0)
            running[name].clear()
    took = time.perf_counter() - started
    assert policy.queued == 0
    return {
        "residency": residency,
        "jobs": jobs,
        "policy_us_per_admission": took / jobs * 1e6,
    }


def _scheduler_job_bytes(jobs: int, models: int, parallel: int) -> float:
    """tracemalloc: what the scheduler itself holds per queued job (no submit task)."""
    lanes = [_InfoLane(f"model-{m}", parallel) for m in range(models)]
    policy = SchedulerPolicy(lanes, max_queue=jobs)
    names = [lane.model_id for lane in lanes]

    async def fill() -> float:
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        held = []
        for i in range(jobs):
            job = _TrioJob(model_id=names[i % models], session=_session(i, i % models))
            held.append(job)
            policy.enqueue(job, now=0.0)
        current = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert all(j.state is JobState.QUEUED for j in held)
        return (current - base) / jobs

    return float(trio.run(fill))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--models", type=int, default=8)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS / "dispatcher_cost.json")
    args = parser.parse_args(argv)
    shape: dict[str, int] = {"jobs": args.jobs, "models": args.models, "parallel": args.parallel}

    residencies: tuple[Residency, ...] = ("swap", "coexist")
    runs = [
        trio.run(partial(_scheduler_run, **shape, residency=r, measure_memory=False))
        for r in residencies
    ]
    policy_runs = [_policy_run(**shape, residency=r) for r in residencies]
    memory_run = trio.run(partial(_scheduler_run, **shape, residency="swap", measure_memory=True))
    scheduler_bytes = _scheduler_job_bytes(args.jobs, args.models, args.parallel)

    result: dict[str, Any] = {
        "benchmark": "dispatcher_cost",
        "shape": shape,
        "aim_us_per_admission": 50.0,
        "python": platform.python_version(),
        "trio": trio.__version__,
        "machine": platform.machine(),
        "scheduler": runs,
        "policy": policy_runs,
        "memory": {
            "scheduler_bytes_per_queued_job": scheduler_bytes,
            "with_submit_task_bytes_per_queued_job": memory_run["total_bytes_per_queued_job"],
            "peak_with_submit_task_bytes_per_queued_job": memory_run["peak_bytes_per_queued_job"],
        },
    }
    result["within_aim"] = all(
        r["dispatcher_us_per_admission"] <= result["aim_us_per_admission"] for r in runs
    )

    print(
        f"Dispatcher cost: {args.jobs} queued jobs, {args.models} models, "
        f"{args.parallel} slots each, fake engines"
    )
    for r in runs:
        print(
            f"  {r['residency']:8s} dispatcher {r['dispatcher_us_per_admission']:6.1f} µs/admission"
            f"  (slowest pass {r['slowest_pass_ms']:.2f} ms, {r['dispatch_passes']} passes)"
            f"  end-to-end {r['end_to_end_us_per_job']:6.1f} µs/job"
            f"  switches {r['switches']}  erases {r['erases']}"
        )
    for p in policy_runs:
        print(f"  {p['residency']:8s} policy only {p['policy_us_per_admission']:6.1f} µs/admission")
    mem = result["memory"]
    print(
        f"  memory per queued job: scheduler {mem['scheduler_bytes_per_queued_job']:.0f} B, "
        f"with its waiting submit() task {mem['with_submit_task_bytes_per_queued_job']:.0f} B "
        f"(peak {mem['peak_with_submit_task_bytes_per_queued_job']:.0f} B)"
    )
    print(f"  aim <= 50 µs/admission: {'met' if result['within_aim'] else 'NOT met'}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"  wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
