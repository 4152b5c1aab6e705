"""Run gezel-trio's command line with a record of every slot grant, for
:mod:`benchmarks.handoff_profile`.

    python -m benchmarks._handoff_tracer OUT.jsonl serve --config FILE

Each request (from the lean front taking it to its stream's end) gets one JSON line in
OUT: when it reached the front, when its slot grant began and ended, how long it waited
for a background save of its slot, each slot call made for it (``save``, ``restore``,
``erase``: host-side ms and the engine's own ``timings``), whether it was a handoff
(another owner's slot) and its upstream calls, when the engine's first and last chunks
came and the engine's own ``timings`` of the prompt (``prompt_n``, ``prompt_ms``,
``cache_n``). Background saves get a line each (``"bg_save"``), with their host-side
span and the engine's ``save_ms``. Times are ``perf_counter`` seconds; a line is written
(and flushed) as its record ends. The records ride a context variable, which the job
task the front spawns for a stream inherits.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import runpy
import sys
import time
from collections.abc import Callable
from typing import Any

from gezel_trio.api.lean import LeanFront
from gezel_trio.engine.client import EngineClient
from gezel_trio.scheduler.dispatcher import SlotRequest
from gezel_trio.scheduler.maintenance import SlotMaintenance
from gezel_trio.scheduler.policy import SchedulerPolicy

_RECORD: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "handoff_record", default=None
)
_TIMINGS = re.compile(rb'"timings"\s*:\s*(\{[^{}]*\})')
_OUT: Any = None


def _write(record: dict[str, Any]) -> None:
    _OUT.write(json.dumps(record) + "\n")
    _OUT.flush()


def _install() -> None:
    serve, aenter, aexit = LeanFront._serve, SlotRequest.__aenter__, SlotRequest.__aexit__
    slot_action, stream = EngineClient.slot_action, EngineClient.stream
    wait_for_save, run_idle_save = SlotMaintenance.wait_for_save, SlotMaintenance._run_idle_save
    note_handoff = SchedulerPolicy.note_handoff

    @functools.wraps(serve)
    async def serve_traced(self: Any, *args: Any, **kwargs: Any) -> Any:
        record: dict[str, Any] = {"kind": "request", "front": time.perf_counter(), "calls": []}
        scope = args[1] if len(args) > 1 else kwargs.get("scope", {})
        for name, value in scope.get("headers", ()):
            if name.lower() == b"x-session-id":
                record["session"] = value.decode("latin-1")
        token = _RECORD.set(record)
        try:
            return await serve(self, *args, **kwargs)
        finally:
            _RECORD.reset(token)
            record["front_out"] = time.perf_counter()
            if "stream_end" in record or "stream_in" not in record:
                _write(record)  # else the stream's job writes it as it ends

    @functools.wraps(aenter)
    async def aenter_traced(self: Any) -> Any:
        record = _RECORD.get()
        if record is not None:
            record["grant_in"] = time.perf_counter()
        grant = await aenter(self)
        if record is not None:
            record["grant_out"] = time.perf_counter()
            record["slot"] = grant.slot_id
            record["prepare_calls"] = grant.prepare_calls
            record["restored"] = grant.restored_tokens
        return grant

    @functools.wraps(aexit)
    async def aexit_traced(self: Any, *exc: Any) -> Any:
        record = _RECORD.get()
        t0 = time.perf_counter()
        try:
            return await aexit(self, *exc)
        finally:
            if record is not None:
                record["release_ms"] = (time.perf_counter() - t0) * 1000

    @functools.wraps(wait_for_save)
    async def wait_for_save_traced(self: Any, *args: Any, **kwargs: Any) -> Any:
        record = _RECORD.get()
        t0 = time.perf_counter()
        try:
            return await wait_for_save(self, *args, **kwargs)
        finally:
            if record is not None:
                record["save_wait_ms"] = (time.perf_counter() - t0) * 1000

    @functools.wraps(slot_action)
    async def slot_action_traced(self: Any, slot: int, action: str, **kwargs: Any) -> Any:
        record = _RECORD.get()
        t0 = time.perf_counter()
        body = await slot_action(self, slot, action, **kwargs)
        call = {
            "action": action,
            "slot": slot,
            "t0": t0,
            "ms": (time.perf_counter() - t0) * 1000,
            "engine": body.get("timings"),
            "tokens": body.get("n_saved", body.get("n_restored")),
        }
        if record is not None:
            record["calls"].append(call)
        else:
            _write({"kind": "slot_call", **call})
        return body

    @functools.wraps(run_idle_save)
    async def run_idle_save_traced(self: Any, save: Any) -> Any:
        record: dict[str, Any] = {"kind": "bg_save", "slot": save.slot, "calls": []}
        token = _RECORD.set(record)
        record["t0"] = time.perf_counter()
        try:
            return await run_idle_save(self, save)
        finally:
            record["t1"] = time.perf_counter()
            _RECORD.reset(token)
            _write(record)

    @functools.wraps(note_handoff)
    def note_handoff_traced(self: Any, *, calls: int, shared: bool = False) -> None:
        record = _RECORD.get()
        if record is not None:
            record["handoff_calls"] = calls
            record["shared"] = shared
        note_handoff(self, calls=calls, shared=shared)

    @functools.wraps(stream)
    async def stream_traced(self: Any, path: str, body: Any, sink: Any, **kwargs: Any) -> Any:
        record = _RECORD.get()
        if record is None:
            return await stream(self, path, body, sink, **kwargs)
        record["stream_in"] = time.perf_counter()
        tail = [b""]

        class Sink:
            async def send(self, value: Any, /) -> None:
                if isinstance(value, bytes):
                    if "first_chunk" not in record:
                        record["first_chunk"] = time.perf_counter()
                    tail[0] = (tail[0] + value)[-4096:]
                await sink.send(value)

        try:
            return await stream(self, path, body, Sink(), **kwargs)
        finally:
            record["stream_end"] = time.perf_counter()
            found = _TIMINGS.findall(tail[0])
            if found:
                try:
                    record["engine"] = json.loads(found[-1])
                except ValueError:
                    pass
            if "front_out" in record:
                _write(record)

    LeanFront._serve = serve_traced  # type: ignore[method-assign]
    SlotRequest.__aenter__ = aenter_traced  # type: ignore[method-assign]
    SlotRequest.__aexit__ = aexit_traced  # type: ignore[method-assign]
    SlotMaintenance.wait_for_save = wait_for_save_traced  # type: ignore[method-assign]
    SlotMaintenance._run_idle_save = run_idle_save_traced  # type: ignore[method-assign]
    SchedulerPolicy.note_handoff = note_handoff_traced  # type: ignore[method-assign]
    EngineClient.slot_action = slot_action_traced  # type: ignore[method-assign]
    EngineClient.stream = stream_traced  # type: ignore[method-assign]


def main(argv: Callable[[], list[str]] = lambda: sys.argv) -> None:
    global _OUT
    args = argv()
    _OUT = open(args[1], "a", buffering=1)  # noqa: SIM115 - open for the process's life
    _install()
    sys.argv = ["gezel_trio.cli", *args[2:]]
    runpy.run_module("gezel_trio.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
