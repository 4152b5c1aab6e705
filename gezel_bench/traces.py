"""Request traces: the native ``gezel-trace`` format, importers, scaling and oracles.

A :class:`Trace` is a set of :class:`Session` objects, each an ordered tuple of
:class:`Turn` objects. A turn carries the prompt as a list of *hash block ids*: equal ids
mean equal content, so the ids alone say how much of a prompt is shared with earlier
turns. :mod:`gezel_bench.synth` turns the ids into token ids.

The native format is JSON Lines (documented in ``docs/benchmarks.md``)::

    {"format": "gezel-trace", "version": 1, "block_size": 8, "source": "...", "scaling": {...}}
    {"session": "s1", "turn": 0, "t": 0.0, "think_time": 0.0, "blocks": [1, 2],
     "prompt_tokens": 13, "output_tokens": 4, "parent": null}

Importers read the Weka kv-cache-tester conversations (:func:`import_weka`) and the
Mooncake conversation trace (:func:`import_mooncake`); :func:`scale_trace` shrinks a
trace for a small machine and records what it did in ``Trace.scaling``.

Everything here is synchronous and pure (file reads aside); nothing here knows Trio.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from .errors import BenchError, TraceFormatError

__all__ = [
    "FORMAT",
    "VERSION",
    "Scaling",
    "Session",
    "Trace",
    "Turn",
    "block_reuse_ratio",
    "common_prefix_len",
    "dump_trace",
    "import_mooncake",
    "import_weka",
    "load_trace",
    "oracle_tokens",
    "save_trace",
    "scale_trace",
]

FORMAT = "gezel-trace"
VERSION = 1


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a session.

    ``t`` is the arrival time in seconds since the trace began (open loop);
    ``think_time`` the seconds between the previous response of the same session and
    this request (closed loop). ``blocks`` are the prompt's hash block ids; the prompt
    is their concatenation cut to ``prompt_tokens`` (and, where the blocks do not cover
    ``prompt_tokens``, followed by tokens unique to this turn).
    """

    session: str
    index: int
    t: float
    think_time: float
    blocks: tuple[int, ...]
    prompt_tokens: int
    output_tokens: int

    @property
    def key(self) -> tuple[str, int]:
        return (self.session, self.index)


@dataclass(frozen=True, slots=True)
class Session:
    """A conversation: turns in order. A sub-agent names its ``parent`` session and
    ``spawn_after``, the number of the parent's turns that complete before it starts
    (in closed loop the parent's next turn then waits for the sub-agent to finish)."""

    id: str
    turns: tuple[Turn, ...]
    parent: str | None = None
    spawn_after: int | None = None

    @property
    def start(self) -> float:
        return self.turns[0].t if self.turns else 0.0

    def __repr__(self) -> str:
        sub = f" parent={self.parent!r}@{self.spawn_after}" if self.parent else ""
        return f"<Session {self.id!r} turns={len(self.turns)} start={self.start:.3f}{sub}>"


@dataclass(frozen=True, slots=True)
class Scaling:
    """How to shrink a trace for a small machine. ``None`` keeps the source value.

    - ``tokens_per_block``: the new block size in tokens (e.g. 64-token Weka blocks to 8);
      prompt lengths scale by the same ratio (rounded up, so the block structure holds).
    - ``output_scale``: factor on output lengths (default: the token ratio);
      ``max_output_tokens`` caps them.
    - ``max_prompt_tokens``: a session ends before its first turn whose scaled prompt is
      longer (keeps prompts inside a slot's context).
    - ``max_sessions``: keep that many root conversations (their sub-agents come along),
      the earliest first, or a seeded sample when ``seed`` is set.
    - ``max_turns``: per session; ``max_requests``: in all, by arrival order.
    - ``time_scale``: factor on timestamps and think times, applied at replay.
    - ``stagger``: seconds added to the k-th kept root session's times (``k * stagger``),
      for sources whose conversations all start at 0 (Weka).
    """

    tokens_per_block: int | None = None
    output_scale: float | None = None
    max_output_tokens: int | None = None
    max_prompt_tokens: int | None = None
    max_sessions: int | None = None
    max_turns: int | None = None
    max_requests: int | None = None
    time_scale: float = 1.0
    stagger: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "tokens_per_block",
            "max_output_tokens",
            "max_prompt_tokens",
            "max_sessions",
            "max_turns",
            "max_requests",
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise BenchError(f"scaling {name} must be a positive integer, not {value!r}")
        if self.output_scale is not None and not self.output_scale > 0:
            raise BenchError(f"scaling output_scale must be > 0, not {self.output_scale!r}")
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise BenchError(f"scaling time_scale must be > 0, not {self.time_scale!r}")
        if not (self.stagger >= 0 and math.isfinite(self.stagger)):
            raise BenchError(f"scaling stagger must be >= 0, not {self.stagger!r}")


