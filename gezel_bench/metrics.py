"""Benchmark metrics: pure functions over per-request records.

Field names follow vLLM's and SGLang's serving benchmarks (``completed``, ``failed``,
``duration``, ``request_throughput``, ``output_throughput``,
``total_token_throughput``, ``mean_/median_/std_/p99_`` of ``ttft_ms``, ``tpot_ms``,
``itl_ms`` and ``e2el_ms``) so figures can be set side by side. Cache figures:

- ``cache_hit_ratio``: cached prompt tokens / prompt tokens, both as the engine counts
  them (llama.cpp ``timings.cache_n``, OpenAI ``usage.prompt_tokens_details``).
- ``oracle_hit_ratio``: what an unlimited *per-session* prefix cache would reuse
  (:func:`gezel_bench.traces.oracle_tokens`) / prompt tokens sent.
- ``cache_efficiency``: ``cache_hit_ratio / oracle_hit_ratio``.
- ``cross_session_reuse``: cached tokens a request got beyond the longest prefix its
  own session had sent or received by then (see :func:`self_reusable_tokens`), summed.
  A lower-bound detector: reuse of another session's copy of tokens the session also
  holds itself cannot be told apart and is not counted.
- ``cross_owner_reuse``: the same with the request's *owner* in place of its session:
  the sessions that sent the same key (one owner when the replay keys sub-agents by
  their root session; every keyless request of the caller when it sends none).
- ``cross_owner_probe_tokens`` / ``cross_caller_tokens``: cached tokens that leak probes
  (:class:`ProbeRecord`, sent after the replay with a replayed prompt) got beyond their
  own probe owner's earlier prompts: under a fresh session key of the same caller, and
  under a second caller's API key. Each must be 0 through an isolating host.
- ``fairness``: Jain's index of the per-session mean TTFT (1.0 = all equal).
- ``prompt_token_mismatch``: requests whose engine-reported prompt length differs
  from the synthesized one; ``output_token_mismatch``: the same for output.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = [
    "ProbeRecord",
    "RequestRecord",
    "SessionTurn",
    "cache_hit_by_turn",
    "handoff_counters",
    "jain_index",
    "percentile",
    "ratios",
    "self_reusable_tokens",
    "summarize",
    "summarize_probes",
]


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request. Times are seconds; ``t_*`` since replay start."""

    session: str
    turn: int
    t_scheduled: float = 0.0
    t_sent: float | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2el: float | None = None
    prompt_tokens_sent: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens_requested: int = 0
    output_tokens: int = 0
    oracle_tokens: int = 0
    self_reusable_tokens: int | None = None
    owner: str | None = None
    """The key the request was sent under (``None``: keyless)."""
    owner_reusable_tokens: int | None = None
    output_ids: list[int] | None = None
    retries: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        return {
            "session": self.session,
            "turn": self.turn,
            "t_scheduled": _r(self.t_scheduled),
            "t_sent": _r(self.t_sent),
            "ttft_ms": _ms(self.ttft),
            "itl_ms": [_ms(x) for x in self.itl],
            "e2el_ms": _ms(self.e2el),
            "prompt_tokens_sent": self.prompt_tokens_sent,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "oracle_tokens": self.oracle_tokens,
            "self_reusable_tokens": self.self_reusable_tokens,
            "owner": self.owner,
            "owner_reusable_tokens": self.owner_reusable_tokens,
            "output_tokens_requested": self.output_tokens_requested,
            "output_tokens": self.output_tokens,
            "retries": self.retries,
            "error": self.error,
        }


@dataclass(slots=True, kw_only=True)
class ProbeRecord:
    """One leak probe: a replayed prompt sent again by another owner after the replay.

    ``kind`` is ``"owner"`` (the same caller under a fresh session key) or ``"caller"``
    (a second API key, keyed as the replay was). ``allowed_tokens`` is what the probe's
    own owner had sent before it (its earlier probes' common prefix); anything cached
    beyond that came from another owner."""

    kind: str
    session: str
    prompt_tokens_sent: int
    allowed_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None

    @property
    def leaked(self) -> int:
        return max(0, (self.cached_tokens or 0) - self.allowed_tokens)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "session": self.session,
            "prompt_tokens_sent": self.prompt_tokens_sent,
            "allowed_tokens": self.allowed_tokens,
            "cached_tokens": self.cached_tokens,
            "leaked": self.leaked,
            "error": self.error,
        }


def summarize_probes(probes: Sequence[ProbeRecord]) -> dict[str, Any]:
    """Leaked tokens per probe kind (``None`` for a kind that was not probed), the
    probes sent and those that failed or reported no cache figure."""
    out: dict[str, Any] = {"leak_probes": len(probes)}
    for kind, key in (("owner", "cross_owner_probe_tokens"), ("caller", "cross_caller_tokens")):
        mine = [p for p in probes if p.kind == kind and p.error is None]
        out[key] = sum(p.leaked for p in mine) if mine else None
    out["leak_probes_unreported"] = sum(
        1 for p in probes if p.error is not None or p.cached_tokens is None
    )
    return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000.0, 3)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def jain_index(values: Sequence[float]) -> float | None:
    """Jain's fairness index ``(sum x)^2 / (n * sum x^2)``; ``None`` for no values."""
    if not values:
        return None
    square_sum = sum(x * x for x in values)
    if square_sum == 0:
        return 1.0
    return sum(values) ** 2 / (len(values) * square_sum)


