"""One agent's warm turns, the host against a bare llama-server: what a request that needs
no slot work costs through the host. This is the floor under the trace replay's median
TTFT ratio, whose middle requests are turns like these.

    python -m benchmarks.steady_turns [--turns 60] [--history 1000] [--gap 0.3]

One llama-server binary (the host's own resolution) and the generated ``small`` model
(the trace figures' model) serve two paths on the same machine:

- ``direct``: llama-server started with the flags the host gives its own engine (read
  from the host's log: 2 slots of 4,096 tokens, ``--cache-ram 0``, ``--batch-size 512``
  and the rest), so that the host is the only difference;
- ``host``: ``gezel-trio serve`` in front of its own engine (defaults: affinity, parking,
  background saves).

One session's turns: a token prompt of ``--history`` ids that grows by 24 new ones a turn,
4 tokens answered (``/completion``, streamed, ``ignore_eos``). Each turn goes to both
paths, the order alternating each turn so that drift falls on both alike, ``--gap``
seconds apart (the host saves the idle slot in the background meanwhile, as an agent's
think time lets it). It prints, as medians over the turns after 2 warm ones:

- TTFT at the client on each path, and the paired difference (host minus direct, turn by
  turn);
- the same turn's time inside each engine (its own log's ``prompt eval`` and ``eval``
  times): the engine behind the host computes the same tokens, so what it takes longer
  is the CPU it shares with the host's process (the bench client runs beside both);
- the host's CPU per turn (its process, background saves included), and the part of the
  client's TTFT outside the host's own request log (the front's).

Writes ``benchmarks/results/steady_turns.json``. About 1 minute on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks._harness import RESULTS, logged_process, median, write_result
from gezel_bench.targets import gezel_serve_argv, resolve_llama_server
from gezel_trio.engine.demo_model import write_demo_model
from gezel_trio.engine.ports import free_port

NEW_TOKENS = 24
ANSWER_TOKENS = 4
WARM = 2
_TIMING = re.compile(r"(prompt eval|\beval) time =\s+([\d.]+) ms /\s+(\d+) tokens")


def _turn_timings(log: str) -> tuple[list[float], list[float]]:
    """Each turn's prompt-eval and eval milliseconds in a llama-server log, in order."""
    prompt: list[float] = []
    answer: list[float] = []
    for what, ms, tokens in _TIMING.findall(log):
        if what == "prompt eval" and int(tokens) == NEW_TOKENS:
            prompt.append(float(ms))
        elif what != "prompt eval" and int(tokens) == ANSWER_TOKENS:
            answer.append(float(ms))
    return prompt, answer


def _engine_argv(host_log: Path, port: int) -> list[str]:
    """The argv the host started its engine with, on ``port`` and without its slot-save
    path (the bare engine saves nothing)."""
    for line in host_log.read_text().splitlines():
        if '"engine_starting"' in line:
            argv: list[str] = json.loads(line)["argv"]
            if "--slot-save-path" in argv:
                at = argv.index("--slot-save-path")
                del argv[at : at + 2]
            argv[argv.index("--port") + 1] = str(port)
            return argv
    raise SystemExit(f"the host's log names no engine argv: {host_log}")


def _follow_log(client: httpx.Client, host_url: str, lines: list[str], since: int) -> int:
    """Append to ``lines`` the host's engine's log lines after the ``since``-th (the host
    keeps its last 400); returns what to pass as ``since`` next."""
    logs = client.get(host_url + "/api/models/small/logs", params={"since": since})
    logs.raise_for_status()
    answer = logs.json()
    lines += answer["lines"]
    return int(answer["next"])


