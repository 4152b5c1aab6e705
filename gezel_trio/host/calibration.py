"""Calibration as the scheduler's exclusive operation: may this engine co-batch?

Recurrent and hybrid architectures (Mamba, RWKV, LFM2, Qwen3.5-style
gated-delta-net, ...) have been measured to corrupt every sequence but the
first when several share a batch, and a Mamba engine that did not crash can
stay corrupt for later one-at-a-time requests until its process restarts.
Until an engine has passed the co-batch probe
(:func:`gezel_trio.engine.calibrate.probe_cobatch`), such a model is served one
sequence at a time (its lane's admission ceiling is 1).

A calibration runs as an exclusive ``calibrate`` job: the scheduler drains the
engine, runs the probe alone, and only then admits traffic again. Inside that
block, and so before the engine serves anything else,

- the verdict is applied (one rule, :func:`decide_ceiling`, for a live verdict
  and for a remembered one), and
- after a failed probe (crashed or not) or an abandoned one the engine process
  is stopped and started again: the probe co-batched on it, so its state is
  suspect. Status (``restarts_after_failure``, ``last_restart``) and the log
  say so.

It runs

- when an engine of a recurrent architecture first becomes READY,
- again when the engine binary changes (the build fingerprint is part of the
  remembered verdict), and
- on demand for any model (``POST /api/models/{id}/calibrate``).

An error (QueueFull in a burst, NoCapacity, a failed start, a bug) is logged,
shown in status (``last_error``, ``next_retry_in``) and retried with backoff
(:class:`RetryPolicy`) by :func:`serve_calibration`; it never reaches the host.

Verdicts are remembered in ``<state_dir>/calibration.json`` per model file and
engine build.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import trio

from ..config.schema import ModelConfig
from ..engine.arch import ArchVerdict, keeps_recurrent_state
from ..engine.calibrate import CalibrationResult, decide_ceiling, probe_cobatch
from ..engine.supervisor import Engine, EngineState
from ..errors import GezelError, SchedulerClosed
from ..scheduler import Scheduler

log = logging.getLogger("gezel_trio.host.calibration")

__all__ = [
    "CalibratedModel",
    "CalibrationBook",
    "CalibrationState",
    "Calibrator",
    "CobatchProbe",
    "RetryPolicy",
    "apply_verdict",
    "calibrate",
    "serve_calibration",
]


def _describe(exc: BaseException) -> str:
    if isinstance(exc, GezelError):
        return f"{type(exc).__name__}: {exc.message}"
    return f"{type(exc).__name__}: {exc}"


@dataclass
class CalibrationState:
    """What the host knows about one model's co-batch safety (written by this module)."""

    arch: ArchVerdict | None = None
    result: dict[str, Any] | None = None
    source: str | None = None
    """Where ``result`` came from: ``"probe"`` (this host ran it) or ``"remembered"``."""
    fingerprint: str | None = None
    runs: int = 0
    phase: str = "idle"
    """idle, waiting for engine, queued, starting engine, probing, restarting, retry wait."""
    errors: int = 0
    """Calibrations that raised instead of giving a verdict, all told."""
    consecutive_errors: int = 0
    last_error: str | None = None
    last_error_at: float | None = None
    next_retry_at: float | None = None
    """Trio clock time of the next attempt after an error (``None``: none scheduled)."""
    restarts_after_failure: int = 0
    """Engine processes stopped (and started again) because a probe failed on them."""
    last_restart: dict[str, Any] | None = field(default=None)

    def as_dict(self) -> dict[str, Any]:
        status = "not_run"
        if self.result is not None:
            status = "passed" if self.result.get("verdict") == "passed" else "failed"
        next_retry_in: float | None = None
        if self.next_retry_at is not None:
            try:
                next_retry_in = round(max(0.0, self.next_retry_at - trio.current_time()), 3)
            except RuntimeError:  # read outside the host's Trio thread
                next_retry_in = None
        return {
            "status": status,
            "phase": self.phase,
            "architecture": self.arch.architecture if self.arch else None,
            "recurrent": self.arch.recurrent if self.arch else None,
            "arch_reason": self.arch.reason if self.arch else None,
            "fingerprint": self.fingerprint,
            "source": self.source,
            "runs": self.runs,
            "errors": self.errors,
            "consecutive_errors": self.consecutive_errors,
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
            "next_retry_in": next_retry_in,
            "restarts_after_failure": self.restarts_after_failure,
            "last_restart": dict(self.last_restart) if self.last_restart else None,
            "result": self.result,
        }

    def note_error(self, exc: BaseException) -> str:
        """Record a calibration that raised; returns its description."""
        message = _describe(exc)
        self.errors += 1
        self.consecutive_errors += 1
        self.last_error, self.last_error_at = message, time.time()
        return message


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


