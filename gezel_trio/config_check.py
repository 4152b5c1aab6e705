"""``gezel-trio check-config``: what serving this config would run into, before it does.

Beyond the config file's own validation (types, keys, ranges), :func:`check_config`
checks what an engine start would hit, for every model the host spawns:

- the model file exists and is a GGUF (its header and metadata read);
- the engine's command line builds: the model's ``args`` do not take the host's own
  flags (``--host``, ``--port``), and ``--parallel``/``--ctx-size`` are numbers;
- the memory plan fits the device (the first GPU, else RAM) with every spawned model
  resident at once under ``coexist``, or the largest alone under ``swap``, and what
  the plan is, in words;
- the engine binary resolves.

It only reads: no engine is started, nothing is written to the state dir.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import Config
from .engine.argv import build_argv
from .engine.binary import resolve_engine
from .engine.gguf_meta import GGUFError, read_gguf_info
from .engine.planner import plan_engine
from .errors import GezelError
from .gpu.ledger import CPU_DEVICE, default_capacities, format_bytes
from .gpu.probe import DeviceHealth, NvmlProbe
from .models_dir import models_from_dir

__all__ = ["CheckReport", "check_config"]


@dataclass
class CheckReport:
    """Problems (each names the key or file to fix) and what the plan is."""

    problems: list[str] = field(default_factory=list)
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
        lines += [f"problem: {p}" for p in self.problems]
        lines.append("ok" if self.ok else f"{len(self.problems)} problem(s)")
        return "\n".join(lines)


async def read_device_health() -> DeviceHealth:
    """One NVML reading (no GPU: a reading that says so)."""
    probe = NvmlProbe()
    try:
        return await probe.read(max_age=0)
    finally:
        await probe.aclose()


def check_config(config: Config, health: DeviceHealth | None) -> CheckReport:
    """Check ``config`` against the files, the engine and the device ``health`` describes
    (see the module). Blocking file I/O."""
    report = CheckReport()
    try:
        engine = resolve_engine(config.engine.binary)
        report.binary = str(engine.path)
    except GezelError as exc:
        report.problems.append(f"engine.binary: {exc.message}")
        engine = None
    capacities = default_capacities(health)
    gpu_ids = [d for d in capacities if d != CPU_DEVICE]
    report.device = gpu_ids[0] if gpu_ids else CPU_DEVICE
    report.budget_bytes = capacities.get(report.device, 0)
    total = 0
    largest = 0
    for i, model in enumerate(models_from_dir(config.models, config.engine.models_dir)):
        key = f"models[{i}] ({model.id})"
        if model.external:
            report.plans[model.id] = {"summary": f"external engine at {model.url}"}
            continue
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
        try:
            build_argv(
                binary=engine.path if engine else Path("llama-server"),
                model_path=str(path),
                port=0,
                parallel=model.parallel,
                ctx_per_slot=model.ctx_per_slot,
                slot_save_dir=config.state_dir / "slots" / model.id,
                host_args=config.engine.extra_args,
                user_args=model.args,
            )
        except GezelError as exc:
            report.problems.append(f"{key}.args: {exc.message}")
        if model.rpc:
            report.plans[model.id] = {
                "summary": f"layers on the RPC workers {', '.join(model.rpc)} (planned at each "
                "start against the memory they report)"
            }
            continue
        plan = plan_engine(
            info,
            budget_bytes=report.budget_bytes,
            already_reserved_bytes=0,
            requested_ctx_per_slot=model.ctx_per_slot,
            requested_parallel=model.parallel,
            gpu=report.device != CPU_DEVICE,
        )
        summary = (
            f"{plan.parallel} slot(s) x {plan.ctx_per_slot} tokens, "
            f"{format_bytes(plan.total_bytes)} on {plan.device}"
        )
        if plan.reasons:
            summary += " (" + "; ".join(plan.reasons) + ")"
        report.plans[model.id] = {**plan.as_dict(), "summary": summary}
        if not plan.fits:
            report.problems.append(
                f"{key}: does not fit {report.device} ({format_bytes(report.budget_bytes)}): "
                + "; ".join(plan.reasons)
            )
        total += plan.total_bytes
        largest = max(largest, plan.total_bytes)
    swap = config.gpu.policy == "swap"
    needed = largest if swap else total
    if needed > report.budget_bytes and not report.problems:
        report.problems.append(
            f"gpu.policy: {config.gpu.policy!r} keeps "
            + ("one model" if swap else "every model")
            + f" resident: {format_bytes(needed)} needed, {format_bytes(report.budget_bytes)} "
            'on the device (set policy = "swap", or fewer slots or tokens per slot)'
        )
    return report
