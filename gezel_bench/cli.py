"""``gezel-trio bench``: replay a trace against targets and write a report.

:func:`add_bench_arguments` fills an :mod:`argparse` (sub)parser; :func:`run_bench`
runs it and returns the exit status: 0 when every target that was not skipped ran,
1 when one failed to run, 2 for a usage or trace error, 3 when ``--check`` found a
broken invariant (a failed request, a prompt length the engine counted differently,
or cross-session reuse through a gezel target). Targets run one after another, each
launched, replayed and torn down before the next.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from gezel_trio.errors import GezelError

from .errors import BenchError
from .metrics import handoff_counters
from .replay import KeyBy, ReplayConfig, run_replay
from .report import TargetOutcome, build_report, compare_table, markdown_report, write_report
from .synth import API_STYLES, DEFAULT_VOCAB_LO, Api
from .targets import (
    LAUNCH_KINDS,
    Endpoint,
    EngineCommand,
    LaunchSettings,
    gguf_vocab_size,
    open_target,
    resolve_llama_server,
)
from .trace_specs import open_trace_spec
from .traces import Scaling, Trace, save_trace, scale_trace

__all__ = ["add_bench_arguments", "bench", "main", "run_bench"]


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every ``bench`` option to ``parser``."""
    parser.add_argument(
        "--trace",
        required=True,
        metavar="SPEC",
        help="weka:DIR_OR_FILE, mooncake:FILE.jsonl, or a native .jsonl trace",
    )
    g = parser.add_argument_group("scaling (recorded in the report)")
    g.add_argument("--tokens-per-block", type=int, metavar="N", help="new block size in tokens")
    g.add_argument("--output-scale", type=float, metavar="X", help="factor on output lengths")
    g.add_argument("--max-output-tokens", type=int, metavar="N")
    g.add_argument(
        "--max-prompt-tokens",
        type=int,
        metavar="N",
        help="end a session before its first longer prompt",
    )
    g.add_argument("--max-sessions", type=int, metavar="N", help="root sessions to keep")
    g.add_argument("--max-turns", type=int, metavar="N", help="turns per session")
    g.add_argument("--max-requests", type=int, metavar="N", help="requests in all")
    g.add_argument(
        "--time-scale", type=float, metavar="X", help="factor on timestamps and think times"
    )
    g.add_argument(
        "--stagger", type=float, default=0.0, metavar="S", help="start offset per root session"
    )
    g.add_argument("--sample-seed", type=int, metavar="N", help="sample sessions with this seed")
    g.add_argument("--save-trace", type=Path, metavar="PATH", help="write the scaled trace")
    g.add_argument(
        "--import-only", action="store_true", help="import, scale, save the trace and stop"
    )

    r = parser.add_argument_group("replay")
    r.add_argument("--mode", choices=("closed", "open"), default="closed")
    r.add_argument("--concurrency", type=int, metavar="N", help="max requests in flight")
    r.add_argument("--seed", type=int, default=0, help="prompt synthesis and sampling seed")
    r.add_argument("--vocab-lo", type=int, default=DEFAULT_VOCAB_LO, metavar="ID")
    r.add_argument(
        "--vocab-hi", type=int, metavar="ID", help="default: the model's n_vocab (/v1/models)"
    )
    r.add_argument("--request-timeout", type=float, metavar="S", help="per request; default none")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument(
        "--keyless",
        action="store_true",
        help="send no session key (as most clients do); cross-session reuse is then "
        "legitimate within the caller's keyless owner and is not an invariant",
    )
    r.add_argument(
        "--leak-probe",
        action="store_true",
        help="after each replay, send every session's last prompt again under a fresh "
        "session key and as a second caller (launched gezel targets get two API keys): "
        "what they get from the cache is cross-owner and cross-caller reuse",
    )
    r.add_argument("--api-key", metavar="KEY", help="the caller's API key for --url targets")
    r.add_argument(
        "--second-api-key", metavar="KEY", help="another caller's key for --url leak probes"
    )

    t = parser.add_argument_group("targets")
    t.add_argument(
        "--url",
        action="append",
        default=[],
        metavar="[NAME=]URL",
        help="an endpoint already running (repeatable)",
    )
    t.add_argument("--api", choices=API_STYLES, default="llama", help="API style of --url")
    t.add_argument("--model-name", metavar="NAME", help="the model field sent to --url")
    t.add_argument(
        "--targets",
        default="",
        metavar="LIST",
        help=f"comma-separated targets to launch: {','.join(LAUNCH_KINDS)}; each may take "
        "':keyless' (replay it with no session keys), ':keyless=MODE' (also the host's "
        "[scheduler] keyless: shared, conversation or blind) or ':root-key' (sub-agents "
        "send their root session's key, as Claude Code does), e.g. direct,gezel,gezel:keyless",
    )
    t.add_argument("--model", type=Path, metavar="PATH", help="GGUF model for launched targets")
    t.add_argument("--parallel", type=int, default=2, metavar="N", help="slots per engine")
    t.add_argument("--ctx-per-slot", type=int, default=4096, metavar="N")
    t.add_argument("--startup-timeout", type=float, default=180.0, metavar="S")
    t.add_argument("--gezel-api", choices=API_STYLES, default="openai")
    t.add_argument(
        "--engine-args",
        default="",
        metavar="ARGS",
        help="extra llama-server flags for every launched engine, e.g. '--cache-ram 48'",
    )
    t.add_argument(
        "--replicas",
        type=int,
        default=2,
        metavar="N",
        help="engines the gezel-replicas target runs for the model (default 2)",
    )
    t.add_argument(
        "--models",
        type=int,
        default=1,
        metavar="N",
        help="serve --model as N models that each session uses in turn (one resident at a "
        "time: gezel in swap mode, router with --models-max 1)",
    )

    o = parser.add_argument_group("report")
    o.add_argument("--out", type=Path, metavar="DIR", help="default: benchmarks/results/<time>")
    o.add_argument("--compare", action="store_true", help="print ratios to the first target")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--check", action="store_true", help="exit 3 if an invariant is broken")


