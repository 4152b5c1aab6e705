"""Owners in the bench: the Claude-Code-like trace, keys by root session, leak probes,
handoff counters read from a status, target variants and the figures' ratios.

Pure parts and virtual-time replays against the fake engine of ``test_bench_replay``;
no real server.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from gezel_bench.agentic import claude_code_trace
from gezel_bench.cli import parse_target
from gezel_bench.errors import BenchError
from gezel_bench.metrics import (
    ProbeRecord,
    RequestRecord,
    SessionTurn,
    handoff_counters,
    self_reusable_tokens,
    summarize,
    summarize_probes,
)
from gezel_bench.replay import ReplayConfig, run_replay, session_keys
from gezel_bench.report import figures_rows, figures_table, paired_ratio
from gezel_bench.targets import EngineCommand, LaunchSettings, gezel_config_toml
from gezel_bench.trace_specs import open_trace_spec
from gezel_bench.traces import Session, Trace, Turn, load_trace, save_trace

from .test_bench_replay import FakeEngine, fake_client

# ------------------------------------------------------------ the Claude-Code-like trace


def _shape(trace: Trace) -> list[tuple[Any, ...]]:
    return [
        (s.id, s.parent, s.spawn_after, [(t.blocks, t.prompt_tokens, t.output_tokens, t.t)
                                         for t in s.turns])
        for s in trace.sessions
    ]  # fmt: skip


def test_claude_code_trace_is_deterministic_for_a_seed() -> None:
    assert _shape(claude_code_trace(seed=4)) == _shape(claude_code_trace(seed=4))
    assert _shape(claude_code_trace(seed=4)) != _shape(claude_code_trace(seed=5))
    spec = open_trace_spec("claude-code:seed=4,main_turns=5")
    assert _shape(spec) == _shape(claude_code_trace(seed=4, main_turns=5))


def test_claude_code_trace_shape() -> None:
    trace = claude_code_trace(seed=1, block_size=8, main_system_tokens=800, sub_system_tokens=400)
    main, a, b = trace.sessions
    assert (main.id, main.parent) == ("cc", None)
    assert [(s.id, s.parent, s.spawn_after) for s in (a, b)] == [
        ("cc/agent-a", "cc", 3),
        ("cc/agent-b", "cc", 3),
    ]
    assert (len(main.turns), len(a.turns), len(b.turns)) == (8, 5, 5)
    for s in trace.sessions:
        for prev, cur in zip(s.turns, s.turns[1:], strict=False):
            assert cur.blocks[: len(prev.blocks)] == prev.blocks  # a growing history
            assert len(cur.blocks) > len(prev.blocks)
        for t in s.turns:
            assert t.prompt_tokens == len(t.blocks) * 8
    # each opens with its own long system prompt; no block is shared across sessions
    assert len(main.turns[0].blocks) > 100 and len(a.turns[0].blocks) > 50
    blocks = [{b for t in s.turns for b in t.blocks} for s in trace.sessions]
    assert not (blocks[0] & blocks[1]) and not (blocks[0] & blocks[2])
    assert not (blocks[1] & blocks[2])
    # the sub-agents start together, after the main agent's third turn
    assert a.start == b.start > main.turns[2].t


def test_claude_code_trace_round_trips_and_refuses_bad_options(tmp_path: Path) -> None:
    trace = claude_code_trace(seed=2, subagents=3)
    back = load_trace(save_trace(trace, tmp_path / "cc.jsonl"))
    assert _shape(back) == _shape(trace)
    with pytest.raises(BenchError):
        open_trace_spec("claude-code:sead=1")
    with pytest.raises(BenchError):
        open_trace_spec("claude-code:seed=x")
    with pytest.raises(BenchError):
        claude_code_trace(spawn_after=9, main_turns=8)


def test_session_keys_by_root() -> None:
    trace = claude_code_trace(seed=0)
    assert set(session_keys(trace, "root").values()) == {"cc"}
    assert session_keys(trace) == {s.id: s.id for s in trace.sessions}
    nested = Trace(
        1,
        "unit",
        (
            Session("r", (Turn("r", 0, 0, 0, (1,), 1, 1),)),
            Session("r/a", (Turn("r/a", 0, 0, 0, (2,), 1, 1),), "r", 1),
            Session("r/a/b", (Turn("r/a/b", 0, 0, 0, (3,), 1, 1),), "r/a", 1),
        ),
    )
    assert session_keys(nested, "root") == {"r": "r", "r/a": "r", "r/a/b": "r"}


# ------------------------------------------------------------------------ report math


def test_reuse_grouped_by_owner() -> None:
    turns = [
        SessionTurn("a", 0, [1, 2, 3, 4], [9], 1, 0.0, 1.0),
        SessionTurn("b", 0, [1, 2, 3, 5, 6], [9], 1, 2.0, 3.0),
    ]
    assert self_reusable_tokens(turns) == {("a", 0): 0, ("b", 0): 0}
    same_owner = self_reusable_tokens(turns, group=lambda t: "k")
    assert same_owner == {("a", 0): 0, ("b", 0): 3}


def test_cross_owner_reuse_and_probe_summaries() -> None:
    def rec(session: str, cached: int, own: int, owner: int | None) -> RequestRecord:
        r = RequestRecord(session, 0, prompt_tokens_sent=100, prompt_tokens=100, ttft=0.1)
        r.cached_tokens, r.self_reusable_tokens, r.owner_reusable_tokens = cached, own, owner
        return r

    m = summarize([rec("a", 50, 0, 50), rec("b", 80, 60, 70), rec("c", 5, 5, None)], duration=1)
    assert m["cross_session_reuse"] == 50 + 20
    assert m["cross_owner_reuse"] == 10
    probes = [
        ProbeRecord(kind="owner", session="a", prompt_tokens_sent=10, cached_tokens=0),
        ProbeRecord(kind="owner", session="b", prompt_tokens_sent=10, cached_tokens=9),
        ProbeRecord(
            kind="caller", session="a", prompt_tokens_sent=10, allowed_tokens=4, cached_tokens=6
        ),
        ProbeRecord(kind="caller", session="b", prompt_tokens_sent=10, error="HTTP 500"),
    ]
    assert [p.leaked for p in probes] == [0, 9, 2, 0]
    assert summarize_probes(probes) == {
        "leak_probes": 4,
        "cross_owner_probe_tokens": 9,
        "cross_caller_tokens": 2,
        "leak_probes_unreported": 1,
    }
    assert summarize_probes(probes[:2])["cross_caller_tokens"] is None


def test_handoff_counters_are_read_defensively() -> None:
    status = {
        "config": {"scheduler": {"erase_on_handoff": True}},
        "scheduler": {"parking": {"parked": 3, "handoffs": 4, "handoff_calls": 9}},
    }
    got = handoff_counters(status)
    assert got == {
        "handoffs": 4,
        "upstream_calls": 9,
        "calls_per_handoff": 2.25,
        "at": "scheduler.parking",
    }
    nested = {"engines": [{"scheduler": {"handoff": {"count": 2, "upstream_calls": 6}}}]}
    assert handoff_counters(nested) == {
        "handoffs": 2,
        "upstream_calls": 6,
        "calls_per_handoff": 3.0,
        "at": "engines[0].scheduler",
    }
    assert handoff_counters({"scheduler": {"handoffs": 0, "handoff_calls": 0}}) == {
        "handoffs": 0,
        "upstream_calls": 0,
        "calls_per_handoff": None,
        "at": "scheduler",
    }
    assert handoff_counters({"scheduler": {"erase_on_handoff": True}}) is None
    assert handoff_counters({}) is None and handoff_counters(None) is None


def _target(
    name: str, kind: str, eff: float, ttft: float, *, keyless: bool = False, key_by: str = "session"
) -> dict[str, Any]:
    return {
        "name": name,
        "status": "ok",
        "description": {"kind": kind, "host_handoffs": None},
        "config": {"keyless": keyless, "key_by": key_by},
        "metrics": {
            "cache_efficiency": eff,
            "median_ttft_ms": ttft,
            "cross_session_reuse": 0,
            "cross_owner_reuse": 0,
        },
    }


def test_figures_rows_divide_by_direct_and_by_the_keyed_run() -> None:
    report = {
        "targets": [
            _target("direct", "direct", 1.0, 100.0),
            {"name": "router", "status": "skipped", "description": {"kind": "router"}},
            _target("gezel", "gezel", 0.9, 110.0),
            _target("gezel:keyless", "gezel", 0.45, 220.0, keyless=True),
            _target("gezel:root-key", "gezel", 0.9, 99.0, key_by="root"),
        ]
    }
    report["targets"][2]["description"]["host_handoffs"] = {
        "handoffs": 4,
        "calls_per_handoff": 2.5,
    }
    rows = {r["target"]: r for r in figures_rows(report)}
    assert list(rows) == ["direct", "gezel", "gezel:keyless", "gezel:root-key"]
    assert rows["direct"]["efficiency_vs_keyed"] is None  # itself
    assert rows["gezel"]["ttft_vs_base"] == pytest.approx(1.1)
    assert rows["gezel"]["efficiency_vs_keyed"] is None
    assert rows["gezel:keyless"]["efficiency_vs_keyed"] == pytest.approx(0.5)
    assert rows["gezel:keyless"]["ttft_vs_keyed"] == pytest.approx(2.0)
    assert rows["gezel:keyless"]["keys"] == "none"
    assert rows["gezel:root-key"]["ttft_vs_keyed"] == pytest.approx(0.9)
    assert rows["gezel:root-key"]["keys"] == "one per root"
    text = figures_table(report)
    gezel = next(line for line in text.splitlines() if line.startswith("gezel "))
    assert "2.50" in gezel and "n/a" not in gezel
    assert text.splitlines()[2].rstrip().endswith("n/a")  # direct: no handoff counters
    assert "| gezel:keyless | none |" in figures_table(report, markdown=True)
    report["targets"][3]["description"]["host_handoffs"] = {"handoffs": 0}
    keyless = next(line for line in figures_table(report).splitlines() if "keyless" in line)
    assert keyless.split()[-2:] == ["0", "-"]  # counted, none happened


def test_the_paired_ratio_is_the_median_of_each_requests_own_ratio() -> None:
    """Requests both targets completed, matched by session and turn; the machine was
    twice as slow for the target's first half: the ratio of medians says 2.0, the
    requests' own ratios mostly 1.0."""
    base = _target("direct", "direct", 1.0, 100.0)
    target = _target("gezel", "gezel", 1.0, 200.0)
    base["ttft_by_request"] = {f"s{i}#0": 100.0 for i in range(5)} | {"only-base#0": 1.0}
    target["ttft_by_request"] = {
        "s0#0": 200.0,
        "s1#0": 200.0,
        "s2#0": 100.0,
        "s3#0": 100.0,
        "s4#0": 100.0,
        "only-target#0": 1.0,
    }
    assert paired_ratio(target, base) == pytest.approx(1.0)
    assert paired_ratio(base, base) == pytest.approx(1.0)
    assert paired_ratio(target, {"name": "old"}) is None  # a report from before the field
    rows = {r["target"]: r for r in figures_rows({"targets": [base, target]})}
    assert rows["gezel"]["ttft_vs_base"] == pytest.approx(2.0)
    assert rows["gezel"]["paired_ttft_vs_base"] == pytest.approx(1.0)
    assert "paired/base" in figures_table({"targets": [base, target]})