def _stats(prefix: str, values_s: Sequence[float]) -> dict[str, float | None]:
    ms = [v * 1000.0 for v in values_s]
    if not ms:
        return {f"{k}_{prefix}_ms": None for k in ("mean", "median", "std", "p99")}
    mean = sum(ms) / len(ms)
    std = math.sqrt(sum((x - mean) ** 2 for x in ms) / len(ms))
    return {
        f"mean_{prefix}_ms": mean,
        f"median_{prefix}_ms": percentile(ms, 50),
        f"std_{prefix}_ms": std,
        f"p99_{prefix}_ms": percentile(ms, 99),
    }


class SessionTurn(NamedTuple):
    """What one request of a session put into an engine: for :func:`self_reusable_tokens`.

    ``t_sent`` and ``t_end`` (seconds, any common origin) say when; ``None`` when
    unknown (``t_end`` of a failed request: it may have run to any time).
    """

    session: str
    turn: int
    prompt: Sequence[int]
    output_ids: Sequence[int] | None
    output_count: int
    t_sent: float | None = None
    t_end: float | None = None


def _may_precede(q: SessionTurn, r: SessionTurn) -> bool:
    if q.t_sent is not None and r.t_sent is not None:
        return q.t_sent < (r.t_end if r.t_end is not None else math.inf)
    return q.turn < r.turn


def self_reusable_tokens(
    turns: Iterable[SessionTurn], *, group: Callable[[SessionTurn], str] | None = None
) -> dict[tuple[str, int], int]:
    """Longest prefix of each prompt that its own session had already produced.

    ``group`` widens "its own session" to the turns with the same ``group(turn)`` (an
    owner: the sessions that sent one key); the result stays keyed by session and turn.

    For a request ``r``, every other turn ``q`` of the same session that was sent
    before ``r`` ended (or, without times, has a lower turn index) may have left
    ``prompt(q) + output(q)`` in a slot: the reusable length is the longest common
    prefix of ``prompt(r)`` with one of those sequences. When the output ids are
    unknown (OpenAI streams do not carry them) and ``prompt(q)`` is a whole prefix of
    ``prompt(r)``, the next ``output_count`` tokens are assumed to match, so the bound
    never falls below the truth. The result is capped at ``len(prompt(r)) - 1`` (an
    engine evaluates at least one token).
    """
    by_group: dict[str, list[SessionTurn]] = defaultdict(list)
    for item in turns:
        by_group[item.session if group is None else group(item)].append(item)
    out: dict[tuple[str, int], int] = {}
    for items in by_group.values():
        for r in items:
            best = 0
            for q in items:
                if q is r or not _may_precede(q, r):
                    continue
                n = _lcp(r.prompt, q.prompt)
                if n == len(q.prompt):
                    rest = r.prompt[n:]
                    if q.output_ids is not None:
                        n += _lcp(rest, q.output_ids)
                    else:
                        n += min(q.output_count, len(rest))
                best = max(best, n)
            out[(r.session, r.turn)] = max(0, min(best, len(r.prompt) - 1))
    return out


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def summarize(records: Sequence[RequestRecord], *, duration: float) -> dict[str, Any]:
    """Every metric of one target's run. ``duration`` is the wall time of the replay."""
    done = [r for r in records if r.ok]
    failed = len(records) - len(done)
    input_tokens = sum(
        r.prompt_tokens if r.prompt_tokens is not None else r.prompt_tokens_sent for r in done
    )
    output_tokens = sum(r.output_tokens for r in done)
    per_second = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)

    ttfts = [r.ttft for r in done if r.ttft is not None]
    itls = [x for r in done for x in r.itl]
    e2els = [r.e2el for r in done if r.e2el is not None]
    tpots = [
        (r.e2el - r.ttft) / (r.output_tokens - 1)
        for r in done
        if r.e2el is not None and r.ttft is not None and r.output_tokens > 1
    ]

    reported = [r for r in done if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in reported)
    reported_prompt = sum(
        r.prompt_tokens if r.prompt_tokens is not None else r.prompt_tokens_sent for r in reported
    )
    sent = sum(r.prompt_tokens_sent for r in done)
    oracle = sum(r.oracle_tokens for r in done)
    hit = cached / reported_prompt if reported_prompt else None
    oracle_ratio = oracle / sent if sent else None
    efficiency = hit / oracle_ratio if hit is not None and oracle_ratio else None
    cross = sum(
        max(
            0,
            (r.cached_tokens or 0)
            - (r.self_reusable_tokens if r.self_reusable_tokens is not None else r.oracle_tokens),
        )
        for r in reported
    )
    cross_owner = sum(
        max(0, (r.cached_tokens or 0) - r.owner_reusable_tokens)
        for r in reported
        if r.owner_reusable_tokens is not None
    )

    per_session: dict[str, list[float]] = defaultdict(list)
    for r in done:
        if r.ttft is not None:
            per_session[r.session].append(r.ttft)
    fairness = jain_index([sum(v) / len(v) for v in per_session.values()])

    return {
        "completed": len(done),
        "failed": failed,
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_second(len(done)),
        "output_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(input_tokens + output_tokens),
        **_stats("ttft", ttfts),
        **_stats("tpot", tpots),
        **_stats("itl", itls),
        **_stats("e2el", e2els),
        "cached_tokens": cached,
        "oracle_tokens": oracle,
        "cache_hit_ratio": hit,
        "oracle_hit_ratio": oracle_ratio,
        "cache_efficiency": efficiency,
        "cross_session_reuse": cross,
        "cross_owner_reuse": cross_owner,
        "cache_unreported": len(done) - len(reported),
        "prompt_token_mismatch": sum(
            1
            for r in done
            if r.prompt_tokens is not None and r.prompt_tokens != r.prompt_tokens_sent
        ),
        "output_token_mismatch": sum(
            1 for r in done if r.output_tokens != r.output_tokens_requested
        ),
        "sessions": len({r.session for r in records}),
        "fairness": fairness,
        "retries": sum(r.retries for r in records),
    }


