"""Benchmark targets: an endpoint to replay against, or a recipe that launches one.

Kinds that launch a server (all on the same binary, model and slot count):

- ``direct``: plain ``llama-server -m MODEL --parallel N -c N*CTX``, its defaults
  otherwise;
- ``router``: llama-server's router mode (``--models-dir`` holding the model), where
  the binary supports it (``--help`` lists ``--models-dir``), else skipped;
- ``gezel``: ``gezel-trio serve --config`` with a generated TOML (affinity and slot
  every request pinned), ``gezel-noaffinity`` with affinity off, and ``gezel-noparking``
  (affinity on, KV parking off: a handoff erases).

:func:`open_target` launches one in its own process group, waits for it to answer,
yields an :class:`Endpoint`, and on exit (normal, error or cancellation) stops the
whole group: SIGTERM, then SIGKILL after a grace period, under a shielded deadline.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import trio

from gezel_trio.engine.argv import model_flags, server_argv, without_cache_ram
from gezel_trio.engine.client import check_health
from gezel_trio.engine.ports import free_port

from .errors import BenchError, TargetFailed
from .synth import Api

__all__ = [
    "LAUNCH_KINDS",
    "Endpoint",
    "EngineCommand",
    "LaunchSettings",
    "direct_argv",
    "engine_version",
    "free_port",
    "gezel_config_toml",
    "gezel_serve_argv",
    "gguf_vocab_size",
    "log_tail",
    "open_target",
    "resolve_llama_server",
    "router_argv",
    "router_support",
]

Kind = Literal["direct", "router", "gezel", "gezel-noaffinity", "gezel-noparking", "gezel-replicas"]
LAUNCH_KINDS: tuple[Kind, ...] = (
    "direct",
    "router",
    "gezel",
    "gezel-noaffinity",
    "gezel-noparking",
    "gezel-replicas",
)


@dataclass(frozen=True, slots=True)
class EngineCommand:
    """A llama-server executable and the full environment to start it with."""

    path: Path
    env: Mapping[str, str]
    found_by: str = ""


def resolve_llama_server() -> EngineCommand:
    """The llama-server binary the benchmark launches: the host's own resolution
    (:func:`gezel_trio.engine.binary.resolve_engine`), so every target runs the same binary.

    Raises :class:`BenchError` with the resolver's list of places tried.
    """
    from gezel_trio.engine.binary import resolve_engine
    from gezel_trio.errors import EngineNotFound

    try:
        found = resolve_engine()
    except EngineNotFound as exc:
        raise BenchError(exc.message) from None
    return EngineCommand(found.path, found.launch_env(), found.found_by)


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchSettings:
    """What every launched target shares: model, slots, per-slot context, where to put
    configs and logs, and how long a target may take to come up."""

    model_path: Path
    parallel: int = 2
    ctx_per_slot: int = 4096
    workdir: Path
    host: str = "127.0.0.1"
    startup_timeout: float = 180.0
    gezel_api: Api = "openai"
    engine_args: tuple[str, ...] = ()
    """Extra llama-server flags for every launched engine (``--cache-ram 48``)."""
    replicas: int = 2
    """Engines of the model the ``gezel-replicas`` target runs (one pool of slots)."""
    models: int = 1
    """Serve the model file as this many models (ids ``<id>-a``, ``<id>-b``, ...): sessions
    then use them in turn, and one engine at a time is resident (swap)."""
    api_keys: tuple[str, ...] = ()
    """API keys a gezel target accepts (``[server] api_keys``; none: no keys, one local
    caller). The replay sends the first; leak probes the second, as another caller."""
    admin_key: str | None = None
    """A gezel target's admin key (``[server] admin_keys``), for ``/api/status``."""

    @property
    def model_id(self) -> str:
        name = self.model_path.name
        return name[: -len(".gguf")] if name.endswith(".gguf") else name

    @property
    def model_ids(self) -> tuple[str, ...]:
        if self.models <= 1:
            return (self.model_id,)
        return tuple(f"{self.model_id}-{chr(ord('a') + i)}" for i in range(self.models))


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where to send requests, in which API style, with which ``model`` field."""

    name: str
    base_url: str
    api: Api
    model: str | None = None
    description: dict[str, Any] = field(default_factory=dict)
    models: tuple[str, ...] = ()
    """Models a session's turns go to in turn (empty: ``model`` for every turn)."""
    admin_key: str | None = None
    """The key that reads its ``/api/status`` (a gezel target with keys)."""


