"""Trace format, importers (Weka, Mooncake), scaling, oracles and prompt synthesis."""

from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gezel_bench.errors import BenchError, TraceFormatError
from gezel_bench.synth import (
    PromptSynthesizer,
    endpoint_path,
    request_body,
    request_headers,
)
from gezel_bench.trace_specs import open_trace_spec
from gezel_bench.traces import (
    Scaling,
    Session,
    Trace,
    Turn,
    block_reuse_ratio,
    dump_trace,
    import_mooncake,
    import_weka,
    load_trace,
    oracle_tokens,
    save_trace,
    scale_trace,
)


def _traces_dir() -> Path:
    env = os.environ.get("GEZEL_TRACES_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[1].parent / "shared" / "traces"


TRACES = _traces_dir()
WEKA = TRACES / "weka"
MOONCAKE = TRACES / "mooncake" / "conversation_trace.jsonl"
needs_weka = pytest.mark.skipif(not WEKA.is_dir(), reason=f"no Weka traces at {WEKA}")
needs_mooncake = pytest.mark.skipif(
    not MOONCAKE.is_file(), reason=f"no Mooncake trace at {MOONCAKE}"
)


def _req(
    t: float, n_in: int, n_out: int, ids: list[int], think: float | None = 0.0
) -> dict[str, Any]:
    r: dict[str, Any] = {"t": t, "type": "n", "in": n_in, "out": n_out, "hash_ids": ids}
    if think is not None:
        r["think_time"] = think
    return r


def _write_weka(path: Path, requests: list[dict[str, Any]], **top: Any) -> Path:
    data = {"id": path.stem, "block_size": 64, "hash_id_scope": "local", "requests": requests}
    data.update(top)
    path.write_text(json.dumps(data))
    return path


def _turn(session: str, index: int, t: float, blocks: list[int], prompt: int, out: int = 2) -> Turn:
    return Turn(session, index, t, 0.0, tuple(blocks), prompt, out)


# ------------------------------------------------------------------------------ Weka


@needs_weka
def test_weka_directory_keeps_every_request_and_think_time() -> None:
    trace = import_weka(WEKA)
    files = sorted(WEKA.glob("*.json"))
    raw = [json.loads(f.read_text()) for f in files]
    assert len(trace.sessions) == len(files)
    assert trace.n_requests == sum(len(d["requests"]) for d in raw)
    assert trace.block_size == 64

    first = raw[0]
    session = trace.session(first["id"])
    assert [t.prompt_tokens for t in session.turns] == [r["in"] for r in first["requests"]]
    assert [t.output_tokens for t in session.turns] == [r["out"] for r in first["requests"]]
    assert [t.t for t in session.turns] == [float(r["t"]) for r in first["requests"]]
    for turn, r in zip(session.turns, first["requests"], strict=True):
        if r.get("think_time") is not None:
            assert turn.think_time == pytest.approx(r["think_time"])
        # equal source ids map to equal ids, different to different (within the file)
        assert len(set(turn.blocks)) == len(set(r["hash_ids"]))
    mapping: dict[int, int] = {}
    for turn, r in zip(session.turns, first["requests"], strict=True):
        for new, old in zip(turn.blocks, r["hash_ids"], strict=True):
            assert mapping.setdefault(old, new) == new


@needs_weka
def test_weka_local_hash_ids_never_collide_across_files() -> None:
    trace = import_weka(WEKA)
    a, b = trace.sessions[0], trace.sessions[1]
    ids_a = {x for t in a.turns for x in t.blocks}
    ids_b = {x for t in b.turns for x in t.blocks}
    assert ids_a and ids_b and not (ids_a & ids_b)
    # within one conversation, prefixes are shared heavily
    assert block_reuse_ratio(trace, scope="session") > 0.8
    assert block_reuse_ratio(trace, scope="global") == block_reuse_ratio(trace, scope="session")


def test_weka_sub_agents_become_separate_sessions(tmp_path: Path) -> None:
    inner = {
        "t": 3.0,
        "type": "subagent",
        "agent_id": "agent_009",
        "requests": [_req(1.0, 130, 5, [100, 101], think=None)],
    }
    marker = {
        "t": 10.0,
        "type": "subagent",
        "agent_id": "agent_001",
        "subagent_type": "Explore",
        "requests": [
            _req(0.0, 200, 7, [50, 51, 52], think=0.0),
            inner,
            _req(4.0, 300, 9, [50, 51, 52, 53], think=2.0),
        ],
    }
    second = {"t": 11.0, "type": "subagent", "requests": [_req(0.0, 70, 1, [60], 0.0)]}
    reqs = [
        _req(0.0, 128, 10, [1, 2], 0.0),
        _req(5.0, 192, 12, [1, 2, 3], 1.5),
        marker,
        second,
        _req(20.0, 256, 3, [1, 2, 3, 4], 6.0),
    ]
    _write_weka(tmp_path / "conv.json", reqs)
    trace = import_weka(tmp_path / "conv.json")

    ids = {s.id for s in trace.sessions}
    assert ids == {"conv", "conv/agent_001", "conv/agent_001/agent_009", "conv/sa2"}
    root = trace.session("conv")
    assert root.parent is None and len(root.turns) == 3
    assert [t.think_time for t in root.turns] == [0.0, 1.5, 6.0]

    sa = trace.session("conv/agent_001")
    assert (sa.parent, sa.spawn_after) == ("conv", 2)
    assert [t.t for t in sa.turns] == [10.0, 14.0]  # marker t + relative t
    assert [t.prompt_tokens for t in sa.turns] == [200, 300]

    nested = trace.session("conv/agent_001/agent_009")
    assert (nested.parent, nested.spawn_after) == ("conv/agent_001", 1)
    assert nested.turns[0].t == 14.0  # 10 + 3 + 1
    assert nested.turns[0].think_time == 0.0  # absent on a first request

    other = trace.session("conv/sa2")
    assert (other.parent, other.spawn_after) == ("conv", 2)

    # one file is one id space: a sub-agent's ids differ from the parent's unless equal
    assert set(sa.turns[0].blocks).isdisjoint(root.turns[-1].blocks)
    assert sa.turns[1].blocks[:3] == sa.turns[0].blocks


def test_weka_missing_think_time_is_derived_from_the_gap(tmp_path: Path) -> None:
    reqs = [_req(0.0, 64, 1, [1]), _req(10.0, 128, 1, [1, 2], think=None)]
    reqs[0]["api_time"] = 4.0
    _write_weka(tmp_path / "a.json", reqs)
    trace = import_weka(tmp_path / "a.json")
    assert trace.sessions[0].turns[1].think_time == pytest.approx(6.0)


def test_weka_global_scope_shares_ids_across_files(tmp_path: Path) -> None:
    _write_weka(tmp_path / "a.json", [_req(0.0, 128, 1, [7, 8])], hash_id_scope="global")
    _write_weka(tmp_path / "b.json", [_req(0.0, 128, 1, [7, 9])], hash_id_scope="global")
    _write_weka(tmp_path / "c.json", [_req(0.0, 128, 1, [7, 8])])  # local
    trace = import_weka(tmp_path)
    a, b, c = (trace.session(x).turns[0].blocks for x in ("a", "b", "c"))
    assert a[0] == b[0] and a[1] != b[1]
    assert not set(c) & (set(a) | set(b))


def test_weka_rejects_mixed_block_sizes_and_garbage(tmp_path: Path) -> None:
    _write_weka(tmp_path / "a.json", [_req(0.0, 64, 1, [1])])
    _write_weka(tmp_path / "b.json", [_req(0.0, 64, 1, [1])], block_size=32)
    with pytest.raises(TraceFormatError, match="block_size"):
        import_weka(tmp_path)
    (tmp_path / "b.json").write_text("{not json")
    with pytest.raises(TraceFormatError, match=r"b\.json"):
        import_weka(tmp_path)
    with pytest.raises(TraceFormatError, match="no such file"):
        import_weka(tmp_path / "missing")


# -------------------------------------------------------------------------- Mooncake


def _write_mooncake(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> Path:
    with path.open("w") as fp:
        for ts, n_in, n_out, ids in rows:
            fp.write(
                json.dumps(
                    {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}
                )
                + "\n"
            )
    return path


def test_mooncake_sessions_follow_the_longest_hash_chain(tmp_path: Path) -> None:
    rows = [
        (0, 1500, 10, [0, 1, 2]),  # A0
        (0, 1100, 10, [0, 3, 4]),  # B0: shares only block 0 -> new session
        (2000, 2000, 10, [0, 1, 2, 5]),  # A1 extends A0 exactly
        (3000, 2100, 10, [0, 3, 6, 7, 8]),  # B1: its last block of B0 was partial
        (4000, 2000, 10, [0, 1, 2, 9]),  # branches off A0/A1 prefix: longest match is A1
        (5000, 1600, 10, [0, 3, 4, 11]),  # matches B0 best, but B0 is not B's latest -> fork
    ]
    trace = import_mooncake(_write_mooncake(tmp_path / "m.jsonl", rows))
    assert trace.block_size == 512
    by_first = {s.turns[0].blocks: s for s in trace.sessions}
    a = by_first[(0, 1, 2)]
    b = by_first[(0, 3, 4)]
    assert [t.blocks for t in a.turns] == [(0, 1, 2), (0, 1, 2, 5), (0, 1, 2, 9)]
    assert [t.blocks for t in b.turns] == [(0, 3, 4), (0, 3, 6, 7, 8)]
    assert [t.t for t in a.turns] == [0.0, 2.0, 4.0]
    assert [t.think_time for t in a.turns] == [0.0, 2.0, 2.0]
    assert len(trace.sessions) == 3
    fork = by_first[(0, 3, 4, 11)]
    assert len(fork.turns) == 1 and fork.parent is None


def test_mooncake_min_shared_blocks(tmp_path: Path) -> None:
    rows = [(0, 600, 1, [0, 1]), (1000, 600, 1, [0, 2])]
    path = _write_mooncake(tmp_path / "m.jsonl", rows)
    assert len(import_mooncake(path).sessions) == 2
    assert len(import_mooncake(path, min_shared_blocks=1).sessions) == 1


@needs_mooncake
def test_mooncake_full_trace_reproduces_the_published_reuse() -> None:
    """The README: about 36.6% of prefix blocks repeat with an unlimited cache."""
    trace = import_mooncake(MOONCAKE)
    with MOONCAKE.open() as fp:
        lines = sum(1 for line in fp if line.strip())
    assert trace.n_requests == lines
    everything = block_reuse_ratio(trace, scope="global")
    assert everything == pytest.approx(0.366, abs=0.01)
    # Sessions inferred from hash chains hold nearly all of that reuse: what they miss
    # is mostly block 0, the prefix every request shares (one block per request).
    per_session = block_reuse_ratio(trace, scope="session")
    total_blocks = sum(len(t.blocks) for t in trace.requests())
    shared_first_block = (lines - 1) / total_blocks
    assert per_session <= everything
    assert per_session >= everything - shared_first_block - 0.01
    # the token-level oracle agrees with the block-level figure
    oracle = oracle_tokens(trace)
    prompt = sum(t.prompt_tokens for t in trace.requests())
    assert sum(oracle.values()) / prompt == pytest.approx(per_session, abs=0.02)


# ----------------------------------------------------------------- native format I/O


def _small_trace() -> Trace:
    root = Session(
        "s1",
        (
            Turn("s1", 0, 0.0, 0.0, (1, 2), 13, 4),
            Turn("s1", 1, 2.5, 1.25, (1, 2, 3), 20, 3),
        ),
    )
    sub = Session("s1/a", (Turn("s1/a", 0, 1.0, 0.0, (9,), 5, 2),), parent="s1", spawn_after=1)
    other = Session("s2", (Turn("s2", 0, 0.5, 0.0, (4,), 7, 1),))
    return Trace(8, "unit", (root, other, sub), {"source_block_size": 64, "time_scale": 0.5})


def test_native_round_trip(tmp_path: Path) -> None:
    trace = _small_trace()
    path = save_trace(trace, tmp_path / "t.jsonl")
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    assert header["format"] == "gezel-trace" and header["version"] == 1
    assert header["block_size"] == 8 and header["scaling"]["time_scale"] == 0.5
    body = [json.loads(x) for x in lines[1:]]
    assert [(x["session"], x["turn"]) for x in body] == [
        ("s1", 0),
        ("s2", 0),
        ("s1/a", 0),
        ("s1", 1),
    ]
    assert body[2]["parent"] == "s1" and body[2]["spawn_after"] == 1
    assert "spawn_after" not in body[0] and body[0]["parent"] is None

    back = load_trace(path)
    assert back.block_size == 8 and back.source == "unit" and back.time_scale == 0.5
    assert {s.id: s for s in back.sessions} == {s.id: s for s in trace.sessions}
    assert open_trace_spec(f"native:{path}").sessions == back.sessions
    assert open_trace_spec(str(path)).sessions == back.sessions


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda h, b: h.update(format="other"), "not a gezel-trace"),
        (lambda h, b: h.update(version=2), "unsupported version"),
        (lambda h, b: b[0].pop("blocks"), "missing field 'blocks'"),
        (lambda h, b: b[0].update(t=-1), "'t' must be"),
        (lambda h, b: b[0].update(prompt_tokens=0), "must be >= 1"),
        (lambda h, b: b[3].update(turn=0), "repeats turn 0"),
        (lambda h, b: b[3].update(turn=5), "turns are not"),
        (lambda h, b: b[2].update(parent="ghost"), "unknown parent"),
        (lambda h, b: b[2].pop("spawn_after"), "spawn_after"),
        (lambda h, b: b[2].update(spawn_after=3), "which has 2"),
        (lambda h, b: b[0].update(blocks=[1, "x"]), "list of integers"),
    ],
)
def test_native_rejects_malformed(tmp_path: Path, mutate: Any, message: str) -> None:
    buf = io.StringIO()
    dump_trace(_small_trace(), buf)
    header, *body = (json.loads(x) for x in buf.getvalue().splitlines())
    mutate(header, body)
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [header, *body]) + "\n")
    with pytest.raises(TraceFormatError, match=message):
        load_trace(path)


