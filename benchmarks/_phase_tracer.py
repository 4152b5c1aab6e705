"""Run gezel-trio's command line with wall-clock marks at the seams of a completion, for
:mod:`benchmarks.request_phases`.

    python -m benchmarks._phase_tracer OUT serve --config FILE

Each seam (:data:`SEAMS`, and :data:`MODULE_SEAMS`) is wrapped so that its entry and
exit append ``(mark, perf_counter())`` to the record of the request being served; a
record starts when the lean front takes a request, with the two marks hypercorn made
before it (the request's first bytes handed to h11, and the app's task spawned). From
then on, a trio instrument adds up, for each part of a request (before the engine has
it, while the engine works, after its answer), the steps of the request's own task and
of every other task, and the wall time they ran (CPU, and any preemption by other
processes); a step counts in the part it ends in (the step that reads the answer's last
event and releases the slot counts after it). Recording starts at the first
``SIGUSR1``; ``SIGUSR2`` writes ``{"requests": [...], "steps": [...]}`` to OUT. For
requests sent one after another: a mark only goes to the newest record.
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import trio
from hypercorn.events import RawData
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.task_group import TaskGroup

from gezel_trio.api import lean
from gezel_trio.api.lean import LeanFront
from gezel_trio.engine.transport import EngineTransport, _OneShot
from gezel_trio.host.completion import CompletionService
from gezel_trio.scheduler.dispatcher import SlotRequest

SEAMS: tuple[tuple[type, str, str], ...] = (
    (LeanFront, "_serve", "front"),
    (LeanFront, "_read_body", "body"),
    (CompletionService, "complete", "complete"),
    (SlotRequest, "__aenter__", "grant"),
    (SlotRequest, "__aexit__", "release"),
    (EngineTransport, "_send_once", "upstream"),
    (_OneShot, "send", "write"),
    (_OneShot, "receive_head", "head"),
)
"""(class, async method, mark): ``mark>`` on entry, ``mark<`` on exit."""

MODULE_SEAMS: tuple[tuple[Any, str, str], ...] = ((lean, "_send_response", "respond"),)
"""(module, async function, mark), as :data:`SEAMS`."""

PARTS = ("before the engine", "while the engine works", "after the answer")
_NEXT_PART: dict[str, str | None] = {"write<": PARTS[1], "release>": PARTS[2], "front<": None}
"""The mark that ends each part of a request."""


class _Recorder(trio.abc.Instrument):
    """The marks of each request, and the task steps taken during each of its parts."""

    def __init__(self) -> None:
        self.on = False
        self.installed = False
        self.requests: list[list[tuple[str, float]]] = []
        self.current: list[tuple[str, float]] | None = None
        self.owner: trio.lowlevel.Task | None = None
        self.part: str | None = None  # of the current request; None once it is answered
        self.steps: dict[tuple[str, str], list[float]] = {}
        self.bytes_in = self.app_task = 0.0
        self._step_began = 0.0

    def mark(self, name: str) -> None:
        if self.current is not None:
            self.current.append((name, time.perf_counter()))
            self.part = _NEXT_PART.get(name, self.part)

    def begin(self) -> None:
        """A request reached the lean front: a new record, its task the owner."""
        if not self.on:
            return
        if not self.installed:  # (from within trio.run: a signal handler may not be)
            trio.lowlevel.add_instrument(self)
            self.installed = True
            self._step_began = time.perf_counter()  # (this step began before it)
        self.current = [("bytes in", self.bytes_in), ("app task", self.app_task)]
        self.part = PARTS[0]
        self.requests.append(self.current)
        self.owner = trio.lowlevel.current_task()

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._step_began = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        part = self.part
        if part is None:
            return
        who = "the request's task" if task is self.owner else "other tasks"
        entry = self.steps.setdefault((part, who), [0, 0.0])
        entry[0] += 1
        entry[1] += time.perf_counter() - self._step_began


RECORDER = _Recorder()


def _wrap(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def marked(*args: Any, **kwargs: Any) -> Any:
        if name == "front":
            RECORDER.begin()
        RECORDER.mark(name + ">")
        try:
            return await fn(*args, **kwargs)
        finally:
            RECORDER.mark(name + "<")

    return marked


def _install() -> None:
    for owner, attribute, name in (*SEAMS, *MODULE_SEAMS):
        setattr(owner, attribute, _wrap(getattr(owner, attribute), name))
    handle, spawn_app = H11Protocol.handle, TaskGroup.spawn_app

    async def handle_marked(self: H11Protocol, event: Any) -> None:
        if isinstance(event, RawData) and event.data[:5] == b"POST ":
            RECORDER.bytes_in = time.perf_counter()
        await handle(self, event)

    async def spawn_app_marked(self: TaskGroup, *args: Any, **kwargs: Any) -> Any:
        RECORDER.app_task = time.perf_counter()
        return await spawn_app(self, *args, **kwargs)

    H11Protocol.handle = handle_marked  # type: ignore[method-assign]
    TaskGroup.spawn_app = spawn_app_marked  # type: ignore[method-assign]


def _start(signum: int, frame: object) -> None:
    RECORDER.on = True


def _write(out: str) -> None:
    steps = [[part, who, n, seconds] for (part, who), (n, seconds) in RECORDER.steps.items()]
    with open(out + ".part", "w") as f:
        json.dump({"requests": RECORDER.requests, "steps": steps}, f)
    os.replace(out + ".part", out)


def main() -> None:
    out = sys.argv[1]
    _install()
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, lambda signum, frame: _write(out))
    sys.argv = ["gezel_trio.cli", *sys.argv[2:]]
    runpy.run_module("gezel_trio.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
