"""What the benchmark scripts share beyond the harness package (:mod:`gezel_bench`).

Percentiles come from :mod:`gezel_bench.metrics`; a host for a figure starts with the
harness's own command line and reports failure with its log tail
(:mod:`gezel_bench.targets`). What is left here is what the scripts need and the replay
harness does not: a synchronous host for blocking clients (the SDKs, ``httpx.Client``)
with any config, and where a figure's JSON goes. The harness's launcher,
:func:`gezel_bench.targets.open_target`, is async and builds one recipe's config.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from gezel_bench.errors import BenchError
from gezel_bench.metrics import percentile
from gezel_bench.targets import gezel_serve_argv, log_tail
from gezel_trio.engine.ports import free_port

RESULTS = Path(os.environ.get("GEZEL_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")
"""Where figures are written: ``benchmarks/results``, or ``$GEZEL_BENCH_RESULTS`` (``run_all
--quick`` points it elsewhere, so smoke runs never overwrite the recorded figures)."""

ONE_TOKEN_BODIES: dict[str, dict[str, object]] = {
    "/v1/chat/completions": {
        "model": "tiny",
        "messages": [{"role": "user", "content": "The quick brown fox"}],
        "max_tokens": 1,
        "temperature": 0,
    },
    "/v1/completions": {
        "model": "tiny",
        "prompt": "The quick brown fox",
        "max_tokens": 1,
        "temperature": 0,
    },
}
"""A warm 1-token request to the generated ``tiny`` model, by path: the hot-path probes'."""

__all__ = [
    "ONE_TOKEN_BODIES",
    "floor_process",
    "free_port",
    "host_process",
    "hot_path_models",
    "llama_server_process",
    "median",
    "parse_hot_path_args",
    "pct",
    "post_ok",
    "read_json_when_written",
    "rotated",
    "write_result",
]


def pct(values: Sequence[float], p: float) -> float:
    """:func:`gezel_bench.metrics.percentile`, NaN for no values (a figure's empty cell)."""
    return percentile(values, p) if values else float("nan")


def median(values: Sequence[float]) -> float:
    return pct(values, 50)


def rotated(items: Sequence[str], i: int) -> list[str]:
    """``items`` rotated by ``i``: the order of a benchmark's paths in its round ``i``, so
    that drift over a run falls on each path alike."""
    k = i % len(items)
    return [*items[k:], *items[:k]]


def parse_hot_path_args(doc: str | None, *, requests: int, help: str) -> argparse.Namespace:
    """The command line of a probe of the 1-token hot path (its description the first
    paragraph of ``doc``): ``--requests`` (default ``requests``, at least 1) and
    ``--path`` (a key of :data:`ONE_TOKEN_BODIES`)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0] if doc else None)
    ap.add_argument("--requests", type=int, default=requests, help=help)
    ap.add_argument("--path", default="/v1/chat/completions", choices=sorted(ONE_TOKEN_BODIES))
    args = ap.parse_args()
    if args.requests < 1:
        ap.error("--requests: at least 1")
    return args


def hot_path_models() -> list[dict[str, Any]]:
    """The host's models for a probe of the hot path: the generated ``tiny`` model, 8
    slots, as in ``proxy_overhead``."""
    from gezel_trio.engine.demo_model import write_demo_model

    model = write_demo_model(RESULTS / "tmp" / "tiny.gguf", size="tiny")
    return [{"id": "tiny", "path": str(model), "parallel": 8, "ctx_per_slot": 512}]


def read_json_when_written(path: Path, *, within: float, what: str) -> Any:
    """The JSON another process writes to ``path`` (whole: it renames it into place),
    once it is there; fails the benchmark after ``within`` seconds without it."""
    deadline = time.monotonic() + within
    while not path.exists():
        if time.monotonic() > deadline:
            raise BenchError(f"no {what} within {within} s")
        time.sleep(0.05)
    return json.loads(path.read_text())


def post_ok(client: httpx.Client, url: str, body: dict[str, object]) -> None:
    """POST ``body``; a status other than 200 fails the benchmark with the answer's start."""
    r = client.post(url, json=body)
    if r.status_code != 200:
        raise BenchError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")


def toml_config(models: list[dict[str, Any]], *, port: int, state_dir: str, extra: str = "") -> str:
    lines = [
        "[server]",
        f"port = {port}",
        'log_level = "warning"',
        "[engine]",
        f"state_dir = {json.dumps(state_dir)}",
        extra,
    ]
    for m in models:
        lines.append("[[models]]")
        for k, v in m.items():
            if isinstance(v, dict):  # an inline table (an image model's files)
                pairs = ", ".join(f"{name} = {json.dumps(x)}" for name, x in v.items())
                lines.append(f"{k} = {{{pairs}}}")
            else:
                lines.append(f"{k} = {json.dumps(v)}")
    return "\n".join(lines) + "\n"