# --------------------------------------------------------------------------- scaling


def test_scaling_tokens_outputs_and_record() -> None:
    trace = Trace(
        64,
        "unit",
        (
            Session(
                "a",
                (
                    Turn("a", 0, 0.0, 0.0, (1, 2), 150, 100),  # 2 full blocks + 22-token tail
                    Turn("a", 1, 1.0, 0.5, (1, 2, 3), 192, 4),
                ),
            ),
        ),
        {"source_block_size": 64},
    )
    scaled = scale_trace(trace, Scaling(tokens_per_block=8, max_output_tokens=10))
    turns = scaled.sessions[0].turns
    assert scaled.block_size == 8
    assert [t.prompt_tokens for t in turns] == [19, 24]  # ceil(150/8), 192/8
    assert [t.output_tokens for t in turns] == [10, 1]  # min(10, round(12.5)), max(1, 0.5)
    assert turns[0].prompt_tokens >= len(turns[0].blocks) * 8
    assert [t.t for t in turns] == [0.0, 1.0]  # time scale is applied at replay
    rec = scaled.scaling
    assert rec["source_block_size"] == 64 and rec["block_size"] == 8
    assert rec["token_ratio"] == 0.125 and rec["output_scale"] == 0.125
    assert rec["max_output_tokens"] == 10 and rec["time_scale"] == 1.0
    again = scale_trace(scaled, Scaling(tokens_per_block=4, output_scale=1.0, time_scale=0.1))
    assert again.scaling["token_ratio"] == 0.0625
    assert again.scaling["source_block_size"] == 64
    assert again.time_scale == 0.1
    assert [t.prompt_tokens for t in again.sessions[0].turns] == [10, 12]


