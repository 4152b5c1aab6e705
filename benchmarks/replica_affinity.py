"""Keyless conversations on two replicas: does each turn land where its prefix is?

    python -m benchmarks.replica_affinity [--conversations 4] [--turns 6] [--size tiny]
                                          [--repeats 1] [--parallel 2]

One host (in process, the real server on a real socket) serves one model from two
engines it runs (``replicas = 2``, ``--parallel`` slots each, ``keyless = "shared"``).
``--conversations`` chat conversations run at once, with no session key of any kind
(no ``prompt_cache_key``, no session header): each sends ``--turns`` growing turns
(its whole history, a new user message each time), one after the other.

Reported, over the turns after the first of each conversation:

- ``affinity_hit_rate``: the share whose engine had the conversation's whole previous
  prompt cached (``usage.prompt_tokens_details.cached_tokens`` of the engine's answer
  at least the previous turn's prompt tokens, less one): the turn ran on the member,
  and the slot, that served its previous turn. The engine's own figure, not the host's.
- ``router_hit_rate``: the share the router sent to the member holding their longest
  prefix (its ``prefix`` counts), and the shed and missed ones;
- cached prompt tokens against prompt tokens, and median latency;
- the per-member prefix counts from ``/api/status``.

Aim (issue 21): affinity hit rate >= 95%. Writes benchmarks/results/replica_affinity.json.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from gezel_trio.config.schema import Config, ModelConfig, validate
from gezel_trio.engine.demo_model import write_demo_model
from gezel_trio.server import open_server

from ._harness import median, write_result

MODEL = "m"
N_PREDICT = 8
WORDS = [
    "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
    "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon",
]  # fmt: skip


def _config(state: Path, model: Path, parallel: int) -> Config:
    cfg = Config()
    cfg.server.port = 0
    cfg.server.log_level = "warning"
    cfg.engine.state_dir = str(state)
    cfg.gpu.policy = "coexist"
    cfg.scheduler.keyless = "shared"
    cfg.models = [
        ModelConfig(id=MODEL, path=str(model), parallel=parallel, ctx_per_slot=4096, replicas=2)
    ]
    validate(cfg)
    return cfg


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def run(
    model: Path, *, conversations: int, turns: int, parallel: int = 2, seed: int = 1
) -> dict[str, Any]:
    """The whole scenario on ``model``; returns the figures (see the module docstring)."""
    rng = random.Random(seed)
    turns_out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gezel-affinity-") as tmp:
        cfg = _config(Path(tmp) / "state", model, parallel)
        async with (
            open_server(cfg) as (_host, binds),
            httpx.AsyncClient(base_url=binds[0], timeout=300) as client,
        ):
            r = await client.post(f"/api/models/{MODEL}/load")
            r.raise_for_status()

            async def conversation(c: int) -> None:
                crng = random.Random(rng.random())
                messages: list[dict[str, str]] = [
                    {"role": "system", "content": f"Agent {c}. " + _text(crng, 80)}
                ]
                previous: int | None = None
                for t in range(turns):
                    messages.append({"role": "user", "content": _text(crng, 40)})
                    body = {
                        "model": MODEL,
                        "messages": messages,
                        "max_tokens": N_PREDICT,
                        "temperature": 0,
                    }
                    started = time.perf_counter()
                    r = await client.post("/v1/chat/completions", json=body)
                    r.raise_for_status()
                    answer = r.json()
                    usage = answer["usage"]
                    details = usage.get("prompt_tokens_details") or {}
                    cached = int(details.get("cached_tokens", 0))
                    prompt = int(usage["prompt_tokens"])
                    turns_out.append(
                        {
                            "conversation": c,
                            "turn": t,
                            "prompt_tokens": prompt,
                            "cached_tokens": cached,
                            "previous_prompt_tokens": previous,
                            "kept": None if previous is None else cached >= previous - 1,
                            "latency_ms": round((time.perf_counter() - started) * 1000, 1),
                        }
                    )
                    content = answer["choices"][0]["message"]["content"] or ""
                    messages.append({"role": "assistant", "content": content})
                    previous = prompt

            async with trio.open_nursery() as nursery:
                for c in range(conversations):
                    nursery.start_soon(conversation, c)
            replicas = (await client.get("/api/status")).json()["replicas"][MODEL]
    later = [t for t in turns_out if t["kept"] is not None]
    prefix = replicas.get("prefix", {})
    hits = sum(p["hits"] for p in prefix.values())
    shed = sum(p["shed"] for p in prefix.values())
    misses = sum(p["misses"] for p in prefix.values())
    return {
        "conversations": conversations,
        "turns": turns,
        "parallel": parallel,
        "continuations": len(later),
        "affinity_hit_rate": round(sum(1 for t in later if t["kept"]) / len(later), 4)
        if later
        else None,
        "router_hit_rate": round(hits / len(later), 4) if later else None,
        "router_hits": hits,
        "router_shed": shed,
        "router_misses": misses,
        "cached_tokens": sum(t["cached_tokens"] for t in later),
        "prompt_tokens": sum(t["prompt_tokens"] for t in later),
        "latency_median_ms": median([t["latency_ms"] for t in turns_out]),
        "routed": replicas.get("routed", {}),
        "prefix": prefix,
        "turns_detail": turns_out,
    }


async def main(
    size: str, conversations: int, turns: int, repeats: int, parallel: int
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gezel-affinity-models-") as d:
        model = write_demo_model(Path(d) / f"{size}.gguf", size=size)  # type: ignore[arg-type]
        runs = [
            await run(
                model, conversations=conversations, turns=turns, parallel=parallel, seed=1 + i
            )
            for i in range(repeats)
        ]
    continuations = sum(r["continuations"] for r in runs)
    kept = sum(round((r["affinity_hit_rate"] or 0) * r["continuations"]) for r in runs)
    return {
        "size": size,
        "conversations": conversations,
        "turns": turns,
        "repeats": repeats,
        "parallel": parallel,
        "continuations": continuations,
        "affinity_hit_rate": round(kept / continuations, 4) if continuations else None,
        "router_hits": sum(r["router_hits"] for r in runs),
        "router_shed": sum(r["router_shed"] for r in runs),
        "router_misses": sum(r["router_misses"] for r in runs),
        "cached_tokens": sum(r["cached_tokens"] for r in runs),
        "prompt_tokens": sum(r["prompt_tokens"] for r in runs),
        "latency_median_ms": median([r["latency_median_ms"] for r in runs]),
        "runs": runs,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--parallel", type=int, default=2)
    args = parser.parse_args()
    out = trio.run(main, args.size, args.conversations, args.turns, args.repeats, args.parallel)
    print(
        f"{out['repeats']} run(s): {out['conversations']} keyless conversations x "
        f"{out['turns']} turns on 2 replicas of {out['parallel']} slots, {out['size']} model"
    )
    print(
        f"affinity hit rate (engine's cached tokens) {out['affinity_hit_rate']} over "
        f"{out['continuations']} continuations; router: {out['router_hits']} prefix hits, "
        f"{out['router_shed']} shed for load, {out['router_misses']} misses"
    )
    print(
        f"cached prompt tokens {out['cached_tokens']} of {out['prompt_tokens']} on turns 2+; "
        f"median latency {out['latency_median_ms']} ms"
    )
    print("wrote", write_result("replica_affinity", out))
