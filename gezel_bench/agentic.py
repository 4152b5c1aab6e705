"""A synthetic Claude-Code-like trace: one conversation, a main agent and its sub-agents.

Claude Code runs sub-agents (its Task tool) under the parent's session id, each with a
system prompt of its own, and the parent waits for them. :func:`claude_code_trace` writes
that shape as a :class:`~gezel_bench.traces.Trace`:

- a root session ``cc`` (the main agent) of ``main_turns`` turns, opening with a long
  system prompt of its own;
- ``subagents`` sub-agent sessions ``cc/agent-a``, ``cc/agent-b``, ... that all start
  after the main agent's turn ``spawn_after - 1`` and run side by side (their turns
  interleave on the engine), each opening with another long system prompt; the main
  agent's turn ``spawn_after`` waits for them (the replay's closed loop does this);
- every turn repeats its session's previous prompt and appends new blocks (the answer
  and a tool result: a growing history), drawn from the seed.

Sessions share no block, so each one's reusable prefix is its own history. Replayed with
one key per session it is three owners; with the bench's ``:root-key`` targets it is one
owner holding three conversations, as Claude Code sends it. Deterministic for a seed;
pure. ``claude-code[:key=value,...]`` in ``--trace`` builds it (keys: the arguments).
"""

from __future__ import annotations

import random
from typing import Any

from .errors import BenchError
from .traces import Session, Trace, Turn

__all__ = ["claude_code_trace", "parse_claude_code_spec"]

ROOT = "cc"


def claude_code_trace(
    *,
    seed: int = 0,
    block_size: int = 16,
    main_system_tokens: int = 1536,
    sub_system_tokens: int = 1024,
    main_turns: int = 8,
    sub_turns: int = 5,
    subagents: int = 2,
    spawn_after: int = 3,
    growth: tuple[int, int] = (64, 320),
    output: tuple[int, int] = (8, 24),
    think: tuple[float, float] = (0.5, 3.0),
) -> Trace:
    """The trace (see the module). ``growth`` (tokens appended per turn, rounded up to
    whole blocks), ``output`` (tokens per answer) and ``think`` (seconds of tool work
    before a turn) are inclusive ranges drawn from ``seed``."""
    if block_size < 1 or main_turns < 1 or sub_turns < 1 or subagents < 0:
        raise BenchError("block_size, main_turns and sub_turns must be >= 1, subagents >= 0")
    if not 0 <= spawn_after <= main_turns:
        raise BenchError(f"spawn_after must be in [0, {main_turns}], not {spawn_after}")
    if subagents > 26:
        raise BenchError("at most 26 sub-agents")
    rng = random.Random(seed)
    next_id = 1

    def blocks(tokens: int) -> list[int]:
        nonlocal next_id
        n = max(1, -(-tokens // block_size))
        out = list(range(next_id, next_id + n))
        next_id += n
        return out

    def conversation(sid: str, system: int, turns: int, t0: float) -> tuple[Turn, ...]:
        history = blocks(system)
        out: list[Turn] = []
        t = t0
        for i in range(turns):
            history = history + blocks(rng.randint(*growth))
            gap = round(rng.uniform(*think), 3)
            if i:
                t += 2.0 + gap  # a rough answer time plus the tool's, for open loop
            tokens = len(history) * block_size
            out.append(Turn(sid, i, round(t, 3), gap, tuple(history), tokens, rng.randint(*output)))
        return tuple(out)

    main = conversation(ROOT, main_system_tokens, main_turns, 0.0)
    spawn_t = main[spawn_after - 1].t + 2.0 if spawn_after else 0.0
    sessions = [Session(ROOT, main)]
    for k in range(subagents):
        sid = f"{ROOT}/agent-{chr(ord('a') + k)}"
        turns = conversation(sid, sub_system_tokens, sub_turns, spawn_t)
        sessions.append(Session(sid, turns, parent=ROOT, spawn_after=spawn_after))
    settings: dict[str, Any] = {
        "seed": seed,
        "block_size": block_size,
        "main_system_tokens": main_system_tokens,
        "sub_system_tokens": sub_system_tokens,
        "main_turns": main_turns,
        "sub_turns": sub_turns,
        "subagents": subagents,
        "spawn_after": spawn_after,
    }
    source = "synthetic claude-code: " + ", ".join(f"{k}={v}" for k, v in settings.items())
    return Trace(block_size, source, tuple(sessions), {"block_size": block_size})


_INT_KEYS = (
    "seed",
    "block_size",
    "main_system_tokens",
    "sub_system_tokens",
    "main_turns",
    "sub_turns",
    "subagents",
    "spawn_after",
)


def parse_claude_code_spec(options: str) -> Trace:
    """The trace of ``claude-code:OPTIONS`` (``seed=3,main_turns=10``; integers only)."""
    kwargs: dict[str, Any] = {}
    for part in (p.strip() for p in options.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or key not in _INT_KEYS:
            raise BenchError(f"claude-code trace option {part!r}: use {', '.join(_INT_KEYS)}")
        try:
            kwargs[key] = int(value)
        except ValueError:
            raise BenchError(f"claude-code trace option {part!r}: not an integer") from None
    return claude_code_trace(**kwargs)
