"""Replay a trace against one endpoint: Trio tasks, an httpx streaming client.

Two modes:

- ``open``: every request is sent at its trace time ``t * time_scale`` whatever
  happened to the others (arrival-rate load, as the trace was recorded);
- ``closed``: per session, the first turn goes at its trace time and each next turn
  ``think_time * time_scale`` after the previous response completed. A sub-agent
  session starts when its parent's turn ``spawn_after - 1`` completes (with the parent,
  for ``spawn_after == 0``), and the parent's turn ``spawn_after`` waits for it to end.

Requests due at the same trace instant (sessions that all start at 0) leave in the
trace's order, each :data:`TIE_GAP` after the one before it was written: Trio wakes
tasks due together in an order it reverses at random, so without this the targets of
one run saw the opening burst in opposite orders, and which requests queued behind
the long prefills differed between them (it moved a median TTFT by a third).

A :class:`trio.CapacityLimiter` bounds the requests in flight; ``t_sent`` is when a
request actually left (after the limiter), ``t_scheduled`` when the trace wanted it.
TTFT, inter-token latencies and end-to-end latency are measured from ``t_sent``.
httpx's read timeout is off: a long prefill is never cut; ``request_timeout`` is an
optional overall deadline per request. A request that fails before any byte of its
response (a dead keep-alive connection) is retried once; any other failure is recorded
in the request's ``error`` and the replay goes on.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, TextIO

import httpx
import trio

from gezel_trio._trio import unwrap
from gezel_trio.engine.sse import DONE, aiter_data

from .errors import BenchError
from .metrics import ProbeRecord, RequestRecord, SessionTurn, self_reusable_tokens
from .synth import DEFAULT_VOCAB_LO, Api, PromptSynthesizer, endpoint_path, request_body
from .synth import request_headers as _headers
from .traces import Session, Trace, Turn, common_prefix_len, oracle_tokens

__all__ = [
    "ModelInfo",
    "Progress",
    "ReplayConfig",
    "ReplayResult",
    "StreamParser",
    "probe_model",
    "run_replay",
    "session_keys",
    "warm_up",
]

Mode = Literal["closed", "open"]
KeyBy = Literal["session", "root"]
Key = tuple[str, int]

TIE_GAP = 0.002
"""Seconds between two requests due at the same trace instant, counted from when the
first was written (see the module)."""

_WRITTEN = frozenset({"http11.send_request_body.complete", "http2.send_request_body.complete"})
"""httpcore's trace events for a request written out."""


def tie_order(trace: Trace, mode: Mode) -> dict[Key, Key]:
    """For each request due at the same trace instant as an earlier one (closed: the
    first turns of root sessions that start together; open: turns of one time), the
    request it follows, in the trace's order."""
    if mode == "open":
        due = [(turn.t, turn.key) for turn in trace.requests()]
    else:
        due = [(s.start, s.turns[0].key) for s in trace.sessions if s.parent is None and s.turns]
    after: dict[Key, Key] = {}
    last: dict[float, Key] = {}
    for t, key in due:
        if t in last:
            after[key] = last[t]
        last[t] = key
    return after


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayConfig:
    """How to replay. ``vocab_hi=None`` asks the endpoint (``/v1/models`` ``n_vocab``);
    ``time_scale=None`` takes the trace's; ``concurrency=None`` is unbounded."""

    base_url: str
    api: Api = "llama"
    model: str | None = None
    mode: Mode = "closed"
    concurrency: int | None = None
    seed: int = 0
    vocab_lo: int = DEFAULT_VOCAB_LO
    vocab_hi: int | None = None
    time_scale: float | None = None
    connect_timeout: float = 30.0
    request_timeout: float | None = None
    warmup: bool = True
    label: str = ""
    extra_body: Mapping[str, Any] | None = None
    models: tuple[str, ...] = ()
    """When set, turn ``i`` of every session goes to ``models[i % len(models)]``."""
    keyless: bool = False
    """Send no session key (no ``prompt_cache_key``, no ``X-Session-Id``), as most
    clients do: the host's ``[scheduler] keyless`` policy decides what they share."""
    key_by: KeyBy = "session"
    """``"root"``: a sub-agent sends its root session's key, as Claude Code's sub-agents
    send their parent's session id (one owner, several conversations)."""
    api_key: str | None = None
    """Sent as ``Authorization: Bearer`` with every request (the caller)."""
    leak_probe: bool = False
    """After the replay, send each session's last prompt again as another owner (a fresh
    session key of the same caller; with ``probe_key``, also as a second caller) and
    record what it got from the cache (:class:`~.metrics.ProbeRecord`)."""
    probe_key: str | None = None
    """The second caller's API key for the cross-caller probes (none: not probed)."""
    probe_tokens: int = 256
    """A probe sends the first this many tokens of its session's last prompt: enough to
    match what a leak would give it, cheap to prefill when nothing does."""

    def __post_init__(self) -> None:
        if self.mode not in ("closed", "open"):
            raise BenchError(f"mode must be 'closed' or 'open', not {self.mode!r}")
        if self.api not in ("llama", "openai"):
            raise BenchError(f"api must be 'llama' or 'openai', not {self.api!r}")
        if self.concurrency is not None and self.concurrency < 1:
            raise BenchError("concurrency must be >= 1")
        if self.time_scale is not None and not self.time_scale > 0:
            raise BenchError("time_scale must be > 0")
        if self.key_by not in ("session", "root"):
            raise BenchError(f"key_by must be 'session' or 'root', not {self.key_by!r}")

    def describe(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url,
            "api": self.api,
            "model": self.model,
            "mode": self.mode,
            "concurrency": self.concurrency,
            "seed": self.seed,
            "vocab_lo": self.vocab_lo,
            "vocab_hi": self.vocab_hi,
            "time_scale": self.time_scale,
            "request_timeout": self.request_timeout,
            "models": list(self.models),
            "keyless": self.keyless,
            "key_by": self.key_by,
            "leak_probe": self.leak_probe,
            "second_caller": self.probe_key is not None,
            "probe_tokens": self.probe_tokens,
        }