@dataclass(frozen=True, slots=True)
class _TargetSpec:
    name: str
    kind: str  # "url" or a launch kind
    url: str | None = None
    keyless: bool | None = None  # None: --keyless
    keyless_mode: str | None = None  # a gezel target's [scheduler] keyless
    key_by: KeyBy = "session"


KEYLESS_MODES = ("shared", "conversation", "blind")


def parse_target(spec: str) -> _TargetSpec:
    """``KIND[:OPTION...]`` of ``--targets``: the options are ``keyless``,
    ``keyless=MODE`` and ``root-key``; the whole spec is the target's name."""
    kind, *options = (part.strip() for part in spec.split(":"))
    if kind not in LAUNCH_KINDS:
        raise BenchError(f"unknown target {kind!r}: choose from {', '.join(LAUNCH_KINDS)}")
    keyless: bool | None = None
    mode: str | None = None
    key_by: KeyBy = "session"
    for option in options:
        name, sep, value = option.partition("=")
        if name == "keyless" and (not sep or value in KEYLESS_MODES):
            keyless, mode = True, value or None
        elif option == "root-key":
            key_by = "root"
        else:
            raise BenchError(
                f"target {spec!r}: unknown option {option!r} (keyless, "
                f"keyless={{{','.join(KEYLESS_MODES)}}}, root-key)"
            )
    if mode is not None and not kind.startswith("gezel"):
        raise BenchError(f"target {spec!r}: keyless=MODE is a gezel target's setting")
    return _TargetSpec(spec, kind, keyless=keyless, keyless_mode=mode, key_by=key_by)


