"""Benchmark reports: JSON (machine-readable), a Markdown table, PNG plots, ratios.

:func:`build_report` gathers every target's metrics with the trace, its scaling and
the replay settings; :func:`write_report` writes ``report.json``, ``report.md``,
``ttft_cdf.png``, ``cache_hit_per_turn.png``, one ``requests-<target>.jsonl`` per
target and the replayed ``trace.jsonl`` into a directory. Plots use matplotlib's Agg
backend (imported only when plotting). Synchronous file I/O.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .. import __version__
from .metrics import cache_hit_by_turn, ratios, summarize
from .replay import ReplayResult
from .traces import Trace, save_trace

__all__ = [
    "COMPARE_KEYS",
    "REPORT_FORMAT",
    "TargetOutcome",
    "build_report",
    "compare_ratios",
    "compare_table",
    "markdown_report",
    "plot_cache_hit_per_turn",
    "plot_ttft_cdf",
    "write_report",
]

REPORT_FORMAT = "gezel-bench-report"

#: Metrics ``--compare`` divides by the first target's.
COMPARE_KEYS = (
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_itl_ms",
    "median_e2el_ms",
    "output_throughput",
    "request_throughput",
    "cache_hit_ratio",
    "cache_efficiency",
)

Status = Literal["ok", "skipped", "failed"]


@dataclass(slots=True)
class TargetOutcome:
    """One target of a run: what it was, whether it ran, and its replay result."""

    name: str
    status: Status
    description: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None
    result: ReplayResult | None = None


def _target_entry(outcome: TargetOutcome) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": outcome.name,
        "status": outcome.status,
        "reason": outcome.reason,
        "description": outcome.description,
    }
    result = outcome.result
    if result is not None:
        entry["config"] = result.config
        entry["model_info"] = result.model_info
        entry["synthesis"] = result.synthesis
        entry["metrics"] = summarize(result.records, duration=result.duration)
        entry["cache_hit_by_turn"] = cache_hit_by_turn(result.records)
        entry["ttft_ms"] = sorted(
            round(r.ttft * 1000.0, 3) for r in result.records if r.ok and r.ttft is not None
        )
        entry["errors"] = sorted({r.error for r in result.records if r.error})[:20]
    return entry


def build_report(
    *,
    trace: Trace,
    outcomes: Sequence[TargetOutcome],
    replay: Mapping[str, Any],
    command: Sequence[str] | None = None,
    compare: bool = False,
) -> dict[str, Any]:
    """The whole run as one JSON-able dict (see ``docs/benchmarks.md`` for its fields)."""
    targets = [_target_entry(o) for o in outcomes]
    report: dict[str, Any] = {
        "format": REPORT_FORMAT,
        "version": 1,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "gezel_trio": __version__,
        "command": list(command) if command is not None else None,
        "host": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
        },
        "trace": {**trace.statistics(), "scaling": dict(trace.scaling)},
        "replay": dict(replay),
        "targets": targets,
    }
    if compare:
        report["compare"] = compare_ratios(targets)
    return report


def compare_ratios(targets: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Each ran target's :data:`COMPARE_KEYS` divided by the first ran target's."""
    ran = [t for t in targets if t.get("metrics")]
    if not ran:
        return {"base": None, "ratios": {}}
    base = ran[0]
    return {
        "base": base["name"],
        "ratios": {t["name"]: ratios(base["metrics"], t["metrics"], COMPARE_KEYS) for t in ran},
    }


def _fmt(value: Any, kind: str = "") -> str:
    if value is None:
        return "-"
    if kind == "pct":
        return f"{100.0 * value:.1f}%"
    if kind == "ratio":
        return f"{value:.2f}"
    if kind == "x":
        return f"{value:.2f}x"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"
    return str(value)


_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("completed", "completed", ""),
    ("failed", "failed", ""),
    ("median TTFT ms", "median_ttft_ms", ""),
    ("p99 TTFT ms", "p99_ttft_ms", ""),
    ("median ITL ms", "median_itl_ms", ""),
    ("median E2EL ms", "median_e2el_ms", ""),
    ("out tok/s", "output_throughput", ""),
    ("cache hit", "cache_hit_ratio", "pct"),
    ("oracle", "oracle_hit_ratio", "pct"),
    ("efficiency", "cache_efficiency", "ratio"),
    ("cross-session", "cross_session_reuse", ""),
    ("fairness", "fairness", "ratio"),
    ("prompt mismatch", "prompt_token_mismatch", ""),
)


def markdown_report(report: Mapping[str, Any]) -> str:
    """A Markdown page: what was replayed, how, and one table row per target."""
    trace = report["trace"]
    scaling = trace.get("scaling", {})
    replay = report.get("replay", {})
    lines = [
        "# gezel-trio bench",
        "",
        f"- trace: `{trace['source']}`: {trace['sessions']} sessions "
        f"({trace['sub_agent_sessions']} sub-agents), {trace['requests']} requests, "
        f"{trace['prompt_tokens']} prompt / {trace['output_tokens']} output tokens",
        "- scaling: " + ", ".join(f"{k}={v}" for k, v in scaling.items() if v is not None) + "",
        "- replay: " + ", ".join(f"{k}={v}" for k, v in replay.items() if v is not None),
    ]
    if report.get("command"):
        lines.append(f"- command: `{' '.join(report['command'])}`")
    lines += ["", "| target | " + " | ".join(c[0] for c in _COLUMNS) + " |"]
    lines.append("|---" * (len(_COLUMNS) + 1) + "|")
    for t in report["targets"]:
        m = t.get("metrics")
        if m is None:
            cells = [f"{t['status']}: {t.get('reason') or ''}".strip()] + [""] * (len(_COLUMNS) - 1)
        else:
            cells = [_fmt(m.get(key), kind) for _, key, kind in _COLUMNS]
        lines.append(f"| {t['name']} | " + " | ".join(cells) + " |")
    compare = report.get("compare")
    if compare and compare.get("base"):
        lines += ["", compare_table(report, markdown=True)]
    lines += _replica_lines(report["targets"])
    return "\n".join(lines) + "\n"