def _many_sessions() -> Trace:
    sessions = []
    for k in range(5):
        sid = f"s{k}"
        turns = tuple(
            _turn(sid, i, 10.0 * k + i, [100 * k + j for j in range(i + 1)], 8 * (i + 1))
            for i in range(4)
        )
        sessions.append(Session(sid, turns))
    sub = Session("s1/a", (_turn("s1/a", 0, 11.5, [999], 8),), parent="s1", spawn_after=3)
    sessions.append(sub)
    return Trace(8, "unit", tuple(sessions), {})


def test_scaling_selects_sessions_turns_and_requests() -> None:
    trace = _many_sessions()
    first = scale_trace(trace, Scaling(max_sessions=2, max_turns=2))
    assert [s.id for s in first.sessions] == ["s0", "s1", "s1/a"]
    assert all(len(s.turns) <= 2 for s in first.sessions)
    # the sub-agent spawned after turn 3, which is gone: it now spawns after the last kept
    assert first.session("s1/a").spawn_after == 2

    sampled = scale_trace(trace, Scaling(max_sessions=2, seed=7))
    again = scale_trace(trace, Scaling(max_sessions=2, seed=7))
    assert [s.id for s in sampled.sessions] == [s.id for s in again.sessions]
    assert len([s for s in sampled.sessions if s.parent is None]) == 2

    capped = scale_trace(trace, Scaling(max_requests=6))
    kept = sorted(t.t for t in capped.requests())
    assert kept == [0.0, 1.0, 2.0, 3.0, 10.0, 11.0]
    assert [s.id for s in capped.sessions] == ["s0", "s1"]  # the sub-agent came at 11.5

    short = scale_trace(trace, Scaling(max_prompt_tokens=16))
    assert all(len(s.turns) == 2 for s in short.sessions if s.parent is None)
    assert max(t.prompt_tokens for t in short.requests()) == 16


