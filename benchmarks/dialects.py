"""Every dialect through the host against the same llama-server directly.

    python -m benchmarks.dialects [--rounds 100]
    python -m benchmarks.dialects --quick       # 20 rounds

A real host (``gezel-trio serve``, the generated ``tiny`` model with FIM tokens) and
the engine it runs, reached directly on its own port:

1. The client calls of each SDK a coding agent or editor makes (the official
   ``openai`` and ``anthropic`` SDKs, and llama.vscode's ``/infill`` request shape),
   sent once to the engine and once to the host: how many work directly, and how
   many of those work through the host.
2. The added latency of a 1-token request of each dialect, host minus direct, median
   and p99, the order of the two paths alternating each round (a dialect the engine
   does not pin, Anthropic's, runs on the host through the chat route).

Prints a table and writes benchmarks/results/dialects.json.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai

from gezel_trio.engine.demo_model import write_demo_model

from ._harness import host_process, median, pct, write_result

MODEL = "tiny"
HELLO = [{"role": "user", "content": "hello world"}]
INFILL = {
    "input_prefix": "def hello(",
    "input_suffix": "):\n    return world\n",
    "input_extra": [{"filename": "util.py", "text": "world = 1\n"}],
    "prompt": "",
    "n_predict": 4,
    "id_slot": 0,
}


def _calls(base: str) -> dict[str, Callable[[], object]]:
    """Each SDK call an agent or editor makes, against ``base``."""
    oa = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
    an = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=60)

    def stream_messages() -> object:
        with an.messages.stream(model=MODEL, max_tokens=4, messages=HELLO) as s:  # type: ignore[arg-type]
            return s.get_final_message()

    def infill(n_predict: int) -> object:
        r = httpx.post(base + "/infill", json={**INFILL, "n_predict": n_predict}, timeout=60)
        r.raise_for_status()
        return r.json()

    return {
        "openai chat": lambda: oa.chat.completions.create(
            model=MODEL,
            messages=HELLO,
            max_tokens=4,  # type: ignore[arg-type]
        ),
        "openai chat stream": lambda: list(
            oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, stream=True)  # type: ignore[arg-type]
        ),
        "openai responses": lambda: oa.responses.create(
            model=MODEL, input="hello world", max_output_tokens=4
        ),
        "openai responses stream": lambda: list(
            oa.responses.create(model=MODEL, input="hello world", max_output_tokens=4, stream=True)
        ),
        "openai responses input_tokens": lambda: oa.post(
            "/responses/input_tokens",
            body={"model": MODEL, "input": "hello world"},
            cast_to=object,
        ),
        "anthropic messages": lambda: an.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=HELLO,  # type: ignore[arg-type]
        ),
        "anthropic messages stream": stream_messages,
        "anthropic count_tokens": lambda: an.messages.count_tokens(
            model=MODEL,
            messages=HELLO,  # type: ignore[arg-type]
        ),
        "llama.vscode infill warm-up": lambda: infill(0),
        "llama.vscode infill": lambda: infill(4),
    }


def _works(call: Callable[[], object]) -> str | None:
    """None when the call succeeds, else why not."""
    try:
        call()
    except Exception as exc:  # any failure counts, and is reported
        return f"{type(exc).__name__}: {str(exc)[:160]}"
    return None


ONE_TOKEN: dict[str, tuple[str, dict[str, Any], str]] = {
    # dialect: (host route, body, engine route for "direct")
    "openai chat": (
        "/v1/chat/completions",
        {"messages": HELLO, "max_tokens": 1, "temperature": 0},
        "/v1/chat/completions",
    ),
    "openai responses": (
        "/v1/responses",
        {"input": "hello world", "max_output_tokens": 1, "temperature": 0},
        "/v1/responses",
    ),
    "anthropic messages": (
        "/v1/messages",
        {"messages": HELLO, "max_tokens": 1, "temperature": 0},
        "/v1/messages",
    ),
    "llama.cpp infill": ("/infill", {**INFILL, "n_predict": 1}, "/infill"),
}


def _latency(base: str, engine: str, rounds: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    with httpx.Client(timeout=60) as client:
        for dialect, (route, body, engine_route) in ONE_TOKEN.items():
            body = {**body, "model": MODEL}
            samples: dict[str, list[float]] = {"direct": [], "host": []}
            for i in range(rounds + 5):
                order = ("direct", "host") if i % 2 else ("host", "direct")
                for path in order:
                    url = engine + engine_route if path == "direct" else base + route
                    t0 = time.perf_counter()
                    r = client.post(url, json=body)
                    elapsed = (time.perf_counter() - t0) * 1000
                    if r.status_code != 200:
                        raise SystemExit(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
                    if i >= 5:  # warm-up rounds are not counted
                        samples[path].append(elapsed)
            out[dialect] = {
                "direct_median_ms": median(samples["direct"]),
                "host_median_ms": median(samples["host"]),
                "added_median_ms": median(samples["host"]) - median(samples["direct"]),
                "added_p99_ms": pct(samples["host"], 99) - pct(samples["direct"], 99),
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 100)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 20 rounds")
    args = ap.parse_args()
    rounds = args.rounds or (20 if args.quick else 100)
    model = write_demo_model(Path("benchmarks/results/tmp") / f"{MODEL}.gguf", size="tiny")
    spec = [{"id": MODEL, "path": str(model), "parallel": 2, "ctx_per_slot": 1024}]
    with host_process(spec) as (base, _):
        httpx.post(f"{base}/api/models/{MODEL}/load", timeout=120).raise_for_status()
        status = httpx.get(base + "/api/status", timeout=10).json()
        engine = status["engines"][0]["url"]
        calls: dict[str, dict[str, str | None]] = {}
        for name in _calls(base):
            calls[name] = {
                "direct": _works(_calls(engine)[name]),
                "host": _works(_calls(base)[name]),
            }
        latency = _latency(base, engine, rounds)
    direct_ok = [n for n, c in calls.items() if c["direct"] is None]
    both_ok = [n for n in direct_ok if calls[n]["host"] is None]
    result = {
        "calls": calls,
        "work_directly": len(direct_ok),
        "work_through_host_of_those": len(both_ok),
        "host_only": [n for n, c in calls.items() if c["host"] is None and c["direct"]],
        "one_token_latency": latency,
        "rounds": rounds,
    }
    path = write_result("dialects", result)
    print(f"client calls: {len(both_ok)} of the {len(direct_ok)} that work directly work "
          f"through the host (of {len(calls)} in all)")  # fmt: skip
    for name, c in calls.items():
        print(f"  {name:32} direct {'ok' if c['direct'] is None else 'FAIL':4}  "
              f"host {'ok' if c['host'] is None else 'FAIL: ' + str(c['host'])}")  # fmt: skip
    print(f"1-token latency, {rounds} rounds     direct ms   host ms   +median    +p99")
    for dialect, f in latency.items():
        print(f"  {dialect:22} {f['direct_median_ms']:12.2f} {f['host_median_ms']:9.2f} "
              f"{f['added_median_ms']:+9.2f} {f['added_p99_ms']:+8.2f}")  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
