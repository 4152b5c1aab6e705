"""``gezel-trio check-config``: what serving this config would run into, before it does.

It reports every problem in one pass, each once, labelled with the key to fix:

- the config file's own validation (types, keys, ranges), collected over the whole
  file and the ``GEZEL_*`` variables instead of stopping at the first
  (:func:`~gezel_trio.config.schema.read_config`);
- the engine flags (``engine.extra_args`` once, each model's ``args``) against the
  resolved engine's own parser, as its ``--help`` lists it
  (:mod:`gezel_trio.engine.flags`): unknown flags, ``name=value``, a value missing;
  and what the host refuses in them (``--host``, ``--port``, ``--cache-ram``, and
  ``--parallel``/``--ctx-size`` that are not whole numbers);
- for every model the host spawns: the model file exists and is a GGUF (its header
  and metadata read);
- the memory plan fits the device (the first GPU, else RAM) with every spawned model
  resident at once under ``coexist``, or the largest alone under ``swap``, and what
  the plan is, in words;
- the engine binary resolves.

It only reads: no engine is started (the binary runs once with ``--help``), nothing
is written to the state dir.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine.argv import arg_problems, last_arg_value
from ..engine.binary import resolve_engine, resolve_sd_server
from ..engine.context import slot_context, slot_flags, slot_request
from ..engine.flags import EngineFlags, engine_flags
from ..engine.gguf_meta import GGUFError, read_gguf_info
from ..engine.planner import AUTO_PARALLEL, plan_engine
from ..engine.sd_argv import sd_footprint
from ..errors import GezelError
from ..gpu.ledger import CPU_DEVICE, default_capacities, format_bytes
from ..gpu.probe import DeviceHealth, NvmlProbe
from .models_dir import models_from_dir
from .schema import Config, ModelConfig

__all__ = ["CheckReport", "check_config"]


@dataclass
class CheckReport:
    """Problems (each names the key or file to fix) and what the plan is."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    """What could not be checked (the engine's flags, when its ``--help`` fails)."""
    plans: dict[str, dict[str, Any]] = field(default_factory=dict)
    binary: str | None = None
    device: str = CPU_DEVICE
    budget_bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "problems": self.problems,
            "warnings": self.warnings,
            "engine_binary": self.binary,
            "device": self.device,
            "budget_bytes": self.budget_bytes,
            "plans": self.plans,
        }

    def text(self) -> str:
        lines = [f"engine binary: {self.binary or 'not found'}"]
        lines.append(f"device: {self.device}, budget {format_bytes(self.budget_bytes)}")
        for model_id, plan in self.plans.items():
            lines.append(f"{model_id}: {plan['summary']}")
        lines += [f"warning: {w}" for w in self.warnings]
        lines += [f"problem: {p}" for p in self.problems]
        lines.append("ok" if self.ok else f"{len(self.problems)} problem(s)")
        return "\n".join(lines)


def _check_image_model(report: CheckReport, config: Config, model: ModelConfig, key: str) -> int:
    """An image model's line: the sd-server that runs it and its estimated footprint
    (its files' problems are the config's own, reported already). The bytes estimated."""
    try:
        binary = str(resolve_sd_server(config.engine.sd_server).path)
    except GezelError as exc:
        report.problems.append(f"{key}: engine.sd_server: {exc.message}")
        binary = "no sd-server"
    nbytes = sd_footprint(model.files, model.path)
    report.plans[model.id] = {
        "kind": "image",
        "engine": binary,
        "total_bytes": nbytes,
        "summary": f"image model on sd-server ({binary}), about {format_bytes(nbytes)} "
        f"estimated from its files on {report.device}",
    }
    return nbytes


async def read_device_health() -> DeviceHealth:
    """One NVML reading (no GPU: a reading that says so)."""
    probe = NvmlProbe()
    try:
        return await probe.read(max_age=0)
    finally:
        await probe.aclose()