@contextmanager
def host_process(
    models: list[dict[str, Any]], *, extra: str = "", program: Sequence[str] = ()
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Run ``gezel-trio serve`` in a subprocess; yields its base URL. Always stops it.
    ``program``, if given, is the command that runs gezel-trio's command line (``serve
    --config FILE`` is appended), in place of its own script."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="gezel-bench-") as tmp:
        cfg = Path(tmp) / "gezel.toml"
        log = Path(tmp) / "host.log"
        cfg.write_text(
            toml_config(models, port=port, state_dir=str(Path(tmp) / "state"), extra=extra)
        )
        argv = [*program, "serve", "--config", str(cfg)] if program else gezel_serve_argv(cfg)
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=open(log, "wb"),  # noqa: SIM115
            env=dict(os.environ),
        )
        base = f"http://127.0.0.1:{port}"
        try:
            if not _healthy(base, proc, within=60):
                raise RuntimeError(log_tail(log, 40))
            yield base, proc
        finally:
            _stop(proc)


@contextmanager
def llama_server_process(*, parallel: int, ctx_size: int) -> Iterator[tuple[int, Path]]:
    """Run a bare llama-server (the host's own resolution of the binary) on the generated
    ``tiny`` model; yields its port and binary once ``/health`` answers 200. Always stops it."""
    from gezel_bench.targets import resolve_llama_server
    from gezel_trio.engine.demo_model import write_demo_model

    engine = resolve_llama_server()
    model = write_demo_model(RESULTS / "tmp" / "tiny.gguf", size="tiny")
    port = free_port()
    argv = [str(engine.path), "--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--parallel", str(parallel), "--ctx-size", str(ctx_size), "--no-webui"]
    proc = subprocess.Popen(
        argv, env=dict(engine.env), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        if not _healthy(f"http://127.0.0.1:{port}", proc, within=60):
            raise RuntimeError(f"llama-server did not become healthy: {argv}")
        yield port, engine.path
    finally:
        _stop(proc)


FLOOR_MODES = ("relayed", "streamed", "hypercorn", "front")
"""How :mod:`benchmarks._floor_proxy` forwards (see its docstring)."""


@contextmanager
def floor_process(
    upstream: str, *, mode: str = "relayed", program: Sequence[str] = ()
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Run :mod:`benchmarks._floor_proxy` in front of the llama-server at ``upstream``
    (``http://127.0.0.1:PORT``), in one of :data:`FLOOR_MODES` (the flag of that name, none
    for ``relayed``); yields its base URL and process once it answers. Always stops it.
    ``program``, if given, is the command that runs the module (its arguments are
    appended), in place of ``python -m``."""
    if mode not in FLOOR_MODES:
        raise ValueError(f"mode: one of {FLOOR_MODES}, not {mode!r}")
    port = free_port()
    upstream_port = upstream.rsplit(":", 1)[1]
    argv = [*(program or (sys.executable, "-m", "benchmarks._floor_proxy"))]
    argv += [str(port), upstream_port, *([] if mode == "relayed" else [f"--{mode}"])]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        if not _healthy(base, proc, within=30):
            raise RuntimeError(f"the floor proxy did not answer: {argv}")
        yield base, proc
    finally:
        _stop(proc)


@contextmanager
def logged_process(
    argv: Sequence[str],
    log: Path,
    health_url: str,
    env: dict[str, str] | None = None,
    *,
    within: float = 180.0,
) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``argv`` (its output to ``log``, in a session of its own), yield it once
    ``health_url`` answers 200, and stop it on the way out. Exits with the log's tail
    when the process dies first or does not answer within ``within`` seconds."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            list(argv), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + within
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"{argv[0]} exited: {log_tail(log, 40)}")
            try:
                if httpx.get(health_url, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{argv[0]} did not answer within {within:g} s: see {log}")
            time.sleep(0.2)
        yield proc
    finally:
        _stop(proc)


def _healthy(base: str, proc: subprocess.Popen[bytes], *, within: float) -> bool:
    """Whether ``base + "/health"`` answers 200 within ``within`` seconds, while ``proc``
    runs (False as soon as it has exited)."""
    deadline = time.monotonic() + within
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 20 s."""
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def write_result(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