def _targets(args: argparse.Namespace) -> list[_TargetSpec]:
    specs: list[_TargetSpec] = []
    for n, raw in enumerate(args.url, start=1):
        name, sep, url = raw.partition("=")
        if not sep or "://" in name:
            name, url = ("url" if len(args.url) == 1 else f"url{n}"), raw
        specs.append(_TargetSpec(name, "url", url))
    for raw in (k.strip() for k in args.targets.split(",")):
        if raw:
            specs.append(parse_target(raw))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise BenchError(f"target names repeat: {names}")
    return specs


def _scaled_trace(args: argparse.Namespace) -> Trace:
    trace = open_trace_spec(args.trace)
    scaling = Scaling(
        tokens_per_block=args.tokens_per_block,
        output_scale=args.output_scale,
        max_output_tokens=args.max_output_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        max_sessions=args.max_sessions,
        max_turns=args.max_turns,
        max_requests=args.max_requests,
        time_scale=args.time_scale if args.time_scale is not None else trace.time_scale,
        stagger=args.stagger,
        seed=args.sample_seed,
    )
    return scale_trace(trace, scaling)


def _invariants(report: dict[str, Any], *, keyless: bool = False) -> list[str]:
    """What the replay broke. Keyless, every request is one owner's (the caller's), so
    reuse across the trace's sessions is allowed and not counted; sessions that share a
    key (``:root-key``) are one owner, so reuse between them is allowed too. Reuse across
    callers (the second key's leak probes) never is, through a gezel target; reuse by the
    fresh-session probes of the same caller is allowed where the host shares a prefix
    within a caller (``[scheduler] share_prefix_within_caller``, on by default)."""
    broken = []
    for t in report["targets"]:
        m = t.get("metrics")
        if m is None:
            continue
        name = t["name"]
        if m["failed"]:
            broken.append(f"{name}: {m['failed']} failed requests")
        if m["prompt_token_mismatch"]:
            broken.append(f"{name}: {m['prompt_token_mismatch']} prompt length mismatches")
        if not str(t.get("description", {}).get("kind", "")).startswith("gezel"):
            continue
        config = t.get("config") or {}
        keyed = not config.get("keyless", keyless)
        if keyed and config.get("key_by", "session") == "session" and m["cross_session_reuse"]:
            broken.append(f"{name}: {m['cross_session_reuse']} cross-session tokens")
        if keyed and m.get("cross_owner_reuse"):
            broken.append(f"{name}: {m['cross_owner_reuse']} cross-owner tokens")
        shares = bool(t.get("description", {}).get("shares_within_caller"))
        for key, what in (
            ("cross_owner_probe_tokens", "cross-owner"),
            ("cross_caller_tokens", "cross-caller"),
        ):
            if key == "cross_owner_probe_tokens" and shares:
                continue
            if m.get(key):
                broken.append(f"{name}: {m[key]} {what} tokens to the leak probes")
    return broken


async def _replay_endpoint(
    endpoint: Endpoint,
    trace: Trace,
    args: argparse.Namespace,
    vocab_hi: int | None,
    spec: _TargetSpec,
    keys: tuple[str | None, str | None],
) -> TargetOutcome:
    config = ReplayConfig(
        base_url=endpoint.base_url,
        api=endpoint.api,
        model=endpoint.model,
        models=endpoint.models,
        mode=args.mode,
        concurrency=args.concurrency,
        seed=args.seed,
        vocab_lo=args.vocab_lo,
        vocab_hi=vocab_hi,
        time_scale=trace.time_scale,
        request_timeout=args.request_timeout,
        label=endpoint.name,
        keyless=args.keyless if spec.keyless is None else spec.keyless,
        key_by=spec.key_by,
        api_key=keys[0],
        leak_probe=args.leak_probe,
        probe_key=keys[1],
    )

    async def replayed() -> None:
        """A gezel target's replica routing and handoff counters, before the probes."""
        status = await _host_status(endpoint.base_url, endpoint.admin_key)
        replicas = status.get("replicas")
        ok = isinstance(replicas, dict) and replicas
        endpoint.description["host_replicas"] = replicas if ok else None
        endpoint.description["host_handoffs"] = handoff_counters(status)
        # the whole configuration is GET /api/config's (the status has the live part)
        config = (await _admin_get(endpoint.base_url, endpoint.admin_key, "/api/config")).get(
            "config"
        )
        scheduler = config.get("scheduler") if isinstance(config, dict) else None
        shares = isinstance(scheduler, dict) and scheduler.get("share_prefix_within_caller")
        endpoint.description["shares_within_caller"] = bool(shares)

    result = await run_replay(
        trace,
        config,
        progress_stream=None if args.no_progress else sys.stderr,
        replayed=replayed if spec.kind.startswith("gezel") else None,
    )
    return TargetOutcome(endpoint.name, "ok", endpoint.description, result=result)