@dataclass(slots=True)
class ReplayResult:
    """One target's run: every request's record, the wall duration, and context."""

    label: str
    config: dict[str, Any]
    records: list[RequestRecord]
    duration: float
    started_at: float
    synthesis: dict[str, Any] = field(default_factory=dict)
    model_info: dict[str, Any] = field(default_factory=dict)
    probes: list[ProbeRecord] = field(default_factory=list)

    def statistics(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "requests": len(self.records),
            "failed": sum(1 for r in self.records if not r.ok),
            "duration": self.duration,
        }

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<ReplayResult {self.label!r} requests={s['requests']} failed={s['failed']} "
            f"duration={self.duration:.2f}s>"
        )


# ----------------------------------------------------------------------- stream parser


class StreamParser:
    """Turns the data lines of one SSE response into a :class:`RequestRecord`'s fields.

    Pure: :meth:`feed` takes one decoded JSON object and the monotonic time it arrived.
    llama.cpp ``/completion`` chunks carry ``tokens`` (ids) and ``content``; the final
    one has ``stop: true``, ``tokens_evaluated``, ``tokens_predicted`` and ``timings``.
    OpenAI chunks carry ``choices[0].text``; the last has ``usage`` (and, from
    llama-server, ``timings``). A chunk with an ``error`` ends the request as failed.
    """

    def __init__(self, api: Api) -> None:
        self.api = api
        self.token_times: list[float] = []
        self.output_ids: list[int] = []
        self.ids_complete = api == "llama"
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.output_count: int | None = None
        self.error: str | None = None
        self.finished = False

    def feed(self, obj: Any, now: float) -> None:
        if not isinstance(obj, dict):
            return
        if "error" in obj:
            err = obj["error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            self.error = f"stream error: {msg}"
            return
        timings = obj.get("timings")
        if isinstance(timings, dict) and isinstance(timings.get("cache_n"), int):
            self.cached_tokens = timings["cache_n"]
        if self.api == "llama":
            self._feed_llama(obj, now)
        else:
            self._feed_openai(obj, now)

    def _feed_llama(self, obj: dict[str, Any], now: float) -> None:
        tokens = obj.get("tokens")
        ids = [t for t in tokens if isinstance(t, int)] if isinstance(tokens, list) else []
        if ids or obj.get("content"):
            self.token_times.append(now)
            if ids:
                self.output_ids.extend(ids)
            else:
                self.ids_complete = False
        if isinstance(obj.get("tokens_evaluated"), int):
            self.prompt_tokens = obj["tokens_evaluated"]
        if obj.get("stop") is True:
            self.finished = True
            if isinstance(obj.get("tokens_predicted"), int):
                self.output_count = obj["tokens_predicted"]

    def _feed_openai(self, obj: dict[str, Any], now: float) -> None:
        choices = obj.get("choices")
        if isinstance(choices, list) and choices:
            choice = choices[0] if isinstance(choices[0], dict) else {}
            if choice.get("text") or choice.get("finish_reason") is None:
                self.token_times.append(now)
            if choice.get("finish_reason") is not None:
                self.finished = True
        usage = obj.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("prompt_tokens"), int):
                self.prompt_tokens = usage["prompt_tokens"]
            if isinstance(usage.get("completion_tokens"), int):
                self.output_count = usage["completion_tokens"]
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                self.cached_tokens = details["cached_tokens"]
            self.finished = True

    @property
    def output_tokens(self) -> int:
        if self.output_count is not None:
            return self.output_count
        return len(self.output_ids) if self.ids_complete else len(self.token_times)


