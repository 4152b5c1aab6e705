"""Typed, validated configuration: a TOML file, then ``GEZEL_*`` env overrides, then CLI flags.

Every validation error names the key (``models[0].parallel``) and says what
was expected, as a :class:`~gezel_trio.errors.ConfigError`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .errors import ConfigError

GpuPolicySetting = Literal["auto", "coexist", "swap"]
LogLevel = Literal["debug", "info", "warning", "error"]

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
    handed over; past it the client is gone and its request is cancelled."""
    stream_stall_timeout: float = 120.0
    """Seconds a streaming client may stop reading before its request is cancelled."""
    sse_keepalive_interval: float = 5.0
    """A streaming request still waiting (queued, or its model loading) after this many
    seconds gets its 200 response head and an SSE comment every as many seconds, so
    clients and reverse proxies do not time out; 0 waits silently."""


@dataclass
class EngineConfig:
    binary: str | None = None
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
    erase_on_handoff: bool = True
    kv_parking: bool = True
    """Save a chat's KV to disk (slot save) when its slot is handed over or its engine
    stops on purpose, and restore it when the chat returns, into any later engine."""
    kv_store_bytes: int | None = None
    """Bytes the parked-KV files may take, over every model (least recently used are
    evicted beyond). None: a quarter of the state dir's free space, at most 32 GiB."""
    park_on_stop_timeout: float = 10.0
    """Seconds a planned engine stop may spend saving its slots before SIGTERM."""
    lock_model: bool = False


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
    url: str | None = None
    name: str | None = None
    parallel: int = 2
    ctx_per_slot: int = 2048
    args: list[str] = field(default_factory=list)
    idle_ttl: float = 0.0
    """Seconds an idle engine stays resident; 0 keeps it until evicted or stopped."""
    slot_class: str | None = None
    """The arbiter's slot class; models of one class never evict each other. Default: the id."""
    embeddings: bool = False
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
        return " or ".join(_describe(a) for a in typing.get_args(tp))
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


def _build(cls: type[Any], data: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix}: expected a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if prefix == "scheduler" and "pinning" in unknown:
        raise ConfigError(
            "scheduler.pinning: removed; every request is pinned to a slot the host "
            "has checked (delete the key)"
        )
    if unknown:
        raise ConfigError(
            f"{prefix}.{unknown[0]}: unknown key; expected one of {', '.join(sorted(names))}"
        )
    kwargs = {k: _coerce(f"{prefix}.{k}", v, hints[k], from_text=False) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required key is missing
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
            and f.name not in kwargs
        ]
        raise ConfigError(
            f"{prefix}.{missing[0] if missing else '?'}: required key missing"
        ) from exc


