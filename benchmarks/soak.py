"""Soak: a real host under a realistic, hostile mix for N minutes; every answer checked.

    python -m benchmarks.soak [--minutes 30] [--quick] [--concurrency 6] [--parallel 2]
                              [--fault-every 30] [--max-tokens 16] [--walkaway 0.12]
                              [--engine-binary PATH] [--out benchmarks/results/soak.json]

Runs ``gezel-trio serve`` as its own process, in swap mode (``[gpu] policy = "swap"``)
with two generated demo models, ``tiny`` and ``small``, 2 slots each, two API keys and an
admin key, and a short ``idle_ttl`` on ``tiny``. Beside it the soak starts one plain
llama-server per model (the same binary the host reports in ``/api/status``, the same
model, the same slots and context): the *reference* engines, which nothing else touches.

The load, for the whole time (loopback only):

- agentic sessions: conversations whose prompt grows turn by turn (the host's own answers
  go back into the history) under ``prompt_cache_key``, on two API keys. Both keys use the
  same chat names (``agent-1``, ``agent-2``, ...), so the host must keep two callers' chats
  with one name apart;
- keyless chats: one-off chat and text completions without a ``prompt_cache_key``;
- streaming and non-streaming requests, at random;
- clients that walk away: a stream closed after a few tokens, a non-streaming request
  given up after a random fraction of a second;
- models alternate (sessions and chats are spread over both), so the host swaps engines;
- engine faults on a period, the kinds in turn: ``kill`` (SIGKILL; tried again on a
  ready engine, up to ``KILL_TRIES``, when it landed on one the host had just signalled
  to stop for a swap: no crash for the host to see), ``stop`` (SIGSTOP,
  SIGCONT 1.5 s later: a stall the host must ride out) and ``hang`` (SIGSTOP until the
  host notices and replaces the engine; SIGCONT after, if it still exists). Targets are
  the engine pids in ``/api/status`` under ``engines[].pid``, and only pids whose command
  line names this soak's state dir;
- quiet points between load segments: every client pauses, the soak checks that the
  scheduler holds nothing (no queued or running job, no busy engine), sends one request to
  ``tiny`` and waits for its idle release, then samples the host's RSS and descriptors.

Every request is greedy (temperature 0, a fixed ``max_tokens``, ``ignore_eos``) and
carries a unique marker (``[r000123]``) in its prompt: the soak's request id. Each
completed answer that was not walked away from is replayed on the reference engine of its
model (the same body, without ``stream`` and ``prompt_cache_key``) and its generated text
compared. A llama-server's greedy answer depends a little on what shares its batch
(measured with the bundled build: the ``small`` model changed 1 answer in 107 when a second
prompt ran beside it; a ``tiny`` answer whose top two candidates were 0.05 nats apart
changed in 170 of 172 paired runs), so a mismatch is judged again, with nothing else on
the reference: alone (``cache_prompt`` off, with ``top_logprobs``), equal is
``ref_unstable`` (the reference disagreed with itself); then beside each of up to three
requests to the same model that were in flight with it on the host, equal is
``batch_variant`` (a clean engine gives the host's answer in company: no other chat's state
is involved); else, if the host took the reference's runner-up within ``tie_nats`` (0.05)
at the first diverging token, ``near_tie``; anything else is ``contaminated``.

Figures (printed, and written to ``--out``):

- ``requests``: sent; ``completed``, ``walked_away``, ``checked``;
- ``lost``: failed or unanswered (``--deadline``) without a fault to explain it. A request
  to a model whose engine was faulted while the request was in flight (from the signal to
  the host's replacement of the pid, plus a grace) may fail: that is ``faulted``, not lost;
- ``duplicated``: more than one answer for one request id (two engine answer ids in one
  response, more than one finish, a second ``[DONE]``, more tokens than ``max_tokens``),
  one engine answer id delivered to two requests, plus ``upstream_excess``: completions
  the host forwarded beyond the requests it was sent (``upstream_calls`` in status), less
  those it sent again because their engine died before answering (``completions.resent``
  in status: by design, nothing of the first reached a client);
- ``contaminated``: a completed answer that differs from the reference and is explained
  neither by the reference alone nor in company (``batch_variant``) nor by a near tie
  (``near_tie``), both reported beside it;
- RSS and descriptor growth of the host process between the first quiet point (after a
  warm-up) and the last; engine starts, crashes (restarts after a fault), swaps, idle
  releases observed.

Aims (exit 1 when one is missed): 0 lost, 0 duplicated, 0 contaminated, every completed
answer checked, RSS growth <= ``--rss-slack-pct`` (10 %), descriptor growth <=
``--fd-slack``, every quiet point clean (nothing stuck, ``tiny`` released), every fault
recovered, the host alive at the end. ``--quick`` is a one-minute smoke of all of it: a
short warm-up, one segment with one fault of each kind, two quiet points.

Logs (the host's, both reference engines', and ``requests.jsonl``: every request with its
outcome) stay in ``--logs`` (default: a fresh ``/tmp/gezel-soak-*`` folder).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from ._harness import RESULTS

API_KEYS = ("sk-soak-a", "sk-soak-b")
ADMIN_KEY = "sk-soak-admin"
MODELS = ("tiny", "small")
KILL_TRIES = 3
"""Kills tried in one fault period until the host sees one as a crash (a kill can land
on an engine the host has just signalled to stop for a swap)."""
IDLE_MODEL = "tiny"  # the model with the short idle_ttl
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")

# llama-server closes keep-alive connections on its own schedule: the reference client
# never reuses one.
REF_LIMITS = httpx.Limits(max_keepalive_connections=0)

SYSTEM = (
    "You are a build agent. You read the repository, run the tests, change one file at a "
    "time and explain each step briefly. Tools: read_file, write_file, run, search."
)
_TEXT = (
    "read the failing test then open scheduler policy and check why the slot owner map "
    "keeps a stale entry after a walk away run pytest again with the seed fixed print "
    "the queue and explain which lease is still held by the evicted engine summarise "
    "the diff list three risks propose a smaller patch retry the build with logs on"
)
WORDS = tuple(_TEXT.split())


# ---------------------------------------------------------------------------- records


@dataclass
class Req:
    """One request the soak sent, and what became of it."""

    id: int
    marker: str
    model: str
    kind: str  # "session" | "chat" | "quiet"
    path: str
    stream: bool
    key: str  # which API key (index as text, never the key)
    session: str | None
    body: dict[str, Any] = field(repr=False)
    walk_plan: float | int | None = None  # seconds to give up after, or events to read
    t0: float = 0.0
    t1: float = 0.0
    outcome: str = "pending"  # ok | walked | failed | timeout
    status: int | None = None
    error: str | None = None
    text: str = ""
    completion_tokens: int | None = None
    usage: dict[str, Any] | None = None
    answer_ids: list[str] = field(default_factory=list)
    dup_reasons: list[str] = field(default_factory=list)
    # clean | ref_unstable | batch_variant | near_tie | contaminated | unverified
    verdict: str | None = None
    ref_text: str | None = None
    divergence: dict[str, Any] | None = None
    faulted: bool = False

    def row(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Fault:
    kind: str  # kill | stop | hang
    model: str
    pid: int
    t0: float
    t1: float | None = None
    replaced_after: float | None = None  # seconds until the host showed another pid
    recovered: bool = True
    note: str = ""


@dataclass
class Sample:
    t: float
    rss: int
    fds: int
    starts: int
    crashes: int


@dataclass
class QuietPoint:
    t: float
    label: str
    drained_in: float | None
    stuck: str | None
    idle_released_in: float | None
    rss: int
    fds: int


@dataclass
class SoakReport:
    settings: dict[str, Any]
    requests: int = 0
    completed: int = 0
    walked_away: int = 0
    checked: int = 0
    clean: int = 0
    lost: int = 0
    faulted: int = 0
    duplicated: int = 0
    duplicated_answers: int = 0
    upstream_completions: int | None = None
    upstream_excess: int = 0
    resent: int = 0
    contaminated: int = 0
    near_tie: int = 0
    batch_variant: int = 0
    ref_unstable: int = 0
    unverified: int = 0
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    faults_skipped: int = 0
    quiet_points: list[QuietPoint] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    engine_starts: int = 0
    engine_crashes: int = 0
    swaps: int = 0
    evictions: int = 0
    host_alive: bool = True
    host_stats: dict[str, Any] = field(default_factory=dict)
    host_log_warnings: list[str] = field(default_factory=list)
    examples: dict[str, list[str]] = field(default_factory=dict)
    elapsed_s: float = 0.0
    logs: str = ""

    # ------------------------------------------------------------------ figures

    @property
    def rss_start(self) -> int:
        return self.quiet_points[0].rss if self.quiet_points else 0

    @property
    def rss_end(self) -> int:
        return self.quiet_points[-1].rss if self.quiet_points else 0

    @property
    def rss_growth(self) -> int:
        return self.rss_end - self.rss_start

    @property
    def rss_growth_pct(self) -> float:
        return 100.0 * self.rss_growth / self.rss_start if self.rss_start else 0.0

    @property
    def fd_growth(self) -> int:
        if not self.quiet_points:
            return 0
        return self.quiet_points[-1].fds - self.quiet_points[0].fds

    @property
    def idle_releases(self) -> int:
        return sum(1 for q in self.quiet_points if q.idle_released_in is not None)

    def fault_counts(self) -> dict[str, int]:
        return dict(Counter(f.kind for f in self.faults))

    def misses(self, *, rss_slack_pct: float, fd_slack: int) -> list[str]:
        """The aims this run missed, in words (empty: all met)."""
        out = []
        if self.requests == 0 or self.completed == 0:
            out.append("no request completed")
        if self.lost:
            out.append(f"{self.lost} lost")
        if self.duplicated:
            out.append(f"{self.duplicated} duplicated")
        if self.contaminated:
            out.append(f"{self.contaminated} contaminated")
        if self.unverified:
            out.append(f"{self.unverified} completed answers not checked against the reference")
        if self.rss_growth_pct > rss_slack_pct:
            out.append(f"RSS grew {self.rss_growth_pct:.1f}% (aim <= {rss_slack_pct:g}%)")
        if self.fd_growth > fd_slack:
            out.append(f"descriptors grew by {self.fd_growth} (aim <= {fd_slack})")
        for q in self.quiet_points:
            if q.stuck:
                out.append(f"quiet point {q.label}: {q.stuck}")
            if q.idle_released_in is None:
                out.append(f"quiet point {q.label}: {IDLE_MODEL} was not idle-released")
        for f in self.faults:
            if not f.recovered:
                out.append(f"{f.kind} of {f.model} pid {f.pid}: {f.note}")
        if not self.host_alive:
            out.append("the host process died")
        return out

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            rss_start_bytes=self.rss_start,
            rss_end_bytes=self.rss_end,
            rss_growth_bytes=self.rss_growth,
            rss_growth_pct=round(self.rss_growth_pct, 2),
            rss_max_bytes=max((s.rss for s in self.samples), default=None),
            fds_start=self.quiet_points[0].fds if self.quiet_points else None,
            fds_end=self.quiet_points[-1].fds if self.quiet_points else None,
            fd_growth=self.fd_growth,
            fault_counts=self.fault_counts(),
            idle_releases=self.idle_releases,
            engine_restarts=self.engine_crashes,
        )
        return d

    def summary(self) -> str:
        mb = 1024 * 1024
        fc = self.fault_counts()
        qs = self.quiet_points
        return "\n".join(
            [
                f"soak {self.elapsed_s / 60:.1f} min: {self.requests} requests: "
                f"{self.completed} completed, {self.walked_away} walked away, "
                f"{self.faulted} failed in a fault window, {self.lost} lost",
                f"  checked {self.checked} against the reference: {self.clean} clean, "
                f"{self.contaminated} contaminated, {self.batch_variant} batch-variant, "
                f"{self.near_tie} near-tie, "
                f"{self.ref_unstable} reference-unstable, "
                f"{self.unverified} unverified; {self.duplicated} duplicated "
                f"({self.duplicated_answers} in answers, upstream excess "
                f"{self.upstream_excess} of {self.upstream_completions} forwarded, "
                f"{self.resent} resent after their engine died)",
                f"  faults: {fc.get('kill', 0)} kill, {fc.get('stop', 0)} stop, "
                f"{fc.get('hang', 0)} hang ({self.faults_skipped} skipped); engines: "
                f"{self.engine_starts} starts, {self.engine_crashes} crashes (restarts), "
                f"{self.swaps} swaps, {self.idle_releases}/{len(qs)} idle releases",
                f"  host RSS {self.rss_start / mb:.1f} -> {self.rss_end / mb:.1f} MiB "
                f"({self.rss_growth_pct:+.1f}%, max "
                f"{max((s.rss for s in self.samples), default=0) / mb:.1f}); fds "
                f"{qs[0].fds if qs else 0} -> {qs[-1].fds if qs else 0} ({self.fd_growth:+d})",
            ]
        )


# ---------------------------------------------------------------------------- host side


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _ours(pid: int, marker: str) -> bool:
    """Is ``pid`` a live (not zombie) process whose command line names ``marker``?"""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][:1]
    except (OSError, IndexError):
        return False
    return marker in cmdline and state != "Z"


def _proc_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][:1]
    except (OSError, IndexError):
        return None


def host_config(
    *,
    port: int,
    state_dir: Path,
    models: dict[str, Path],
    parallel: int,
    ctx_per_slot: int,
    idle_ttl: float,
    binary: str | None,
) -> str:
    lines = [
        "[server]",
        'host = "127.0.0.1"',
        f"port = {port}",
        'log_level = "info"',
        f"api_keys = {json.dumps(list(API_KEYS))}",
        f"admin_keys = {json.dumps([ADMIN_KEY])}",
        "[engine]",
        f"state_dir = {json.dumps(str(state_dir))}",
        "load_timeout = 60",
        "health_interval = 1",
        *([f"binary = {json.dumps(binary)}"] if binary else []),
        "[gpu]",
        'policy = "swap"',
    ]
    for mid, path in models.items():
        lines += [
            "[[models]]",
            f"id = {json.dumps(mid)}",
            f"path = {json.dumps(str(path))}",
            f"parallel = {parallel}",
            f"ctx_per_slot = {ctx_per_slot}",
        ]
        if mid == IDLE_MODEL:
            lines.append(f"idle_ttl = {idle_ttl:g}")
    return "\n".join(lines) + "\n"


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, *, within: float) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"{url} did not come up (exit {proc.poll()}):\n{tail}")
        time.sleep(0.05)


@contextlib.contextmanager
def _process(argv: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[Any]:
    """Run ``argv`` with output to ``log``; always terminate it (SIGKILL 20 s later)."""
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


# ---------------------------------------------------------------------------- the soak


@dataclass
class Settings:
    minutes: float
    quick: bool
    concurrency: int
    parallel: int
    ctx_per_slot: int
    max_tokens: int
    walkaway: float
    fault_every: float
    idle_ttl: float
    warmup: float
    segment: float
    sample_every: float
    progress_every: float
    deadline: float
    seed: int
    fd_slack: int
    rss_slack_pct: float
    drain_timeout: float = 180.0
    fault_grace: float = 2.0
    tie_nats: float = 0.05
    stop_seconds: float = 1.5


class Soak:
    def __init__(
        self,
        settings: Settings,
        *,
        base_url: str,
        host_pid: int,
        refs: dict[str, str],
        state_marker: str,
    ) -> None:
        self.s = settings
        self.base_url = base_url
        self.host_pid = host_pid
        self.refs = refs
        self.state_marker = state_marker
        self.rng = random.Random(settings.seed)
        self.report = SoakReport(settings=asdict(settings))
        self.records: list[Req] = []
        self.answer_owner: dict[str, int] = {}
        self.next_id = 0
        self.session_count = 0
        self.chat_count = 0
        self.in_flight = 0
        self.no_flight = trio.Event()
        self.no_flight.set()
        self.checkers_live = 0
        self.checkers_done = trio.Event()
        self.paused = False
        self.resumed = trio.Event()
        self.stopping = False
        self.t_start = 0.0
        self.ref_limiters = {m: trio.CapacityLimiter(2) for m in refs}
        self.check_channels: dict[str, Any] = {}

    # ------------------------------------------------------------------ helpers

    def now(self) -> float:
        return trio.current_time() - self.t_start

    def log(self, msg: str) -> None:
        print(f"[{self.now():7.1f}s] {msg}", flush=True)

    def _words(self, lo: int, hi: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(lo, hi)))

    def _new_req(
        self,
        *,
        model: str,
        kind: str,
        path: str,
        key: int,
        session: str | None,
        content: str,
        messages: list[dict[str, str]] | None,
        walk: bool,
    ) -> Req:
        self.next_id += 1
        rid = self.next_id
        marker = f"[r{rid:06d}]"
        stream = self.rng.random() < 0.5
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": self.s.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        text = f"{marker} {content}"
        if path == "/v1/chat/completions":
            body["messages"] = [*(messages or []), {"role": "user", "content": text}]
        else:
            body["prompt"] = text
        if session is not None:
            body["prompt_cache_key"] = session
        if stream:
            body["stream"] = True
            if path == "/v1/chat/completions":
                body["stream_options"] = {"include_usage": True}
        plan: float | int | None = None
        if walk and self.rng.random() < self.s.walkaway:
            plan = (
                self.rng.randint(1, self.s.max_tokens // 2)
                if stream
                else (round(self.rng.uniform(0.02, 0.6), 3))
            )
        return Req(
            id=rid,
            marker=marker,
            model=model,
            kind=kind,
            path=path,
            stream=stream,
            key=str(key),
            session=session,
            body=body,
            walk_plan=plan,
        )

    # ------------------------------------------------------------------ one request

    async def send(self, client: httpx.AsyncClient, req: Req, key: str) -> None:
        self.records.append(req)
        self.in_flight += 1
        if self.in_flight == 1:
            self.no_flight = trio.Event()
        req.t0 = self.now()
        headers = {"Authorization": f"Bearer {key}"}
        try:
            with trio.move_on_after(self.s.deadline) as deadline:
                if req.stream:
                    await self._stream(client, req, headers)
                else:
                    await self._plain(client, req, headers)
            if deadline.cancelled_caught:
                req.outcome, req.error = "timeout", f"no answer within {self.s.deadline:g}s"
        except httpx.HTTPError as exc:
            req.outcome, req.error = "failed", f"{type(exc).__name__}: {exc}"[:300]
        finally:
            req.t1 = self.now()
            self.in_flight -= 1
            if self.in_flight == 0:
                self.no_flight.set()
        self._check_answer_shape(req)
        if req.outcome == "ok":
            try:
                self.check_channels[req.model].send_nowait(req)
            except trio.WouldBlock:
                req.verdict = "unverified"

    async def _plain(self, client: httpx.AsyncClient, req: Req, headers: dict[str, str]) -> None:
        giveup = float(req.walk_plan) if req.walk_plan is not None else math.inf
        with trio.move_on_after(giveup) as walked:
            resp = await client.post(req.path, json=req.body, headers=headers)
        if walked.cancelled_caught:
            req.outcome = "walked"
            return
        req.status = resp.status_code
        if resp.status_code != 200:
            req.outcome, req.error = "failed", f"HTTP {resp.status_code}: {resp.text[:300]}"
            return
        try:
            data = resp.json()
        except ValueError:
            req.outcome, req.error = "failed", f"not JSON: {resp.text[:200]}"
            return
        choices = data.get("choices") or []
        if len(choices) != 1:
            req.dup_reasons.append(f"{len(choices)} choices")
        if choices:
            c = choices[0]
            req.text = (
                (c.get("message") or {}).get("content") or ""
                if req.path == "/v1/chat/completions"
                else c.get("text") or ""
            )
        if data.get("id"):
            req.answer_ids.append(str(data["id"]))
        req.usage = data.get("usage")
        req.completion_tokens = (req.usage or {}).get("completion_tokens")
        req.outcome = "ok"

    async def _stream(self, client: httpx.AsyncClient, req: Req, headers: dict[str, str]) -> None:
        walk_after = int(req.walk_plan) if req.walk_plan is not None else None
        events = 0
        done = 0
        finishes = 0
        parts: list[str] = []
        ids: list[str] = []
        async with client.stream("POST", req.path, json=req.body, headers=headers) as resp:
            req.status = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                req.outcome, req.error = "failed", f"HTTP {resp.status_code}: {body[:300]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done += 1
                    continue
                if done:
                    req.dup_reasons.append("data after [DONE]")
                try:
                    obj = json.loads(payload)
                except ValueError:
                    req.outcome, req.error = "failed", f"bad event: {payload[:200]}"
                    return
                if "error" in obj:
                    req.outcome, req.error = "failed", f"stream error: {json.dumps(obj)[:300]}"
                    return
                if obj.get("id") and obj["id"] not in ids:
                    ids.append(str(obj["id"]))
                for c in obj.get("choices") or []:
                    piece = (
                        (c.get("delta") or {}).get("content")
                        if req.path == "/v1/chat/completions"
                        else c.get("text")
                    )
                    if piece:
                        parts.append(piece)
                        events += 1
                    if c.get("finish_reason"):
                        finishes += 1
                if obj.get("usage"):
                    req.usage = obj["usage"]
                    req.completion_tokens = obj["usage"].get("completion_tokens")
                if walk_after is not None and events >= walk_after and not done:
                    req.outcome = "walked"
                    req.text = "".join(parts)
                    req.answer_ids = ids
                    return  # leaving the block closes the response mid-stream
        req.text = "".join(parts)
        req.answer_ids = ids
        if done == 0:
            req.outcome, req.error = "failed", f"stream ended without [DONE] ({events} tokens)"
            return
        if done > 1:
            req.dup_reasons.append(f"{done} [DONE]")
        if finishes > 1:
            req.dup_reasons.append(f"{finishes} finishes")
        req.outcome = "ok"

    def _check_answer_shape(self, req: Req) -> None:
        if len(req.answer_ids) > 1:
            req.dup_reasons.append(f"{len(req.answer_ids)} answer ids in one response")
        if req.completion_tokens is not None and req.completion_tokens > self.s.max_tokens:
            req.dup_reasons.append(f"{req.completion_tokens} tokens > max_tokens")
        for aid in req.answer_ids:
            other = self.answer_owner.setdefault(aid, req.id)
            if other != req.id:
                req.dup_reasons.append(f"answer id {aid} also delivered to request {other}")

    # ------------------------------------------------------------------ reference checks

    @contextlib.asynccontextmanager
    async def _seats(self, model: str, n: int) -> AsyncIterator[None]:
        """Hold ``n`` of the reference engine's 2 seats (2: nothing else runs there)."""
        limiter = self.ref_limiters[model]
        held: list[object] = []
        try:
            for _ in range(n):
                token = object()
                await limiter.acquire_on_behalf_of(token)
                held.append(token)
            yield
        finally:
            for token in held:
                limiter.release_on_behalf_of(token)

    async def _ask(
        self, ref: httpx.AsyncClient, req: Req, *, fresh: bool, logprobs: bool = False
    ) -> tuple[str, list[dict[str, Any]]]:
        """The reference engine's answer to ``req``'s body (no seat taken here): its text
        and, with ``logprobs``, the top candidates of every generated token."""
        body = {
            k: v
            for k, v in req.body.items()
            if k not in ("stream", "stream_options", "prompt_cache_key")
        }
        chat = req.path == "/v1/chat/completions"
        if fresh:
            body["cache_prompt"] = False
        if logprobs:
            body.update({"logprobs": True, "top_logprobs": 4} if chat else {"logprobs": 4})
        resp = await ref.post(self.refs[req.model] + req.path, json=body)
        resp.raise_for_status()
        c = resp.json()["choices"][0]
        text = (c.get("message") or {}).get("content") if chat else c.get("text")
        return str(text or ""), list((c.get("logprobs") or {}).get("content") or [])

    def _partners(self, req: Req, n: int = 3) -> list[Req]:
        """Requests to the same model that were in flight with ``req`` (else just before)."""
        same = [r for r in self.records if r.model == req.model and r.id != req.id and r.t1]
        overlap = [r for r in same if r.t0 <= req.t1 and r.t1 >= req.t0]
        before = [r for r in same if r.t1 < req.t0][-n:]
        return (overlap + before)[:n]

    async def _paired(self, ref: httpx.AsyncClient, req: Req, partner: Req) -> str:
        """``req`` on the reference while ``partner`` shares its batch."""
        out: list[str] = []

        async def mine() -> None:
            out.append((await self._ask(ref, req, fresh=True))[0])

        async def theirs() -> None:
            await self._ask(ref, partner, fresh=True)

        async with self._seats(req.model, 2), trio.open_nursery() as nursery:
            nursery.start_soon(theirs)
            nursery.start_soon(mine)
        return out[0]

    async def checker(self, ref: httpx.AsyncClient, recv: Any) -> None:
        try:
            await self._check_all(ref, recv)
        finally:
            self.checkers_live -= 1
            if self.checkers_live == 0:
                self.checkers_done.set()

    async def _check_all(self, ref: httpx.AsyncClient, recv: Any) -> None:
        async with recv:
            async for req in recv:
                try:
                    await self._check(ref, req)
                except (httpx.HTTPError, trio.TooSlowError, KeyError, ValueError) as exc:
                    req.verdict = "unverified"
                    req.error = f"reference failed: {type(exc).__name__}: {exc}"[:300]

    async def _check(self, ref: httpx.AsyncClient, req: Req) -> None:
        with trio.fail_after(60):
            async with self._seats(req.model, 1):
                expected, _ = await self._ask(ref, req, fresh=False)
        if expected == req.text:
            req.verdict = "clean"
            return
        # A llama-server's greedy answer depends a little on what shares its batch (see
        # the module docstring), so a mismatch is judged again: alone, then in company.
        with trio.fail_after(240):
            async with self._seats(req.model, 2):
                again, candidates = await self._ask(ref, req, fresh=True, logprobs=True)
            req.ref_text = again
            if again == req.text:
                req.verdict = "ref_unstable"  # the reference disagreed with itself
                return
            req.divergence = first_divergence(req.text, candidates)
            for partner in self._partners(req):
                if await self._paired(ref, req, partner) == req.text:
                    req.verdict = "batch_variant"
                    req.divergence["reproduced_with"] = partner.marker
                    return
        gap = req.divergence.get("gap")
        if gap is not None and gap <= self.s.tie_nats:
            req.verdict = "near_tie"
            return
        req.verdict = "contaminated"
        self.log(
            f"CONTAMINATED {req.marker} {req.model} {req.kind} session={req.session}: "
            f"host {req.text!r} ref {again!r} ({req.divergence})"
        )

    # ------------------------------------------------------------------ clients

    async def _wait_gate(self) -> bool:
        """Wait while paused; False once the soak is stopping."""
        while self.paused and not self.stopping:
            await self.resumed.wait()
        return not self.stopping

    async def session_worker(self, client: httpx.AsyncClient) -> None:
        while not self.stopping:
            self.session_count += 1
            n = self.session_count
            # sessions come in pairs: one chat name under both API keys, on one model
            pair = (n + 1) // 2
            key = n % 2
            model = MODELS[pair % 2]
            name = f"agent-{pair}"
            history: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
            for _turn in range(self.rng.randint(3, 8)):
                if not await self._wait_gate():
                    return
                content = self._words(6, 14)
                req = self._new_req(
                    model=model,
                    kind="session",
                    path="/v1/chat/completions",
                    key=key,
                    session=name,
                    content=content,
                    messages=history,
                    walk=True,
                )
                await self.send(client, req, API_KEYS[key])
                if req.outcome == "ok":
                    history = [
                        *history,
                        {"role": "user", "content": f"{req.marker} {content}"},
                        {"role": "assistant", "content": req.text},
                    ]
                await trio.sleep(self.rng.uniform(0.0, 0.3))

    async def chat_worker(self, client: httpx.AsyncClient) -> None:
        while not self.stopping:
            if not await self._wait_gate():
                return
            self.chat_count += 1
            model = MODELS[self.chat_count % 2]
            key = self.rng.randrange(2)
            path = COMPLETION_PATHS[0] if self.rng.random() < 0.7 else COMPLETION_PATHS[1]
            req = self._new_req(
                model=model,
                kind="chat",
                path=path,
                key=key,
                session=None,
                content=self._words(4, 16),
                messages=[{"role": "system", "content": SYSTEM}] if self.rng.random() < 0.5 else [],
                walk=True,
            )
            await self.send(client, req, API_KEYS[key])
            await trio.sleep(self.rng.uniform(0.0, 0.2))

    # ------------------------------------------------------------------ status and faults

    async def status(self, admin: httpx.AsyncClient) -> dict[str, Any] | None:
        try:
            with trio.move_on_after(10):
                r = await admin.get("/api/status")
                if r.status_code == 200:
                    data: dict[str, Any] = r.json()
                    return data
        except (httpx.HTTPError, ValueError):
            pass
        return None

    def _engine(self, status: dict[str, Any] | None, key: str) -> dict[str, Any] | None:
        for e in (status or {}).get("engines", []):
            if e.get("key") == key:
                return dict(e)
        return None

    async def sample(self, admin: httpx.AsyncClient) -> Sample | None:
        st = await self.status(admin)
        if st is None:
            return None
        engines = st.get("engines", [])
        s = Sample(
            t=round(self.now(), 2),
            rss=_rss(self.host_pid),
            fds=_fds(self.host_pid),
            starts=sum(int(e.get("starts") or 0) for e in engines),
            crashes=sum(int(e.get("crashes") or 0) for e in engines),
        )
        self.report.samples.append(s)
        return s

    async def _pick_target(self, admin: httpx.AsyncClient) -> tuple[str, int, int] | None:
        """A ready engine of ours (key, pid, crashes so far), a busy one if there is one
        within a few seconds."""
        best: tuple[str, int, int] | None = None
        with trio.move_on_after(8):
            while True:
                for e in (await self.status(admin) or {}).get("engines", []):
                    pid = e.get("pid")
                    if e.get("state") != "ready" or not pid or not _ours(pid, self.state_marker):
                        continue
                    target = str(e["key"]), int(pid), int(e.get("crashes") or 0)
                    if e.get("busy"):
                        return target
                    best = best or target
                await trio.sleep(0.1)
        return best

    async def _wait_replaced(
        self, admin: httpx.AsyncClient, key: str, pid: int, within: float
    ) -> float | None:
        t0 = trio.current_time()
        with trio.move_on_after(within):
            while True:
                e = self._engine(await self.status(admin), key)
                if e is not None and e.get("pid") != pid:
                    return trio.current_time() - t0
                await trio.sleep(0.1)
        return None

    async def inject(self, admin: httpx.AsyncClient, kind: str) -> None:
        for _ in range(KILL_TRIES if kind == "kill" else 1):
            if await self._inject_once(admin, kind):
                return

    async def _inject_once(self, admin: httpx.AsyncClient, kind: str) -> bool:
        """One fault; False for a kill the host could not see as a crash (it hit an engine
        the host had itself begun to stop, between the status read and the signal), which
        ``inject`` tries again on another ready engine."""
        target = await self._pick_target(admin)
        if target is None:
            self.report.faults_skipped += 1
            self.log(f"fault {kind}: no ready engine to hit, skipped")
            return True
        key, pid, crashes = target
        f = Fault(kind=kind, model=key, pid=pid, t0=self.now())
        self.report.faults.append(f)
        seen = True
        if kind == "kill":
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            f.replaced_after = await self._wait_replaced(admin, key, pid, 60)
            e = self._engine(await self.status(admin), key)
            seen = e is not None and int(e.get("crashes") or 0) > crashes
            if f.replaced_after is None:
                f.recovered, f.note = False, "the host still showed the killed pid after 60 s"
            elif not seen:
                f.note = "it landed on a stop the host had signalled: no crash to see"
        elif kind == "stop":
            os.kill(pid, signal.SIGSTOP)
            await trio.sleep(self.s.stop_seconds)
            if _proc_state(pid) == "T" and _ours(pid, self.state_marker):
                os.kill(pid, signal.SIGCONT)
            e = self._engine(await self.status(admin), key)
            if e is not None and e.get("pid") != pid:
                f.note = "the host replaced the engine during a short stop"
        else:  # hang: stopped until the host replaces it
            os.kill(pid, signal.SIGSTOP)
            f.replaced_after = await self._wait_replaced(admin, key, pid, 60)
            if f.replaced_after is None:
                f.recovered, f.note = False, "a stopped engine was not replaced within 60 s"
            if _proc_state(pid) == "T" and _ours(pid, self.state_marker):
                os.kill(pid, signal.SIGCONT)
        f.t1 = self.now() + self.s.fault_grace
        took = f"replaced in {f.replaced_after:.1f}s" if f.replaced_after is not None else ""
        self.log(f"fault {kind} {key} pid {pid} {took} {f.note}".rstrip())
        return seen

    async def faults_during(
        self, admin: httpx.AsyncClient, seconds: float, kinds: Iterator[str]
    ) -> None:
        """Inject faults every ``fault_every`` s for ``seconds`` (the last one may run over)."""
        if self.s.fault_every <= 0:
            await trio.sleep(seconds)
            return
        end = trio.current_time() + seconds
        first = min(3.0, self.s.fault_every / 2)
        await trio.sleep(first)
        while trio.current_time() < end:
            t = trio.current_time()
            await self.inject(admin, next(kinds))
            rest = self.s.fault_every - (trio.current_time() - t)
            if trio.current_time() + max(rest, 0) >= end:
                break
            await trio.sleep(max(rest, 0))
        await trio.sleep_until(max(end, trio.current_time()))

    # ------------------------------------------------------------------ quiet points

    async def quiet_point(
        self, client: httpx.AsyncClient, admin: httpx.AsyncClient, label: str
    ) -> None:
        self.paused = True
        self.resumed = trio.Event()
        t0 = trio.current_time()
        drained_in: float | None = None
        with trio.move_on_after(self.s.deadline + 10):
            await self.no_flight.wait()
            drained_in = trio.current_time() - t0
        stuck: str | None = None if drained_in is not None else "clients still waiting"
        # nothing may stay queued, running or busy once every client has its answer
        if stuck is None:
            with trio.move_on_after(10):
                while True:
                    st = await self.status(admin) or {}
                    sch = st.get("scheduler", {})
                    busy = {e["key"]: e.get("busy") for e in st.get("engines", []) if e.get("busy")}
                    if not sch.get("queued") and not sch.get("running") and not busy:
                        break
                    stuck = f"queued={sch.get('queued')} running={sch.get('running')} busy={busy}"
                    await trio.sleep(0.2)
                stuck = None
        # the idle model: make it resident, then it must be released within its ttl
        released_in: float | None = None
        req = self._new_req(
            model=IDLE_MODEL,
            kind="quiet",
            path="/v1/chat/completions",
            key=0,
            session=None,
            content=self._words(4, 8),
            messages=None,
            walk=False,
        )
        await self.send(client, req, API_KEYS[0])
        if req.outcome == "ok":
            t1 = trio.current_time()
            with trio.move_on_after(self.s.idle_ttl + 15):
                while True:
                    e = self._engine(await self.status(admin), IDLE_MODEL)
                    if e is not None and e.get("state") == "stopped":
                        released_in = trio.current_time() - t1
                        break
                    await trio.sleep(0.1)
        await trio.sleep(0.5)
        sample = await self.sample(admin)
        q = QuietPoint(
            t=round(self.now(), 2),
            label=label,
            drained_in=None if drained_in is None else round(drained_in, 2),
            stuck=stuck,
            idle_released_in=None if released_in is None else round(released_in, 2),
            rss=sample.rss if sample else _rss(self.host_pid),
            fds=sample.fds if sample else _fds(self.host_pid),
        )
        self.report.quiet_points.append(q)
        mb = 1024 * 1024
        self.log(
            f"quiet point {label}: drained in {q.drained_in}s, "
            f"{'stuck: ' + stuck if stuck else 'nothing held'}, {IDLE_MODEL} released in "
            f"{q.idle_released_in}s, RSS {q.rss / mb:.1f} MiB, {q.fds} fds"
        )
        self.paused = False
        self.resumed.set()

    # ------------------------------------------------------------------ progress

    def progress(self) -> None:
        c = Counter(r.outcome for r in self.records)
        v = Counter(r.verdict for r in self.records)
        mb = 1024 * 1024
        self.log(
            f"{len(self.records)} requests: {c['ok']} ok, {c['walked']} walked, "
            f"{c['failed'] + c['timeout']} failed; checked "
            f"{sum(n for k, n in v.items() if k not in (None, 'unverified'))} "
            f"({v['contaminated']} contaminated, {v['batch_variant']} batch-variant, "
            f"{v['near_tie']} near-tie); "
            f"faults {len(self.report.faults)}; "
            f"RSS {_rss(self.host_pid) / mb:.1f} MiB, {_fds(self.host_pid)} fds"
        )

    async def ticker(self, admin: httpx.AsyncClient) -> None:
        next_progress = trio.current_time() + self.s.progress_every
        while not self.stopping:
            await trio.sleep(self.s.sample_every)
            await self.sample(admin)
            if trio.current_time() >= next_progress:
                next_progress += self.s.progress_every
                self.progress()

    # ------------------------------------------------------------------ the run

    async def run(self) -> SoakReport:
        s = self.s
        self.t_start = trio.current_time()
        total = s.minutes * 60
        end = self.t_start + total
        kinds = _cycle(("kill", "stop", "hang"))
        timeout = httpx.Timeout(connect=10, read=s.deadline, write=10, pool=s.deadline)
        async with (
            httpx.AsyncClient(
                base_url=self.base_url, timeout=timeout, limits=httpx.Limits(max_connections=64)
            ) as client,
            httpx.AsyncClient(
                base_url=self.base_url,
                timeout=10,
                headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            ) as admin,
            httpx.AsyncClient(timeout=60, limits=REF_LIMITS) as ref,
            trio.open_nursery() as checkers,
        ):
            recvs = {}
            for m in self.refs:
                send, recv = trio.open_memory_channel[Req](20000)
                self.check_channels[m] = send
                recvs[m] = recv
                for _ in range(2):
                    self.checkers_live += 1
                    checkers.start_soon(self.checker, ref, recv.clone())
                await recv.aclose()
            with trio.fail_after(total + s.deadline * 3 + 300):
                async with trio.open_nursery() as load:
                    load.start_soon(self.ticker, admin)
                    n_sessions = max(1, round(s.concurrency * 2 / 3))
                    for _ in range(n_sessions):
                        load.start_soon(self.session_worker, client)
                    for _ in range(max(1, s.concurrency - n_sessions)):
                        load.start_soon(self.chat_worker, client)
                    self.log(
                        f"load: {n_sessions} session clients, "
                        f"{max(1, s.concurrency - n_sessions)} chat clients; warm-up {s.warmup:g}s"
                    )
                    await trio.sleep(s.warmup)
                    await self.quiet_point(client, admin, "baseline")
                    n = 0
                    quiet_cost = s.idle_ttl + 8
                    while True:
                        left = end - trio.current_time() - quiet_cost
                        if left < min(s.segment, 20):
                            break
                        n += 1
                        await self.faults_during(admin, min(s.segment, left), kinds)
                        await self.quiet_point(client, admin, f"q{n}")
                    self.stopping = True
                    self.resumed.set()
                    with trio.move_on_after(s.deadline + 10):
                        await self.no_flight.wait()
                    load.cancel_scope.cancel()
            for ch in self.check_channels.values():
                await ch.aclose()
            self.log(f"load done; draining reference checks (at most {s.drain_timeout:g}s)")
            with trio.move_on_after(s.drain_timeout):
                await self.checkers_done.wait()
            final = await self.status(admin)
            checkers.cancel_scope.cancel()
        self._finish(final)
        self.report.elapsed_s = round(trio.current_time() - self.t_start, 1)
        return self.report

    def _finish(self, final: dict[str, Any] | None) -> None:
        rep = self.report
        windows = [(f.model, f.t0, f.t1 if f.t1 is not None else math.inf) for f in rep.faults]
        by_kind: dict[str, Counter[str]] = {}
        examples: dict[str, list[str]] = {}

        def example(what: str, line: str) -> None:
            lst = examples.setdefault(what, [])
            if len(lst) < 10:
                lst.append(line)

        for r in self.records:
            k = by_kind.setdefault(r.kind, Counter())
            k["requests"] += 1
            rep.requests += 1
            if r.dup_reasons:
                rep.duplicated_answers += 1
                k["duplicated"] += 1
                example("duplicated", f"{r.marker} {r.model}: {'; '.join(r.dup_reasons)}")
            if r.outcome in ("failed", "timeout", "pending"):
                r.faulted = any(m == r.model and r.t0 <= t1 and r.t1 >= t0 for m, t0, t1 in windows)
                if r.faulted:
                    rep.faulted += 1
                    k["faulted"] += 1
                else:
                    rep.lost += 1
                    k["lost"] += 1
                    example(
                        "lost",
                        f"{r.marker} {r.model} {r.kind} stream={r.stream} "
                        f"t={r.t0:.1f}-{r.t1:.1f}: {r.error}",
                    )
                continue
            if r.outcome == "walked":
                rep.walked_away += 1
                k["walked_away"] += 1
                continue
            rep.completed += 1
            k["completed"] += 1
            verdict = r.verdict or "unverified"
            if verdict == "unverified":
                rep.unverified += 1
                example("unverified", f"{r.marker} {r.model}: {r.error}")
                continue
            rep.checked += 1
            k[verdict] += 1
            if verdict == "clean":
                rep.clean += 1
            elif verdict == "contaminated":
                rep.contaminated += 1
                example(
                    "contaminated",
                    f"{r.marker} {r.model} {r.kind} session={r.session} "
                    f"stream={r.stream}: host {r.text!r} ref {r.ref_text!r} {r.divergence}",
                )
            elif verdict in ("near_tie", "batch_variant"):
                setattr(rep, verdict, getattr(rep, verdict) + 1)
                example(
                    verdict,
                    f"{r.marker} {r.model} {r.kind}: host {r.text!r} ref {r.ref_text!r} "
                    f"{r.divergence}",
                )
            else:
                rep.ref_unstable += 1
                example("ref_unstable", f"{r.marker} {r.model}: {r.text!r}")
        rep.by_kind = {k: dict(v) for k, v in by_kind.items()}
        rep.examples = examples
        if final is not None:
            engines = final.get("engines", [])
            rep.engine_starts = sum(int(e.get("starts") or 0) for e in engines)
            rep.engine_crashes = sum(int(e.get("crashes") or 0) for e in engines)
            sch = final.get("scheduler", {})
            rep.swaps = int(sch.get("switches") or 0)
            rep.host_stats = {
                "scheduler": {
                    k: sch.get(k)
                    for k in ("admissions", "switches", "erases", "parking", "reconciliations")
                },
                "arbiter": final.get("arbiter"),
                "engines": {
                    e.get("key"): {
                        k: e.get(k)
                        for k in ("starts", "crashes", "last_crash", "kv_parking", "upstream_calls")
                    }
                    for e in engines
                },
            }
            rep.evictions = int(final.get("arbiter", {}).get("evictions") or 0)
            forwarded = sum(
                int((e.get("upstream_calls") or {}).get(p, 0))
                for e in engines
                for p in COMPLETION_PATHS
            )
            rep.upstream_completions = forwarded
            # a completion sent again because its engine died before answering is one
            # more upstream call by design (the host counts them): only the rest is excess
            rep.resent = int((final.get("completions") or {}).get("resent") or 0)
            rep.upstream_excess = max(0, forwarded - rep.resent - rep.requests)
        else:
            rep.host_alive = False
        rep.duplicated = rep.duplicated_answers + rep.upstream_excess


