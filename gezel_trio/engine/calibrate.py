"""Calibration: prove an engine co-batches sequences safely before it serves them.

The probe sends N identical token-id prompts to ``POST /completion`` at once (N = the
engine's parallel slots), greedy (``temperature 0``, ``top_k 1``), with a fixed seed and
``cache_prompt: false``, for a few prompt lengths. Identical co-batched greedy prompts
have no benign excuse to differ from each other, so a single difference fails the
engine. With ``compare_alone`` (the default) it runs in three phases:

1. every length is decoded alone on the untouched engine (the reference answers),
2. every length is co-batched N ways; a co-batched answer may differ from its
   reference only by a near-tie flip: at the first differing token the reference's
   top-2 log-probability margin must be at most ``near_tie_margin``,
3. every length is decoded alone again: a recurrent engine can stay corrupt after a
   co-batched decode (llama.cpp issue 29002), so a later one-at-a-time answer that
   differs from its reference beyond a near tie fails the engine too.

A failed probe has co-batched on the engine: its process may hold corrupt state, and
the host restarts it before it serves anything (see :mod:`gezel_trio.host.calibration`).

:func:`decide_ceiling` turns a result, live or remembered, into the engine's admission
ceiling. It is pure policy: no I/O, no event loop.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

import httpx
import trio

from .client import request_once

__all__ = [
    "NEAR_TIE_MARGIN",
    "PROBE_LENGTHS",
    "PROBE_N_PREDICT",
    "PROBE_SEED",
    "CalibrationResult",
    "LengthDetail",
    "decide_ceiling",
    "probe_cobatch",
    "probe_prompts",
    "probe_request",
]

#: Largest top-2 log-probability margin (nats) at which a flip against the prompt
#: decoded alone is put down to float noise rather than a corrupted state.
NEAR_TIE_MARGIN = 0.05

#: Prompt lengths (tokens) the probe tries, its tokens to generate, and its seed.
PROBE_LENGTHS: tuple[int, ...] = (16, 64, 160)
PROBE_N_PREDICT = 24
PROBE_SEED = 1234

_PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog while five wizards box quickly; "
    "0123456789, a model answers a question about the cache, the slot and the server."
)

Verdict = Literal["passed", "failed"]


@dataclass(frozen=True, slots=True)
class LengthDetail:
    """What one prompt length showed."""

    prompt_tokens: int
    #: Co-batched requests that returned an answer.
    answers: int
    #: Distinct answers among them (1 is the only good value).
    distinct_answers: int
    #: Co-batched answers that differ from the prompt decoded alone beyond a near tie;
    #: ``None`` when the alone comparison was not made.
    alone_mismatches: int | None
    #: Differences from the alone answer tolerated as near-tie flips.
    near_tie_flips: int
    #: Smallest alone top-2 margin (nats) at a first differing token, if any differed.
    min_flip_margin: float | None
    #: Set when this length could not be completed (engine error, crash, timeout).
    error: str | None = None
    #: 1 when this length, decoded alone again after every co-batched round, differs
    #: from its first alone answer beyond a near tie (the engine stayed corrupt), else 0;
    #: ``None`` when that comparison was not made.
    later_mismatches: int | None = None


@dataclass(frozen=True, slots=True)
class CalibrationResult:
    """The outcome of one :func:`probe_cobatch` run, for status, logs and ``/metrics``."""

    verdict: Verdict
    crashed: bool
    parallel: int
    #: Co-batched prompts sent (N per length tried).
    prompts_tried: int
    #: Most distinct answers seen for one length.
    distinct_answers: int
    details: tuple[LengthDetail, ...]
    #: Wall-clock start (``time.time()``).
    started_at: float
    duration_s: float
    reason: str

    @property
    def passed(self) -> bool:
        return self.verdict == "passed" and not self.crashed

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values for status and logs."""
        out = asdict(self)
        out["details"] = [asdict(d) for d in self.details]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CalibrationResult:
        """Read back :meth:`to_dict`'s output (a remembered verdict); extra keys are ignored.

        Raises :class:`ValueError` when the verdict, the crash flag or the slot count
        is missing or malformed (the caller then calibrates again).
        """
        verdict = data.get("verdict")
        crashed = data.get("crashed")
        parallel = data.get("parallel")
        if verdict not in ("passed", "failed") or not isinstance(crashed, bool):
            raise ValueError(f"not a calibration verdict: {dict(data)!r:.200}")
        if not isinstance(parallel, int) or isinstance(parallel, bool) or parallel < 1:
            raise ValueError(f"a calibration verdict with a bad slot count: {parallel!r}")
        names = {f.name for f in fields(LengthDetail)}
        details: list[LengthDetail] = []
        for raw in data.get("details") or ():
            try:
                details.append(LengthDetail(**{k: v for k, v in raw.items() if k in names}))
            except (TypeError, AttributeError):
                continue  # a detail is for reading only; the verdict stands without it

        def number(key: str) -> float:
            value = data.get(key)
            return float(value) if isinstance(value, int | float) else 0.0

        return cls(
            verdict=verdict,
            crashed=crashed,
            parallel=parallel,
            prompts_tried=int(number("prompts_tried")),
            distinct_answers=int(number("distinct_answers")),
            details=tuple(details),
            started_at=number("started_at"),
            duration_s=number("duration_s"),
            reason=str(data.get("reason") or ""),
        )