def test_scaling_stagger_shifts_root_sessions_and_their_sub_agents() -> None:
    base = _many_sessions()
    zero = Trace(
        8,
        "unit",
        tuple(
            Session(
                s.id,
                tuple(Turn(t.session, t.index, t.t % 10, 0.0, t.blocks, 8, 1) for t in s.turns),
                s.parent,
                s.spawn_after,
            )
            for s in base.sessions
        ),
        {},
    )
    scaled = scale_trace(zero, Scaling(max_sessions=3, stagger=5.0))
    starts = {s.id: s.start for s in scaled.sessions}
    assert starts == {"s0": 0.0, "s1": 5.0, "s2": 10.0, "s1/a": 6.5}
    assert scaled.scaling["stagger"] == 5.0


def test_scaling_rejects_nonsense() -> None:
    with pytest.raises(BenchError):
        Scaling(tokens_per_block=0)
    with pytest.raises(BenchError):
        Scaling(time_scale=0)
    with pytest.raises(BenchError):
        Scaling(output_scale=-1.0)


@needs_weka
def test_scaled_weka_subset_is_small_and_recorded(tmp_path: Path) -> None:
    trace = open_trace_spec(
        f"weka:{WEKA}",
        scaling=Scaling(tokens_per_block=2, max_sessions=3, max_turns=3, max_output_tokens=4),
    )
    stats = trace.statistics()
    assert stats["sessions"] == 3 and stats["requests"] <= 9
    for session in trace.sessions:
        raw = json.loads((WEKA / f"{session.id}.json").read_text())["requests"]
        for turn, r in zip(session.turns, raw, strict=False):
            assert turn.prompt_tokens == math.ceil(r["in"] * 2 / 64)
            assert turn.output_tokens == min(4, max(1, round(r["out"] * 2 / 64)))
            assert len(turn.blocks) == len(r["hash_ids"])
    assert trace.scaling["source_sessions"] == 40
    back = load_trace(save_trace(trace, tmp_path / "w.jsonl"))
    assert back.scaling == dict(trace.scaling)


