"""A short speed measurement of one engine, run alone (the scheduler's ``benchmark`` op).

One prompt of ``prompt_tokens`` fresh tokens (``cache_prompt`` off, so it is
really prefilled) and ``n_predict`` forced tokens (``ignore_eos``), on a
drained engine: prefill and decode speed from llama-server's own ``timings``.
"""

from __future__ import annotations

import random
from typing import Any

import httpx

from ..errors import EngineFailed
from .client import request_once


async def measure_speed(
    client: httpx.AsyncClient,
    base_url: str,
    *,
    vocab_size: int | None,
    prompt_tokens: int = 256,
    n_predict: int = 32,
    seed: int = 0,
) -> dict[str, Any]:
    """Prefill and decode tokens/s of one request. Raises EngineFailed on an engine error."""
    rng = random.Random(seed)
    hi = max(300, (vocab_size or 1000) - 1)
    prompt = [rng.randrange(256, hi) for _ in range(prompt_tokens)]
    resp = await request_once(
        client,
        "POST",
        base_url + "/completion",
        json={
            "prompt": prompt,
            "n_predict": n_predict,
            "ignore_eos": True,
            "cache_prompt": False,
            "temperature": 0,
            "seed": seed,
        },
        timeout=httpx.Timeout(600.0, connect=10.0),
    )
    if resp.status_code != 200:
        raise EngineFailed(f"benchmark request answered {resp.status_code}: {resp.text[:200]}")
    t = resp.json().get("timings", {})
    return {
        "prompt_tokens": t.get("prompt_n"),
        "prompt_ms": t.get("prompt_ms"),
        "prompt_tokens_per_s": t.get("prompt_per_second"),
        "predicted_tokens": t.get("predicted_n"),
        "predicted_ms": t.get("predicted_ms"),
        "predicted_tokens_per_s": t.get("predicted_per_second"),
    }
