"""Non-streaming answers assembled from the engine's stream.

Unit tests on events as llama-server and OpenAI send them (tool-call deltas,
reasoning, split events), and a comparison with llama-server's own non-streaming
answers: the same greedy request through the host (streamed upstream,
assembled) and directly (not streamed) must agree on every field a client reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import trio

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.assemble import StreamAssembler
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.sse import SseDecoder

from ._engine_bin import ENGINE_LIMITS, open_llama_server
from .conftest import make_config, running


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + (
        b"data: [DONE]\n\n"
    )


def test_sse_decoder_holds_back_a_split_event() -> None:
    raw = _sse({"a": 1}, {"b": 2})
    decoder = SseDecoder()
    got = [*decoder.feed(raw[:7]), *decoder.feed(raw[7:20]), *decoder.feed(raw[20:])]
    assert got == [{"a": 1}, {"b": 2}]


def test_chat_deltas_merge_content_reasoning_and_tool_calls() -> None:
    top = {"created": 1, "id": "c1", "model": "m", "object": "chat.completion.chunk"}
    events = [
        {**top, "choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]},
        {**top, "choices": [{"index": 0, "delta": {"reasoning_content": "thin"}}]},
        {**top, "choices": [{"index": 0, "delta": {"reasoning_content": "king"}}]},
        {**top, "choices": [{"index": 0, "delta": {"content": "Hel"}}]},
        {**top, "choices": [{"index": 0, "delta": {"content": "lo"}}]},
        {
            **top,
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "t1",
                                "type": "function",
                                "function": {"name": "get", "arguments": '{"a"'},
                            }
                        ]
                    },
                }
            ],
        },
        {
            **top,
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]},
                }
            ],
        },
        {**top, "choices": [{"index": 0, "finish_reason": "tool_calls", "delta": {}}]},
        {**top, "choices": [], "usage": {"completion_tokens": 5}, "timings": {"predicted_n": 5}},
    ]
    assembler = StreamAssembler("chat")
    for event in events:
        assembler.feed(event)
    out = assembler.result()
    assert out["object"] == "chat.completion" and out["id"] == "c1" and out["model"] == "m"
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant",
        "content": "Hello",
        "reasoning_content": "thinking",
        "tool_calls": [
            {"type": "function", "id": "t1", "function": {"name": "get", "arguments": '{"a":1}'}}
        ],
    }
    assert out["usage"] == {"completion_tokens": 5} and out["timings"] == {"predicted_n": 5}


def test_an_error_event_is_kept_as_the_answer() -> None:
    assembler = StreamAssembler("native")
    assembler.feed({"error": {"code": 500, "message": "boom"}})
    assert assembler.error == {"error": {"code": 500, "message": "boom"}}


CASES = [
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 12},
    ),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 12}),
    ("/completion", {"prompt": "Once upon a time", "n_predict": 12, "return_tokens": True}),
]


def _comparable(path: str, answer: dict[str, Any]) -> Any:
    if path == "/completion":
        return {
            k: answer.get(k)
            for k in (
                "content",
                "tokens",
                "stop",
                "stop_type",
                "tokens_predicted",
                "tokens_evaluated",
                "truncated",
                "stopping_word",
            )
        }
    usage = dict(answer["usage"])
    usage.pop("prompt_tokens_details", None)  # cache hits differ between the two engines
    choices = answer["choices"]
    return {"object": answer["object"], "usage": usage, "choices": choices}


async def test_assembled_answers_match_llama_servers_own(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=1, ctx_per_slot=1024)],
        state_dir=state_dir,
        engine_binary=engine_binary,
    )
    with trio.fail_after(120):
        async with (
            running(cfg) as (_host, client),
            open_llama_server(tiny_model, parallel=1, ctx=1024) as server,
            httpx.AsyncClient(limits=ENGINE_LIMITS, base_url=server.base_url, timeout=60) as direct,
        ):
            for path, body in CASES:
                request = {**body, "temperature": 0, "seed": 1}
                via_host = await client.post(path, json={**request, "model": "tiny"})
                straight = await direct.post(path, json=request)
                assert via_host.status_code == straight.status_code == 200, via_host.text
                assert via_host.headers["content-type"].startswith("application/json")
                mine, theirs = via_host.json(), straight.json()
                assert _comparable(path, mine) == _comparable(path, theirs), path
                assert set(theirs) <= set(mine), (path, set(theirs) - set(mine))
