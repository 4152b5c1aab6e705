"""Typed, validated configuration: a TOML file, then ``GEZEL_*`` env overrides, then CLI flags.

Every validation error names the key (``models[0].parallel``) and says what
was expected. One pass finds them all: a :class:`~gezel_trio.errors.ConfigError`
carries every problem of the file (its ``detail``: one line each), and
:func:`read_config` returns them with the config as far as it is valid.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import types
import typing
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..engine.sd_argv import SD_FILE_FLAGS
from ..errors import ConfigError

GpuPolicySetting = Literal["auto", "coexist", "swap"]
LogLevel = Literal["debug", "info", "warning", "error"]
KeylessMode = Literal["shared", "conversation", "blind"]
ModelKind = Literal["text", "image"]
"""How the host treats requests that name no session (``[scheduler] keyless``)."""

MODEL_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "gezel-trio"


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: list[str] = field(default_factory=list)
    admin_keys: list[str] = field(default_factory=list)
    max_body_bytes: int = 8 * 1024 * 1024
    log_level: LogLevel = "info"
    cors_origins: list[str] = field(default_factory=list)
    stream_start_timeout: float = 10.0
    """Seconds a streaming response's body may take to start after its head was
    handed over; past it the client is gone and its request is cancelled. Only under
    another ASGI server than :func:`~gezel_trio.front_guard.serve_front`, whose
    connections end a stream as soon as its client leaves, started or not."""
    stream_stall_timeout: float = 120.0
    """Seconds a client may stop reading before its request is cancelled and its connection
    reset: a stream's relay gives up on it, and so does every response write (see
    :mod:`gezel_trio.front_guard`)."""
    sse_keepalive_interval: float = 5.0
    """A streaming request still waiting (queued, or its model loading) after this many
    seconds gets its 200 response head and an SSE comment every as many seconds, so
    clients and reverse proxies do not time out; 0 waits silently."""
    shutdown_timeout: float = 10.0
    """Seconds from SIGINT/SIGTERM to the end of the shutdown. Running requests get all of
    it but the last 2 s (at most half of it); then every client connection still open is
    reset, and the host parks its sessions' KV and stops its engines in the time left."""
    keep_alive_timeout: float = 75.0
    """Seconds an idle client connection stays open; also the most a client may take to
    send a request's head, counted from the connection (or its previous response)."""
    body_timeout: float = 60.0
    """Seconds a client may take to send a request's body once the request reads it; past
    it the request fails with 408 and the connection closes."""
    ollama_listen: str | None = None
    """A second address to serve on, ``"host:port"`` (``"127.0.0.1:11434"``, ``"[::1]:11434"``),
    for apps that hard-code Ollama's port: the same app, routes and keys. None: none."""


@dataclass
class EngineConfig:
    binary: str | None = None
    sd_server: str | None = None
    """The image engine (sd-server) to run; unset: ``$GEZEL_SD_SERVER``, ``PATH``, then a
    ``build-engine`` build (see :func:`~gezel_trio.engine.binary.resolve_sd_server`)."""
    state_dir: str | None = None
    load_timeout: float = 120.0
    """Seconds from spawn to ``/health`` 200 before the start counts as failed."""
    request_timeout: float = 600.0
    """Seconds without a byte from the engine before a request fails (a hung engine)."""
    health_interval: float = 2.0
    """Seconds between health checks of a READY engine."""
    health_failures: int = 3
    """Consecutive failed health checks before a READY engine is restarted."""
    stop_grace: float = 10.0
    """Seconds between SIGTERM and SIGKILL."""
    log_lines: int = 400
    extra_args: list[str] = field(default_factory=list)
    models_dir: str | None = None
    """Serve every GGUF in this folder with the defaults (as llama-server's router does):
    split files are one model, an ``mmproj`` file is paired with its model, ids come
    from the file names, and files added or removed while serving are picked up. A
    ``[[models]]`` entry for the same file wins."""
    models_dir_poll: float = 2.0
    """Seconds between looks at ``models_dir`` for files added or removed."""


