"""Run every benchmark, one after another, and record how each went: ``tox -e bench``.

    python benchmarks/run_all.py [--quick] [--only a,b] [--skip a,b] [--list]

Each benchmark runs as its own process (``python -m benchmarks.<name> ...``) from the
repository root, so one that fails or hangs does not take the others with it; each writes
its own figures under ``benchmarks/results/``. ``--quick`` runs each in its smoke form
(minutes in all instead of about an hour: the soak alone is 30 minutes), and writes under
``benchmarks/results/quick/`` so that a smoke run never overwrites the recorded figures. The
trace replay
(``gezel-trio bench`` on the Weka traces) runs when ``../shared/traces/weka`` exists.

Writes ``benchmarks/results/run_all.json``: per benchmark its command, exit status,
seconds and the last lines it printed. Exits 1 when any benchmark failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TRACES = ROOT.parent / "shared" / "traces" / "weka"


@dataclass(frozen=True)
class Bench:
    name: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    needs: Path | None = None

    def argv(self, *, quick: bool) -> list[str]:
        return [sys.executable, *(self.quick if quick else self.full)]


def _module(name: str, *args: str) -> tuple[str, ...]:
    return ("-m", f"benchmarks.{name}", *args)


def _replay(out: str, *args: str) -> tuple[str, ...]:
    """A trace replay writing its report to ``<results>/<out>`` (``RESULTS`` is replaced
    by the quick folder in ``--quick`` runs)."""
    return (
        "-m",
        "gezel_trio.cli",
        "bench",
        "--trace",
        f"weka:{TRACES}",
        "--tokens-per-block",
        "4",
        "--max-turns",
        "8",
        "--max-prompt-tokens",
        "3500",
        "--max-output-tokens",
        "16",
        "--time-scale",
        "0.05",
        "--parallel",
        "2",
        "--ctx-per-slot",
        "4096",
        "--compare",
        "--check",
        "--no-progress",
        "--out",
        str(RESULTS / out),
        *args,
    )


QUICK_RESULTS = RESULTS / "quick"
"""Where ``--quick`` runs write (``GEZEL_BENCH_RESULTS``): never over the recorded figures."""


BENCHES = (
    Bench("proxy_overhead", _module("proxy_overhead"), _module("proxy_overhead", "--quick")),
    Bench("dispatcher_cost", _module("dispatcher_cost"), _module("dispatcher_cost")),
    Bench(
        "engine_disconnect",
        _module("engine_disconnect"),
        _module("engine_disconnect", "--repeats", "1"),
    ),
    Bench(
        "abandoned_requests",
        _module("abandoned_requests"),
        _module("abandoned_requests", "--rounds", "1"),
    ),
    Bench("front_cost", _module("front_cost"), _module("front_cost", "--requests", "100")),
    Bench("steady_turns", _module("steady_turns"), _module("steady_turns", "--turns", "8")),
    Bench("python_calls", _module("python_calls"), _module("python_calls", "--requests", "50")),
    Bench("prompt_cost", _module("prompt_cost"), _module("prompt_cost", "--repeats", "30")),
    Bench(
        "request_phases",
        _module("request_phases"),
        _module("request_phases", "--requests", "30"),
    ),
    Bench(
        "request_gaps",
        _module("request_gaps"),
        _module("request_gaps", "--requests", "20", "--gaps", "0,5"),
    ),
    Bench(
        "transport_cost",
        _module("transport_cost"),
        _module("transport_cost", "--requests", "50", "--rounds", "1"),
    ),
    Bench(
        "swap_time",
        _module("swap_time", "--size", "small"),
        _module("swap_time", "--size", "tiny", "--runs", "1"),
    ),
    Bench(
        "images",
        _module("images", "--runs", "5"),
        _module("images", "--runs", "1"),
    ),
    Bench("cache_reuse", _module("cache_reuse"), _module("cache_reuse", "--turns", "3")),
    Bench(
        "calibration_cost",
        _module("calibration_cost", "--requests", "100"),
        _module("calibration_cost", "--requests", "20"),
    ),
    Bench(
        "kv_return",
        _module("kv_return"),
        _module("kv_return", "--repeats", "1", "--tokens", "1000"),
    ),
    Bench(
        "caller_prefix",
        _module("caller_prefix", "--repeats", "3"),
        _module("caller_prefix", "--repeats", "1", "--system-words", "300"),
    ),
    Bench(
        "handoff_profile",
        _module("handoff_profile", "--runs", "3"),
        _module("handoff_profile", "--runs", "1"),
    ),
    Bench(
        "new_sessions",
        _module("new_sessions"),
        _module("new_sessions", "--clients", "codex"),
    ),
    Bench("soak", _module("soak", "--minutes", "30"), _module("soak", "--quick")),
    Bench(
        "replica_failover",
        _module("replica_failover", "--size", "small", "--repeats", "3"),
        _module("replica_failover", "--before", "3", "--after", "4", "--chats", "4"),
    ),
    Bench(
        "replica_failover_hang",
        _module("replica_failover", "--size", "small", "--repeats", "3", "--fault", "hang"),
        _module(
            "replica_failover", "--before", "3", "--after", "4", "--chats", "4", "--fault", "hang"
        ),
    ),
    Bench(
        "replica_affinity",
        _module("replica_affinity", "--conversations", "8", "--repeats", "3"),
        _module("replica_affinity", "--conversations", "4", "--turns", "4"),
    ),
    Bench(
        "hostile_connections",
        _module("hostile_connections"),
        _module("hostile_connections", "--quick"),
    ),
    Bench("ollama_api", _module("ollama_api"), _module("ollama_api", "--quick")),
    Bench("dialects", _module("dialects"), _module("dialects", "--quick")),
    Bench(
        "profile_1token",
        _module("profile_1token"),
        _module("profile_1token", "--seconds", "3", "--format", "raw"),
    ),
    Bench(
        "cache_reuse_keyless",
        _module("cache_reuse", "--keyless"),
        _module("cache_reuse", "--turns", "3", "--keyless"),
    ),
    Bench(
        "rpc_overhead",
        _module("rpc_overhead"),
        _module("rpc_overhead", "--size", "tiny", "--runs", "2", "--n-predict", "16"),
    ),
    Bench(
        "cache_owners",
        _module("cache_owners"),
        _module("cache_owners", "--figure", "cc2", "--targets", "direct,gezel:root-key"),
        needs=TRACES,
    ),
    Bench(
        "replay_weka",
        _replay("weka-small-2x", "--max-sessions", "4", "--targets", "direct,router,gezel"),
        _replay("weka-quick", "--max-sessions", "2", "--targets", "direct,gezel"),
        needs=TRACES,
    ),
)


def _demo_small() -> Path:
    """The ``small`` demo model the replays use (generated once, cached)."""
    out = subprocess.run(
        [sys.executable, "-m", "gezel_trio.cli", "make-model", "--size", "small"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="each benchmark's smoke form")
    ap.add_argument("--only", default="", help="comma-separated names to run")
    ap.add_argument("--skip", default="", help="comma-separated names to leave out")
    ap.add_argument("--list", action="store_true", help="print the benchmarks and exit")
    args = ap.parse_args(argv)
    names = {b.name for b in BENCHES}
    only = {n for n in args.only.split(",") if n}
    skip = {n for n in args.skip.split(",") if n}
    unknown = (only | skip) - names
    if unknown:
        ap.error(
            f"unknown benchmark(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(names))}"
        )
    chosen = [b for b in BENCHES if (not only or b.name in only) and b.name not in skip]
    if args.list:
        for b in chosen:
            print(b.name, " ".join(b.argv(quick=args.quick)[1:]))
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    report: list[dict[str, object]] = []
    for bench in chosen:
        argv_ = bench.argv(quick=args.quick)
        if bench.needs is not None and not bench.needs.exists():
            print(f"== {bench.name}: skipped ({bench.needs} does not exist)", flush=True)
            report.append({"name": bench.name, "status": "skipped", "why": f"no {bench.needs}"})
            continue
        if bench.name.startswith("replay"):
            argv_ += ["--model", str(_demo_small())]
        if args.quick:
            argv_ = [a.replace(str(RESULTS), str(QUICK_RESULTS)) for a in argv_]
        print(f"== {bench.name}: {' '.join(argv_[1:])}", flush=True)
        t0 = time.monotonic()
        env = dict(os.environ, GEZEL_BENCH_RESULTS=str(QUICK_RESULTS)) if args.quick else None
        proc = subprocess.run(argv_, cwd=ROOT, capture_output=True, text=True, env=env)
        seconds = round(time.monotonic() - t0, 1)
        output = (proc.stdout + proc.stderr).strip().splitlines()
        for line in output[-15:]:
            print(f"   {line}", flush=True)
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        print(f"== {bench.name}: {status} in {seconds}s", flush=True)
        report.append(
            {
                "name": bench.name,
                "command": argv_[1:],
                "status": status,
                "seconds": seconds,
                "tail": output[-40:],
            }
        )
    path = (QUICK_RESULTS if args.quick else RESULTS) / "run_all.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"quick": args.quick, "benchmarks": report}, indent=2) + "\n")
    failed = [r["name"] for r in report if r["status"] not in ("ok", "skipped")]
    print(f"wrote {path}; " + (f"failed: {', '.join(map(str, failed))}" if failed else "all ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
