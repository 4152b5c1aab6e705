"""Cache reuse on the ``small`` demo model: 4 sessions x 6 growing turns on 2 slots.

    python -m benchmarks.cache_reuse [--turns 6] [--sessions 4] [--growth 96] [--keyless]

Writes a native trace in which each session's turn repeats its previous
prompt and appends new blocks (an agent's growing context), then replays it
with ``gezel-trio bench`` against llama-server directly and through
gezel-trio (default, and with KV parking off), closed loop, on the same
binary, model and slots. Reports the share of prompt tokens served from the
engine's cache (``cache_hit_ratio``) and the share an unlimited per-session
cache would serve (``oracle``). Results land in benchmarks/results/cache-reuse/
(``cache-reuse-keyless/`` with ``--keyless``: the same work sent with no session key,
as most clients send it; ``--keyless-mode MODE`` sets the host's ``[scheduler]
keyless`` and adds ``-MODE`` to the folder).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from gezel_trio.engine.demo_model import write_demo_model

OUT = Path(os.environ.get("GEZEL_BENCH_RESULTS") or "benchmarks/results") / "cache-reuse"


def write_trace(path: Path, *, sessions: int, turns: int, growth: int, block: int) -> None:
    lines = [
        {
            "format": "gezel-trace",
            "version": 1,
            "block_size": block,
            "source": f"synthetic: {sessions} sessions x {turns} growing turns",
            "scaling": {"block_size": block},
            "sessions": sessions,
            "requests": sessions * turns,
        }
    ]
    next_id = 1
    for s in range(sessions):
        blocks: list[int] = []
        for t in range(turns):
            for _ in range(growth):
                blocks.append(next_id)
                next_id += 1
            lines.append(
                {
                    "session": f"s{s}",
                    "turn": t,
                    "t": 0.0,
                    "think_time": 0.0,
                    "blocks": list(blocks),
                    "prompt_tokens": len(blocks) * block,
                    "output_tokens": 16,
                    "parent": None,
                }
            )
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--growth", type=int, default=96, help="blocks added per turn")
    ap.add_argument("--block", type=int, default=4, help="tokens per block")
    ap.add_argument("--keyless", action="store_true", help="send no session key")
    ap.add_argument(
        "--keyless-mode",
        choices=("shared", "conversation", "blind"),
        default=None,
        help="the host's [scheduler] keyless (default: its own default)",
    )
    args = ap.parse_args()
    out = OUT.with_name(OUT.name + "-keyless") if args.keyless else OUT
    env = dict(os.environ)
    if args.keyless_mode is not None:
        out = out.with_name(out.name + "-" + args.keyless_mode)
        env["GEZEL_SCHEDULER_KEYLESS"] = args.keyless_mode  # read by the host it launches
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace.jsonl"
    write_trace(
        trace, sessions=args.sessions, turns=args.turns, growth=args.growth, block=args.block
    )
    model = write_demo_model(Path("benchmarks/results/tmp/small.gguf"), size="small")
    ctx = args.turns * args.growth * args.block + 512
    cmd = [
        sys.executable, "-m", "gezel_bench",
        "--trace", f"native:{trace}",
        "--model", str(model),
        "--targets", "direct,gezel,gezel-noparking",
        "--parallel", "2",
        "--ctx-per-slot", str(ctx),
        "--mode", "closed",
        "--compare", "--check",
        "--out", str(out),
        *(["--keyless"] if args.keyless else []),
    ]  # fmt: skip
    print("+", " ".join(cmd), flush=True)
    raise SystemExit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