@dataclass
class SchedulerConfig:
    max_queue: int = 256
    slot_poll: float = 0.25
    affinity: bool = True
    affinity_max_wait: float = 1.0
    """Seconds a queued request may be passed over by sessions that hold slots."""
    short_first_passes: int = 4
    """Times a queued request with a long prefill (more than a batch of new tokens) may be
    passed over by one with a short prefill, such as an agent's next turn on its parked
    or held KV (0: first come, first served)."""
    erase_on_handoff: bool = True
    blind_handoff: bool = True
    """A slot handed to a new owner is not erased first: the request is sent with
    ``cache_prompt`` off, so the engine clears the slot and reads nothing it held (one
    upstream call per handoff instead of two). The slot counts as the new owner's only
    once the engine's first token came; until then it is unknown. Off: erase first."""
    kv_parking: bool = True
    """Save a chat's KV to disk (slot save) when its slot is handed over or its engine
    stops on purpose, and restore it when the chat returns, into any later engine."""
    kv_store_bytes: int | None = None
    """Bytes the parked-KV files may take, over every model (least recently used are
    evicted beyond). None: a quarter of the state dir's free space, at most 32 GiB."""
    park_on_stop_timeout: float = 10.0
    """Seconds a planned engine stop may spend saving its slots before SIGTERM."""
    save_idle_slots: bool = True
    """With ``kv_parking``: save an owner's slot in the background once its request has
    ended and the slot stayed idle ``save_idle_delay`` seconds, so that the next
    handoff of that slot skips the save (restore and request: 2 upstream calls; the
    request alone to an emptied slot, with ``blind_handoff``)."""
    save_idle_delay: float = 0.05
    save_lone_delay: float = 0.1
    """Seconds a slot that no handoff is likely to take (a fresh or clean slot is left
    for a newcomer) stays idle before it is saved anyway, so that a new session of its
    caller, or its owner back after its engine stopped, finds its copy current; an
    agent's own next turn, mostly sooner, waits for no save. ``inf``: never."""
    lock_model: bool = False
    keyless: KeylessMode = "shared"
    """Requests that name no session: ``shared``, one owner per caller (its prompt
    cache kept in its slots, erased before another owner uses them); ``blind``,
    no owner (sent with ``cache_prompt`` off); ``conversation``, one owner per keyless
    conversation, found by how it opens, and parked like a named chat."""
    share_prefix_within_caller: bool = True
    """A request whose owner holds no KV for it may start from a slot another owner of
    the same caller (API key) left, sharing its prefix (its system prompt, say): the
    engine keeps only the tokens the two share. Attention models only; never across
    callers."""
    prefix_load_bound: int = 2
    """A replicated model's request goes to the member holding the longest prefix of its
    owner's KV unless that member's load (jobs queued and running) exceeds the least
    loaded member's by more than this; then to the least loaded."""


@dataclass
class GpuConfig:
    policy: GpuPolicySetting = "auto"
    temp_limit_c: float = 85.0
    temp_margin_c: float = 5.0
    stale_lease_minutes: float = 90.0
    lease_wait_poll: float = 60.0
    pressure_grace: float = 60.0


@dataclass
class ModelConfig:
    id: str
    path: str | None = None
    """A text model's GGUF file; an image model's one full model file (``--model``)."""
    url: str | None = None
    name: str | None = None
    parallel: int | None = None
    """Slots of the engine. Unset: up to :data:`~gezel_trio.engine.planner.AUTO_PARALLEL`,
    fewer when that many do not fit at the context per slot (see docs/configuration.md)."""
    ctx_per_slot: int | None = None
    """Tokens of context per slot. Unset: the model's trained context, shrunk only when
    memory cannot hold it. Above the trained context, the engine runs it with the
    model's context length overridden and YaRN rope scaling (a warning says so)."""
    args: list[str] = field(default_factory=list)
    idle_ttl: float = 0.0
    """Seconds an idle engine stays resident; 0 keeps it until evicted or stopped."""
    slot_class: str | None = None
    """The arbiter's slot class; models of one class never evict each other. Default: the id."""
    embeddings: bool = False
    reranking: bool = False
    """Start the engine with ``--reranking``: it serves the rerank routes (and no
    completions)."""
    allow_unsafe_batching: bool = False
    """Operator override: keep configured parallelism even if calibration fails."""
    rpc: list[str] = field(default_factory=list)
    """``host:port`` of ``ggml-rpc-server`` workers: the engine starts with ``--rpc`` and
    its layers spread over them (planned against the memory they report)."""
    replicas: int = 1
    """Engines of this model the host runs (each placed on its own device where it can)."""
    replica_urls: list[str] = field(default_factory=list)
    """External llama-servers that serve this model too: replicas on other machines."""
    replica_of: str | None = None
    """Set by the host on the engines it expands a replicated model into (not a key)."""
    kind: ModelKind = "text"
    """``text``: llama-server serves it; ``image``: stable-diffusion.cpp's sd-server."""
    files: dict[str, str] = field(default_factory=dict)
    """An image model's files, by sd-server's flag name with ``_`` for ``-``
    (``diffusion_model``, ``llm``, ``vae``, ``taesd``, ...; see
    :data:`~gezel_trio.engine.sd_argv.SD_FILE_FLAGS`)."""

    @property
    def external(self) -> bool:
        return self.url is not None

    @property
    def display_name(self) -> str:
        return self.name or self.id

    @property
    def gpu_class(self) -> str:
        return self.slot_class or self.id


