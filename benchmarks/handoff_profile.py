"""Where a keyed handoff's time goes, on the host's side and the engine's.

    python -m benchmarks.handoff_profile [--figure weka4|weka8] [--keyless] [--runs N]

One ``gezel-trio bench`` run of the Weka figure of :mod:`benchmarks.cache_owners`
(``weka4``: 4 sessions on 2 slots, the ``small`` demo model) against two endpoints
launched here, one after the other in the same run: ``direct`` (plain llama-server,
its default ``--cache-ram``) and ``gezel`` (``gezel-trio serve`` with the bench's
config, run under :mod:`benchmarks._handoff_tracer`, which records every slot grant).
Both are replayed through llama.cpp's ``/completion`` so that the two take the same
route.

Prints, for the host's requests split into handoffs (placed on another owner's slot)
and the rest: the median of each phase of a request (the host's front before its
grant, the grant's wait for a background save of its slot, its slot calls, the time
from grant to upstream request, the engine's answer to the first chunk split into the
engine's own prefill ``prompt_ms`` and the rest), upstream calls per handoff, the
background saves (count, host-side and engine-side ms, and how many requests' prefill
ran while one was in flight), and the TTFT of each handoff against direct's for the
same request. Writes ``benchmarks/results/handoff_profile[-keyless].json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gezel_bench.targets import (
    LaunchSettings,
    direct_argv,
    gezel_config_toml,
    gguf_vocab_size,
    resolve_llama_server,
)
from gezel_trio.engine.demo_model import write_demo_model

from ._harness import logged_process
from .cache_owners import FIGURES

RESULTS = Path(os.environ.get("GEZEL_BENCH_RESULTS") or "benchmarks/results")
DIRECT_PORT, HOST_PORT = 19401, 19402


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds ``pid`` has used so far (Linux ``/proc``), 0 if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """``pid``'s child processes (Linux ``/proc``)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:7.1f}"


def phases(record: dict[str, Any]) -> dict[str, float]:
    """One host request's phases in ms (see the module)."""
    calls = record.get("calls", [])
    engine = record.get("engine") or {}
    upstream = (record["first_chunk"] - record["stream_in"]) * 1000
    prompt_ms = float(engine.get("prompt_ms", 0.0))
    slot_calls = sum(c["ms"] for c in calls)
    grant = (record["grant_out"] - record["grant_in"]) * 1000
    return {
        "front to grant": (record["grant_in"] - record["front"]) * 1000,
        "save wait": record.get("save_wait_ms", 0.0),
        "slot calls": slot_calls,
        "grant, rest": grant - slot_calls - record.get("save_wait_ms", 0.0),
        "grant to upstream": (record["stream_in"] - record["grant_out"]) * 1000,
        "engine prefill": prompt_ms,
        "upstream, rest": upstream - prompt_ms,
        "front to first chunk": (record["first_chunk"] - record["front"]) * 1000,
    }


def analyse(trace_out: Path, bench_out: Path) -> dict[str, Any]:
    """The figures of one run (see the module)."""
    lines = [json.loads(line) for line in trace_out.read_text().splitlines() if line.strip()]
    requests = [r for r in lines if r["kind"] == "request" and "first_chunk" in r]
    saves = [r for r in lines if r["kind"] == "bg_save"]
    turns: dict[str, int] = {}
    for r in requests:
        session = r.get("session", "")
        r["turn"] = turns.get(session, 0)
        turns[session] = r["turn"] + 1

    def load(name: str) -> dict[tuple[str, int], dict[str, Any]]:
        rows = [json.loads(x) for x in (bench_out / f"requests-{name}.jsonl").read_text().split()]
        return {(r["session"], r["turn"]): r for r in rows if r.get("ttft_ms") is not None}

    direct, host = load("direct"), load("gezel")
    out: dict[str, Any] = {}
    for label, group in (
        ("handoffs", [r for r in requests if "handoff_calls" in r]),
        ("others", [r for r in requests if "handoff_calls" not in r]),
    ):
        rows = [phases(r) for r in group]
        med = {k: _median([row[k] for row in rows]) for k in (rows[0] if rows else {})}
        ratios = []
        diffs = []
        for r in group:
            key = (r.get("session", ""), r["turn"])
            if key in direct and key in host:
                ratios.append(host[key]["ttft_ms"] / direct[key]["ttft_ms"])
                diffs.append(host[key]["ttft_ms"] - direct[key]["ttft_ms"])
        actions: dict[str, list[float]] = {}
        engine_ms: dict[str, list[float]] = {}
        for r in group:
            for c in r.get("calls", []):
                actions.setdefault(c["action"], []).append(c["ms"])
                timing = (c.get("engine") or {}).get(f"{c['action']}_ms")
                if isinstance(timing, (int, float)):
                    engine_ms.setdefault(c["action"], []).append(float(timing))
        out[label] = {
            "n": len(group),
            "phases_median_ms": med,
            "calls_per_handoff": _median(
                [r["handoff_calls"] for r in group if "handoff_calls" in r]
            ),
            "slot_calls": {a: {"n": len(v), "median_ms": _median(v)} for a, v in actions.items()},
            "slot_calls_engine_ms": {a: _median(v) for a, v in engine_ms.items()},
            "ttft_vs_direct_median": _median(ratios),
            "ttft_minus_direct_median_ms": _median(diffs),
            "prefill_during_bg_save": sum(
                1
                for r in group
                if any(s["t0"] < r["first_chunk"] and s["t1"] > r["stream_in"] for s in saves)
            ),
        }
    save_ms = [s["calls"][0]["ms"] for s in saves if s["calls"]]
    save_engine = [
        float((s["calls"][0].get("engine") or {}).get("save_ms", 0)) for s in saves if s["calls"]
    ]
    out["background_saves"] = {
        "n": len(saves),
        "median_ms": _median(save_ms),
        "engine_median_ms": _median(save_engine),
        "total_ms": sum(save_ms),
    }
    report = json.loads((bench_out / "report.json").read_text())
    out["median_ttft_ms"] = {
        t["name"]: (t.get("metrics") or {}).get("median_ttft_ms") for t in report["targets"]
    }
    out["efficiency"] = {
        t["name"]: (t.get("metrics") or {}).get("cache_efficiency") for t in report["targets"]
    }
    return out