async def _host_status(base_url: str, admin_key: str | None) -> dict[str, Any]:
    """A gezel target's ``/api/status`` after the replay (``{}`` when unreadable)."""
    return await _admin_get(base_url, admin_key, "/api/status")


async def _admin_get(base_url: str, admin_key: str | None, path: str) -> dict[str, Any]:
    """A gezel target's admin document at ``path`` (``{}`` when unreadable)."""
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else None
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=10, headers=headers) as client:
            document = (await client.get(path)).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return document if isinstance(document, dict) else {}


BENCH_KEYS = ("gezel-bench-caller-a", "gezel-bench-caller-b")
"""The two callers' API keys of launched targets under ``--leak-probe``."""
BENCH_ADMIN_KEY = "gezel-bench-admin"


def _launch_keys(settings: LaunchSettings) -> tuple[str | None, str | None]:
    """The replay's key and the second caller's, for a launched target: both or none.
    (A plain llama-server ignores them: it has no callers to tell apart.)"""
    if len(settings.api_keys) < 2:
        return (None, None)
    return (settings.api_keys[0], settings.api_keys[1])


async def _run_target(
    spec: _TargetSpec,
    trace: Trace,
    args: argparse.Namespace,
    settings: LaunchSettings | None,
    engine: EngineCommand | None,
) -> TargetOutcome:
    description: dict[str, Any] = {"kind": spec.kind}
    try:
        if spec.kind == "url":
            assert spec.url is not None
            api: Api = args.api
            description.update(url=spec.url, api=api)
            endpoint = Endpoint(spec.name, spec.url, api, args.model_name, description)
            keys = (args.api_key, args.second_api_key)
            return await _replay_endpoint(endpoint, trace, args, args.vocab_hi, spec, keys)
        assert settings is not None
        async with open_target(
            spec.kind,  # type: ignore[arg-type]
            settings=settings,
            engine=engine,
            name=spec.name,
            keyless=spec.keyless_mode,
        ) as endpoint:
            description = endpoint.description
            vocab_hi = args.vocab_hi or await trio.to_thread.run_sync(
                gguf_vocab_size, settings.model_path
            )
            keys = _launch_keys(settings)
            return await _replay_endpoint(endpoint, trace, args, vocab_hi, spec, keys)
    except GezelError as exc:
        if exc.message.startswith("skipped:"):
            reason = exc.message.removeprefix("skipped:").strip()
            return TargetOutcome(spec.name, "skipped", description, reason=reason)
        return TargetOutcome(spec.name, "failed", description, reason=exc.message)
    except OSError as exc:
        return TargetOutcome(spec.name, "failed", description, reason=f"{exc}")