@dataclass
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    models: list[ModelConfig] = field(default_factory=list)
    source: str | None = field(default=None, compare=False)
    """The file this config was read from (what a reload reads again); None: built in code."""

    @property
    def state_dir(self) -> Path:
        return Path(self.engine.state_dir) if self.engine.state_dir else default_state_dir()

    def model(self, model_id: str) -> ModelConfig | None:
        for m in self.models:
            if m.id == model_id:
                return m
        return None


# --------------------------------------------------------------------------- parsing

_SECTIONS: dict[str, type[Any]] = {
    "server": ServerConfig,
    "engine": EngineConfig,
    "scheduler": SchedulerConfig,
    "gpu": GpuConfig,
}


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (types.UnionType, typing.Union):
        # an optional key is left out to leave it unset: TOML has no null
        return " or ".join(_describe(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is list:
        (inner,) = typing.get_args(tp)
        return f"a list of {_describe(inner)}"
    if tp is type(None):
        return "null"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, str(tp)
    )


def _coerce(key: str, value: Any, tp: Any, *, from_text: bool) -> Any:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if type(None) in args and (value is None or (from_text and value == "")):
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg, from_text=from_text)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_describe(tp)}, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{key}: expected {_describe(tp)}, got {value!r}")
        return value
    if origin is dict:
        _, inner = typing.get_args(tp)
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a table of strings, got {value!r}")
        return {
            str(k): _coerce(f"{key}.{k}", v, inner, from_text=from_text) for k, v in value.items()
        }
    if origin is list:
        (inner,) = typing.get_args(tp)
        if from_text and isinstance(value, str):
            value = [v for v in (p.strip() for p in value.split(",")) if v]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected {_describe(tp)}, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, inner, from_text=from_text) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_text and isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if from_text and isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if from_text and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if isinstance(value, int | float):
            return float(value)
        if from_text and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {tp!r}")  # pragma: no cover