def _ttft(client: httpx.Client, url: str, body: dict[str, Any]) -> float:
    """Milliseconds to the first streamed token; a keep-alive connection llama-server had
    closed (it closes one after each streamed answer) is retried once."""
    for attempt in (1, 2):
        try:
            t0 = time.perf_counter()
            first = None
            with client.stream("POST", url, json=body) as resp:
                if resp.status_code != 200:
                    raise SystemExit(f"{url}: HTTP {resp.status_code}: {resp.read()[:300]!r}")
                for line in resp.iter_lines():
                    if first is None and line.startswith("data:"):
                        first = time.perf_counter()
            if first is None:
                raise SystemExit(f"{url}: no event streamed")
            return (first - t0) * 1000
        except httpx.RemoteProtocolError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=60)
    ap.add_argument("--history", type=int, default=1000, help="prompt ids of the first turn")
    ap.add_argument("--gap", type=float, default=0.3, help="seconds between requests")
    args = ap.parse_args(argv)
    if args.turns <= WARM:
        ap.error(f"--turns: more than {WARM}")
    engine = resolve_llama_server()
    model = write_demo_model(RESULTS / "tmp" / "small.gguf", size="small")
    rng = random.Random(0)
    history = [rng.randrange(300, 682) for _ in range(args.history)]
    with tempfile.TemporaryDirectory(prefix="gezel-steady-") as tmp:
        host_port, direct_port = free_port(), free_port()
        config = Path(tmp) / "gezel.toml"
        config.write_text(
            f'[server]\nport = {host_port}\n[engine]\nbinary = "{engine.path}"\n'
            f'state_dir = "{tmp}/state"\n[[models]]\nid = "small"\npath = "{model}"\n'
            "parallel = 2\nctx_per_slot = 4096\n"
        )
        host_log = Path(tmp) / "host.log"
        host_url = f"http://127.0.0.1:{host_port}"
        with logged_process(gezel_serve_argv(config), host_log, host_url + "/health") as host:
            client = httpx.Client(timeout=120)
            prompts = {"host": list(history), "direct": list(history)}
            body = {"prompt": prompts["host"], "n_predict": 1, "model": "small"}
            client.post(host_url + "/completion", json=body).raise_for_status()  # starts it
            direct_log = Path(tmp) / "direct.log"
            direct_url = f"http://127.0.0.1:{direct_port}"
            direct_argv = _engine_argv(host_log, direct_port)
            with logged_process(direct_argv, direct_log, direct_url + "/health", dict(engine.env)):
                client.post(direct_url + "/completion", json=body).raise_for_status()
                cpu = psutil.Process(host.pid)
                ttft: dict[str, list[float]] = {"host": [], "direct": []}
                cpu_at_warm = 0.0
                engine_lines: list[str] = []
                since = 0
                for turn in range(args.turns):
                    if turn % 10 == 9:
                        since = _follow_log(client, host_url, engine_lines, since)
                    if turn == WARM:
                        t = cpu.cpu_times()
                        cpu_at_warm = t.user + t.system
                    new = [rng.randrange(300, 682) for _ in range(NEW_TOKENS)]
                    order = ("direct", "host") if turn % 2 == 0 else ("host", "direct")
                    for path in order:
                        prompts[path] += new
                        url = (host_url if path == "host" else direct_url) + "/completion"
                        ms = _ttft(
                            client,
                            url,
                            {
                                "model": "small",
                                "prompt": prompts[path],
                                "n_predict": ANSWER_TOKENS,
                                "stream": True,
                                "ignore_eos": True,
                                "cache_prompt": True,
                            },
                        )
                        if turn >= WARM:
                            ttft[path].append(ms)
                        time.sleep(args.gap)
                t = cpu.cpu_times()
                host_cpu_ms = (t.user + t.system - cpu_at_warm) * 1000 / len(ttft["host"])
                _follow_log(client, host_url, engine_lines, since)
                logged = [
                    json.loads(line)["ttft_ms"]
                    for line in host_log.read_text().splitlines()
                    if '"ttft_ms"' in line and '"/completion"' in line
                ][-len(ttft["host"]) :]
            direct_text = direct_log.read_text(errors="replace")
    host_text = "\n".join(engine_lines)
    timings = {"direct": _turn_timings(direct_text), "host": _turn_timings(host_text)}
    n = len(ttft["host"])
    paired = [h - d for h, d in zip(ttft["host"], ttft["direct"], strict=True)]
    result: dict[str, Any] = {
        "setup": {
            "binary": str(engine.path),
            "engine_argv": direct_argv,
            "turns": args.turns,
            "history": args.history,
            "gap_s": args.gap,
        },
        "ttft_ms": {p: median(v) for p, v in ttft.items()},
        "paired_added_ms": median(paired),
        "engine_prompt_eval_ms": {p: median(v[0][-n:]) for p, v in timings.items()},
        "engine_eval_ms": {p: median(v[1][-n:]) for p, v in timings.items()},
        "host_cpu_ms_per_turn": host_cpu_ms,
        "front_ms": median([c - h for c, h in zip(ttft["host"], logged, strict=False)]),
        "turns_measured": n,
    }
    written = write_result("steady_turns", result)
    at = result["ttft_ms"]
    print(f"{n} warm turns, {args.history}+ tokens of history, {args.gap:g} s apart:")
    print(f"  TTFT direct {at['direct']:.2f} ms, host {at['host']:.2f} ms")
    spread = statistics.pstdev(paired)
    print(f"  host minus direct, turn by turn: {median(paired):+.2f} ms (spread {spread:.2f})")
    for what in ("prompt_eval", "eval"):
        v = result[f"engine_{what}_ms"]
        name = what.replace("_", " ")
        ratio = v["host"] / v["direct"]
        print(f"  {name} inside the engine: direct {v['direct']:.2f} ms, ", end="")
        print(f"behind the host {v['host']:.2f} ms ({ratio:.3f}x)")
    print(f"  host CPU per turn {host_cpu_ms:.1f} ms (background saves included)")
    print(f"  client TTFT outside the host's own request log {result['front_ms']:.2f} ms")
    print(f"written to {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