def gguf_vocab_size(path: Path) -> int | None:
    """The vocabulary size recorded in a GGUF file (its token list), or ``None``.

    Blocking file I/O (the metadata is memory-mapped, tensors are not read)."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
    except Exception:  # a file gguf cannot read: the endpoint may still say
        return None
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is not None and len(field.data) > 0:
        return len(field.data)
    for key, value in reader.fields.items():
        if key.endswith(".vocab_size") and value.data:
            return int(value.parts[value.data[0]][0])
    return None


def direct_argv(engine: EngineCommand, settings: LaunchSettings, port: int) -> list[str]:
    """Plain ``llama-server -m MODEL``: the engine's own command line, its defaults
    otherwise, then the benchmark's ``engine_args``."""
    return [
        *server_argv(
            engine.path,
            serves=model_flags(str(settings.model_path), short=True),
            host=settings.host,
            port=port,
            parallel=settings.parallel,
            ctx_total=settings.parallel * settings.ctx_per_slot,
            short=True,
        ),
        *settings.engine_args,
    ]


def router_argv(
    engine: EngineCommand, settings: LaunchSettings, port: int, models_dir: Path
) -> list[str]:
    """llama-server's router mode over ``models_dir``, one model resident at a time."""
    return [
        *server_argv(
            engine.path,
            serves=["--models-dir", str(models_dir), "--models-max", "1"],
            host=settings.host,
            port=port,
            parallel=settings.parallel,
            ctx_total=settings.parallel * settings.ctx_per_slot,
            short=True,
        ),
        *settings.engine_args,
    ]


def _toml_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def gezel_config_toml(
    *,
    settings: LaunchSettings,
    engine: EngineCommand,
    port: int,
    affinity: bool,
    kv_parking: bool = True,
    replicas: int = 1,
    keyless: str | None = None,
) -> str:
    """The ``gezel-trio serve`` config of a benchmark target (the one place its shape
    lives): one model with the benchmark's slots and per-slot context. ``keyless`` sets
    ``[scheduler] keyless`` (None: the host's default)."""
    b = "true" if affinity else "false"
    keys = ", ".join(_toml_str(k) for k in settings.api_keys)
    lines = [
        "[server]",
        f"host = {_toml_str(settings.host)}",
        f"port = {port}",
        *([f"api_keys = [{keys}]"] if settings.api_keys else []),
        *([f"admin_keys = [{_toml_str(settings.admin_key)}]"] if settings.admin_key else []),
        "",
        "[engine]",
        f"binary = {_toml_str(str(engine.path))}",
        # a state dir of its own: nothing parked by an earlier run is restored into this one
        f"state_dir = {_toml_str(str(settings.workdir / f'state-{port}'))}",
        "",
    ]
    if settings.models > 1:
        lines += ["[gpu]", 'policy = "swap"', ""]
    # the host owns --cache-ram (it keeps llama-server's RAM prompt cache, shared across
    # sessions, off; its own KV store takes its place): pass on all other engine flags
    args = ", ".join(_toml_str(a) for a in without_cache_ram(settings.engine_args))
    for model_id in settings.model_ids:
        lines += [
            "[[models]]",
            f"id = {_toml_str(model_id)}",
            f"path = {_toml_str(str(settings.model_path))}",
            f"parallel = {settings.parallel}",
            f"ctx_per_slot = {settings.ctx_per_slot}",
            f"args = [{args}]",
            *([f"replicas = {replicas}"] if replicas > 1 else []),
            "",
        ]
    lines += [
        "[scheduler]",
        f"affinity = {b}",
        f"kv_parking = {'true' if kv_parking else 'false'}",
        *([f"keyless = {_toml_str(keyless)}"] if keyless is not None else []),
        "",
    ]
    return "\n".join(lines)