# --------------------------------------------------------------------------- oracles


def test_oracle_tokens_by_hand() -> None:
    s = "s"
    turns = (
        _turn(s, 0, 0.0, [1, 2, 3], 20),  # first turn: 0
        _turn(s, 1, 1.0, [1, 2, 3, 4], 30),  # 3 blocks shared, q has 20 tokens: min(24, 20) = 20
        _turn(s, 2, 2.0, [1, 2, 5], 17),  # 2 blocks with either: 16 = min(16, 17 - 1)
        _turn(s, 3, 3.0, [1, 2, 3, 4], 16),  # all 4 with turn 1 (32, 30) capped at 16 - 1
        _turn(s, 4, 4.0, [9], 8),  # nothing shared
    )
    other = Session("o", (_turn("o", 0, 0.0, [1, 2, 3, 4], 40),))
    trace = Trace(8, "unit", (Session(s, turns), other), {})
    assert oracle_tokens(trace) == {
        ("s", 0): 0,
        ("s", 1): 20,
        ("s", 2): 16,
        ("s", 3): 15,
        ("s", 4): 0,
        ("o", 0): 0,  # sharing with another session does not count
    }


def test_block_reuse_ratio_by_hand() -> None:
    a = Session("a", (_turn("a", 0, 0.0, [1, 2], 16), _turn("a", 1, 2.0, [1, 2, 3], 24)))
    b = Session("b", (_turn("b", 0, 1.0, [1, 4], 16),))
    trace = Trace(8, "unit", (a, b), {})
    # arrival order: a0 (0 of 2), b0 (1 of 2 globally, 0 in-session), a1 (2 of 3)
    assert block_reuse_ratio(trace, scope="global") == pytest.approx(3 / 7)
    assert block_reuse_ratio(trace, scope="session") == pytest.approx(2 / 7)
    with pytest.raises(ValueError):
        block_reuse_ratio(trace, scope="nope")