async def bench(args: argparse.Namespace, command: list[str] | None = None) -> int:
    """The async body of :func:`run_bench` (for callers already inside Trio).

    Raises :class:`BenchError` for usage and trace errors; a target that fails is
    reported, not raised. Cancellation stops the running target and propagates.
    """
    trace = await trio.to_thread.run_sync(_scaled_trace, args)
    if trace.n_requests == 0:
        raise BenchError("the scaled trace has no requests: loosen the scaling limits")
    stats = trace.statistics()
    print(
        f"trace {stats['source']}: {stats['sessions']} sessions, {stats['requests']} requests, "
        f"block {stats['block_size']} tokens, longest prompt {stats['max_prompt_tokens']}, "
        f"time scale {trace.time_scale}",
        file=sys.stderr,
    )
    if args.save_trace is not None:
        save_trace(trace, args.save_trace)
    if args.import_only:
        if args.save_trace is None:
            print("--import-only without --save-trace writes nothing", file=sys.stderr)
        return 0

    specs = _targets(args)
    if not specs:
        raise BenchError("no targets: give --url URL and/or --targets LIST")
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir: Path = args.out or Path("benchmarks") / "results" / stamp
    settings: LaunchSettings | None = None
    engine: EngineCommand | None = None
    if any(s.kind != "url" for s in specs):
        if args.model is None:
            raise BenchError("launched targets need --model PATH")
        longest = max(t.prompt_tokens + t.output_tokens for t in trace.requests())
        if longest > args.ctx_per_slot:
            raise BenchError(
                f"a request needs {longest} tokens but --ctx-per-slot is {args.ctx_per_slot}: "
                "lower --max-prompt-tokens / --max-output-tokens or raise --ctx-per-slot"
            )
        if args.models < 1:
            raise BenchError("--models needs at least 1")
        settings = LaunchSettings(
            model_path=args.model.resolve(),
            parallel=args.parallel,
            ctx_per_slot=args.ctx_per_slot,
            workdir=(out_dir / "logs").resolve(),
            startup_timeout=args.startup_timeout,
            gezel_api=args.gezel_api,
            engine_args=tuple(shlex.split(args.engine_args)),
            models=args.models,
            replicas=args.replicas,
            api_keys=BENCH_KEYS if args.leak_probe else (),
            admin_key=BENCH_ADMIN_KEY if args.leak_probe else None,
        )
        engine = resolve_llama_server()

    outcomes = []
    for spec in specs:
        print(f"target {spec.name}: starting", file=sys.stderr)
        outcome = await _run_target(spec, trace, args, settings, engine)
        print(
            f"target {spec.name}: {outcome.status}"
            + (f" ({outcome.reason})" if outcome.reason else ""),
            file=sys.stderr,
        )
        outcomes.append(outcome)

    replay = {
        "mode": args.mode,
        "concurrency": args.concurrency,
        "seed": args.seed,
        "time_scale": trace.time_scale,
        "vocab_lo": args.vocab_lo,
        "vocab_hi": args.vocab_hi,
        "parallel": args.parallel if settings else None,
        "ctx_per_slot": args.ctx_per_slot if settings else None,
    }
    report = build_report(
        trace=trace, outcomes=outcomes, replay=replay, command=command, compare=args.compare
    )
    written = await trio.to_thread.run_sync(
        lambda: write_report(
            report, out_dir, outcomes=outcomes, trace=trace, plots=not args.no_plots
        )
    )
    print(markdown_report(report))
    if args.compare:
        print(compare_table(report))
    print(f"report written to {out_dir}: " + ", ".join(p.name for p in written), file=sys.stderr)

    if args.check:
        broken = _invariants(report, keyless=args.keyless)
        for line in broken:
            print(f"invariant broken: {line}", file=sys.stderr)
        if broken:
            return 3
    return 1 if any(o.status == "failed" for o in outcomes) else 0


def run_bench(args: argparse.Namespace, *, argv: list[str] | None = None) -> int:
    """Run ``gezel-trio bench`` with parsed ``args``; returns the exit status."""
    command = ["gezel-trio", "bench", *(sys.argv[1:] if argv is None else argv)]
    if command[2:3] == ["bench"]:
        del command[2]
    try:
        return trio.run(bench, args, command)
    except GezelError as exc:
        print(f"gezel-trio bench: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gezel-trio bench: interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m gezel_bench``."""
    parser = argparse.ArgumentParser(
        prog="gezel-trio bench",
        description="Replay an agentic trace against targets and compare them.",
    )
    add_bench_arguments(parser)
    args = parser.parse_args(argv)
    return run_bench(args, argv=sys.argv[1:] if argv is None else argv)