def first_divergence(host: str, candidates: list[dict[str, Any]]) -> dict[str, Any]:
    """Where ``host`` leaves the reference's tokens, and how close the reference was to
    choosing what the host chose there.

    ``candidates`` is the reference's ``logprobs.content``: per generated token, the token
    and its ``top_logprobs``. ``gap`` (nats) is the chosen token's logprob minus that of
    the candidate the host's text continues with; None when the host's text continues
    with none of them (or the reference gave no candidates).
    """
    offset = 0
    for i, step in enumerate(candidates):
        chosen = str(step.get("token", ""))
        if chosen and host.startswith(chosen, offset):
            offset += len(chosen)
            continue
        out: dict[str, Any] = {"token": i, "ref": chosen, "host": host[offset : offset + 12]}
        for cand in step.get("top_logprobs") or []:
            tok = str(cand.get("token", ""))
            if tok and tok != chosen and host.startswith(tok, offset):
                out.update(host=tok, gap=round(float(step["logprob"]) - float(cand["logprob"]), 4))
                return out
        out["gap"] = None
        return out
    return {"token": len(candidates), "ref": "", "host": host[offset : offset + 12], "gap": None}


def _cycle(items: tuple[str, ...]) -> Iterator[str]:
    while True:
        yield from items


# ---------------------------------------------------------------------------- main