class CobatchProbe(Protocol):
    """The probe's call (:func:`probe_cobatch`; tests pass their own)."""

    def __call__(
        self,
        client: httpx.AsyncClient,
        base_url: str,
        *,
        parallel: int,
        engine_alive: Callable[[], bool] | None = None,
    ) -> Awaitable[CalibrationResult]: ...


class CalibratedModel(Protocol):
    """What calibration reads and sets of one model (a
    :class:`~gezel_trio.host.runtime.ModelRuntime`): its settings and engine, read;
    its :class:`CalibrationState` and admission ceiling, written."""

    calibration: CalibrationState
    ceiling: int | None
    """The admission ceiling calibration sets (None: the engine's slots)."""
    ceiling_reason: str | None

    @property
    def id(self) -> str: ...

    @property
    def config(self) -> ModelConfig: ...

    @property
    def engine(self) -> Engine: ...

    @property
    def parallel(self) -> int:
        """The admission ceiling in effect (for the log)."""
        ...

    @property
    def slot_count(self) -> int:
        """The engine's slots (what it runs, else what it will run)."""
        ...


@dataclass(frozen=True)
class RetryPolicy:
    """How long :func:`serve_calibration` waits after its n-th consecutive error:
    ``base``, 2x, 4x, ... up to ``cap`` seconds (1, 2, 4, ... 60 by default)."""

    base: float = 1.0
    cap: float = 60.0

    def delay(self, failures: int) -> float:
        if failures < 1:
            return 0.0
        return float(min(self.cap, self.base * 2 ** min(failures - 1, 62)))


@dataclass(frozen=True)
class Calibrator:
    """What calibration needs from the host, passed in (no import of the host)."""

    scheduler: Scheduler
    http: httpx.AsyncClient
    book: CalibrationBook
    fingerprint: Callable[[], str]
    """The engine build's fingerprint (part of a remembered verdict's key)."""
    probe: CobatchProbe = probe_cobatch
    retry: RetryPolicy = RetryPolicy()


def apply_verdict(
    runtime: CalibratedModel, result: CalibrationResult | None, *, remembered: bool = False
) -> None:
    """Set the lane's admission ceiling from a verdict, live or remembered, or from the
    absence of one. :func:`decide_ceiling` is the only rule."""
    state = runtime.calibration
    recurrent = bool(state.arch and state.arch.recurrent)
    override = runtime.config.allow_unsafe_batching
    configured = runtime.slot_count
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
    elif result.passed:
        runtime.ceiling_reason = f"calibration passed with {result.parallel} slots only" + (
            " (remembered)" if remembered else ""
        )
    else:
        runtime.ceiling_reason = (
            ("calibration failed earlier (remembered)" if remembered else "calibration failed")
            + (" (the engine crashed)" if result.crashed else "")
            + f": {result.distinct_answers} distinct answers to identical prompts; "
            f"{result.reason}"
        )


def detect_architecture(runtime: CalibratedModel) -> None:
    """Read the model's architecture once (a blocking GGUF read, done in a thread by callers)."""
    if runtime.config.path is None:
        return
    try:
        runtime.calibration.arch = keeps_recurrent_state(Path(runtime.config.path))
    except Exception as exc:  # an unreadable file fails at engine start with its own error
        runtime.calibration.last_error = f"architecture unknown: {exc}"