class _Reading:
    """What one pass over a config found: every problem (one line each, naming its key),
    the keys whose values were refused (their rules are not checked again), and the
    index in the file of each model that could be built."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.bad: set[str] = set()
        self.model_indices: list[int] = []

    def refuse(self, key: str, message: str) -> None:
        self.problems.append(message)
        self.bad.add(key)


def _build(cls: type[Any], data: Any, prefix: str, reading: _Reading) -> Any:
    """``cls`` from ``data``, or None when a required key is missing or ``data`` is not a
    table. Every unknown key and refused value is added to ``reading``; a refused value
    is left at its default."""
    if not isinstance(data, Mapping):
        reading.refuse(prefix, f"{prefix}: expected a table, got {data!r}")
        return None
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in sorted(set(data) - names, key=str):
        if prefix == "scheduler" and key == "pinning":
            reading.refuse(
                f"{prefix}.{key}",
                "scheduler.pinning: removed; every request is pinned to a slot the host "
                "has checked (delete the key)",
            )
        else:
            reading.refuse(
                f"{prefix}.{key}",
                f"{prefix}.{key}: unknown key; expected one of {', '.join(sorted(names))}",
            )
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in names:
            continue
        try:
            kwargs[key] = _coerce(f"{prefix}.{key}", value, hints[key], from_text=False)
        except ConfigError as exc:
            reading.refuse(f"{prefix}.{key}", exc.message)
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and f.name not in data
    ]
    for name in missing:
        reading.refuse(f"{prefix}.{name}", f"{prefix}.{name}: required key missing")
    if missing or any(
        f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and f.name not in kwargs
        for f in dataclasses.fields(cls)
    ):
        return None
    return cls(**kwargs)


def _read_mapping(data: Mapping[str, Any], reading: _Reading) -> Config:
    """A config from parsed TOML, as much of it as is valid (see :class:`_Reading`)."""
    for name in sorted(set(data) - {*_SECTIONS, "models"}, key=str):
        reading.refuse(
            name,
            f"{name}: unknown section; expected server, engine, scheduler, gpu or [[models]]",
        )
    cfg = Config()
    for name, cls in _SECTIONS.items():
        if name in data:
            section = _build(cls, data[name], name, reading)
            if section is not None:
                setattr(cfg, name, section)
    raw_models = data.get("models", [])
    if not isinstance(raw_models, list):
        reading.refuse("models", "models: expected an array of tables ([[models]])")
        raw_models = []
    for i, raw in enumerate(raw_models):
        model = _build(ModelConfig, _with_image_id(raw), f"models[{i}]", reading)
        if model is not None:
            cfg.models.append(model)
            reading.model_indices.append(i)
    return cfg


def _with_image_id(raw: Any) -> Any:
    """An image model's table with its default ``id``, when it has none: the stem of its
    ``path``, else of its ``model`` or ``diffusion_model`` file (``flux-2-klein.gguf``:
    ``flux-2-klein``). Anything else as it is (a missing id is refused by name)."""
    if not isinstance(raw, Mapping) or "id" in raw or raw.get("kind") != "image":
        return raw
    files = raw.get("files")
    files = files if isinstance(files, Mapping) else {}
    for file in (raw.get("path"), files.get("model"), files.get("diffusion_model")):
        if isinstance(file, str) and file:
            return {**raw, "id": Path(file).stem}
    return raw


def _raise_all(problems: list[str]) -> None:
    """Raise one :class:`ConfigError` for ``problems`` (if any): its message is every
    problem joined by ``"; "`` (the first key first), its ``detail`` the list."""
    if problems:
        raise ConfigError("; ".join(problems), detail=list(problems))


def config_from_mapping(data: Mapping[str, Any]) -> Config:
    """Build and validate a :class:`Config` from parsed TOML. Raises one
    :class:`ConfigError` naming every key that is wrong (``detail``: one line each)."""
    reading = _Reading()
    cfg = _read_mapping(data, reading)
    reading.problems += config_problems(cfg, skip=reading.bad, model_indices=reading.model_indices)
    _raise_all(reading.problems)
    return cfg


def split_listen(address: str) -> tuple[str, int] | None:
    """``"host:port"`` (``"[::1]:port"`` for IPv6) as (host, port); None if it is not one."""
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        return None
    return host, int(port)


def validate(cfg: Config) -> None:
    """Check cross-field rules. Raises one :class:`ConfigError` naming every key that
    breaks one (``detail``: one line each; the message: the lines joined by ``"; "``)."""
    _raise_all(config_problems(cfg))


def config_problems(
    cfg: Config,
    *,
    skip: Collection[str] = (),
    model_indices: Sequence[int] | None = None,
) -> list[str]:
    """Every cross-field rule ``cfg`` breaks, one line each, naming its key. Rules on a
    key in ``skip`` (a value already refused) are not checked; ``model_indices`` are the
    positions in the file of ``cfg.models`` (default: their own)."""
    out: list[str] = []

    def check(ok: bool, key: str, message: str, *also: str) -> None:
        if not ok and key not in skip and not any(k in skip for k in also):
            out.append(f"{key}: {message}")

    check(
        0 <= cfg.server.port <= 65535,
        "server.port",
        f"expected 0..65535, got {cfg.server.port}",
    )
    check(cfg.server.max_body_bytes >= 1024, "server.max_body_bytes", "expected at least 1024")
    listen = cfg.server.ollama_listen
    check(
        listen is None or split_listen(listen) is not None,
        "server.ollama_listen",
        f'expected "host:port", such as "127.0.0.1:11434", got {listen!r}',
    )
    for name in (
        "stream_start_timeout",
        "stream_stall_timeout",
        "shutdown_timeout",
        "keep_alive_timeout",
        "body_timeout",
    ):
        check(  # NaN too
            getattr(cfg.server, name) > 0, f"server.{name}", "expected a positive number of seconds"
        )
    for name in ("load_timeout", "request_timeout", "health_interval", "stop_grace"):
        check(
            getattr(cfg.engine, name) > 0, f"engine.{name}", "expected a positive number of seconds"
        )
    check(cfg.engine.health_failures >= 1, "engine.health_failures", "expected at least 1")
    check(
        cfg.server.sse_keepalive_interval >= 0,
        "server.sse_keepalive_interval",
        "expected seconds >= 0 (0: off)",
    )
    check(cfg.scheduler.max_queue >= 1, "scheduler.max_queue", "expected at least 1")
    check(
        cfg.scheduler.short_first_passes >= 0,
        "scheduler.short_first_passes",
        "expected 0 (off) or more",
    )
    check(
        cfg.scheduler.prefix_load_bound >= 0,
        "scheduler.prefix_load_bound",
        f"expected 0 or more, got {cfg.scheduler.prefix_load_bound}",
    )
    check(
        cfg.scheduler.slot_poll > 0,
        "scheduler.slot_poll",
        "expected a positive number of seconds",
    )
    kv_bytes = cfg.scheduler.kv_store_bytes
    check(
        kv_bytes is None
        or (not isinstance(kv_bytes, bool) and isinstance(kv_bytes, int) and kv_bytes >= 0),
        "scheduler.kv_store_bytes",
        "expected a whole number of bytes >= 0 (0 keeps nothing parked), or leave it out "
        "for the default",
    )
    check(
        cfg.scheduler.park_on_stop_timeout >= 0,
        "scheduler.park_on_stop_timeout",
        "expected seconds >= 0",
    )
    check(
        cfg.scheduler.save_idle_delay >= 0,
        "scheduler.save_idle_delay",
        "expected seconds >= 0",
    )
    check(
        cfg.scheduler.save_lone_delay >= 0,
        "scheduler.save_lone_delay",
        "expected seconds >= 0, or inf for never",
    )
    check(cfg.gpu.temp_margin_c >= 0, "gpu.temp_margin_c", "expected a number >= 0")
    indices = list(model_indices) if model_indices is not None else list(range(len(cfg.models)))
    seen: set[str] = set()
    for i, m in zip(indices, cfg.models, strict=True):
        key = f"models[{i}]"
        check(
            bool(MODEL_ID_RE.match(m.id)),
            f"{key}.id",
            f"expected letters, digits, '.', '_', ':' or '-' (max 128), got {m.id!r}",
        )
        check(m.id not in seen, f"{key}.id", f"duplicate model id {m.id!r}")
        seen.add(m.id)
        if m.kind == "image":
            out += _image_model_problems(m, key, skip)
            continue
        check(
            not m.files,
            f"{key}.files",
            'files are an image model\'s (kind = "image"); a text model has one path',
        )
        check(
            (m.path is None) != (m.url is None),
            key,
            "set exactly one of path (a GGUF file) or url (an engine)",
            f"{key}.path",
            f"{key}.url",
        )
        check(
            m.url is None or m.url.startswith(("http://", "https://")),
            f"{key}.url",
            f"expected an http:// or https:// URL, got {m.url!r}",
        )
        check(
            m.parallel is None or 1 <= m.parallel <= 256,
            f"{key}.parallel",
            f"expected 1..256, got {m.parallel}",
        )
        check(
            m.replica_of is None,
            f"{key}.replica_of",
            "set by the host, not a config key; remove it",
        )
        check(1 <= m.replicas <= 64, f"{key}.replicas", f"expected 1..64, got {m.replicas}")
        check(
            m.url is None or m.replicas == 1,
            f"{key}.replicas",
            "an external engine (url) is one replica; list the others in replica_urls",
            f"{key}.url",
        )
        for j, extra in enumerate(m.replica_urls):
            check(
                extra.startswith(("http://", "https://")),
                f"{key}.replica_urls[{j}]",
                f"expected an http:// or https:// URL, got {extra!r}",
                f"{key}.replica_urls",
            )
        check(
            not (m.rpc and m.url is not None),
            f"{key}.rpc",
            "an external engine (url) cannot be given RPC workers",
            f"{key}.url",
        )
        if f"{key}.rpc" not in skip:
            for j, endpoint in enumerate(m.rpc):
                from ..engine.rpc import parse_endpoint

                try:
                    parse_endpoint(endpoint, key=f"{key}.rpc[{j}]")
                except ConfigError as exc:
                    out.append(exc.message)
        check(
            m.ctx_per_slot is None or 64 <= m.ctx_per_slot <= 1 << 20,
            f"{key}.ctx_per_slot",
            f"expected 64..1048576, got {m.ctx_per_slot}",
        )
        check(m.idle_ttl >= 0, f"{key}.idle_ttl", f"expected seconds >= 0, got {m.idle_ttl}")
    return out


_TEXT_ONLY_KEYS = (
    "url",
    "parallel",
    "ctx_per_slot",
    "embeddings",
    "reranking",
    "allow_unsafe_batching",
    "rpc",
    "replicas",
    "replica_urls",
)
_SD_OWN_FLAGS = ("--listen-ip", "-l", "--listen-port")


def _image_model_problems(m: ModelConfig, key: str, skip: Collection[str]) -> list[str]:
    """The rules an image model (``kind = "image"``) breaks: its files (known flag names,
    files that exist), and no text-model key set. Reads the file system (stat)."""
    out: list[str] = []
    defaults = ModelConfig(id=m.id)
    for name in _TEXT_ONLY_KEYS:
        if getattr(m, name) != getattr(defaults, name) and f"{key}.{name}" not in skip:
            out.append(f'{key}.{name}: not an image model\'s key (kind = "image"); remove it')
    if f"{key}.files" in skip or f"{key}.path" in skip:
        return out
    if not m.files and m.path is None:
        out.append(
            f"{key}: an image model needs its files: path (one full model file) or a files "
            'table, such as files = {diffusion_model = "...", llm = "...", vae = "..."}'
        )
    for name, file in sorted(m.files.items()):
        if name not in SD_FILE_FLAGS:
            out.append(
                f"{key}.files.{name}: not a model-file flag of sd-server; expected one of "
                + ", ".join(SD_FILE_FLAGS)
            )
        elif not Path(file).expanduser().is_file():
            out.append(f"{key}.files.{name}: no such file {file!r}")
    if m.path is not None and not Path(m.path).expanduser().is_file():
        out.append(f"{key}.path: no such file {m.path!r}")
    if m.idle_ttl < 0:
        out.append(f"{key}.idle_ttl: expected seconds >= 0, got {m.idle_ttl}")
    for flag in m.args:
        if flag.split("=", 1)[0] in _SD_OWN_FLAGS:
            out.append(f"{key}.args: {flag} is the host's to set (it runs sd-server on loopback)")
    return out


@dataclass(frozen=True, slots=True)
class ConfigReading:
    """A config file read as far as it is valid: what :func:`read_config` returns."""

    config: Config
    """The config, with every refused value at its default and every model that could
    not be built left out."""
    problems: list[str]
    """Every problem found, one line each, naming its key."""
    model_indices: list[int]
    """The position in the file of each of ``config.models``."""


def read_config(
    path: str | os.PathLike[str] | None, env: Mapping[str, str] | None = None
) -> ConfigReading:
    """Read a TOML file (or start empty) with the env overrides, and validate it, collecting
    every problem in one pass instead of raising at the first (``check-config``). Raises
    :class:`ConfigError` only when the file cannot be read as TOML at all."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ConfigError(f"--config: no such file {str(p)!r}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: not valid TOML: {exc}") from exc
    reading = _Reading()
    cfg = _read_mapping(data, reading)
    _apply_env(cfg, os.environ if env is None else env, reading)
    reading.problems += config_problems(cfg, skip=reading.bad, model_indices=reading.model_indices)
    cfg.source = None if path is None else str(path)
    return ConfigReading(cfg, reading.problems, reading.model_indices)