def check_config(
    config: Config,
    health: DeviceHealth | None,
    *,
    problems: Sequence[str] = (),
    model_indices: Sequence[int] | None = None,
) -> CheckReport:
    """Check ``config`` against the files, the engine and the device ``health`` describes
    (see the module). ``problems`` are the config file's own (from
    :func:`~gezel_trio.config.schema.read_config`), reported first; ``model_indices`` are the
    positions in the file of ``config.models`` (for the labels). Blocking file I/O."""
    report = CheckReport(problems=list(problems))
    flags: EngineFlags | None = None
    try:
        engine = resolve_engine(config.engine.binary)
        report.binary = str(engine.path)
    except GezelError as exc:
        report.problems.append(f"engine.binary: {exc.message}")
        engine = None
    if engine is not None:
        try:
            flags = engine_flags(engine.path, env=engine.launch_env())
        except (OSError, ValueError) as exc:
            report.warnings.append(f"engine flags not checked against the engine: {exc}")

    def check_args(key: str, args: Sequence[str]) -> None:
        found = arg_problems(args)
        if flags is not None:
            # one line per flag: what the host refuses in it says enough
            covered = {p.split(" ", 1)[0] for p in found}
            found += [p for p in flags.problems(args) if p.split(" ", 1)[0] not in covered]
        report.problems += [f"{key}: {p}" for p in found]

    check_args("engine.extra_args", config.engine.extra_args)
    capacities = default_capacities(health)
    gpu_ids = [d for d in capacities if d != CPU_DEVICE]
    report.device = gpu_ids[0] if gpu_ids else CPU_DEVICE
    report.budget_bytes = capacities.get(report.device, 0)
    total = 0
    largest = 0
    misfit = False
    explicit = len(config.models)
    indices = list(model_indices or ())
    indices += range(len(indices), explicit)  # models added in code (the demo model)
    for i, model in enumerate(models_from_dir(config.models, config.engine.models_dir)):
        key = (
            f"models[{indices[i]}] ({model.id})"
            if i < explicit
            else f"engine.models_dir ({model.id})"
        )
        if model.external:
            report.plans[model.id] = {"summary": f"external engine at {model.url}"}
            continue
        if model.kind == "image":
            nbytes = _check_image_model(report, config, model, key)
            total += nbytes
            largest = max(largest, nbytes)
            continue
        check_args(f"{key}.args", model.args)
        assert model.path is not None
        path = Path(model.path)
        if not path.is_file():
            report.problems.append(f"{key}.path: {model.path!r} does not exist")
            continue
        try:
            info = read_gguf_info(str(path))
        except GGUFError as exc:
            report.problems.append(
                f"{key}.path: {model.path!r} is not a usable GGUF: {exc.message}"
            )
            continue
        if model.rpc:
            report.plans[model.id] = {
                "summary": f"layers on the RPC workers {', '.join(model.rpc)} (planned at each "
                "start against the memory they report)"
            }
            continue
        request = slot_request(
            ctx_per_slot=model.ctx_per_slot,
            parallel=model.parallel,
            flags=[*config.engine.extra_args, *model.args],
            n_ctx_train=info.context_length or None,
            default_parallel=AUTO_PARALLEL,
        )
        plan = plan_engine(
            info,
            budget_bytes=report.budget_bytes,
            already_reserved_bytes=0,
            requested_ctx_per_slot=request.ctx_per_slot,
            requested_parallel=request.parallel,
            fixed=request.fixed,
            gpu=report.device != CPU_DEVICE,
        )
        launch = slot_flags(
            parallel=plan.parallel,
            ctx_per_slot=plan.ctx_per_slot,
            extended=plan.context_flags,
            extra_args=config.engine.extra_args,
            model_args=model.args,
        )
        runs_ctx = slot_context(launch, n_ctx_train=info.context_length or None)
        runs_parallel = last_arg_value(launch, "--parallel") or str(plan.parallel)
        if plan.context_flags:
            report.warnings.append(
                f"{key}.ctx_per_slot: {plan.ctx_per_slot} is above the model's trained context "
                f"{info.context_length}: the engine runs it with {' '.join(plan.context_flags)}"
                ", and answers past the trained context may be worse"
            )
        summary = (
            f"{runs_parallel} slot(s) x {runs_ctx} tokens, "
            f"{format_bytes(plan.total_bytes)} on {plan.device}"
        )
        if plan.reasons:
            summary += " (" + "; ".join(plan.reasons) + ")"
        report.plans[model.id] = {
            **plan.as_dict(),
            "runs_ctx_per_slot": runs_ctx,
            "summary": summary,
        }
        if not plan.fits:
            misfit = True
            report.problems.append(
                f"{key}: does not fit {report.device} ({format_bytes(report.budget_bytes)}): "
                + "; ".join(plan.reasons)
            )
        total += plan.total_bytes
        largest = max(largest, plan.total_bytes)
    swap = config.gpu.policy == "swap"
    needed = largest if swap else total
    if needed > report.budget_bytes and not misfit:
        report.problems.append(
            f"gpu.policy: {config.gpu.policy!r} keeps "
            + ("one model" if swap else "every model")
            + f" resident: {format_bytes(needed)} needed, {format_bytes(report.budget_bytes)} "
            'on the device (set policy = "swap", or fewer slots or tokens per slot)'
        )
    return report
