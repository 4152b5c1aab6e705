"""Calibration as the scheduler's exclusive operation: may this engine co-batch?

Recurrent and hybrid architectures (Mamba, RWKV, LFM2, Qwen3.5-style
gated-delta-net, ...) have been measured to corrupt every sequence but the
first when several share a batch. Until an engine has passed the co-batch
probe (:func:`gezel_trio.engine.calibrate.probe_cobatch`), such a model is
served one sequence at a time (its lane's admission ceiling is 1).

A calibration runs as an exclusive ``calibrate`` job: the scheduler drains the
engine, runs the probe alone, and only then admits traffic again. It runs

- when an engine of a recurrent architecture first becomes READY,
- again when the engine binary changes (the build fingerprint is part of the
  remembered verdict), and
- on demand for any model (``POST /api/models/{id}/calibrate``).

Verdicts are remembered in ``<state_dir>/calibration.json`` per model file and
engine build.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import trio

from ..engine.arch import ArchVerdict, keeps_recurrent_state
from ..engine.calibrate import CalibrationResult, decide_ceiling, probe_cobatch
from ..engine.supervisor import EngineState
from ..errors import EngineFailed
from ..scheduler import Scheduler

if TYPE_CHECKING:
    from .runtime import ModelRuntime

log = logging.getLogger("gezel_trio.host.calibration")


@dataclass
class CalibrationState:
    """What the host knows about one model's co-batch safety."""

    arch: ArchVerdict | None = None
    result: dict[str, Any] | None = None
    fingerprint: str | None = None
    runs: int = 0
    last_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        status = "not_run"
        if self.result is not None:
            status = "passed" if self.result.get("verdict") == "passed" else "failed"
        return {
            "status": status,
            "architecture": self.arch.architecture if self.arch else None,
            "recurrent": self.arch.recurrent if self.arch else None,
            "arch_reason": self.arch.reason if self.arch else None,
            "fingerprint": self.fingerprint,
            "runs": self.runs,
            "last_error": self.last_error,
            "result": self.result,
        }


class CalibrationBook:
    """Verdicts on disk, keyed by model file identity and engine build."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            data = json.loads(path.read_text())
            self._data: dict[str, Any] = data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            self._data = {}

    @staticmethod
    def key(model_path: str, build: str) -> str:
        try:
            st = Path(model_path).stat()
            ident = f"{Path(model_path).resolve()}:{st.st_size}:{int(st.st_mtime)}"
        except OSError:
            ident = model_path
        return f"{ident}|{build}"

    def get(self, key: str) -> dict[str, Any] | None:
        value = self._data.get(key)
        return value if isinstance(value, dict) else None

    def put(self, key: str, result: dict[str, Any]) -> None:
        self._data[key] = result
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(self._data, indent=1))
            tmp.replace(self.path)
        except OSError as exc:  # a read-only state dir only costs a re-run
            log.warning("could not save calibration verdicts: %s", exc)


@dataclass(frozen=True)
class Calibrator:
    """What calibration needs from the host, passed in (no import of the host)."""

    scheduler: Scheduler
    http: httpx.AsyncClient
    book: CalibrationBook
    fingerprint: Callable[[], str]
    """The engine build's fingerprint (part of a remembered verdict's key)."""


def apply_verdict(runtime: ModelRuntime, result: CalibrationResult | None) -> None:
    """Set the lane's admission ceiling from a verdict (or from the absence of one)."""
    state = runtime.calibration
    recurrent = bool(state.arch and state.arch.recurrent)
    override = runtime.config.allow_unsafe_batching
    configured = runtime.engine.parallel or runtime.config.parallel
    ceiling = decide_ceiling(
        result, configured_parallel=configured, recurrent=recurrent, override=override
    )
    if ceiling >= configured:
        runtime.ceiling, runtime.ceiling_reason = None, None
        if override and recurrent and (result is None or not result.passed):
            runtime.ceiling_reason = (
                "allow_unsafe_batching: co-batching is NOT proven safe for this "
                "recurrent/hybrid model; answers may leak between chats"
            )
        return
    runtime.ceiling = ceiling
    if result is None:
        runtime.ceiling_reason = (
            f"{state.arch.architecture if state.arch else 'this'} architecture keeps "
            "recurrent state: one sequence at a time until calibration passes"
        )
    else:
        runtime.ceiling_reason = (
            f"calibration {result.verdict}"
            + (" (the engine crashed)" if result.crashed else "")
            + f": {result.distinct_answers} distinct answers to identical prompts; "
            f"{result.reason}"
        )