def settings_from(args: argparse.Namespace) -> Settings:
    if args.quick:
        return Settings(
            minutes=1.0,
            quick=True,
            concurrency=args.concurrency,
            parallel=args.parallel,
            ctx_per_slot=args.ctx_per_slot,
            max_tokens=args.max_tokens,
            walkaway=args.walkaway,
            fault_every=args.fault_every if args.fault_every is not None else 11.0,
            idle_ttl=args.idle_ttl if args.idle_ttl is not None else 3.0,
            warmup=5.0,
            segment=36.0,
            sample_every=args.sample_every or 2.0,
            progress_every=5.0,
            deadline=args.deadline,
            seed=args.seed,
            fd_slack=args.fd_slack,
            rss_slack_pct=args.rss_slack_pct,
            drain_timeout=60.0,
        )
    return Settings(
        minutes=args.minutes,
        quick=False,
        concurrency=args.concurrency,
        parallel=args.parallel,
        ctx_per_slot=args.ctx_per_slot,
        max_tokens=args.max_tokens,
        walkaway=args.walkaway,
        fault_every=args.fault_every if args.fault_every is not None else 30.0,
        idle_ttl=args.idle_ttl if args.idle_ttl is not None else 4.0,
        warmup=30.0,
        segment=120.0,
        sample_every=args.sample_every or 5.0,
        progress_every=30.0,
        deadline=args.deadline,
        seed=args.seed,
        fd_slack=args.fd_slack,
        rss_slack_pct=args.rss_slack_pct,
    )


