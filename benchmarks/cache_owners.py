"""Cache reuse and isolation by owner (issue 21's closing figures), each one command.

    python -m benchmarks.cache_owners [--figure weka4|weka8|cc2|cc4|all] [--repeats N]

Each figure is one ``gezel-trio bench`` run on the ``small`` demo model, every target
launched in turn on the same binary and slots, with ``--leak-probe`` (two API keys on the
host) and ``--compare`` against ``direct`` (plain llama-server, its default RAM cache):

- ``weka4`` / ``weka8``: the Weka traces, 4 (8) sessions on 2 slots (4-token blocks for
  4 sessions, the reference scaling; 2-token blocks and the first 9 conversations, of
  which 8 fit 3,500 tokens, for 8), replayed keyed
  (``gezel``), with no keys (``gezel:keyless``, the host's default ``[scheduler]
  keyless``) and direct;
- ``cc2`` / ``cc4``: a synthetic Claude-Code-like trace (``--trace claude-code``: one
  session id, a main agent and 2 sub-agents with their own long system prompts, the
  sub-agents side by side) on 2 (4) slots, sent as Claude Code sends it
  (``gezel:root-key``: one key for all three), against the same work under 3 distinct
  keys (``gezel``) and direct.

Each run prints its tables (``figures:``: efficiency, median TTFT, their ratios to direct
and to the keyed run, cached tokens across sessions, owners and callers, and the host's
upstream calls per handoff where ``/api/status`` counts them) and writes its report to
``benchmarks/results/owners-<figure>/`` (``-run<k>`` with ``--repeats``). At the end the
figures tables of every run are printed again together, and with ``--repeats`` the median
over the runs of each target's efficiency and TTFT ratios. Exits 1 when a run failed or
broke an invariant (a gezel target's cross-owner or cross-caller tokens, a failed
request). On 2 shared cores: about 1.5 minutes for ``weka4``, 10 for ``weka8`` (the
trace's think times, mostly idle), 1.5 each for ``cc2`` and ``cc4``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from gezel_bench.report import figures_rows, figures_table
from gezel_trio.engine.demo_model import write_demo_model

RESULTS = Path(os.environ.get("GEZEL_BENCH_RESULTS") or "benchmarks/results")
WEKA = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "weka"

_WEKA_SCALING = (
    "--max-turns", "8", "--max-prompt-tokens", "3500", "--max-output-tokens", "16",
    "--time-scale", "0.05", "--ctx-per-slot", "4096", "--parallel", "2",
    "--targets", "direct,gezel,gezel:keyless",
)  # fmt: skip

FIGURES: dict[str, tuple[str, ...]] = {
    # the reference scaling (benchmarks/README.md): 4 sessions, 20 requests
    "weka4": (
        "--trace", f"weka:{WEKA}", *_WEKA_SCALING, "--tokens-per-block", "4",
        "--max-sessions", "4",
    ),
    # 2-token blocks: of the first 9 conversations, 8 open within 3,500 tokens (54 requests)
    "weka8": (
        "--trace", f"weka:{WEKA}", *_WEKA_SCALING, "--tokens-per-block", "2",
        "--max-sessions", "9",
    ),
    "cc2": (
        "--trace", "claude-code:seed=0", "--time-scale", "0.1", "--ctx-per-slot", "4096",
        "--parallel", "2", "--targets", "direct,gezel,gezel:root-key",
    ),
    "cc4": (
        "--trace", "claude-code:seed=0", "--time-scale", "0.1", "--ctx-per-slot", "4096",
        "--parallel", "4", "--targets", "direct,gezel,gezel:root-key",
    ),
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--figure", choices=(*FIGURES, "all"), default="all")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each figure")
    ap.add_argument("--targets", help="replace the figure's targets (bench --targets)")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    names = list(FIGURES) if args.figure == "all" else [args.figure]
    model = write_demo_model(RESULTS / "tmp" / "small.gguf", size="small")
    runs: list[tuple[str, Path, int]] = []
    for name in names:
        figure = list(FIGURES[name])
        if args.targets:
            figure[figure.index("--targets") + 1] = args.targets
        for k in range(1, args.repeats + 1):
            out = RESULTS / (f"owners-{name}" + (f"-run{k}" if args.repeats > 1 else ""))
            cmd = [
                sys.executable, "-m", "gezel_bench", *figure,
                "--model", str(model), "--leak-probe", "--compare", "--check", "--no-progress",
                *(["--no-plots"] if args.no_plots else []), "--out", str(out),
            ]  # fmt: skip
            print("+", " ".join(cmd), flush=True)
            runs.append((f"{name} run {k}", out, subprocess.call(cmd)))
    print("\n== figures")
    by_figure: dict[str, list[list[dict[str, Any]]]] = {}
    for label, out, code in runs:
        print(f"\n-- {label} ({out}, exit {code})")
        try:
            report = json.loads((out / "report.json").read_text())
        except (OSError, ValueError) as exc:
            print(f"no report: {exc}")
            continue
        print(figures_table(report))
        by_figure.setdefault(label.split()[0], []).append(figures_rows(report))
    if args.repeats > 1:
        print(f"\n== medians over {args.repeats} runs")
        for name, reports in by_figure.items():
            print(f"-- {name}")
            for target in [r["target"] for r in reports[0]]:
                rows = [r for rows in reports for r in rows if r["target"] == target]
                cells = []
                for key in (
                    "efficiency",
                    "ttft_vs_base",
                    "paired_ttft_vs_base",
                    "ttft_vs_keyed",
                    "calls_per_handoff",
                ):
                    values = [r[key] for r in rows if r[key] is not None]
                    cells.append(f"{key} {statistics.median(values):.2f}" if values else f"{key} -")
                print(f"   {target:<16} " + ", ".join(cells) + f" ({len(rows)} runs)")
    return 1 if any(code for _, _, code in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