# ------------------------------------------------------------------------- synthesis


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.integers(1, 5),
    width=st.integers(2, 40),
    seed=st.integers(0, 2**31),
    raw_ids=st.sets(st.integers(-(10**9), 10**9), max_size=80),
)
def test_synthesis_is_a_bijection_on_block_ids(
    block_size: int, width: int, seed: int, raw_ids: set[int]
) -> None:
    capacity = width**block_size
    ids = sorted(raw_ids)[: capacity // 2]
    lo = 300
    synth = PromptSynthesizer(
        block_size=block_size, vocab_lo=lo, vocab_hi=lo + width, seed=seed, block_ids=ids
    )
    again = PromptSynthesizer(
        block_size=block_size, vocab_lo=lo, vocab_hi=lo + width, seed=seed, block_ids=ids
    )
    seqs = [synth.block_tokens(i) for i in ids]
    assert len(set(seqs)) == len(ids)  # different id -> different tokens
    assert seqs == [again.block_tokens(i) for i in ids]  # equal id -> equal tokens
    assert all(len(s) == block_size and all(lo <= x < lo + width for x in s) for s in seqs)


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.integers(1, 6),
    common=st.lists(st.integers(0, 30), max_size=6),
    tail_a=st.lists(st.integers(31, 60), max_size=4, unique=True),
    tail_b=st.lists(st.integers(61, 90), max_size=4, unique=True),
    extra_a=st.integers(0, 12),
    extra_b=st.integers(0, 12),
)
def test_synthesized_prompts_share_exactly_their_common_blocks(
    block_size: int,
    common: list[int],
    tail_a: list[int],
    tail_b: list[int],
    extra_a: int,
    extra_b: int,
) -> None:
    blocks_a = (*common, *tail_a)
    blocks_b = (*common, *tail_b)
    a = Turn("a", 0, 0.0, 0.0, blocks_a, max(1, len(blocks_a) * block_size + extra_a), 1)
    b = Turn("b", 0, 0.0, 0.0, blocks_b, max(1, len(blocks_b) * block_size + extra_b), 1)
    trace = Trace(block_size, "prop", (Session("a", (a,)), Session("b", (b,))), {})
    synth = PromptSynthesizer.for_trace(trace, vocab_hi=700, seed=3)
    pa, pb = synth.prompt(a), synth.prompt(b)
    assert len(pa) == a.prompt_tokens and len(pb) == b.prompt_tokens
    shared = len(common) * block_size
    assert pa[:shared] == pb[:shared]
    if tail_a and tail_b:
        # the first differing blocks differ somewhere inside themselves
        assert pa[shared : shared + block_size] != pb[shared : shared + block_size]
    assert synth.prompt(a) == pa  # deterministic