def cache_hit_by_turn(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """Cache and oracle hit ratios of completed requests grouped by turn index."""
    groups: dict[int, list[RequestRecord]] = defaultdict(list)
    for r in records:
        if r.ok:
            groups[r.turn].append(r)
    rows: list[dict[str, Any]] = []
    for turn in sorted(groups):
        rs = groups[turn]
        reported = [r for r in rs if r.cached_tokens is not None]
        prompt = sum(
            r.prompt_tokens if r.prompt_tokens is not None else r.prompt_tokens_sent
            for r in reported
        )
        sent = sum(r.prompt_tokens_sent for r in rs)
        rows.append(
            {
                "turn": turn,
                "requests": len(rs),
                "cache_hit_ratio": (
                    sum(r.cached_tokens or 0 for r in reported) / prompt if prompt else None
                ),
                "oracle_hit_ratio": sum(r.oracle_tokens for r in rs) / sent if sent else None,
            }
        )
    return rows


def ratios(
    base: Mapping[str, Any], other: Mapping[str, Any], keys: Iterable[str]
) -> dict[str, float | None]:
    """``other[k] / base[k]`` for each key where both are numbers and ``base[k]`` is not 0."""
    out: dict[str, float | None] = {}
    for k in keys:
        a, b = base.get(k), other.get(k)
        if isinstance(a, int | float) and isinstance(b, int | float) and a:
            out[k] = b / a
        else:
            out[k] = None
    return out


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


_HANDOFF_COUNTS = ("handoffs", "handoff_count", "handoffs_total", "count", "total")


def handoff_counters(status: Any) -> dict[str, Any] | None:
    """Handoffs and the upstream calls they made, read defensively from a host's
    ``/api/status``: the first mapping (depth first, in the status's order) with a count
    named like ``handoffs`` and/or a counter with ``handoff`` and ``call`` in its name
    (``handoff_calls``, ``handoff_upstream_calls``), or a ``handoff...`` mapping holding
    ``count``/``total`` and ``...calls``. ``None`` when the status has neither.
    ``calls_per_handoff`` is ``None`` unless both are there and handoffs is not 0."""
    found: list[tuple[str, int | None, int | None]] = []

    def visit(obj: Any, path: str) -> None:
        if isinstance(obj, list):
            for i, item in enumerate(obj):
                visit(item, f"{path}[{i}]")
            return
        if not isinstance(obj, dict):
            return
        handoffs: int | None = None
        calls: int | None = None
        for key, value in obj.items():
            name = str(key).lower()
            if "handoff" not in name:
                continue
            if isinstance(value, dict):
                inner = [_count(value.get(k)) for k in _HANDOFF_COUNTS]
                handoffs = next((n for n in inner if n is not None), handoffs)
                for k2, v2 in value.items():
                    if "call" in str(k2).lower() and _count(v2) is not None:
                        calls = v2
            elif _count(value) is not None:
                if "call" in name:
                    calls = value
                elif name in _HANDOFF_COUNTS:
                    handoffs = value
        if handoffs is not None or calls is not None:
            found.append((path, handoffs, calls))
        for key, value in obj.items():
            visit(value, f"{path}.{key}" if path else str(key))

    visit(status, "")
    if not found:
        return None
    path, handoffs, calls = next((f for f in found if f[1] is not None), found[0])
    per = calls / handoffs if handoffs and calls is not None else None
    return {"handoffs": handoffs, "upstream_calls": calls, "calls_per_handoff": per, "at": path}