def _replica_lines(targets: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per gezel target with a replicated model: where its requests ran, and how often a
    returning chat ran where it ran before (the affinity hit rate)."""
    out: list[str] = []
    for t in targets:
        replicas = (t.get("description") or {}).get("host_replicas")
        if not isinstance(replicas, Mapping):
            continue
        for model, info in replicas.items():
            if not isinstance(info, Mapping):
                continue
            rate = info.get("affinity_hit_rate")
            routed = ", ".join(f"{m} {n}" for m, n in sorted((info.get("routed") or {}).items()))
            out.append(
                f"- `{t['name']}` replicas of `{model}`: ran on {routed or 'none'}; "
                f"returning chats on their replica "
                f"{'n/a' if rate is None else f'{100 * rate:.1f}%'} "
                f"({info.get('kept')} of {info.get('returns')}); moved {info.get('moved')}"
            )
    return ["", *out] if out else []


def compare_table(report: Mapping[str, Any], *, markdown: bool = False) -> str:
    """Ratios of each target's figures to the first target's, as text."""
    compare = report.get("compare") or compare_ratios(report["targets"])
    base = compare.get("base")
    if base is None:
        return "nothing to compare: no target ran"
    names = list(compare["ratios"])
    if markdown:
        out = [
            f"Ratios to `{base}` (latency below 1 and throughput above 1 are better):",
            "",
            "| target | " + " | ".join(COMPARE_KEYS) + " |",
            "|---" * (len(COMPARE_KEYS) + 1) + "|",
        ]
        for name in names:
            row = compare["ratios"][name]
            out.append(
                f"| {name} | " + " | ".join(_fmt(row.get(k), "x") for k in COMPARE_KEYS) + " |"
            )
        return "\n".join(out)
    width = max(len(n) for n in names) + 2
    header = "target".ljust(width) + "".join(k.rjust(20) for k in COMPARE_KEYS)
    out = [f"ratios to {base} (latency < 1 and throughput > 1 are better)", header]
    for name in names:
        row = compare["ratios"][name]
        out.append(
            name.ljust(width) + "".join(_fmt(row.get(k), "x").rjust(20) for k in COMPARE_KEYS)
        )
    return "\n".join(out)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ttft_cdf(report: Mapping[str, Any], path: Path) -> Path:
    """The TTFT CDF of every ran target on one figure."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for t in report["targets"]:
        xs = t.get("ttft_ms") or []
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=t["name"])
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.set_title("TTFT CDF")
    if any(t.get("ttft_ms") for t in report["targets"]):
        ax.set_xscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_cache_hit_per_turn(report: Mapping[str, Any], path: Path) -> Path:
    """Cache hit ratio by turn index for every ran target, with the per-session oracle."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    oracle_drawn = False
    for t in report["targets"]:
        rows = t.get("cache_hit_by_turn") or []
        if not rows:
            continue
        turns = [r["turn"] for r in rows]
        ax.plot(turns, [r["cache_hit_ratio"] for r in rows], marker="o", label=t["name"])
        if not oracle_drawn:
            ax.plot(
                turns,
                [r["oracle_hit_ratio"] for r in rows],
                linestyle="--",
                color="black",
                linewidth=1.2,
                zorder=10,
                label="oracle (per session)",
            )
            oracle_drawn = True
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("turn index")
    ax.set_ylabel("cached prompt tokens / prompt tokens")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.set_title("cache hit per turn")
    if oracle_drawn:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "target"


def write_report(
    report: Mapping[str, Any],
    out_dir: Path,
    *,
    outcomes: Sequence[TargetOutcome] = (),
    trace: Trace | None = None,
    plots: bool = True,
) -> list[Path]:
    """Write the report files into ``out_dir`` (created) and return their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    path = out_dir / "report.json"
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    written.append(path)
    path = out_dir / "report.md"
    path.write_text(markdown_report(report), encoding="utf-8")
    written.append(path)
    for outcome in outcomes:
        if outcome.result is None:
            continue
        path = out_dir / f"requests-{_safe(outcome.name)}.jsonl"
        with path.open("w", encoding="utf-8") as fp:
            for r in outcome.result.records:
                fp.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")
        written.append(path)
    if trace is not None:
        written.append(save_trace(trace, out_dir / "trace.jsonl"))
    if plots:
        written.append(plot_ttft_cdf(report, out_dir / "ttft_cdf.png"))
        written.append(plot_cache_hit_per_turn(report, out_dir / "cache_hit_per_turn.png"))
    return written