def load_config(path: str | os.PathLike[str] | None) -> Config:
    """Read a TOML file (or start empty when ``path`` is None). Env overrides are applied.
    Raises one :class:`ConfigError` naming every key that is wrong."""
    reading = read_config(path)
    _raise_all(reading.problems)
    return reading.config


def apply_env(cfg: Config, env: Mapping[str, str]) -> None:
    """Apply ``GEZEL_<SECTION>_<KEY>`` overrides, e.g. ``GEZEL_SERVER_PORT=9000``.
    Raises one :class:`ConfigError` naming every variable that is wrong (the others
    are applied).

    ``GEZEL_LLAMA_SERVER`` is not a config key: it is one step of engine binary
    resolution (see :mod:`gezel_trio.engine.binary`).
    """
    reading = _Reading()
    _apply_env(cfg, env, reading)
    _raise_all(reading.problems)


def _apply_env(cfg: Config, env: Mapping[str, str], reading: _Reading) -> None:
    for section, cls in _SECTIONS.items():
        obj = getattr(cfg, section)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            var = f"GEZEL_{section.upper()}_{f.name.upper()}"
            if var in env:
                try:
                    value = _coerce(var, env[var], hints[f.name], from_text=True)
                except ConfigError as exc:
                    reading.refuse(f"{section}.{f.name}", exc.message)
                else:
                    setattr(obj, f.name, value)
                    reading.bad.discard(f"{section}.{f.name}")