class _EngineError(Exception):
    """The engine answered, but not with a usable completion."""


@dataclass(frozen=True, slots=True)
class _Answer:
    tokens: tuple[int, ...]
    content: str
    #: Top-2 log-probability margin at each generated position (None if not reported).
    margins: tuple[float | None, ...]

    @property
    def key(self) -> tuple[int, ...] | str:
        return self.tokens if self.tokens else self.content


def _margins(body: dict[str, Any]) -> tuple[float | None, ...]:
    out: list[float | None] = []
    for step in body.get("completion_probabilities") or ():
        top: list[dict[str, Any]] = step.get("top_logprobs") or step.get("probs") or []
        try:
            first, second = top[0], top[1]
            if "logprob" in first:
                out.append(float(first["logprob"]) - float(second["logprob"]))
            else:  # older servers report probabilities
                out.append(math.log(float(first["prob"])) - math.log(float(second["prob"])))
        except (IndexError, KeyError, TypeError, ValueError):
            out.append(None)
    return tuple(out)


def probe_request(
    prompt: list[int], *, n_predict: int = PROBE_N_PREDICT, seed: int = PROBE_SEED
) -> dict[str, Any]:
    """The ``POST /completion`` body the probe sends for ``prompt``: greedy, seeded,
    no prompt cache, a fixed length, token ids and top-2 probabilities returned."""
    return {
        "prompt": prompt,
        "n_predict": n_predict,
        "temperature": 0.0,
        "top_k": 1,
        "seed": seed,
        "cache_prompt": False,
        "ignore_eos": True,
        "n_probs": 2,
        "return_tokens": True,
        "stream": False,
    }


async def _complete(
    client: httpx.AsyncClient, url: str, prompt: list[int], *, n_predict: int, seed: int
) -> _Answer:
    r = await request_once(
        client, "POST", url, json=probe_request(prompt, n_predict=n_predict, seed=seed)
    )
    if r.status_code != 200:
        raise _EngineError(f"/completion answered {r.status_code}: {r.text[:200]}")
    try:
        body = r.json()
        tokens = tuple(int(t) for t in body.get("tokens") or ())
        return _Answer(tokens=tokens, content=str(body.get("content", "")), margins=_margins(body))
    except (ValueError, TypeError, AttributeError) as exc:
        raise _EngineError(f"/completion answered an unreadable body: {exc}") from None


async def _prompt_pool(client: httpx.AsyncClient, base: str) -> list[int]:
    """Token ids the model surely has: the probe text tokenized by the engine itself."""
    r = await request_once(
        client, "POST", base + "/tokenize", json={"content": _PROBE_TEXT, "add_special": False}
    )
    if r.status_code != 200:
        raise _EngineError(f"/tokenize answered {r.status_code}")
    ids = sorted({int(t) for t in r.json().get("tokens", ())})
    if not ids:
        raise _EngineError("/tokenize returned no tokens")
    return ids


def _make_prompt(pool: Sequence[int], length: int, seed: int) -> list[int]:
    rng = random.Random(seed * 1_000_003 + length)
    return [rng.choice(pool) for _ in range(length)]


async def probe_prompts(
    client: httpx.AsyncClient,
    base_url: str,
    *,
    prompt_lengths: Sequence[int] = PROBE_LENGTHS,
    seed: int = PROBE_SEED,
) -> list[list[int]]:
    """The token-id prompts :func:`probe_cobatch` sends to the engine at ``base_url``,
    one per length (for measuring an engine's behaviour independently of the probe).

    Raises :class:`httpx.HTTPError` or :class:`RuntimeError` when the engine cannot
    tokenize the probe text.
    """
    try:
        pool = await _prompt_pool(client, base_url.rstrip("/"))
    except _EngineError as exc:
        raise RuntimeError(str(exc)) from None
    return [_make_prompt(pool, length, seed) for length in prompt_lengths]