# ---------------------------------------------------------------------------- progress


class Progress:
    """A one-line progress report on a text stream (no dependency).

    On a terminal the line is rewritten in place at most every ``interval`` seconds;
    elsewhere a line is printed at each tenth of the way. ``stream=None`` is silent.

    Why not tqdm or rich: the line carries replay state (in flight, failed, the
    target's name) that changes without the count moving, it must be silent when the
    report goes to a pipe, and the bench's output is parsed by the tests; a progress
    library would add a dependency to every install for one status line.
    """

    def __init__(
        self,
        *,
        total: int,
        label: str = "",
        stream: TextIO | None = None,
        interval: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.label = label
        self.stream = stream
        self.interval = interval
        self._clock = clock
        self._start = clock()
        self._last = -math.inf
        self._last_decile = 0
        self._tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self.done = self.failed = self.in_flight = 0
        self.lines_written = 0

    def line(self) -> str:
        elapsed = self._clock() - self._start
        pct = 100.0 * self.done / self.total if self.total else 100.0
        tag = f"[{self.label}] " if self.label else ""
        return (
            f"{tag}{self.done}/{self.total} requests ({pct:.0f}%), {self.failed} failed, "
            f"{self.in_flight} in flight, {elapsed:.1f}s"
        )

    def update(self, *, force: bool = False) -> None:
        if self.stream is None:
            return
        now = self._clock()
        if self._tty:
            if force or now - self._last >= self.interval:
                self.stream.write("\r" + self.line() + "\x1b[K")
                self.stream.flush()
                self._last = now
                self.lines_written += 1
            return
        decile = (10 * self.done) // self.total if self.total else 10
        if force or decile > self._last_decile:
            self._last_decile = decile
            self.stream.write(self.line() + "\n")
            self.stream.flush()
            self.lines_written += 1

    def close(self) -> None:
        if self.stream is None:
            return
        if self._tty:
            self.update(force=True)
            self.stream.write("\n")
            self.stream.flush()
        elif self._last_decile < 10:
            self.update(force=True)


# ------------------------------------------------------------------------------ probes


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What ``GET /v1/models`` says of the model: vocabulary and per-slot context."""

    model: str | None
    n_vocab: int | None
    n_ctx: int | None

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "n_vocab": self.n_vocab, "n_ctx": self.n_ctx}


async def probe_model(client: httpx.AsyncClient, *, model: str | None = None) -> ModelInfo:
    """Read ``/v1/models``; unknown fields are ``None``. Cancellation propagates.

    A failed read (a kept-alive connection the server had closed, an answer that
    is not JSON) is tried up to three times, 0.1 s apart."""
    data: Any = {}
    for attempt in range(3):
        try:
            resp = await client.get("/v1/models")
            if resp.status_code == 200:
                data = resp.json()
                break
        except (httpx.HTTPError, ValueError):
            pass
        if attempt < 2:
            await trio.sleep(0.1)
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        entries = []
    chosen: dict[str, Any] | None = None
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        names = {entry.get("id"), *(entry.get("aliases") or [])}
        if model is None or model in names:
            chosen = entry
            break
    if chosen is None:
        return ModelInfo(model, None, None)
    meta = chosen.get("meta") if isinstance(chosen.get("meta"), dict) else {}
    assert isinstance(meta, dict)
    n_vocab = meta.get("n_vocab")
    n_ctx = meta.get("n_ctx")
    return ModelInfo(
        str(chosen.get("id")) if chosen.get("id") is not None else model,
        n_vocab if isinstance(n_vocab, int) else None,
        n_ctx if isinstance(n_ctx, int) else None,
    )


async def warm_up(
    client: httpx.AsyncClient, config: ReplayConfig, *, ready_s: float = 120.0
) -> None:
    """One tiny completion, so the model is loaded before the clock starts.

    Its prompt uses ids below ``vocab_lo``, which no trace prompt contains, so it can
    share no prefix with the replay. A 503 (still loading) or a refused connection is
    retried for ``ready_s`` seconds; anything else that is not a 200 raises
    :class:`BenchError`.
    """
    token = max(1, min(100, config.vocab_lo - 1))
    body = request_body(
        api=config.api,
        prompt=[token, token],
        output_tokens=1,
        session="gezel-bench-warmup",
        model=config.model,
        seed=config.seed,
    )
    last = ""
    with trio.move_on_after(ready_s):
        while True:
            try:
                async with client.stream(
                    "POST",
                    endpoint_path(config.api),
                    json=body,
                    headers=_headers("gezel-bench-warmup"),
                ) as resp:
                    text = (await resp.aread()).decode("utf-8", "replace")
            except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            except httpx.HTTPError as exc:
                raise BenchError(f"warm-up request failed: {type(exc).__name__}: {exc}") from None
            else:
                if resp.status_code == 200:
                    return
                last = f"HTTP {resp.status_code}: {text[:300]}"
                if resp.status_code != 503:
                    raise BenchError(f"warm-up request failed: {last}")
            await trio.sleep(0.5)
    raise BenchError(f"warm-up request failed for {ready_s:.0f}s: {last}")


# ------------------------------------------------------------------------------ replay


def session_keys(trace: Trace, key_by: KeyBy = "session") -> dict[str, str]:
    """The session key each session's requests carry: its own id, or with
    ``key_by="root"`` the id of its root session (a sub-agent's parent's parent ...)."""
    parent = {s.id: s.parent for s in trace.sessions}
    out: dict[str, str] = {}
    for s in trace.sessions:
        key = s.id
        while key_by == "root" and (up := parent.get(key)) is not None:
            key = up
        out[s.id] = key
    return out


def _request_seed(seed: int, turn: Turn) -> int:
    h = hashlib.blake2b(f"{seed}\x00{turn.session}\x00{turn.index}".encode(), digest_size=4)
    return int.from_bytes(h.digest(), "little") & 0x7FFFFFFF


@asynccontextmanager
async def _open_client(
    config: ReplayConfig, client: httpx.AsyncClient | None
) -> AsyncIterator[httpx.AsyncClient]:
    if client is not None:
        yield client
        return
    timeout = httpx.Timeout(connect=config.connect_timeout, read=None, write=60.0, pool=None)
    conns = max(config.concurrency or 64, 4) + 4
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    async with httpx.AsyncClient(
        base_url=config.base_url, timeout=timeout, limits=limits, headers=headers
    ) as c:
        yield c


def _failed_together(leaves: list[BaseException]) -> BaseException:
    """What a replay whose requests failed with several errors at once raises."""
    return BenchError(f"replay failed: {'; '.join(repr(e) for e in leaves[:5])}")


class _Replay:
    def __init__(
        self,
        trace: Trace,
        config: ReplayConfig,
        client: httpx.AsyncClient,
        synth: PromptSynthesizer,
        progress: Progress,
    ) -> None:
        self.trace = trace
        self.config = config
        self.client = client
        self.synth = synth
        self.progress = progress
        self.time_scale = config.time_scale or trace.time_scale
        self.limiter = trio.CapacityLimiter(config.concurrency) if config.concurrency else None
        self.oracle = oracle_tokens(trace)
        self.keys = session_keys(trace, config.key_by)
        self.prompts: dict[tuple[str, int], list[int]] = {}
        self.records: dict[tuple[str, int], RequestRecord] = {}
        for turn in trace.requests():
            prompt = synth.prompt(turn)
            self.prompts[turn.key] = prompt
            self.records[turn.key] = RequestRecord(
                session=turn.session,
                turn=turn.index,
                prompt_tokens_sent=len(prompt),
                output_tokens_requested=turn.output_tokens,
                oracle_tokens=self.oracle[turn.key],
                owner=None if config.keyless else self.keys[turn.session],
            )
        self.after = tie_order(trace, config.mode)
        self.written = {k: trio.Event() for k in self.records}
        """Set once a request has been written out (or has ended unsent)."""
        self.t0 = 0.0
        self.last_end = 0.0
        self.turn_done: dict[tuple[str, int], trio.Event] = {k: trio.Event() for k in self.records}
        self.session_started = {s.id: trio.Event() for s in trace.sessions}
        self.session_done = {s.id: trio.Event() for s in trace.sessions}
        self.children: dict[tuple[str, int], list[str]] = defaultdict(list)
        for s in trace.sessions:
            if s.parent is not None:
                self.children[(s.parent, s.spawn_after or 0)].append(s.id)

    async def run(self) -> float:
        self.t0 = trio.current_time()
        self.last_end = self.t0
        try:
            async with trio.open_nursery() as nursery:
                if self.config.mode == "open":
                    for turn in self.trace.requests():
                        nursery.start_soon(self._open_request, turn)
                else:
                    for session in self.trace.sessions:
                        nursery.start_soon(self._closed_session, session)
        except BaseExceptionGroup as group:
            raise unwrap(group, several=_failed_together) from None
        return self.last_end - self.t0

    async def _open_request(self, turn: Turn) -> None:
        await trio.sleep_until(self.t0 + turn.t * self.time_scale)
        await self._send(turn)

    async def _closed_session(self, session: Session) -> None:
        try:
            if session.parent is None:
                await trio.sleep_until(self.t0 + session.start * self.time_scale)
            elif session.spawn_after:
                await self.turn_done[(session.parent, session.spawn_after - 1)].wait()
            else:
                await self.session_started[session.parent].wait()
            self.session_started[session.id].set()
            for i, turn in enumerate(session.turns):
                for child in self.children.get((session.id, i), ()):
                    await self.session_done[child].wait()
                if i > 0 or session.parent is not None:
                    await trio.sleep(turn.think_time * self.time_scale)
                await self._send(turn)
        finally:
            self.session_started[session.id].set()
            for turn in session.turns:
                self.turn_done[turn.key].set()
            self.session_done[session.id].set()

    async def _send(self, turn: Turn) -> None:
        record = self.records[turn.key]
        record.t_scheduled = trio.current_time() - self.t0
        before = self.after.get(turn.key)
        try:
            if before is not None:
                await self.written[before].wait()
                await trio.sleep(TIE_GAP)
            if self.limiter is None:
                await self._request(turn, record)
            else:
                async with self.limiter:
                    await self._request(turn, record)
        finally:
            self.written[turn.key].set()
            self.turn_done[turn.key].set()
            self.last_end = max(self.last_end, trio.current_time())
            self.progress.in_flight -= 1 if record.t_sent is not None else 0
            self.progress.done += 1
            self.progress.failed += 0 if record.ok else 1
            self.progress.update()

    async def _request(self, turn: Turn, record: RequestRecord) -> None:
        config = self.config
        body = request_body(
            api=config.api,
            prompt=self.prompts[turn.key],
            output_tokens=turn.output_tokens,
            session=self.keys[turn.session],
            model=config.models[turn.index % len(config.models)] if config.models else config.model,
            seed=_request_seed(config.seed, turn),
            extra=dict(config.extra_body) if config.extra_body else None,
        )
        if config.keyless:
            body.pop("prompt_cache_key", None)
        request = self.client.build_request(
            "POST",
            endpoint_path(config.api),
            json=body,
            headers={} if config.keyless else _headers(self.keys[turn.session]),
            extensions={"trace": self._on_written(turn.key)},
        )
        self.progress.in_flight += 1
        start = trio.current_time()
        record.t_sent = start - self.t0
        parser = StreamParser(config.api)
        try:
            with trio.fail_after(config.request_timeout or math.inf):
                resp = await self._send_with_retry(request, record)
                self.written[turn.key].set()  # a transport that does not trace its writes
                try:
                    if resp.status_code != 200:
                        text = (await resp.aread()).decode("utf-8", "replace")
                        record.error = f"HTTP {resp.status_code}: {text[:300]}"
                        return
                    async with aclosing(aiter_data(resp.aiter_bytes())) as payloads:
                        async for payload in payloads:
                            if payload == DONE:
                                break
                            try:
                                obj = json.loads(payload)
                            except ValueError:
                                text = payload.decode("utf-8", "replace")
                                record.error = f"bad stream chunk: {text[:120]!r}"
                                return
                            parser.feed(obj, trio.current_time())
                            if parser.error is not None:
                                break
                finally:
                    await resp.aclose()
        except trio.TooSlowError:
            record.error = f"timed out after {config.request_timeout}s"
        except httpx.HTTPError as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        finally:
            end = trio.current_time()
            self._fill(record, parser, start, end)

    def _on_written(self, key: Key) -> Callable[[str, Mapping[str, Any]], Awaitable[None]]:
        """httpcore's ``trace`` extension for request ``key``: sets ``written[key]``."""
        written = self.written[key]

        async def trace(name: str, info: Mapping[str, Any]) -> None:
            if name in _WRITTEN:
                written.set()

        return trace

    async def _send_with_retry(
        self, request: httpx.Request, record: RequestRecord
    ) -> httpx.Response:
        try:
            return await self.client.send(request, stream=True)
        except (httpx.RemoteProtocolError, httpx.ConnectError):
            # Nothing came back: a keep-alive connection the server had closed, or no
            # connection at all. Safe to send once more.
            record.retries += 1
            return await self.client.send(request, stream=True)

    @staticmethod
    def _fill(record: RequestRecord, parser: StreamParser, start: float, end: float) -> None:
        times = parser.token_times
        if times:
            record.ttft = times[0] - start
            record.itl = [b - a for a, b in itertools.pairwise(times)]
        record.prompt_tokens = parser.prompt_tokens
        record.cached_tokens = parser.cached_tokens
        record.output_tokens = parser.output_tokens
        record.output_ids = list(parser.output_ids) if parser.ids_complete else None
        if record.error is None and parser.error is not None:
            record.error = parser.error
        if record.error is None and not times:
            record.error = "no tokens streamed"
        if record.error is None:
            record.e2el = end - start

    def finish(self) -> list[RequestRecord]:
        entries = []
        for key, record in self.records.items():
            if record.ok:
                ids, count = record.output_ids, record.output_tokens
            else:  # it may have generated anything up to its length: assume the most
                ids, count = None, record.output_tokens_requested
            t_end = None
            if record.t_sent is not None and record.e2el is not None:
                t_end = record.t_sent + record.e2el
            entries.append(
                SessionTurn(key[0], key[1], self.prompts[key], ids, count, record.t_sent, t_end)
            )
        reusable = self_reusable_tokens(entries)
        owners = {k: r.owner or "" for k, r in self.records.items()}
        by_owner = self_reusable_tokens(entries, group=lambda e: owners[(e.session, e.turn)])
        out: list[RequestRecord] = []
        for turn in self.trace.requests():
            record = self.records[turn.key]
            record.self_reusable_tokens = reusable[turn.key]
            record.owner_reusable_tokens = by_owner[turn.key]
            out.append(record)
        return out

    async def probe_leaks(self) -> list[ProbeRecord]:
        """Each session's last prompt (its first ``probe_tokens``) sent again, one at a
        time, by another owner: under a fresh session key of the replay's caller
        (``owner``), and under the second caller's key, keyed as the replay was
        (``caller``). One output token each."""
        config = self.config
        kinds = ["owner"] + (["caller"] if config.probe_key else [])
        sent: dict[tuple[str, str | None], list[list[int]]] = defaultdict(list)
        probes: list[ProbeRecord] = []
        for session in self.trace.sessions:
            if not session.turns:
                continue
            prompt = self.prompts[session.turns[-1].key][: max(2, config.probe_tokens)]
            for kind in kinds:
                key: str | None
                if kind == "owner":
                    key, auth = f"gezel-bench-probe/{session.id}", config.api_key
                else:
                    key = None if config.keyless else self.keys[session.id]
                    auth = config.probe_key
                # what this probe's own owner sent before it may legitimately be cached
                earlier = sent[(kind, key)]
                allowed = max((common_prefix_len(prompt, p) for p in earlier), default=0)
                earlier.append(prompt)
                probe = ProbeRecord(
                    kind=kind,
                    session=session.id,
                    prompt_tokens_sent=len(prompt),
                    allowed_tokens=min(allowed, len(prompt) - 1),
                )
                await self._probe(probe, prompt, key, auth)
                probes.append(probe)
        return probes

    async def _probe(
        self, probe: ProbeRecord, prompt: list[int], key: str | None, auth: str | None
    ) -> None:
        config = self.config
        body = request_body(
            api=config.api,
            prompt=prompt,
            output_tokens=1,
            session=key or "",
            model=config.models[0] if config.models else config.model,
            seed=config.seed,
        )
        headers = _headers(key) if key is not None else {}
        if key is None:
            body.pop("prompt_cache_key", None)
        if auth is not None:
            headers["Authorization"] = f"Bearer {auth}"
        parser = StreamParser(config.api)
        try:
            with trio.fail_after(config.request_timeout or 300.0):
                async with self.client.stream(
                    "POST", endpoint_path(config.api), json=body, headers=headers
                ) as resp:
                    if resp.status_code != 200:
                        text = (await resp.aread()).decode("utf-8", "replace")
                        probe.error = f"HTTP {resp.status_code}: {text[:200]}"
                        return
                    async with aclosing(aiter_data(resp.aiter_bytes())) as payloads:
                        async for payload in payloads:
                            if not payload or payload == DONE:
                                continue
                            try:
                                parser.feed(json.loads(payload), trio.current_time())
                            except ValueError:
                                continue
        except (trio.TooSlowError, httpx.HTTPError) as exc:
            probe.error = f"{type(exc).__name__}: {exc}"
            return
        probe.cached_tokens = parser.cached_tokens
        probe.error = parser.error


async def run_replay(
    trace: Trace,
    config: ReplayConfig,
    *,
    client: httpx.AsyncClient | None = None,
    progress_stream: TextIO | None = sys.stderr,
    replayed: Callable[[], Awaitable[None]] | None = None,
) -> ReplayResult:
    """Replay ``trace`` against ``config.base_url`` and return every request's record.

    Warms the model up (one tiny request, so loading is not timed), probes it
    (vocabulary, context), checks every request fits a slot, then replays. Raises
    :class:`BenchError` before the replay if the trace cannot be synthesized or does
    not fit. ``replayed`` is awaited when the replay is done, before the leak probes
    (to read an endpoint's counters of the replay alone). On cancellation every in-flight
    request is abandoned (its connection closed) and nothing is returned.
    """
    if not trace.sessions:
        raise BenchError("the trace has no requests (check the scaling limits)")
    async with _open_client(config, client) as http:
        if config.warmup:
            await warm_up(http, config)
        info = await probe_model(http, model=config.model)
        vocab_hi = config.vocab_hi or info.n_vocab
        if vocab_hi is None:
            raise BenchError(
                f"{config.base_url} does not report its vocabulary size: pass --vocab-hi"
            )
        if info.n_vocab is not None and vocab_hi > info.n_vocab:
            raise BenchError(
                f"--vocab-hi {vocab_hi} is beyond the model's vocabulary ({info.n_vocab})"
            )
        longest = max(t.prompt_tokens + t.output_tokens for t in trace.requests())
        if info.n_ctx is not None and longest > info.n_ctx:
            raise BenchError(
                f"a request needs {longest} tokens but a slot holds {info.n_ctx}: "
                "lower --max-prompt-tokens / --max-output-tokens or raise the context"
            )
        synth = await trio.to_thread.run_sync(
            lambda: PromptSynthesizer.for_trace(
                trace, vocab_hi=vocab_hi, vocab_lo=config.vocab_lo, seed=config.seed
            )
        )
        progress = Progress(
            total=trace.n_requests, label=config.label or config.base_url, stream=progress_stream
        )
        replay = _Replay(trace, config, http, synth, progress)
        started_at = time.time()
        duration = await replay.run()
        progress.close()
        records = replay.finish()
        if replayed is not None:
            await replayed()
        probes = await replay.probe_leaks() if config.leak_probe else []
    described = config.describe()
    described["vocab_hi"] = vocab_hi
    described["time_scale"] = replay.time_scale
    return ReplayResult(
        label=config.label,
        config=described,
        records=records,
        duration=duration,
        started_at=started_at,
        synthesis=synth.statistics(),
        model_info=info.as_dict(),
        probes=probes,
    )