def detect_architecture(runtime: ModelRuntime) -> None:
    """Read the model's architecture once (a blocking GGUF read, done in a thread by callers)."""
    if runtime.config.path is None:
        return
    try:
        runtime.calibration.arch = keeps_recurrent_state(Path(runtime.config.path))
    except Exception as exc:  # an unreadable file fails at engine start with its own error
        runtime.calibration.last_error = f"architecture unknown: {exc}"


async def calibrate(ctx: Calibrator, runtime: ModelRuntime) -> CalibrationResult:
    """Run the co-batch probe as an exclusive operation and apply its verdict.

    Waits for the engine's turn (the scheduler drains it first). Raises the
    engine's error if it cannot be started. Cancelling abandons the probe;
    the engine keeps its current ceiling.
    """

    async with ctx.scheduler.slot(runtime.id, kind="calibrate"):
        engine = runtime.engine
        await engine.ensure_ready()
        assert engine.base_url is not None
        parallel = engine.parallel or runtime.config.parallel
        result = await probe_cobatch(
            ctx.http,
            engine.base_url,
            parallel=parallel,
            engine_alive=lambda: engine.state.value is EngineState.READY,
        )
    state = runtime.calibration
    state.runs += 1
    state.fingerprint = ctx.fingerprint()
    state.result = result.to_dict() | {"finished_at": time.time()}
    apply_verdict(runtime, result)
    if runtime.config.path is not None:
        ctx.book.put(CalibrationBook.key(runtime.config.path, state.fingerprint), state.result)
    level = logging.INFO if result.passed else logging.ERROR
    log.log(
        level,
        "calibration %s",
        result.verdict,
        extra={
            "fields": {
                "model": runtime.id,
                "crashed": result.crashed,
                "prompts": result.prompts_tried,
                "distinct_answers": result.distinct_answers,
                "duration_s": round(result.duration_s, 3),
                "admission_ceiling": runtime.parallel,
                "reason": result.reason,
            }
        },
    )
    return result


async def serve_calibration(
    ctx: Calibrator,
    runtime: ModelRuntime,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Calibrate a recurrent model's engine whenever a new build of it becomes READY."""
    await trio.to_thread.run_sync(detect_architecture, runtime)
    state = runtime.calibration
    recurrent = bool(state.arch and state.arch.recurrent)
    fingerprint = ctx.fingerprint()
    remembered = None
    if runtime.config.path is not None:
        remembered = ctx.book.get(CalibrationBook.key(runtime.config.path, fingerprint))
    if remembered is not None:
        state.result, state.fingerprint = remembered, fingerprint
        passed = remembered.get("verdict") == "passed"
        runtime.ceiling = None if passed or not recurrent else 1
        runtime.ceiling_reason = None if runtime.ceiling is None else "calibration failed earlier"
        if runtime.ceiling is None and recurrent:
            proven = int(remembered.get("parallel") or 1)
            if proven < (runtime.config.parallel or 1):
                runtime.ceiling = proven
                runtime.ceiling_reason = f"calibration passed with {proven} slots only"
    else:
        apply_verdict(runtime, None)
    if runtime.config.allow_unsafe_batching and recurrent:
        log.warning(
            "allow_unsafe_batching is on for a recurrent/hybrid model: co-batched chats may "
            "corrupt each other's answers",
            extra={"fields": {"model": runtime.id}},
        )
    task_status.started()
    if not recurrent or remembered is not None:
        return
    seen = 0
    while state.result is None:

        def new_ready(s: EngineState, after: int = seen) -> bool:
            return s is EngineState.READY and runtime.engine.generation > after

        await runtime.engine.state.wait_value(new_ready)
        seen = runtime.engine.generation
        try:
            await calibrate(ctx, runtime)
        except EngineFailed as exc:
            state.last_error = exc.message