def gezel_serve_argv(config_path: Path) -> list[str]:
    """How to start ``gezel-trio serve`` from this interpreter's environment."""
    script = Path(sys.executable).parent / "gezel-trio"
    if script.is_file():
        return [str(script), "serve", "--config", str(config_path)]
    code = "import sys; from gezel_trio.cli.main import main; sys.exit(main())"
    return [sys.executable, "-c", code, "serve", "--config", str(config_path)]


_QUICK_S = 20.0


async def _run_quick(argv: Sequence[str], env: Mapping[str, str]) -> str:
    with trio.move_on_after(_QUICK_S):
        proc = await trio.run_process(
            list(argv),
            env=dict(env),
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        return (proc.stdout + proc.stderr).decode("utf-8", "replace")
    return ""


async def engine_version(engine: EngineCommand) -> str:
    """``llama-server --version``'s text (the first lines), or ``""``."""
    text = await _run_quick([str(engine.path), "--version"], engine.env)
    lines = [x for x in text.splitlines() if x.strip() and not x.startswith("load_backend")]
    return "; ".join(lines[:2])


async def router_support(engine: EngineCommand) -> str | None:
    """``None`` when the binary's ``--help`` lists ``--models-dir``, else why not."""
    text = await _run_quick([str(engine.path), "--help"], engine.env)
    if "--models-dir" in text:
        return None
    return "this llama-server has no router mode (--models-dir is not in its --help)"


def _signal_name(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code > 128:
        try:
            return f"exit code {code} ({signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return f"exit code {code}"


def log_tail(path: Path, n: int = 12) -> str:
    """The last ``n`` lines of a launched server's log (``""`` if it cannot be read)."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


async def _stop_group(proc: trio.Process, *, grace: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL it after ``grace`` seconds; always reaps."""
    with trio.move_on_after(grace + 5.0, shield=True):
        if proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            with trio.move_on_after(grace):
                await proc.wait()
        try:  # children (router instances) may outlive the leader
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await proc.wait()


async def _wait_ready(
    base_url: str,
    proc: trio.Process,
    log: Path,
    *,
    startup_s: float,
    paths: Sequence[str] = ("/health",),
) -> None:
    async with httpx.AsyncClient(timeout=5.0) as client:
        with trio.move_on_after(startup_s) as scope:
            while True:
                if proc.returncode is not None:
                    raise TargetFailed(
                        f"{shlex.join(map(str, proc.args))} ({_signal_name(proc.returncode)}) "  # type: ignore[arg-type]
                        f"before answering; log {log}:\n{log_tail(log)}"
                    )
                for path in paths:
                    check = await check_health(client, base_url, answer_within=5.0, path=path)
                    if check.ok:
                        return
                await trio.sleep(0.2)
        if scope.cancelled_caught:
            raise TargetFailed(
                f"{base_url} did not become ready within {startup_s:.0f}s; "
                f"log {log}:\n{log_tail(log)}"
            )


@asynccontextmanager
async def _launched(
    argv: Sequence[str],
    env: Mapping[str, str],
    log: Path,
    base_url: str,
    *,
    startup_s: float,
    paths: Sequence[str] = ("/health",),
) -> AsyncIterator[trio.Process]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as fp:
        proc = await trio.lowlevel.open_process(
            list(argv),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=fp,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        await _wait_ready(base_url, proc, log, startup_s=startup_s, paths=paths)
        yield proc
    finally:
        await _stop_group(proc)


@asynccontextmanager
async def open_target(
    kind: Kind,
    *,
    settings: LaunchSettings,
    engine: EngineCommand | None = None,
    name: str | None = None,
    keyless: str | None = None,
) -> AsyncIterator[Endpoint]:
    """Launch a target of ``kind``, wait until it answers, yield its endpoint.
    ``keyless`` is a gezel target's ``[scheduler] keyless`` (None: its default).

    Raises :class:`TargetFailed` when it exits or does not answer within
    ``settings.startup_timeout`` (the message carries its log's tail), and
    :class:`BenchError` with a ``skipped:`` message for a router the binary lacks. On
    exit the process group is stopped and reaped, also on cancellation.
    """
    if kind not in LAUNCH_KINDS:
        raise BenchError(f"unknown target {kind!r}: choose from {', '.join(LAUNCH_KINDS)}")
    if not settings.model_path.is_file():
        raise BenchError(f"model file {settings.model_path} does not exist")
    engine = engine or resolve_llama_server()
    name = name or kind
    settings.workdir.mkdir(parents=True, exist_ok=True)
    port = free_port(settings.host)
    base_url = f"http://{settings.host}:{port}"
    log = settings.workdir / f"{name}.log"
    version = await engine_version(engine)
    description: dict[str, Any] = {
        "kind": kind,
        "binary": str(engine.path),
        "binary_found_by": engine.found_by,
        "engine_version": version,
        "model": str(settings.model_path),
        "parallel": settings.parallel,
        "ctx_per_slot": settings.ctx_per_slot,
        "log": str(log),
    }
    env = dict(engine.env)
    models = settings.model_ids if settings.models > 1 else ()
    description["models"] = list(settings.model_ids)
    description["engine_args"] = list(settings.engine_args)
    if kind == "direct":
        if settings.models > 1:
            raise BenchError("skipped: one llama-server serves one model (--models > 1)")
        argv = direct_argv(engine, settings, port)
        description["argv"] = argv
        async with _launched(argv, env, log, base_url, startup_s=settings.startup_timeout):
            yield Endpoint(name, base_url, "llama", None, description)
    elif kind == "router":
        why_not = await router_support(engine)
        if why_not is not None:
            raise BenchError(f"skipped: {why_not}")
        models_dir = settings.workdir / f"{name}-models"
        models_dir.mkdir(parents=True, exist_ok=True)
        for model_id in settings.model_ids:
            link = models_dir / f"{model_id}.gguf"
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(settings.model_path.resolve())
        argv = router_argv(engine, settings, port, models_dir)
        description["argv"] = argv
        async with _launched(argv, env, log, base_url, startup_s=settings.startup_timeout):
            yield Endpoint(
                name, base_url, "llama", settings.model_ids[0], description, models=models
            )
    else:
        on = kind != "gezel-noaffinity"
        parking = kind in ("gezel", "gezel-replicas")
        config = gezel_config_toml(
            settings=settings,
            engine=engine,
            port=port,
            affinity=on,
            kv_parking=parking,
            replicas=settings.replicas if kind == "gezel-replicas" else 1,
            keyless=keyless,
        )
        config_path = settings.workdir / f"{name}.toml"
        config_path.write_text(config, encoding="utf-8")
        argv = gezel_serve_argv(config_path)
        env["GEZEL_LLAMA_SERVER"] = str(engine.path)
        description.update(
            argv=argv, config=config, affinity=on, kv_parking=parking, keyless_mode=keyless
        )
        async with _launched(
            argv,
            env,
            log,
            base_url,
            startup_s=settings.startup_timeout,
            paths=("/health", "/v1/models"),
        ):
            yield Endpoint(
                name,
                base_url,
                settings.gezel_api,
                settings.model_ids[0],
                description,
                models=models,
                admin_key=settings.admin_key,
            )
