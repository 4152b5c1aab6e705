"""What reading one long prompt costs the host's interpreter, step by step.

    python -m benchmarks.prompt_cost [--tokens 3500] [--repeats 300]

Before a request reaches the scheduler the host decodes its body, checks it, checks a
token prompt's ids against the model's vocabulary and cuts the prompt into the blocks it
is placed by; it encodes the body again for the engine. Each costs in proportion to the
prompt, on the request's path before its grant (``front to grant`` in
:mod:`benchmarks.handoff_profile`). This times the host's own functions on the prompt the
trace replays send (a token array, ``/completion``) and on a chat of the same length in
text (``/v1/chat/completions``, 4 characters a token), with no I/O: the median of
``--repeats`` calls of each, in µs. CPU work alone, so the figure moves with the
machine's speed but not with its load; compare two commits on one machine in one sitting.

Prints a table and writes benchmarks/results/prompt_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gezel_trio.api.validation import check_completion_body
from gezel_trio.host.completion import prompt_blocks
from gezel_trio.host.runtime import ModelRuntime

RESULTS = Path(os.environ.get("GEZEL_BENCH_RESULTS") or "benchmarks/results")
VOCAB = 49_152  # SmolLM2's


def _bodies(tokens: int) -> dict[str, dict[str, Any]]:
    rng = random.Random(0)
    ids = [rng.randrange(100, VOCAB) for _ in range(tokens)]
    words = " ".join(f"w{rng.randrange(10**6)}" for _ in range(tokens // 2))[: 4 * tokens]
    turns = [{"role": "system", "content": words[: len(words) // 2]}]
    turns += [{"role": "user", "content": words[len(words) // 2 :]}]
    return {
        "token array": {"prompt": ids, "n_predict": 16, "stream": True, "cache_prompt": True},
        "chat text": {"messages": turns, "max_tokens": 16, "stream": True},
    }


def _encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def _median_us(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def measure(tokens: int, repeats: int) -> dict[str, dict[str, float]]:
    vocab = SimpleNamespace(vocab_size=VOCAB)
    out: dict[str, dict[str, float]] = {}
    for shape, body in _bodies(tokens).items():
        raw = json.dumps(body).encode()
        kind = "native" if "prompt" in body else "chat"
        steps: dict[str, Callable[[], object]] = {
            "decode the body": partial(json.loads, raw),
            "check the body": partial(check_completion_body, body, kind=kind),
            "check the token ids": partial(
                ModelRuntime.check_token_ids,
                vocab,  # type: ignore[arg-type]  # the one attribute it reads
                body.get("prompt"),
                "prompt",
            ),
            "cut the blocks": partial(prompt_blocks, body),
            "encode for the engine": partial(_encode, body),
        }
        row = {name: _median_us(call, repeats) for name, call in steps.items()}
        row["total"] = sum(row.values())
        out[shape] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=3500)
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args(argv)
    figures = measure(args.tokens, args.repeats)
    steps = list(next(iter(figures.values())))
    print(f"median µs per request, a {args.tokens}-token prompt ({args.repeats} calls each)")
    print(f"{'step':24}" + "".join(f"{shape:>14}" for shape in figures))
    for step in steps:
        print(f"{step:24}" + "".join(f"{row[step]:14.1f}" for row in figures.values()))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "prompt_cost.json"
    report = {"tokens": args.tokens, "repeats": args.repeats, "median_us": figures}
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