@dataclass(frozen=True, slots=True, eq=False)
class Trace:
    """Sessions in start order, the block size in tokens, where it came from, and the
    scaling record (a JSON-able dict; ``time_scale`` there is applied at replay)."""

    block_size: int
    source: str
    sessions: tuple[Session, ...]
    scaling: Mapping[str, Any] = field(default_factory=dict)

    @property
    def time_scale(self) -> float:
        return float(self.scaling.get("time_scale", 1.0))

    @property
    def n_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def session(self, session_id: str) -> Session:
        for s in self.sessions:
            if s.id == session_id:
                return s
        raise KeyError(session_id)

    def requests(self) -> list[Turn]:
        """Every turn in arrival order (ties: session order, then turn index)."""
        order = {s.id: i for i, s in enumerate(self.sessions)}
        turns = [t for s in self.sessions for t in s.turns]
        turns.sort(key=lambda t: (t.t, order[t.session], t.index))
        return turns

    def block_ids(self) -> set[int]:
        return {b for s in self.sessions for t in s.turns for b in t.blocks}

    def with_time_scale(self, time_scale: float) -> Trace:
        Scaling(time_scale=time_scale)  # validates
        return replace(self, scaling={**self.scaling, "time_scale": time_scale})

    def statistics(self) -> dict[str, Any]:
        turns = [t for s in self.sessions for t in s.turns]
        return {
            "source": self.source,
            "block_size": self.block_size,
            "sessions": len(self.sessions),
            "sub_agent_sessions": sum(1 for s in self.sessions if s.parent is not None),
            "requests": len(turns),
            "prompt_tokens": sum(t.prompt_tokens for t in turns),
            "output_tokens": sum(t.output_tokens for t in turns),
            "max_prompt_tokens": max((t.prompt_tokens for t in turns), default=0),
            "max_turns": max((len(s.turns) for s in self.sessions), default=0),
            "span_s": max((t.t for t in turns), default=0.0),
            "distinct_blocks": len(self.block_ids()),
        }

    def __repr__(self) -> str:
        return (
            f"<Trace {self.source!r} sessions={len(self.sessions)} "
            f"requests={self.n_requests} block_size={self.block_size}>"
        )


# ---------------------------------------------------------------------------- oracles


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def oracle_tokens(trace: Trace) -> dict[tuple[str, int], int]:
    """Tokens an unlimited per-session prefix cache would reuse, per ``(session, turn)``.

    For a turn ``r`` and each earlier turn ``q`` of the *same* session, the shared
    prompt prefix is ``min(L * block_size, prompt_tokens(q))`` tokens, where ``L`` is the
    number of leading block ids the two turns have in common (the prompt of ``q`` may
    end inside its last block). The oracle is the largest over all earlier ``q``,
    capped at ``prompt_tokens(r) - 1``: an engine always evaluates at least one token.
    The first turn of a session has oracle 0.
    """
    out: dict[tuple[str, int], int] = {}
    bs = trace.block_size
    for s in trace.sessions:
        earlier: list[Turn] = []
        for turn in s.turns:
            best = 0
            for q in earlier:
                shared = min(common_prefix_len(turn.blocks, q.blocks) * bs, q.prompt_tokens)
                best = max(best, shared)
            out[turn.key] = max(0, min(best, turn.prompt_tokens - 1))
            earlier.append(turn)
    return out