def show(figures: dict[str, Any]) -> None:
    ttft = figures["median_ttft_ms"]
    ratio = ttft["gezel"] / ttft["direct"] if ttft.get("direct") and ttft.get("gezel") else None
    print(
        f"median TTFT: direct {ttft.get('direct')} ms, gezel {ttft.get('gezel')} ms"
        + (f" ({ratio:.2f}x)" if ratio else "")
        + f"; efficiency {figures['efficiency']}"
    )
    for label in ("handoffs", "others"):
        g = figures[label]
        print(
            f"-- {label}: {g['n']} requests, calls/handoff {g['calls_per_handoff']}, "
            f"TTFT/direct median {g['ttft_vs_direct_median']}, "
            f"TTFT-direct median {g['ttft_minus_direct_median_ms']} ms, "
            f"prefill during a background save {g['prefill_during_bg_save']}"
        )
        for phase, value in g["phases_median_ms"].items():
            print(f"   {phase:<22}{_ms(value)} ms")
        for action, stats in g["slot_calls"].items():
            engine = g["slot_calls_engine_ms"].get(action)
            print(
                f"   {action:<10} x{stats['n']}: host {_ms(stats['median_ms'])} ms, "
                f"engine {_ms(engine)} ms"
            )
    print(
        "-- CPU seconds during the run: "
        + ", ".join(f"{k} {v:.2f}" for k, v in figures["cpu_seconds"].items())
        + "; load average "
        + " ".join(f"{x:.2f}" for x in figures["load_average"])
    )
    b = figures["background_saves"]
    print(
        f"-- background saves: {b['n']}, median host {_ms(b['median_ms'])} ms, "
        f"engine {_ms(b['engine_median_ms'])} ms, total {b['total_ms']:.0f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--figure", choices=("weka4", "weka8"), default="weka4")
    ap.add_argument("--keyless", action="store_true", help="replay with no session keys")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--engine-args", default="", help="extra llama-server flags for both")
    args = ap.parse_args(argv)
    model = write_demo_model(RESULTS / "tmp" / "small.gguf", size="small")
    engine = resolve_llama_server()
    vocab = gguf_vocab_size(model)
    name = f"handoff_profile-{args.figure}" + ("-keyless" if args.keyless else "")
    figure = list(FIGURES[args.figure])
    at = figure.index("--targets")
    del figure[at : at + 2]
    runs = []
    for k in range(1, args.runs + 1):
        out = (RESULTS / f"{name}-run{k}").resolve()
        logs = out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        settings = LaunchSettings(
            model_path=model.resolve(),
            workdir=logs,
            engine_args=tuple(args.engine_args.split()),
        )
        config = logs / "gezel.toml"
        config.write_text(
            gezel_config_toml(settings=settings, engine=engine, port=HOST_PORT, affinity=True)
        )
        trace_out = out / "host-trace.jsonl"
        trace_out.unlink(missing_ok=True)
        env = {**os.environ, **engine.env, "GEZEL_LLAMA_SERVER": str(engine.path)}
        root = Path(__file__).resolve().parent.parent
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
        host_argv = [
            sys.executable, "-m", "benchmarks._handoff_tracer", str(trace_out),
            "serve", "--config", str(config),
        ]  # fmt: skip
        with (
            logged_process(
                direct_argv(engine, settings, DIRECT_PORT),
                logs / "direct.log",
                f"http://127.0.0.1:{DIRECT_PORT}/health",
                dict(engine.env),
            ) as direct_proc,
            logged_process(
                host_argv, logs / "gezel.log", f"http://127.0.0.1:{HOST_PORT}/v1/models", env
            ) as host_proc,
        ):
            pids = {"direct engine": direct_proc.pid, "host": host_proc.pid}
            cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
            cmd = [
                sys.executable, "-m", "gezel_bench", *figure,
                "--url", f"direct=http://127.0.0.1:{DIRECT_PORT}",
                "--url", f"gezel=http://127.0.0.1:{HOST_PORT}",
                "--api", "llama", "--model-name", settings.model_id,
                "--vocab-hi", str(vocab), "--compare", "--no-progress", "--no-plots",
                *(["--keyless"] if args.keyless else []), "--out", str(out),
            ]  # fmt: skip
            print("+", " ".join(cmd), flush=True)
            code = subprocess.call(cmd, env=env, stdout=subprocess.DEVNULL)
            # the host starts its engine on the first request: it used no CPU before
            for pid in children(host_proc.pid):
                pids["host engine"] = pid
            cpu = {name: cpu_seconds(pid) - cpu0.get(name, 0.0) for name, pid in pids.items()}
        if code:
            print(f"run {k}: the bench exited {code}")
            return 1
        figures = analyse(trace_out, out)
        figures["cpu_seconds"] = cpu
        figures["load_average"] = os.getloadavg()
        print(f"\n== run {k} ({out})")
        show(figures)
        runs.append(figures)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"command": sys.argv, "runs": runs}, indent=1))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