def config_from_mapping(data: Mapping[str, Any]) -> Config:
    """Build and validate a :class:`Config` from parsed TOML."""
    unknown = sorted(set(data) - {*_SECTIONS, "models"})
    if unknown:
        raise ConfigError(
            f"{unknown[0]}: unknown section; expected server, engine, scheduler, gpu or [[models]]"
        )
    cfg = Config()
    for name, cls in _SECTIONS.items():
        if name in data:
            setattr(cfg, name, _build(cls, data[name], name))
    raw_models = data.get("models", [])
    if not isinstance(raw_models, list):
        raise ConfigError("models: expected an array of tables ([[models]])")
    cfg.models = [_build(ModelConfig, m, f"models[{i}]") for i, m in enumerate(raw_models)]
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Check cross-field rules. Raises :class:`ConfigError` naming the key."""
    if not 0 <= cfg.server.port <= 65535:
        raise ConfigError(f"server.port: expected 0..65535, got {cfg.server.port}")
    if cfg.server.max_body_bytes < 1024:
        raise ConfigError("server.max_body_bytes: expected at least 1024")
    for name in ("stream_start_timeout", "stream_stall_timeout"):
        if getattr(cfg.server, name) <= 0:
            raise ConfigError(f"server.{name}: expected a positive number of seconds")
    for name in ("load_timeout", "request_timeout", "health_interval", "stop_grace"):
        if getattr(cfg.engine, name) <= 0:
            raise ConfigError(f"engine.{name}: expected a positive number of seconds")
    if cfg.engine.health_failures < 1:
        raise ConfigError("engine.health_failures: expected at least 1")
    if cfg.server.sse_keepalive_interval < 0:
        raise ConfigError("server.sse_keepalive_interval: expected seconds >= 0 (0: off)")
    if cfg.scheduler.max_queue < 1:
        raise ConfigError("scheduler.max_queue: expected at least 1")
    if cfg.scheduler.slot_poll <= 0:
        raise ConfigError("scheduler.slot_poll: expected a positive number of seconds")
    kv_bytes = cfg.scheduler.kv_store_bytes
    if kv_bytes is not None and (
        isinstance(kv_bytes, bool) or not isinstance(kv_bytes, int) or kv_bytes < 0
    ):
        raise ConfigError(
            "scheduler.kv_store_bytes: expected a whole number of bytes >= 0 "
            "(0 keeps nothing parked), or leave it out for the default"
        )
    if cfg.scheduler.park_on_stop_timeout < 0:
        raise ConfigError("scheduler.park_on_stop_timeout: expected seconds >= 0")
    if cfg.gpu.temp_margin_c < 0:
        raise ConfigError("gpu.temp_margin_c: expected a number >= 0")
    seen: set[str] = set()
    for i, m in enumerate(cfg.models):
        key = f"models[{i}]"
        if not MODEL_ID_RE.match(m.id):
            raise ConfigError(
                f"{key}.id: expected letters, digits, '.', '_', ':' or '-' (max 128), got {m.id!r}"
            )
        if m.id in seen:
            raise ConfigError(f"{key}.id: duplicate model id {m.id!r}")
        seen.add(m.id)
        if (m.path is None) == (m.url is None):
            raise ConfigError(f"{key}: set exactly one of path (a GGUF file) or url (an engine)")
        if m.url is not None and not m.url.startswith(("http://", "https://")):
            raise ConfigError(f"{key}.url: expected an http:// or https:// URL, got {m.url!r}")
        if not 1 <= m.parallel <= 256:
            raise ConfigError(f"{key}.parallel: expected 1..256, got {m.parallel}")
        if m.replica_of is not None:
            raise ConfigError(f"{key}.replica_of: set by the host, not a config key; remove it")
        if not 1 <= m.replicas <= 64:
            raise ConfigError(f"{key}.replicas: expected 1..64, got {m.replicas}")
        if m.url is not None and m.replicas != 1:
            raise ConfigError(
                f"{key}.replicas: an external engine (url) is one replica; list the others "
                "in replica_urls"
            )
        for j, extra in enumerate(m.replica_urls):
            if not extra.startswith(("http://", "https://")):
                raise ConfigError(
                    f"{key}.replica_urls[{j}]: expected an http:// or https:// URL, got {extra!r}"
                )
        if m.rpc and m.url is not None:
            raise ConfigError(f"{key}.rpc: an external engine (url) cannot be given RPC workers")
        for j, endpoint in enumerate(m.rpc):
            from .engine.rpc import parse_endpoint

            parse_endpoint(endpoint, key=f"{key}.rpc[{j}]")
        if not 64 <= m.ctx_per_slot <= 1 << 20:
            raise ConfigError(f"{key}.ctx_per_slot: expected 64..1048576, got {m.ctx_per_slot}")
        if m.idle_ttl < 0:
            raise ConfigError(f"{key}.idle_ttl: expected seconds >= 0, got {m.idle_ttl}")


def load_config(path: str | os.PathLike[str] | None) -> Config:
    """Read a TOML file (or start empty when ``path`` is None). Env overrides are applied."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ConfigError(f"--config: no such file {str(p)!r}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: not valid TOML: {exc}") from exc
    cfg = config_from_mapping(data)
    apply_env(cfg, os.environ)
    validate(cfg)
    cfg.source = None if path is None else str(path)
    return cfg


def apply_env(cfg: Config, env: Mapping[str, str]) -> None:
    """Apply ``GEZEL_<SECTION>_<KEY>`` overrides, e.g. ``GEZEL_SERVER_PORT=9000``.

    ``GEZEL_LLAMA_SERVER`` is not a config key: it is one step of engine binary
    resolution (see :mod:`gezel_trio.engine.binary`).
    """
    for section, cls in _SECTIONS.items():
        obj = getattr(cfg, section)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            var = f"GEZEL_{section.upper()}_{f.name.upper()}"
            if var in env:
                setattr(obj, f.name, _coerce(var, env[var], hints[f.name], from_text=True))