def block_reuse_ratio(trace: Trace, *, scope: str = "global") -> float:
    """Share of all prompt blocks that an unlimited prefix cache would hold already.

    Requests are taken in arrival order; a request reuses its longest leading run of
    blocks that some earlier request had in the same positions (ids are prefix
    hashes). ``scope="global"`` matches against every earlier request (the figure the
    Mooncake README quotes, ~36.6%), ``scope="session"`` only against the same session.
    """
    if scope not in ("global", "session"):
        raise ValueError(f"scope must be 'global' or 'session', not {scope!r}")
    tries: dict[str, dict[tuple[int, int], int]] = {}
    total = hits = 0
    for turn in trace.requests():
        trie = tries.setdefault("" if scope == "global" else turn.session, {})
        node, matched = 0, True
        for b in turn.blocks:
            total += 1
            child = trie.get((node, b))
            if child is None:
                matched = False
                child = len(trie) + 1
                trie[(node, b)] = child
            elif matched:
                hits += 1
            node = child
    return hits / total if total else 0.0


# ------------------------------------------------------------------ native format I/O


def _header(trace: Trace) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "block_size": trace.block_size,
        "source": trace.source,
        "scaling": dict(trace.scaling),
        "sessions": len(trace.sessions),
        "requests": trace.n_requests,
    }


def _turn_line(turn: Turn, session: Session) -> dict[str, Any]:
    line: dict[str, Any] = {
        "session": turn.session,
        "turn": turn.index,
        "t": round(turn.t, 6),
        "think_time": round(turn.think_time, 6),
        "blocks": list(turn.blocks),
        "prompt_tokens": turn.prompt_tokens,
        "output_tokens": turn.output_tokens,
        "parent": session.parent,
    }
    if session.parent is not None:
        line["spawn_after"] = session.spawn_after
    return line


def dump_trace(trace: Trace, fp: IO[str]) -> None:
    """Write ``trace`` in the native format: the header, then one line per request."""
    by_id = {s.id: s for s in trace.sessions}
    fp.write(json.dumps(_header(trace), separators=(",", ":")) + "\n")
    for turn in trace.requests():
        line = _turn_line(turn, by_id[turn.session])
        fp.write(json.dumps(line, separators=(",", ":")) + "\n")