def _first_difference(a: _Answer, b: _Answer) -> int:
    if a.tokens and b.tokens:
        for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)):
            if x != y:
                return i
        return min(len(a.tokens), len(b.tokens))
    return -1  # no token ids to compare: no position to read a margin at


async def _cobatched(
    client: httpx.AsyncClient, url: str, prompt: list[int], n: int, *, n_predict: int, seed: int
) -> list[_Answer | BaseException]:
    """N identical requests, all in flight before any is sent (a barrier), then gathered."""
    go = trio.Event()
    outcomes: list[_Answer | BaseException] = [_EngineError("not sent")] * n

    async def one(i: int, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await go.wait()
        try:
            outcomes[i] = await _complete(client, url, prompt, n_predict=n_predict, seed=seed)
        except (httpx.HTTPError, _EngineError) as exc:
            outcomes[i] = exc

    async with trio.open_nursery() as nursery:
        for i in range(n):
            await nursery.start(one, i)
        go.set()
    return outcomes


def _describe_failure(exc: BaseException) -> tuple[str, bool]:
    """(message, crashed) for a request that got no answer."""
    if isinstance(exc, httpx.TimeoutException):
        return f"request timed out ({type(exc).__name__})", False
    if isinstance(exc, httpx.TransportError):
        return f"engine connection failed ({type(exc).__name__}: {exc})", True
    return str(exc), False


def _compare(
    reference: _Answer, answers: Sequence[_Answer], near_tie_margin: float
) -> tuple[int, int, float | None]:
    """(mismatches, near-tie flips, smallest margin at a first difference) of ``answers``
    against ``reference``."""
    mismatches = flips = 0
    min_margin: float | None = None
    for a in answers:
        if a.key == reference.key:
            continue
        i = _first_difference(reference, a)
        margin = reference.margins[i] if 0 <= i < len(reference.margins) else None
        if margin is not None:
            min_margin = margin if min_margin is None else min(min_margin, margin)
        if margin is not None and margin <= near_tie_margin:
            flips += 1
        else:
            mismatches += 1
    return mismatches, flips, min_margin


async def probe_cobatch(
    client: httpx.AsyncClient,
    base_url: str,
    *,
    parallel: int,
    prompt_lengths: Sequence[int] = PROBE_LENGTHS,
    n_predict: int = PROBE_N_PREDICT,
    seed: int = PROBE_SEED,
    compare_alone: bool = True,
    near_tie_margin: float = NEAR_TIE_MARGIN,
    engine_alive: Callable[[], bool] | None = None,
) -> CalibrationResult:
    """Probe whether the engine at ``base_url`` co-batches ``parallel`` sequences safely.

    Never raises for engine misbehaviour: a refused or reset connection gives a failed
    result with ``crashed=True`` (as does ``engine_alive()`` returning False at the end),
    an HTTP error or a timeout a failed one. The probe itself has no deadline beyond
    ``client``'s timeouts: bound it with ``trio.fail_after``. On cancellation the
    in-flight requests are closed, so llama-server stops generating them; the engine
    may by then have co-batched, so treat its process as suspect.
    """
    if parallel < 1:
        raise ValueError("parallel must be at least 1")
    started_at = time.time()
    t0 = trio.current_time()
    base = base_url.rstrip("/")
    url = base + "/completion"
    details: list[LengthDetail] = []
    prompts_tried = 0
    crashed = False
    problems: list[str] = []

    def finish() -> CalibrationResult:
        nonlocal crashed
        if engine_alive is not None and not engine_alive():
            crashed = True
            problems.append("the engine process exited during the probe")
        distinct = max((d.distinct_answers for d in details), default=0)
        if crashed or problems:
            verdict: Verdict = "failed"
            reason = "; ".join(problems) if problems else "the engine crashed during the probe"
        else:
            verdict = "passed"
            reason = (
                f"{len(details)} prompt lengths x {parallel} co-batched greedy prompts: "
                "every answer identical"
                + (", equal to the prompt decoded alone before and after" if compare_alone else "")
            )
        return CalibrationResult(
            verdict=verdict,
            crashed=crashed,
            parallel=parallel,
            prompts_tried=prompts_tried,
            distinct_answers=distinct,
            details=tuple(details),
            started_at=started_at,
            duration_s=trio.current_time() - t0,
            reason=reason,
        )

    try:
        pool = await _prompt_pool(client, base)
    except (httpx.HTTPError, _EngineError, ValueError) as exc:
        message, crashed = _describe_failure(exc)
        problems.append(f"could not build probe prompts: {message}")
        return finish()
    prompts = [(length, _make_prompt(pool, length, seed)) for length in prompt_lengths]

    # 1. The reference answers, each decoded alone on the untouched engine.
    alone: dict[int, _Answer] = {}
    if compare_alone:
        for length, prompt in prompts:
            try:
                alone[length] = await _complete(client, url, prompt, n_predict=n_predict, seed=seed)
            except (httpx.HTTPError, _EngineError) as exc:
                message, crashed = _describe_failure(exc)
                problems.append(f"{length}-token prompt decoded alone: {message}")
                details.append(LengthDetail(length, 0, 0, None, 0, None, message))
                return finish()

    # 2. Each length co-batched N ways.
    for length, prompt in prompts:
        outcomes = await _cobatched(client, url, prompt, parallel, n_predict=n_predict, seed=seed)
        prompts_tried += parallel
        answers = [o for o in outcomes if isinstance(o, _Answer)]
        failures = [o for o in outcomes if not isinstance(o, _Answer)]
        distinct = len({a.key for a in answers})

        mismatches: int | None = None
        flips = 0
        min_margin: float | None = None
        reference = alone.get(length)
        if reference is not None:
            mismatches, flips, min_margin = _compare(reference, answers, near_tie_margin)

        error: str | None = None
        if failures:
            described = [_describe_failure(f) for f in failures]
            crashed = crashed or any(c for _, c in described)
            error = f"{len(failures)} of {parallel} co-batched requests failed: {described[0][0]}"
            problems.append(f"{length}-token prompt: {error}")
        details.append(
            LengthDetail(length, len(answers), distinct, mismatches, flips, min_margin, error)
        )
        if distinct > 1:
            problems.append(
                f"{length}-token prompt: {distinct} distinct answers among "
                f"{len(answers)} identical co-batched greedy prompts"
            )
        if mismatches:
            problems.append(
                f"{length}-token prompt: {mismatches} of {len(answers)} co-batched answers "
                f"differ from the prompt decoded alone beyond a near tie"
            )
        if crashed:
            return finish()

    # 3. Each length decoded alone again: did co-batching leave the engine corrupt?
    if compare_alone:
        stayed = 0
        for i, (length, prompt) in enumerate(prompts):
            try:
                later = await _complete(client, url, prompt, n_predict=n_predict, seed=seed)
            except (httpx.HTTPError, _EngineError) as exc:
                message, crashed = _describe_failure(exc)
                problems.append(f"{length}-token prompt decoded alone again: {message}")
                details[i] = replace(details[i], error=details[i].error or message)
                return finish()
            wrong, flips, margin = _compare(alone[length], [later], near_tie_margin)
            d = details[i]
            if margin is not None:
                low = margin if d.min_flip_margin is None else min(margin, d.min_flip_margin)
                d = replace(d, min_flip_margin=low)
            details[i] = replace(d, later_mismatches=wrong, near_tie_flips=d.near_tie_flips + flips)
            stayed += wrong
        if stayed:
            problems.append(
                f"the engine stayed corrupt: {stayed} of {len(prompts)} prompts decoded alone "
                "after the co-batched rounds differ from their answers before them"
            )
    return finish()


def decide_ceiling(
    result: CalibrationResult | None,
    *,
    configured_parallel: int,
    recurrent: bool,
    override: bool,
) -> int:
    """The number of sequences the engine may decode at once: the one rule, for a live
    verdict and for a remembered one (read back with :meth:`CalibrationResult.from_dict`).

    - ``override`` (operator's choice in config): the configured parallelism; the caller
      logs a warning at every start.
    - Not calibrated (``result is None``): 1 for a recurrent/hybrid architecture, else
      the configured parallelism.
    - Passed: the configured parallelism, or for a recurrent model calibrated with fewer
      slots than now configured, the slot count that was proven.
    - Failed or crashed: 1.
    """
    if configured_parallel < 1:
        raise ValueError("configured_parallel must be at least 1")
    if override:
        return configured_parallel
    if result is None:
        return 1 if recurrent else configured_parallel
    if not result.passed:
        return 1
    if recurrent:
        return max(1, min(result.parallel, configured_parallel))
    return configured_parallel