# -------------------------------------------------------------- targets and variants


def test_target_variants() -> None:
    t = parse_target("gezel:keyless")
    assert (t.name, t.kind, t.keyless, t.keyless_mode, t.key_by) == (
        "gezel:keyless",
        "gezel",
        True,
        None,
        "session",
    )
    t = parse_target("gezel-noparking:keyless=conversation")
    assert (t.kind, t.keyless, t.keyless_mode) == ("gezel-noparking", True, "conversation")
    assert parse_target("direct:root-key").key_by == "root"
    assert parse_target("direct").keyless is None
    for bad in ("gezel:keyles", "gezel:keyless=open", "direct:keyless=shared", "nginx:keyless"):
        with pytest.raises(BenchError):
            parse_target(bad)


def test_gezel_config_with_keys_and_keyless_mode(tmp_path: Path) -> None:
    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"GGUF")
    settings = LaunchSettings(
        model_path=model, workdir=tmp_path, api_keys=("ka", "kb"), admin_key="adm"
    )
    text = gezel_config_toml(
        settings=settings,
        engine=EngineCommand(Path("/x/llama-server"), {}),
        port=8124,
        affinity=True,
        keyless="conversation",
    )
    data = tomllib.loads(text)
    assert data["server"]["api_keys"] == ["ka", "kb"] and data["server"]["admin_keys"] == ["adm"]
    assert data["scheduler"]["keyless"] == "conversation"
    from gezel_trio.config.schema import load_config, validate

    path = tmp_path / "g.toml"
    path.write_text(text)
    config = load_config(path)
    validate(config)
    assert config.server.api_keys == ["ka", "kb"] and config.scheduler.keyless == "conversation"


