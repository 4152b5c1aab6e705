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
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gezel_trio import __version__

from .metrics import cache_hit_by_turn, ratios, summarize, summarize_probes
from .replay import ReplayResult
from .traces import Trace, save_trace

__all__ = [
    "COMPARE_KEYS",
    "REPORT_FORMAT",
    "TargetOutcome",
    "build_report",
    "compare_ratios",
    "compare_table",
    "figures_rows",
    "figures_table",
    "markdown_report",
    "paired_ratio",
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
        if result.config.get("leak_probe"):
            entry["metrics"].update(summarize_probes(result.probes))
            entry["probes"] = [p.to_json() for p in result.probes]
        entry["cache_hit_by_turn"] = cache_hit_by_turn(result.records)
        entry["ttft_ms"] = sorted(
            round(r.ttft * 1000.0, 3) for r in result.records if r.ok and r.ttft is not None
        )
        entry["ttft_by_request"] = {
            f"{r.session}#{r.turn}": round(r.ttft * 1000.0, 3)
            for r in result.records
            if r.ok and r.ttft is not None
        }
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
    ("cross-owner", "cross_owner_reuse", ""),
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
    if compare and compare.get("base"):
        lines += ["", figures_table(report, markdown=True)]
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


def _keys(config: Mapping[str, Any], description: Mapping[str, Any]) -> str:
    if config.get("keyless"):
        mode = description.get("keyless_mode")
        return "none" + (f" ({mode})" if mode else "")
    return "one per root" if config.get("key_by") == "root" else "one per session"


def _div(a: Any, b: Any) -> float | None:
    ok = isinstance(a, int | float) and isinstance(b, int | float) and b
    return a / b if ok else None


def figures_rows(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per ran target: cache efficiency and median TTFT, each also as a ratio to the
    first ran target (``base``) and to the same kind of target replayed with one key per
    session (``keyed``: the comparison of a keyless or root-keyed run; ``None`` for that
    run itself), the reuse across sessions, owners and callers, and the host's upstream
    calls per handoff (``None`` where its status does not count them)."""
    ran = [t for t in report["targets"] if t.get("metrics")]
    if not ran:
        return []
    base = ran[0]["metrics"]
    keyed: dict[str, Mapping[str, Any]] = {}
    for t in ran:
        config = t.get("config") or {}
        kind = str((t.get("description") or {}).get("kind", ""))
        if not config.get("keyless") and config.get("key_by", "session") == "session":
            keyed.setdefault(kind, t)
    rows = []
    for t in ran:
        m, config = t["metrics"], t.get("config") or {}
        description = t.get("description") or {}
        ref = keyed.get(str(description.get("kind", "")))
        ref_m = ref["metrics"] if ref is not None and ref is not t else {}
        handoffs = description.get("host_handoffs") or {}
        rows.append(
            {
                "target": t["name"],
                "keys": _keys(config, description),
                "efficiency": m.get("cache_efficiency"),
                "efficiency_vs_base": _div(m.get("cache_efficiency"), base.get("cache_efficiency")),
                "efficiency_vs_keyed": _div(
                    m.get("cache_efficiency"), ref_m.get("cache_efficiency")
                ),
                "median_ttft_ms": m.get("median_ttft_ms"),
                "ttft_vs_base": _div(m.get("median_ttft_ms"), base.get("median_ttft_ms")),
                "paired_ttft_vs_base": paired_ratio(t, ran[0]),
                "ttft_vs_keyed": _div(m.get("median_ttft_ms"), ref_m.get("median_ttft_ms")),
                "cross_session": m.get("cross_session_reuse"),
                "cross_owner": m.get("cross_owner_reuse"),
                "cross_owner_probe": m.get("cross_owner_probe_tokens"),
                "cross_caller_probe": m.get("cross_caller_tokens"),
                "handoffs": handoffs.get("handoffs"),
                "calls_per_handoff": handoffs.get("calls_per_handoff"),
            }
        )
    return rows


def paired_ratio(target: Mapping[str, Any], base: Mapping[str, Any]) -> float | None:
    """The median, over the requests both ``target`` and ``base`` completed, of each
    request's TTFT on ``target`` divided by its TTFT on ``base`` (``ttft_by_request``);
    None when they have none in common (a report from before the field). The targets
    run one after the other: where the machine's speed drifts between their windows, a
    ratio of the two medians moves with it, and each request's own ratio less so."""
    mine = target.get("ttft_by_request") or {}
    theirs = base.get("ttft_by_request") or {}
    ratios = [mine[k] / theirs[k] for k in mine.keys() & theirs.keys() if theirs[k] > 0]
    return statistics.median(ratios) if ratios else None


_FIGURE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("keys", "keys", ""),
    ("efficiency", "efficiency", "ratio"),
    ("eff/base", "efficiency_vs_base", "x"),
    ("eff/keyed", "efficiency_vs_keyed", "x"),
    ("median TTFT ms", "median_ttft_ms", ""),
    ("TTFT/base", "ttft_vs_base", "x"),
    ("paired/base", "paired_ttft_vs_base", "x"),
    ("TTFT/keyed", "ttft_vs_keyed", "x"),
    ("x-session", "cross_session", ""),
    ("x-owner", "cross_owner", ""),
    ("x-owner probe", "cross_owner_probe", ""),
    ("x-caller probe", "cross_caller_probe", ""),
    ("handoffs", "handoffs", ""),
    ("calls/handoff", "calls_per_handoff", "ratio"),
)


def figures_table(report: Mapping[str, Any], *, markdown: bool = False) -> str:
    """:func:`figures_rows` as a table. ``-`` is a figure that does not apply (a ratio to
    itself, a probe kind that was not sent, calls per handoff without a handoff); ``n/a``
    a handoff count the host's status does not expose. Token columns: cached tokens a
    request got beyond what its own session (x-session) or owner (x-owner) had produced,
    and what the leak probes got."""
    rows = figures_rows(report)
    if not rows:
        return "no figures: no target ran"
    base = rows[0]["target"]

    def cell(row: Mapping[str, Any], key: str, kind: str) -> str:
        if key in ("handoffs", "calls_per_handoff") and row["handoffs"] is None:
            return "n/a"  # the host's status does not count them
        return _fmt(row[key], kind)

    title = (
        f"figures: base = {base}; keyed = the same target with one key per session "
        "(x- columns: cached tokens from another session, owner, caller)"
    )
    heads = ["target", *(c[0] for c in _FIGURE_COLUMNS)]
    table = [[r["target"], *(cell(r, key, kind) for _, key, kind in _FIGURE_COLUMNS)] for r in rows]
    if markdown:
        out = [title, "", "| " + " | ".join(heads) + " |", "|---" * len(heads) + "|"]
        out += ["| " + " | ".join(row) + " |" for row in table]
        return "\n".join(out)
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(heads)]
    fmt = "  ".join(f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join([title, fmt.format(*heads), *(fmt.format(*row) for row in table)])


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