def save_trace(trace: Trace, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fp:
        dump_trace(trace, fp)
    return path


def _field(obj: Mapping[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    if name not in obj:
        raise TraceFormatError(f"{where}: missing field {name!r}")
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TraceFormatError(f"{where}: field {name!r} has the wrong type ({value!r})")
    return value


def _nonneg(value: float, name: str, where: str) -> float:
    value = float(value)
    if not (value >= 0 and math.isfinite(value)):
        raise TraceFormatError(f"{where}: field {name!r} must be a finite number >= 0")
    return value


def load_trace(path: Path) -> Trace:
    """Read a native trace; :class:`TraceFormatError` names the line and field."""
    path = Path(path)
    with path.open("r", encoding="utf-8") as fp:
        return _parse_native(fp, str(path))


def _parse_native(lines: Iterable[str], name: str) -> Trace:
    it = iter(lines)
    header_line = next(it, "")
    try:
        header = json.loads(header_line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{name}:1: header is not JSON ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise TraceFormatError(f"{name}:1: not a {FORMAT} file (header format field)")
    if header.get("version") != VERSION:
        raise TraceFormatError(f"{name}:1: unsupported version {header.get('version')!r}")
    block_size = _field(header, "block_size", int, f"{name}:1")
    if block_size < 1:
        raise TraceFormatError(f"{name}:1: block_size must be >= 1")
    scaling = header.get("scaling") or {}
    if not isinstance(scaling, dict):
        raise TraceFormatError(f"{name}:1: scaling must be an object")

    turns: dict[str, dict[int, Turn]] = {}
    parents: dict[str, tuple[str | None, int | None]] = {}
    for lineno, raw in enumerate(it, start=2):
        if not raw.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{where}: not JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{where}: a request line must be an object")
        session = _field(obj, "session", str, where)
        if not session:
            raise TraceFormatError(f"{where}: empty session id")
        index = _field(obj, "turn", int, where)
        if index < 0:
            raise TraceFormatError(f"{where}: turn must be >= 0")
        t = _nonneg(_field(obj, "t", (int, float), where), "t", where)
        think = _nonneg(_field(obj, "think_time", (int, float), where), "think_time", where)
        blocks = _field(obj, "blocks", list, where)
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks):
            raise TraceFormatError(f"{where}: blocks must be a list of integers")
        prompt = _field(obj, "prompt_tokens", int, where)
        output = _field(obj, "output_tokens", int, where)
        if prompt < 1 or output < 1:
            raise TraceFormatError(f"{where}: prompt_tokens and output_tokens must be >= 1")
        parent = obj.get("parent")
        spawn_after = obj.get("spawn_after")
        if parent is not None and not isinstance(parent, str):
            raise TraceFormatError(f"{where}: parent must be a session id or null")
        if parent is not None and (
            not isinstance(spawn_after, int) or isinstance(spawn_after, bool) or spawn_after < 0
        ):
            raise TraceFormatError(f"{where}: a sub-agent line needs spawn_after >= 0")
        if parent is None:
            spawn_after = None
        if parents.setdefault(session, (parent, spawn_after)) != (parent, spawn_after):
            raise TraceFormatError(f"{where}: session {session!r} changes its parent")
        per = turns.setdefault(session, {})
        if index in per:
            raise TraceFormatError(f"{where}: session {session!r} repeats turn {index}")
        per[index] = Turn(session, index, t, think, tuple(blocks), prompt, output)

    sessions: list[Session] = []
    for sid, per in turns.items():
        if sorted(per) != list(range(len(per))):
            raise TraceFormatError(f"{name}: session {sid!r} turns are not 0..{len(per) - 1}")
        ordered = tuple(per[i] for i in range(len(per)))
        for a, b in itertools.pairwise(ordered):
            if b.t < a.t:
                raise TraceFormatError(f"{name}: session {sid!r} turn {b.index} goes back in t")
        parent, spawn_after = parents[sid]
        sessions.append(Session(sid, ordered, parent, spawn_after))
    by_id = {s.id: s for s in sessions}
    for s in sessions:
        if s.parent is None:
            continue
        parent_session = by_id.get(s.parent)
        if parent_session is None:
            raise TraceFormatError(f"{name}: session {s.id!r} names unknown parent {s.parent!r}")
        if (s.spawn_after or 0) > len(parent_session.turns):
            raise TraceFormatError(
                f"{name}: session {s.id!r} spawns after turn {s.spawn_after} of {s.parent!r}, "
                f"which has {len(parent_session.turns)}"
            )
    _check_no_cycles(sessions, name)
    source = header.get("source")
    return Trace(
        block_size=block_size,
        source=source if isinstance(source, str) else name,
        sessions=_sorted_sessions(sessions),
        scaling=scaling,
    )


def _check_no_cycles(sessions: Sequence[Session], name: str) -> None:
    parent_of = {s.id: s.parent for s in sessions}
    for s in sessions:
        seen = {s.id}
        p = s.parent
        while p is not None:
            if p in seen:
                raise TraceFormatError(f"{name}: sub-agent parents form a cycle at {s.id!r}")
            seen.add(p)
            p = parent_of.get(p)


def _sorted_sessions(sessions: Iterable[Session]) -> tuple[Session, ...]:
    return tuple(sorted(sessions, key=lambda s: (s.start, s.id)))


# ------------------------------------------------------------------------- importers


def _source_record(block_size: int, sessions: Sequence[Session]) -> dict[str, Any]:
    return {
        "source_block_size": block_size,
        "source_sessions": len(sessions),
        "source_requests": sum(len(s.turns) for s in sessions),
    }


class _IdSpace:
    """Dense, deterministic renumbering of (namespace, source id) pairs."""

    def __init__(self) -> None:
        self._ids: dict[tuple[str, int], int] = {}

    def __call__(self, namespace: str, source_id: int) -> int:
        key = (namespace, source_id)
        got = self._ids.get(key)
        if got is None:
            got = self._ids[key] = len(self._ids) + 1
        return got


def _weka_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.glob("*.json") if p.is_file())
        if not files:
            raise TraceFormatError(f"{path}: no *.json conversation files")
        return files
    if path.is_file():
        return [path]
    raise TraceFormatError(f"{path}: no such file or directory")


def import_weka(path: Path) -> Trace:
    """Read Weka kv-cache-tester conversations (a directory of JSON files, or one file).

    Each file is one root session, named by its ``id``. Requests keep ``t`` (seconds
    since the conversation began), ``think_time`` (when absent: the gap since the
    previous request's end, ``t - t_prev - api_time_prev``, else ``t - t_prev``), ``in``
    and ``out`` token counts and ``hash_ids``. An entry with ``type == "subagent"`` is a
    sub-agent marker: its nested ``requests`` (timestamps relative to the marker's
    ``t``) become a separate session ``<parent>/<agent_id>`` with ``parent`` set and
    ``spawn_after`` = the number of parent requests before the marker; markers nest.
    ``hash_id_scope: "local"`` ids are renumbered per file so that two conversations
    never share a block by accident; ``"global"`` ids keep their identity across files.
    """
    path = Path(path)
    ids = _IdSpace()
    sessions: list[Session] = []
    block_size: int | None = None
    for file_no, file in enumerate(_weka_files(path)):
        where = str(file)
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise TraceFormatError(f"{where}: cannot read ({exc})") from None
        if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
            raise TraceFormatError(f"{where}: not a Weka trace (no requests list)")
        bs = _field(data, "block_size", int, where)
        if block_size is None:
            block_size = bs
        elif bs != block_size:
            raise TraceFormatError(f"{where}: block_size {bs} differs from {block_size}")
        scope = data.get("hash_id_scope", "local")
        namespace = "global" if scope == "global" else f"file{file_no}"
        root = str(data.get("id") or file.stem)
        _weka_session(data["requests"], root, 0.0, None, None, namespace, ids, sessions, where)
    assert block_size is not None
    return Trace(
        block_size=block_size,
        source=f"weka:{path}",
        sessions=_sorted_sessions(sessions),
        scaling=_source_record(block_size, sessions),
    )


def _weka_session(
    requests: list[Any],
    session_id: str,
    base_t: float,
    parent: str | None,
    spawn_after: int | None,
    namespace: str,
    ids: _IdSpace,
    out: list[Session],
    where: str,
) -> None:
    turns: list[Turn] = []
    subagents: list[tuple[dict[str, Any], int]] = []
    prev: dict[str, Any] | None = None
    for n, req in enumerate(requests):
        w = f"{where}: session {session_id!r} request {n}"
        if not isinstance(req, dict):
            raise TraceFormatError(f"{w}: not an object")
        if req.get("type") == "subagent":
            subagents.append((req, len(turns)))
            continue
        t = _nonneg(_field(req, "t", (int, float), w), "t", w)
        hash_ids = _field(req, "hash_ids", list, w)
        prompt = _field(req, "in", int, w)
        output = _field(req, "out", int, w)
        think = req.get("think_time")
        if think is None:
            if prev is None:
                think = 0.0
            else:
                think = t - float(prev["t"]) - float(prev.get("api_time") or 0.0)
        think = max(0.0, float(think))
        turns.append(
            Turn(
                session=session_id,
                index=len(turns),
                t=base_t + t,
                think_time=think,
                blocks=tuple(ids(namespace, int(h)) for h in hash_ids),
                prompt_tokens=max(1, prompt),
                output_tokens=max(1, output),
            )
        )
        prev = req
    if turns:
        out.append(Session(session_id, tuple(turns), parent, spawn_after))
    used: set[str] = set()
    for k, (marker, after) in enumerate(subagents, start=1):
        name = str(marker.get("agent_id") or f"sa{k}")
        if name in used:
            name = f"{name}-{k}"
        used.add(name)
        nested = marker.get("requests") or []
        if not isinstance(nested, list):
            raise TraceFormatError(f"{where}: sub-agent {name!r} requests is not a list")
        marker_t = _nonneg(marker.get("t", 0.0), "t", where)
        _weka_session(
            nested,
            f"{session_id}/{name}",
            base_t + marker_t,
            session_id if turns else parent,
            after if turns else spawn_after,
            namespace,
            ids,
            out,
            where,
        )


MOONCAKE_BLOCK_SIZE = 512


def import_mooncake(path: Path, *, min_shared_blocks: int = 2) -> Trace:
    """Read the Mooncake FAST'25 JSONL trace and infer its sessions.

    Lines are ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``; an id
    stands for the whole prefix up to its 512-token block. The rule, in arrival order
    (file order on equal timestamps): find the earlier request with the longest
    common block prefix (ties: the most recent). If that prefix is at least
    ``min_shared_blocks`` long and that request is the latest turn of its session,
    this request is that session's next turn; otherwise it starts a new session (a
    prefix shared by every request, such as a system prompt in block 0, is not a
    conversation, hence the default of 2; a request that branches off an older turn
    starts a new session). ``think_time`` is the gap since the session's previous
    arrival: the trace has no response times, so replay it open loop to keep its pace.
    """
    if min_shared_blocks < 1:
        raise BenchError("min_shared_blocks must be >= 1")
    path = Path(path)
    rows: list[tuple[float, int, list[int], int, int]] = []
    try:
        fp = path.open("r", encoding="utf-8")
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot read ({exc})") from None
    with fp:
        for lineno, raw in enumerate(fp, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{where}: not JSON ({exc})") from None
            ts = _nonneg(_field(obj, "timestamp", (int, float), where), "timestamp", where)
            hash_ids = _field(obj, "hash_ids", list, where)
            rows.append(
                (
                    ts / 1000.0,
                    lineno,
                    [int(h) for h in hash_ids],
                    max(1, _field(obj, "input_length", int, where)),
                    max(1, _field(obj, "output_length", int, where)),
                )
            )
    rows.sort(key=lambda r: (r[0], r[1]))

    # A trie over block ids; each node remembers the latest request that passed it.
    children: dict[tuple[int, int], int] = {}
    last_through: list[int] = [-1]  # node -> request index
    session_of: list[int] = []
    tips: list[int] = []  # session -> its latest request index
    members: list[list[int]] = []
    for i, (_, _, blocks, _, _) in enumerate(rows):
        node, depth = 0, 0
        for b in blocks:
            child = children.get((node, b))
            if child is None:
                break
            node, depth = child, depth + 1
        sid = -1
        if depth >= min_shared_blocks:
            q = last_through[node]
            if tips[session_of[q]] == q:
                sid = session_of[q]
        if sid < 0:
            sid = len(tips)
            tips.append(i)
            members.append([])
        session_of.append(sid)
        tips[sid] = i
        members[sid].append(i)
        node = 0
        for b in blocks:
            child = children.get((node, b))
            if child is None:
                child = len(last_through)
                children[(node, b)] = child
                last_through.append(i)
            else:
                last_through[child] = i
            node = child

    width = max(4, len(str(len(members))))
    sessions: list[Session] = []
    for sid, idxs in enumerate(members):
        name = f"mc{sid:0{width}d}"
        turns: list[Turn] = []
        prev_t: float | None = None
        for k, i in enumerate(idxs):
            t, _, blocks, prompt, output = rows[i]
            think = 0.0 if prev_t is None else t - prev_t
            turns.append(Turn(name, k, t, think, tuple(blocks), prompt, output))
            prev_t = t
        sessions.append(Session(name, tuple(turns)))
    return Trace(
        block_size=MOONCAKE_BLOCK_SIZE,
        source=f"mooncake:{path}",
        sessions=_sorted_sessions(sessions),
        scaling={
            **_source_record(MOONCAKE_BLOCK_SIZE, sessions),
            "min_shared_blocks": min_shared_blocks,
        },
    )


# --------------------------------------------------------------------------- scaling


def _descendants(sessions: Sequence[Session], roots: set[str]) -> set[str]:
    keep = set(roots)
    changed = True
    while changed:
        changed = False
        for s in sessions:
            if s.parent in keep and s.id not in keep:
                keep.add(s.id)
                changed = True
    return keep


def scale_trace(trace: Trace, scaling: Scaling) -> Trace:
    """Shrink ``trace`` as ``scaling`` says; the result's ``scaling`` records every value.

    Order: pick root sessions (``max_sessions``, earliest first or a seeded sample)
    with their sub-agents; stagger root start times; scale token counts; cut each
    session at ``max_turns`` and before its first turn over ``max_prompt_tokens``; keep
    the first ``max_requests`` requests by arrival (each session keeps a prefix of its
    turns). Sessions left empty are dropped, with their sub-agents; a sub-agent whose
    spawn point was cut away spawns after the parent's last kept turn.
    """
    source_bs = int(trace.scaling.get("source_block_size", trace.block_size))
    prior_ratio = float(trace.scaling.get("token_ratio", 1.0))
    new_bs = scaling.tokens_per_block or trace.block_size
    ratio = new_bs / trace.block_size
    out_scale = scaling.output_scale if scaling.output_scale is not None else ratio

    roots = [s for s in trace.sessions if s.parent is None]
    if scaling.max_sessions is not None and scaling.max_sessions < len(roots):
        if scaling.seed is None:
            chosen = roots[: scaling.max_sessions]
        else:
            chosen = random.Random(scaling.seed).sample(roots, scaling.max_sessions)
            chosen.sort(key=lambda s: (s.start, s.id))
    else:
        chosen = list(roots)
    offset = {s.id: k * scaling.stagger for k, s in enumerate(chosen)}
    keep = _descendants(trace.sessions, {s.id for s in chosen})
    root_of: dict[str, str] = {}
    by_id = {s.id: s for s in trace.sessions}
    for sid in keep:
        r = sid
        while by_id[r].parent is not None:
            r = by_id[r].parent  # type: ignore[assignment]
        root_of[sid] = r

    staged: list[Session] = []
    for s in trace.sessions:
        if s.id not in keep:
            continue
        shift = offset[root_of[s.id]]
        turns: list[Turn] = []
        for turn in s.turns:
            if scaling.max_turns is not None and len(turns) >= scaling.max_turns:
                break
            prompt = max(1, math.ceil(turn.prompt_tokens * ratio - 1e-9))
            if scaling.max_prompt_tokens is not None and prompt > scaling.max_prompt_tokens:
                break
            output = max(1, round(turn.output_tokens * out_scale))
            if scaling.max_output_tokens is not None:
                output = min(output, scaling.max_output_tokens)
            turns.append(
                replace(turn, t=turn.t + shift, prompt_tokens=prompt, output_tokens=output)
            )
        staged.append(replace(s, turns=tuple(turns)))

    if scaling.max_requests is not None:
        order = {s.id: i for i, s in enumerate(staged)}
        everything = sorted(
            (t for s in staged for t in s.turns), key=lambda t: (t.t, order[t.session], t.index)
        )
        allowed = {t.key for t in everything[: scaling.max_requests]}
        cut: list[Session] = []
        for s in staged:
            kept: list[Turn] = []
            for turn in s.turns:
                if turn.key not in allowed:
                    break
                kept.append(turn)
            cut.append(replace(s, turns=tuple(kept)))
        staged = cut

    alive = {s.id: s for s in staged if s.turns}
    final: list[Session] = []
    for s in staged:
        if s.id not in alive:
            continue
        p = s.parent
        if p is not None:
            parent = alive.get(p)
            if parent is None or any(q not in alive for q in _ancestors(p, by_id)):
                continue
            s = replace(s, spawn_after=min(s.spawn_after or 0, len(parent.turns)))
        final.append(s)

    record = {
        **{k: v for k, v in trace.scaling.items() if k not in ("time_scale",)},
        "source_block_size": source_bs,
        "block_size": new_bs,
        "token_ratio": prior_ratio * ratio,
        "output_scale": out_scale,
        "max_output_tokens": scaling.max_output_tokens,
        "max_prompt_tokens": scaling.max_prompt_tokens,
        "max_sessions": scaling.max_sessions,
        "max_turns": scaling.max_turns,
        "max_requests": scaling.max_requests,
        "time_scale": scaling.time_scale,
        "stagger": scaling.stagger,
        "seed": scaling.seed,
        "source_sessions": trace.scaling.get("source_sessions", len(trace.sessions)),
        "source_requests": trace.scaling.get("source_requests", trace.n_requests),
    }
    return Trace(
        block_size=new_bs,
        source=trace.source,
        sessions=_sorted_sessions(final),
        scaling=record,
    )


def _ancestors(session_id: str, by_id: Mapping[str, Session]) -> Iterator[str]:
    p = by_id[session_id].parent
    while p is not None:
        yield p
        p = by_id[p].parent