def _record(ctx: Calibrator, runtime: CalibratedModel, result: CalibrationResult) -> None:
    """Store, apply, remember and log a live verdict (synchronous: nothing can run between)."""
    state = runtime.calibration
    state.runs += 1
    state.consecutive_errors = 0
    state.result = result.to_dict() | {"finished_at": time.time()}
    state.source = "probe"
    apply_verdict(runtime, result)
    try:
        state.fingerprint = ctx.fingerprint()
    except Exception as exc:  # the verdict holds; it is only not remembered
        state.fingerprint = None
        log.warning(
            "calibration verdict not remembered: no build fingerprint (%s)",
            _describe(exc),
            extra={"fields": {"model": runtime.id}},
        )
    if runtime.config.path is not None and state.fingerprint is not None:
        ctx.book.put(CalibrationBook.key(runtime.config.path, state.fingerprint), state.result)
    log.log(
        logging.INFO if result.passed else logging.ERROR,
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


async def _restart(runtime: CalibratedModel, why: str) -> None:
    """Stop the engine process the probe ran on and start a fresh one.

    Called inside the exclusive block, so nothing is served in between. A failed
    start is logged and recorded: the engine stays down and the scheduler starts
    it on its next use. The stop runs shielded (under the engine's stop deadline);
    cancellation after it abandons only the wait for the new start.
    """
    engine = runtime.engine
    state = runtime.calibration
    state.phase = "restarting"
    restart: dict[str, Any] = {
        "at": time.time(),
        "reason": why,
        "old_pid": engine.pid,
        "old_generation": engine.generation,
        "new_pid": None,
        "new_generation": None,
        "error": None,
    }
    state.restarts_after_failure += 1
    state.last_restart = restart
    fields = {"model": runtime.id, "pid": engine.pid, "generation": engine.generation}
    log.warning(
        "%s: restarting the engine process before it serves anything",
        why,
        extra={"fields": fields},
    )
    # Shielded: a caller cancelled now must not leave the block with the suspect
    # process still READY.
    with trio.move_on_after(engine.timing.stop_grace + 5, shield=True):
        await engine.stop()
    try:
        await engine.ensure_ready()
    except Exception as exc:
        restart["error"] = _describe(exc)
        log.error(
            "the engine could not be restarted after %s (%s): it starts again on its next use",
            why,
            restart["error"],
            extra={"fields": {"model": runtime.id}},
        )
        return
    restart["new_pid"], restart["new_generation"] = engine.pid, engine.generation
    log.info(
        "engine restarted after %s",
        why,
        extra={"fields": {"model": runtime.id, "pid": engine.pid, "generation": engine.generation}},
    )


async def calibrate(ctx: Calibrator, runtime: CalibratedModel) -> CalibrationResult:
    """Run the co-batch probe as an exclusive operation and apply its verdict.

    Waits for the engine's turn (the scheduler drains it first). Inside the
    exclusive block the verdict is applied and, after a failed probe (crashed or
    not), the engine process is restarted, so the process the probe ran on serves
    nothing more. Raises the scheduler's or the engine's error (QueueFull,
    NoCapacity, EngineFailed, ...) after recording it in ``runtime.calibration``.

    Cancelling while queued or while the engine starts changes nothing. Cancelling
    during the probe abandons it: no verdict, the ceiling stays, and the engine is
    stopped (under a shielded deadline, before the block exits) because it may have
    co-batched; it starts again on its next use.
    """
    state = runtime.calibration
    engine = runtime.engine
    try:
        state.phase = "queued"
        async with ctx.scheduler.slot(runtime.id, kind="calibrate"):
            state.phase = "starting engine"
            await engine.ensure_ready()
            assert engine.base_url is not None
            parallel = runtime.slot_count
            state.phase = "probing"
            try:
                result = await ctx.probe(
                    ctx.http,
                    engine.base_url,
                    parallel=parallel,
                    engine_alive=lambda: engine.state.value is EngineState.READY,
                )
            except BaseException as exc:
                if not engine.external:
                    why = f"calibration abandoned ({type(exc).__name__})"
                    log.warning(
                        "%s: stopping the engine process it ran on",
                        why,
                        extra={"fields": {"model": runtime.id, "pid": engine.pid}},
                    )
                    with trio.move_on_after(engine.timing.stop_grace + 5, shield=True):
                        await engine.stop()
                raise
            _record(ctx, runtime, result)
            if not result.passed and not engine.external:
                await _restart(
                    runtime, "calibration failed" + (" (crashed)" if result.crashed else "")
                )
    except Exception as exc:
        state.note_error(exc)
        raise
    finally:
        state.phase = "idle"
    return result


def _remembered(
    ctx: Calibrator, runtime: CalibratedModel, fingerprint: str
) -> CalibrationResult | None:
    if runtime.config.path is None:
        return None
    entry = ctx.book.get(CalibrationBook.key(runtime.config.path, fingerprint))
    if entry is None:
        return None
    try:
        return CalibrationResult.from_dict(entry)
    except ValueError as exc:
        log.warning(
            "ignoring a remembered calibration verdict: %s",
            exc,
            extra={"fields": {"model": runtime.id}},
        )
        return None


async def serve_calibration(
    ctx: Calibrator,
    runtime: CalibratedModel,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Apply a remembered verdict, or calibrate a recurrent model's engine when it is READY.

    Reports started once the ceiling is set (from the remembered verdict, or 1
    for an uncalibrated recurrent model). Then, for a recurrent model with no
    remembered verdict, waits for the engine's first READY and calibrates. An
    error of any kind is logged, recorded (``last_error``, ``next_retry_in``) and
    retried after :attr:`Calibrator.retry`'s backoff, once the engine is READY
    again (a retry never loads an engine nobody uses); it never propagates. Returns
    once a verdict exists (an on-demand calibration counts) or the scheduler
    closes. Cancellation (host shutdown) ends it at any point.
    """
    state = runtime.calibration
    recurrent = False
    remembered: CalibrationResult | None = None
    try:
        await trio.to_thread.run_sync(detect_architecture, runtime)
        recurrent = bool(state.arch and state.arch.recurrent)
        fingerprint = ctx.fingerprint()
        remembered = _remembered(ctx, runtime, fingerprint)
        if remembered is not None:
            assert runtime.config.path is not None
            state.result = ctx.book.get(CalibrationBook.key(runtime.config.path, fingerprint))
            state.fingerprint, state.source = fingerprint, "remembered"
        apply_verdict(runtime, remembered, remembered=remembered is not None)
    except Exception as exc:  # keep the safe ceiling for what is known, and go on
        message = state.note_error(exc)
        log.error("calibration setup failed: %s", message, extra={"fields": {"model": runtime.id}})
        if recurrent and runtime.ceiling is None and not runtime.config.allow_unsafe_batching:
            runtime.ceiling = 1
    if runtime.config.allow_unsafe_batching and recurrent:
        log.warning(
            "allow_unsafe_batching is on for a recurrent/hybrid model: co-batched chats may "
            "corrupt each other's answers",
            extra={"fields": {"model": runtime.id}},
        )
    task_status.started()
    if not recurrent or remembered is not None:
        return
    engine = runtime.engine
    seen = 0
    while state.result is None:
        state.phase = "waiting for engine"
        if state.consecutive_errors == 0:

            def new_ready(s: EngineState, after: int = seen) -> bool:
                return s is EngineState.READY and engine.generation > after

            await engine.state.wait_value(new_ready)
        else:
            await engine.state.wait_value(EngineState.READY)
        if state.result is not None:
            break  # an on-demand calibration gave the verdict meanwhile
        seen = engine.generation
        try:
            await calibrate(ctx, runtime)
        except SchedulerClosed:
            return  # shutting down
        except Exception as exc:
            # calibrate() has recorded it; a verdict recorded before the error stands.
            if state.result is not None:
                break
            delay = ctx.retry.delay(state.consecutive_errors)
            state.next_retry_at = trio.current_time() + delay
            log.error(
                "calibration error (%d in a row): %s; retrying in %.1fs",
                state.consecutive_errors,
                _describe(exc),
                delay,
                extra={"fields": {"model": runtime.id}},
            )
            state.phase = "retry wait"
            try:
                await trio.sleep(delay)
            finally:
                state.next_retry_at = None
    state.phase = "idle"