# ----------------------------------------------------------- replays against the fake


async def test_root_keys_and_leak_probes(autojump_clock: Any) -> None:
    """Sub-agents send their root's key; the probes go out after the replay, a fresh key
    of the same caller and the second caller keyed as the replay was. A fake engine that
    shares slots by prefix leaks to the probes; one that erases per key does not."""
    trace = claude_code_trace(
        seed=0, block_size=4, main_system_tokens=40, sub_system_tokens=24, main_turns=3,
        sub_turns=2, spawn_after=1, growth=(8, 16),
    )  # fmt: skip
    got: dict[bool, dict[str, Any]] = {}
    for isolate in (False, True):
        engine = FakeEngine(slots=2, isolate=isolate, prefill=0.001)
        config = ReplayConfig(
            base_url="http://fake",
            warmup=False,
            key_by="root",
            leak_probe=True,
            api_key="ka",
            probe_key="kb",
        )
        seen_at_hook: list[int] = []

        async def hook(engine: FakeEngine = engine, seen: list[int] = seen_at_hook) -> None:
            seen.append(len(engine.received))

        async with fake_client(engine) as client:
            result = await run_replay(
                trace, config, client=client, progress_stream=None, replayed=hook
            )
        assert seen_at_hook == [trace.n_requests]  # after the replay, before the probes
        replayed = engine.received[: trace.n_requests]
        assert {body["prompt_cache_key"] for _, _, body, _ in replayed} == {"cc"}
        probes = engine.received[trace.n_requests :]
        assert len(probes) == len(result.probes) == 2 * len(trace.sessions)
        owner = [p for p in probes if p[0].startswith("gezel-bench-probe/")]
        caller = [p for p in probes if p[3].get("authorization") == "Bearer kb"]
        assert len(owner) == len(caller) == len(trace.sessions)
        assert {p[0] for p in caller} == {"cc"}  # keyed as the replay was
        assert {r.owner for r in result.records} == {"cc"}
        got[isolate] = summarize_probes(result.probes)
        m = summarize(result.records, duration=result.duration)
        assert m["cross_owner_reuse"] == 0
    assert got[False]["cross_owner_probe_tokens"] > 0
    assert got[True]["cross_owner_probe_tokens"] == 0