def _host_log_warnings(path: Path, limit: int = 20) -> list[str]:
    out: list[str] = []
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return out
    for line in lines:
        if '"level": "warning"' in line or '"level": "error"' in line or "Traceback" in line:
            out.append(line[:400])
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def run_soak(settings: Settings, *, binary: str | None, logs: Path) -> SoakReport:
    """Start the host and the reference engines, run the soak, stop everything."""
    from gezel_trio.engine.binary import resolve_engine
    from gezel_trio.engine.demo_model import write_demo_model
    from gezel_trio.engine.ports import free_port

    logs.mkdir(parents=True, exist_ok=True)
    models = {m: write_demo_model(logs / f"{m}.gguf", size=m) for m in MODELS}  # type: ignore[arg-type]
    state = logs / "state"
    port = free_port()
    cfg = logs / "gezel.toml"
    cfg.write_text(
        host_config(
            port=port,
            state_dir=state,
            models=models,
            parallel=settings.parallel,
            ctx_per_slot=settings.ctx_per_slot,
            idle_ttl=settings.idle_ttl,
            binary=binary,
        )
    )
    base = f"http://127.0.0.1:{port}"
    host_log = logs / "host.log"
    with contextlib.ExitStack() as stack:
        host = stack.enter_context(
            _process(
                [sys.executable, "-m", "gezel_trio.cli", "serve", "--config", str(cfg)],
                host_log,
                env=dict(os.environ),
            )
        )
        _wait_http(base + "/health", host, host_log, within=60)
        status = httpx.get(
            base + "/api/status", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10
        ).json()
        engine_path = status["engine_binary"]["path"]
        found = resolve_engine(engine_path)
        refs: dict[str, str] = {}
        for m, path in models.items():
            rport = free_port()
            argv = [
                str(found.path),
                "--model", str(path),
                "--host", "127.0.0.1",
                "--port", str(rport),
                "--parallel", str(settings.parallel),
                "--ctx-size", str(settings.parallel * settings.ctx_per_slot),
                "--no-webui",
            ]  # fmt: skip
            rlog = logs / f"ref-{m}.log"
            proc = stack.enter_context(_process(argv, rlog, env=found.launch_env()))
            refs[m] = f"http://127.0.0.1:{rport}"
            _wait_http(refs[m] + "/health", proc, rlog, within=60)
        print(
            f"soak: host {base} (pid {host.pid}, {engine_path}); reference engines "
            + ", ".join(f"{m} {u}" for m, u in refs.items())
            + f"; logs in {logs}",
            flush=True,
        )
        soak = Soak(settings, base_url=base, host_pid=host.pid, refs=refs, state_marker=str(state))
        report = trio.run(soak.run)
        report.host_alive = report.host_alive and host.poll() is None
        report.logs = str(logs)
        with (logs / "requests.jsonl").open("w") as fh:
            for r in soak.records:
                fh.write(json.dumps(r.row()) + "\n")
    report.host_log_warnings = _host_log_warnings(host_log)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--quick", action="store_true", help="a one-minute smoke of everything")
    p.add_argument("--concurrency", type=int, default=6, help="clients (2/3 of them sessions)")
    p.add_argument("--parallel", type=int, default=2, help="slots per model")
    p.add_argument("--ctx-per-slot", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--walkaway", type=float, default=0.12, help="share of clients that leave")
    p.add_argument(
        "--fault-every",
        "--kill-every",
        dest="fault_every",
        type=float,
        default=None,
        help="seconds between engine faults (0: none; default 30, --quick 11)",
    )
    p.add_argument("--idle-ttl", type=float, default=None, help=f"{IDLE_MODEL}'s idle_ttl")
    p.add_argument("--deadline", type=float, default=90.0, help="seconds a request may take")
    p.add_argument("--sample-every", type=float, default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--fd-slack", type=int, default=8)
    p.add_argument("--rss-slack-pct", type=float, default=10.0)
    p.add_argument("--engine-binary", default=None, help="llama-server for the host")
    p.add_argument("--logs", type=Path, default=None)
    p.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = p.parse_args(argv)
    settings = settings_from(args)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="gezel-soak-"))
    report = run_soak(settings, binary=args.engine_binary, logs=logs)
    misses = report.misses(rss_slack_pct=settings.rss_slack_pct, fd_slack=settings.fd_slack)
    print(report.summary())
    for what, lines in report.examples.items():
        for line in lines:
            print(f"  {what}: {line}")
    for line in report.host_log_warnings:
        print(f"  host log: {line}")
    payload = report.as_dict()
    payload["aims_missed"] = misses
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}; logs in {logs}")
    if misses:
        print("AIMS MISSED: " + "; ".join(misses))
        return 1
    print("all aims met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
