"""An image model as the scheduler sees it: sd-server behind the same lane protocols.

:class:`ImageRuntime` is a :class:`~.runtime.ModelRuntime` whose engine is sd-server
(opened with :data:`~gezel_trio.engine.kinds.SD_SERVER` by ``Catalog.open_model``): the
same supervisor life cycle (started on demand, health-checked, restarted with backoff,
released when idle, stopped gracefully), the same arbiter (residency in its slot class,
a lease held by each job) and the same ledger (a reservation estimated from its files,
then replaced by the process's measured memory once it has rendered).
What differs is what an image engine is: one slot (it renders one job at a time), no KV
(nothing to erase, park or restore, no context), and a render's progress read from its
output (:mod:`gezel_trio.images.progress`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psutil
import trio

from ..gpu.ledger import CPU_DEVICE, DeviceLedger
from ..images.job import ImageProgress
from ..images.progress import last_progress
from ..scheduler.jobs import SlotMeasurement
from .runtime import ModelRuntime
from .snapshot import ModelStats

__all__ = ["ImageRuntime"]


@dataclass
class ImageRuntime(ModelRuntime):
    """An image model's engine and what the scheduler needs of it (see the module)."""

    progress: ImageProgress | None = None
    """The running job's sampling progress (None: no job runs, or it has not sampled)."""
    renders: int = 0
    """Jobs that completed on this model."""
    measured_bytes: int | None = None
    """The most memory the running engine process was measured to use (None: not
    measured since it started, or it runs on a GPU, whose per-process memory the
    probe does not read)."""
    _measured_pid: int | None = field(default=None, repr=False)
    _listener: Callable[[ImageProgress], None] | None = field(default=None, repr=False)
    _output: trio.Event = field(default_factory=trio.Event, repr=False)

    def __post_init__(self) -> None:
        self.engine.log.observer = self._observe

    def _observe(self, chunk: bytes) -> None:
        """The engine's output, as read: a progress update goes to the running job, and
        a job waiting for output (:meth:`wait_output`) wakes."""
        if self._listener is None:
            return
        self._output.set()
        update = last_progress(chunk)
        if update is not None and update != self.progress:
            self.progress = update
            self._listener(update)

    @contextmanager
    def watching(self, on_progress: Callable[[ImageProgress], None]) -> Iterator[None]:
        """Give the engine's progress updates to ``on_progress`` while the block runs (the
        lane's one job runs inside it)."""
        self.progress = ImageProgress(0, 0)
        self._listener = on_progress
        try:
            yield
        finally:
            self._listener = None
            self.progress = None

    async def wait_output(self, within: float) -> bool:
        """Wait until the engine writes something (a step done, a stage finished) or
        ``within`` seconds pass: whether it wrote. A job polls sooner after output, when
        its state is likely to have changed. Cancellation abandons the wait."""
        self._output = trio.Event()
        with trio.move_on_after(within):
            await self._output.wait()
            return True
        return False

    async def measure_footprint(self, ledger: DeviceLedger) -> None:
        """Replace the engine's ledger reservation (estimated from its files) by the
        most resident memory its process has been measured to use, after a render, when
        it runs on the CPU: never below what was measured. The plan in status shows the
        estimate and the measurement. Does nothing when no process runs or it runs on a
        GPU. Cancellation: the ledger's update runs to its end in its thread."""
        held, pid = self.setup.reservation, self.engine.pid
        if held is None or pid is None or held.device != CPU_DEVICE:
            return
        try:
            rss = await trio.to_thread.run_sync(lambda: psutil.Process(pid).memory_info().rss)
        except psutil.Error:
            return  # it exited meanwhile: its reservation goes with it
        if self._measured_pid != pid:
            self._measured_pid, self.measured_bytes = pid, None
        measured = max(rss, self.measured_bytes or 0)
        self.measured_bytes = measured
        if self.setup.plan is not None:
            self.setup.plan.setdefault("estimated_bytes", held.nbytes)
            self.setup.plan["measured_bytes"] = measured
        if held.nbytes != measured:
            resized = await ledger.resize(held, measured)
            if self.setup.reservation is held:
                self.setup.reservation = resized
            if self.setup.plan is not None:
                self.setup.plan["total_bytes"] = resized.nbytes
                self.setup.plan["reasons"] = [
                    "estimated from the model files' sizes",
                    "then measured from the process's resident memory",
                ]

    # ------------------------------------------------------------------ EngineLane

    @property
    def slot_count(self) -> int:
        return 1

    @property
    def parallel(self) -> int:
        return 1

    @property
    def ctx_per_slot(self) -> int | None:
        return None

    @property
    def cuts_back(self) -> bool:
        return False

    @property
    def calibrates(self) -> bool:
        """No co-batch probe: sd-server takes one job at a time."""
        return False

    @property
    def supports_tools(self) -> bool:
        return False

    async def ask_engine_tools(self) -> bool | None:
        return None

    @property
    def parking_enabled(self) -> bool:
        return False

    async def measure_slots(self) -> SlotMeasurement | None:
        """Unknown: sd-server has no ``/slots`` (the host is its only client)."""
        return None

    async def erase_slot(self, slot_id: int) -> None:
        """Nothing to erase: an image engine keeps no KV between jobs."""

    def statistics(self) -> ModelStats:
        stats = super().statistics()
        job: dict[str, Any] | None = None
        if self.progress is not None:
            job = {"step": self.progress.step, "steps": self.progress.steps}
        return ModelStats(
            engine=stats.engine,
            name=stats.name,
            slot_class=stats.slot_class,
            admission_ceiling=1,
            ceiling_reason=None,
            plan=stats.plan,
            calibration={},
            benchmark=None,
            kv_parking=None,
            upstream_calls=stats.upstream_calls,
            kind="image",
            job=job,
        )