def test_synthesis_cuts_partial_blocks_and_adds_unique_tails() -> None:
    turns = (
        Turn("s", 0, 0.0, 0.0, (1, 2, 3), 10, 1),  # 3 blocks of 4 cut to 10 tokens
        Turn("s", 1, 1.0, 0.0, (1, 2), 11, 1),  # 8 block tokens + 3 tail tokens
        Turn("t", 0, 0.0, 0.0, (1, 2), 11, 1),
    )
    trace = Trace(4, "unit", (Session("s", turns[:2]), Session("t", turns[2:])), {})
    synth = PromptSynthesizer.for_trace(trace, vocab_hi=676, seed=0)
    p0, p1, q0 = (synth.prompt(t) for t in turns)
    assert p0 == [*synth.block_tokens(1), *synth.block_tokens(2), *synth.block_tokens(3)[:2]]
    assert p1[:8] == p0[:8] == q0[:8]
    assert p1[8:] != q0[8:]  # tails are per turn
    assert all(300 <= x < 676 for x in p0 + p1 + q0)
    other_seed = PromptSynthesizer.for_trace(trace, vocab_hi=676, seed=1)
    assert other_seed.prompt(turns[0]) != p0


def test_synthesis_refuses_a_too_small_id_space() -> None:
    with pytest.raises(BenchError, match="tokens_per_block"):
        PromptSynthesizer(block_size=1, vocab_lo=300, vocab_hi=310, block_ids=range(6))
    with pytest.raises(BenchError, match="too small"):
        PromptSynthesizer(block_size=4, vocab_lo=300, vocab_hi=301)


def test_request_bodies_for_both_api_styles() -> None:
    llama = request_body(
        api="llama", prompt=[301, 302], output_tokens=5, session="s1", seed=9, model="m"
    )
    assert endpoint_path("llama") == "/completion"
    assert llama == {
        "prompt": [301, 302],
        "stream": True,
        "ignore_eos": True,
        "cache_prompt": True,
        "prompt_cache_key": "s1",
        "n_predict": 5,
        "return_tokens": True,
        "model": "m",
        "seed": 9,
    }
    oai = request_body(api="openai", prompt=[301], output_tokens=3, session="s2")
    assert endpoint_path("openai") == "/v1/completions"
    assert oai["max_tokens"] == 3 and "n_predict" not in oai and "model" not in oai
    assert oai["stream_options"] == {"include_usage": True}
    assert oai["ignore_eos"] is True and oai["prompt_cache_key"] == "s2"
    assert request_headers("s2") == {"X-Session-Id": "s2"}
    with pytest.raises(BenchError):
        endpoint_path("grpc")  # type: ignore[arg-type]
