"""Anthropic Messages <-> OpenAI chat translation (gezel_trio.api.anthropic_translate), no engine.

Requests of each kind become the chat body llama-server's chat route reads; bad
input is a FieldError naming the field; answers and streams validate against the
official ``anthropic`` SDK's types, and go through the SDK's own client (over an
a mock transport) the way Claude Code would read them.
"""

from __future__ import annotations

import copy
import importlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from pydantic import TypeAdapter

from gezel_trio.api.anthropic_translate import (
    MessageStream,
    chat_to_message,
    count_tokens_to_chat,
    engine_error,
    error_body,
    messages_to_chat,
)
from gezel_trio.errors import FieldError


def _sdk_httpx() -> Any:
    """The SDK talks through httpx (anthropic < 2) or its fork httpx2: mock whichever it uses."""
    for cls in type(anthropic.Anthropic(api_key="x")._client).__mro__:
        package = cls.__module__.partition(".")[0]
        if package in ("httpx", "httpx2"):
            return importlib.import_module(package)
    raise AssertionError("the anthropic SDK's HTTP client is neither httpx nor httpx2")


_HTTPX = _sdk_httpx()
EVENT = TypeAdapter(RawMessageStreamEvent)
OPENAI_MESSAGES = TypeAdapter(list[ChatCompletionMessageParam])
OPENAI_TOOLS = TypeAdapter(list[ChatCompletionToolParam])

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
    "cache_control": {"type": "ephemeral"},
}
TIME_TOOL = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}


def _request(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "qwen",
        "max_tokens": 256,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    body.update(fields)
    return body


# --------------------------------------------------------------------------- requests


def test_minimal_request_becomes_a_chat_body_without_host_fields() -> None:
    chat = messages_to_chat(_request())
    assert chat == {
        "model": "qwen",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 256,
        "stream": False,
    }


def test_multi_part_system_joins_its_blocks_as_the_engine_does_and_drops_cache_control() -> None:
    """Nothing between the blocks, as llama-server's own converter joins them: the host's
    prompt (and its token count) is the one the engine's ``/v1/messages`` renders."""
    chat = messages_to_chat(
        _request(
            system=[
                {"type": "text", "text": "You are terse."},
                {
                    "type": "text",
                    "text": "Answer in French.",
                    "cache_control": {"type": "ephemeral"},
                },
            ]
        )
    )
    assert chat["messages"][0] == {
        "role": "system",
        "content": "You are terse.Answer in French.",
    }
    assert chat["messages"][1] == {"role": "user", "content": "Hi"}
    assert messages_to_chat(_request(system="Be brief."))["messages"][0] == {
        "role": "system",
        "content": "Be brief.",
    }


def test_claude_code_billing_stamp_is_normalized_so_the_prefix_stays_cacheable() -> None:
    def system(stamp: str) -> list[dict[str, Any]]:
        header = (
            f"x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch={stamp};"
        )
        return [
            {"type": "text", "text": header},
            {"type": "text", "text": "You are Claude Code."},
        ]

    first = messages_to_chat(_request(system=system("a5145")))
    second = messages_to_chat(_request(system=system("07c3e")))
    assert first == second
    assert "cch=fffff;" in first["messages"][0]["content"]
    # Only the stamp of a billing header changes; other text is left alone.
    plain = messages_to_chat(_request(system="Remember cch=a5145; here"))
    assert plain["messages"][0]["content"] == "Remember cch=a5145; here"


def test_tool_use_and_tool_result_round_trip() -> None:
    body = _request(
        tools=[WEATHER_TOOL],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris and Rome?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Two cities: ", "signature": "sig"},
                    {"type": "thinking", "thinking": "call twice.", "signature": "sig"},
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                    {
                        "type": "tool_use",
                        "id": "toolu_2",
                        "name": "get_weather",
                        "input": {"city": "Rome"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "is_error": True,
                        "content": [
                            {"type": "text", "text": "timeout"},
                            {"type": "text", "text": "retry later"},
                        ],
                    },
                    {"type": "text", "text": "Summarize."},
                ],
            },
        ],
    )
    chat = messages_to_chat(body)
    assert chat["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris and Rome?"}]},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Checking."}],
            "reasoning_content": "Two cities: call twice.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                },
                {
                    "id": "toolu_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "timeout\nretry later"},
        {"role": "user", "content": [{"type": "text", "text": "Summarize."}]},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city",
                "parameters": WEATHER_TOOL["input_schema"],
            },
        }
    ]
    OPENAI_MESSAGES.validate_python(chat["messages"])
    OPENAI_TOOLS.validate_python(chat["tools"])


def test_assistant_with_only_tool_use_has_empty_content() -> None:
    chat = messages_to_chat(
        _request(
            messages=[
                {"role": "user", "content": "time?"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "get_time", "input": {}}],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
            ],
            tools=[TIME_TOOL],
        )
    )
    assistant, result = chat["messages"][1:]
    assert assistant["content"] == ""
    assert assistant["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert result == {"role": "tool", "tool_call_id": "t1", "content": ""}


def test_images_become_image_url_parts() -> None:
    chat = messages_to_chat(
        _request(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"},
                        },
                        {"type": "image", "source": {"type": "url", "url": "https://x/y.jpg"}},
                        {"type": "text", "text": "Compare."},
                    ],
                },
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "s1", "name": "shot"}],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "s1",
                            "content": [
                                {"type": "text", "text": "screenshot"},
                                {
                                    "type": "image",
                                    "source": {
                                        "type": "base64",
                                        "media_type": "image/jpeg",
                                        "data": "/9j/",
                                    },
                                },
                            ],
                        }
                    ],
                },
            ]
        )
    )
    assert chat["messages"][0]["content"] == [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
        {"type": "image_url", "image_url": {"url": "https://x/y.jpg"}},
        {"type": "text", "text": "Compare."},
    ]
    # A tool result with an image keeps its parts (text-only ones collapse to a string).
    assert chat["messages"][2] == {
        "role": "tool",
        "tool_call_id": "s1",
        "content": [
            {"type": "text", "text": "screenshot"},
            {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/"}},
        ],
    }


def test_redacted_thinking_is_dropped_and_an_empty_final_assistant_turn_too() -> None:
    chat = messages_to_chat(
        _request(
            messages=[
                {"role": "user", "content": "a"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "redacted_thinking", "data": "EncRyPt"},
                        {"type": "text", "text": "b"},
                    ],
                },
                {"role": "user", "content": "c"},
                {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
            ]
        )
    )
    assert chat["messages"] == [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": [{"type": "text", "text": "b"}]},
        {"role": "user", "content": "c"},
    ]
    prefill = messages_to_chat(
        _request(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": []}])
    )
    assert prefill["messages"] == [{"role": "user", "content": "a"}]


CLAUDE_CODE_TURN = [
    {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]},
    {"role": "system", "content": "Available agent types and the tools they have access to:"},
]


def test_a_mid_conversation_system_message_stays_in_place() -> None:
    """Claude Code 2.1 (beta ``mid-conversation-system-2026-04-07``) sends a system message
    after the first user turn: it is a chat system message where it stands, as the
    engine's own converter makes it, in messages and in count_tokens alike."""
    body = _request(system="You are Claude Code.", messages=copy.deepcopy(CLAUDE_CODE_TURN))
    expected = [
        {"role": "system", "content": "You are Claude Code."},
        {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]},
        {"role": "system", "content": "Available agent types and the tools they have access to:"},
    ]
    assert messages_to_chat(copy.deepcopy(body))["messages"] == expected
    del body["max_tokens"]
    assert count_tokens_to_chat(body)["messages"] == expected


def test_every_role_and_content_shape_the_engine_passes_on() -> None:
    chat = messages_to_chat(
        _request(
            messages=[
                {"role": "user", "content": "a"},
                {
                    "role": "system",
                    "content": [
                        {"type": "text", "text": "rule 1", "cache_control": {"type": "ephemeral"}},
                        {"type": "text", "text": "rule 2"},
                    ],
                },
                {"role": "assistant"},  # no content: upstream skips it
                {"role": "developer", "content": "be brief"},
                {"role": "system", "content": []},  # no blocks: nothing, as upstream
                {"role": "user", "content": None},  # rendered as empty by the engine
                {"role": "user", "content": "b"},
            ]
        )
    )
    assert chat["messages"] == [
        {"role": "user", "content": "a"},
        {
            "role": "system",
            "content": [{"type": "text", "text": "rule 1"}, {"type": "text", "text": "rule 2"}],
        },
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": ""},
        {"role": "user", "content": "b"},
    ]
    with pytest.raises(FieldError) as info:
        messages_to_chat(
            _request(
                messages=[
                    {"role": "user", "content": "a"},
                    {"role": "system", "content": [{"type": "tool_use", "id": "t", "name": "n"}]},
                ]
            )
        )
    assert info.value.param == "messages.1.content.0.type"
    assert '"tool_use" is not supported in a "system" message' in info.value.message


def test_a_role_that_is_no_string_is_refused_in_anthropic_s_words() -> None:
    """Claude Code drops its mid-conversation system messages and retries when a 400 says
    ``Unexpected role`` and ``input message role`` (Anthropic's wording): the host's
    refusal of a role it cannot read says both."""
    with pytest.raises(FieldError) as info:
        messages_to_chat(_request(messages=[{"role": 7, "content": "a"}]))
    assert info.value.param == "messages.0.role"
    assert "Unexpected role 7" in info.value.message
    assert "input message role" in info.value.message


def test_text_documents_are_read_and_pdfs_are_refused() -> None:
    doc = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "X"}}
    chat = messages_to_chat(_request(messages=[{"role": "user", "content": [doc]}]))
    assert chat["messages"] == [{"role": "user", "content": [{"type": "text", "text": "X"}]}]
    pdf = {
        "type": "document",
        "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBER"},
    }
    with pytest.raises(FieldError) as info:
        messages_to_chat(_request(messages=[{"role": "user", "content": [pdf]}]))
    assert info.value.param == "messages.0.content.0.source.type"


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, {"tool_choice": "auto"}),
        ({"type": "any"}, {"tool_choice": "required"}),
        ({"type": "none"}, {"tool_choice": "none"}),
        (
            {"type": "any", "disable_parallel_tool_use": True},
            {"tool_choice": "required", "parallel_tool_calls": False},
        ),
    ],
)
def test_tool_choice_maps_to_openai(choice: dict[str, Any], expected: dict[str, Any]) -> None:
    chat = messages_to_chat(_request(tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice))
    assert {k: chat[k] for k in ("tool_choice", "parallel_tool_calls") if k in chat} == expected
    assert [t["function"]["name"] for t in chat["tools"]] == ["get_weather", "get_time"]


def test_tool_choice_tool_forces_the_named_tool() -> None:
    chat = messages_to_chat(
        _request(tools=[WEATHER_TOOL, TIME_TOOL], tool_choice={"type": "tool", "name": "get_time"})
    )
    assert chat["tool_choice"] == "required"
    assert [t["function"]["name"] for t in chat["tools"]] == ["get_time"]


def test_thinking_settings() -> None:
    enabled = messages_to_chat(_request(thinking={"type": "enabled", "budget_tokens": 2048}))
    assert enabled["thinking_budget_tokens"] == 2048
    assert "chat_template_kwargs" not in enabled
    disabled = messages_to_chat(_request(thinking={"type": "disabled"}))
    assert disabled["chat_template_kwargs"] == {"enable_thinking": False}
    assert "thinking_budget_tokens" not in disabled
    adaptive = messages_to_chat(_request(thinking={"type": "adaptive"}))
    assert "chat_template_kwargs" not in adaptive and "thinking_budget_tokens" not in adaptive
    explicit = messages_to_chat(
        _request(thinking={"type": "disabled"}, chat_template_kwargs={"enable_thinking": True})
    )
    assert explicit["chat_template_kwargs"] == {"enable_thinking": True}


def test_sampling_stop_sequences_stream_and_metadata() -> None:
    chat = messages_to_chat(
        _request(
            temperature=0.2,
            top_p=0.9,
            top_k=40,
            stop_sequences=["###"],
            stream=True,
            metadata={"user_id": "user_abc_session_1"},
            service_tier="auto",  # not ours to act on: ignored like an unknown field
        )
    )
    assert chat["temperature"] == 0.2 and chat["top_p"] == 0.9 and chat["top_k"] == 40
    assert chat["stop"] == ["###"]
    assert chat["verbose"] is True
    assert chat["response_fields"] == ["stop_type", "stopping_word"]
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert chat["timings_per_token"] is True  # the prompt's figures for message_start
    assert "timings_per_token" not in messages_to_chat(_request())
    assert "metadata" not in chat and "service_tier" not in chat
    assert "id_slot" not in chat and "cache_prompt" not in chat


def test_count_tokens_needs_no_max_tokens() -> None:
    body = _request(system="S", tools=[WEATHER_TOOL])
    del body["max_tokens"]
    chat = count_tokens_to_chat(body)
    assert "max_tokens" not in chat and "stream" not in chat
    assert chat["messages"][0] == {"role": "system", "content": "S"}
    assert chat["tools"][0]["function"]["name"] == "get_weather"


def test_max_tokens_and_messages_may_be_what_the_engine_serves() -> None:
    """The engine serves a request without ``max_tokens`` (it generates until the turn or
    the slot ends), with ``max_tokens: 0``, with no messages, and with sampling settings
    outside Anthropic's ranges: so does the host."""
    body = _request()
    del body["max_tokens"]
    assert "max_tokens" not in messages_to_chat(body)
    del body["model"]  # the host's first model, as on every route
    assert "model" not in messages_to_chat(body)
    assert messages_to_chat(_request(max_tokens=0))["max_tokens"] == 0
    wide = messages_to_chat(_request(temperature=1.5, top_p=2, top_k=-1, stop_sequences=[""]))
    assert (wide["temperature"], wide["top_p"], wide["top_k"]) == (1.5, 2, -1)
    assert wide["stop"] == [""]
    assert messages_to_chat(_request(system="S", messages=[]))["messages"] == [
        {"role": "system", "content": "S"}
    ]


def test_a_request_built_by_the_anthropic_sdk_translates() -> None:
    sent: list[dict[str, Any]] = []

    def handler(request: Any) -> Any:
        sent.append(json.loads(request.content))
        return _HTTPX.Response(200, json=_message_json())

    request: dict[str, Any] = dict(
        model="qwen",
        max_tokens=512,
        system=[{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_9",
                        "name": "get_weather",
                        "input": {"city": "Oslo"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "-3 C"}],
            },
        ],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "auto"},
        thinking={"type": "enabled", "budget_tokens": 1024},
        metadata={"user_id": "u1"},
    )
    _client(handler).messages.create(**request)
    chat = messages_to_chat(sent[0])
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool"]
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "toolu_9", "content": "-3 C"}
    assert chat["thinking_budget_tokens"] == 1024
    OPENAI_MESSAGES.validate_python(chat["messages"])


# ------------------------------------------------------------------ bad input


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(body: dict[str, Any]) -> None:
        target: Any = body
        keys = [int(k) if k.isdigit() else k for k in path.split(".")]
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return apply


_CONVERSATION = [
    {"role": "user", "content": [{"type": "text", "text": "q"}]},
    {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "ok"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "A"}},
        ],
    },
]


@pytest.mark.parametrize(
    ("change", "param"),
    [
        (_set("model", 7), "model"),
        (_set("max_tokens", -2), "max_tokens"),
        (_set("max_tokens", True), "max_tokens"),
        (_set("max_tokens", "8"), "max_tokens"),
        (_set("messages", "hi"), "messages"),
        (_set("messages.0", "hi"), "messages.0"),
        (_set("messages.0.role", 5), "messages.0.role"),
        (_set("messages.0.role", None), "messages.0.role"),
        (_set("messages.0", {"content": "no role"}), "messages.0.role"),
        (_set("messages.0", {"role": "user"}), "messages.0.content"),
        (_set("messages.0.content", 5), "messages.0.content"),
        (_set("messages.0.content.0.type", "video"), "messages.0.content.0.type"),
        (_set("messages.0.content.0", {"text": "no type"}), "messages.0.content.0.type"),
        (_set("messages.0.content.0.text", 5), "messages.0.content.0.text"),
        (_set("messages.1.content.0.type", "server_tool_use"), "messages.1.content.0.type"),
        (_set("messages.1.content.0.input", "{}"), "messages.1.content.0.input"),
        (_set("messages.1.content.0.id", ""), "messages.1.content.0.id"),
        (_set("messages.1.content.0.name", None), "messages.1.content.0.name"),
        (_set("messages.0.content.0.type", "tool_use"), "messages.0.content.0.type"),
        (_set("messages.1.content.0.type", "tool_result"), "messages.1.content.0.type"),
        (_set("messages.1.content.0.type", "image"), "messages.1.content.0.type"),
        (_set("messages.2.content.0.tool_use_id", None), "messages.2.content.0.tool_use_id"),
        (_set("messages.2.content.0.is_error", "yes"), "messages.2.content.0.is_error"),
        (_set("messages.2.content.0.content", 3), "messages.2.content.0.content"),
        (
            _set("messages.2.content.0.content", [{"type": "search_result"}]),
            "messages.2.content.0.content.0.type",
        ),
        (
            _set("messages.2.content.1.source.media_type", "image/bmp"),
            "messages.2.content.1.source.media_type",
        ),
        (
            _set("messages.2.content.1.source", {"type": "file", "file_id": "f"}),
            "messages.2.content.1.source.type",
        ),
        (_set("messages.2.content.1.source.data", None), "messages.2.content.1.source.data"),
        (_set("system", 5), "system"),
        (_set("system", [{"type": "image"}]), "system.0.type"),
        (_set("system", [{"type": "text"}]), "system.0.text"),
        (_set("stop_sequences", "###"), "stop_sequences"),
        (_set("stop_sequences", ["###", 3]), "stop_sequences"),
        (_set("temperature", "hot"), "temperature"),
        (_set("temperature", float("nan")), "temperature"),
        (_set("top_p", "0.9"), "top_p"),
        (_set("top_k", 1.5), "top_k"),
        (_set("stream", "yes"), "stream"),
        (_set("metadata", "me"), "metadata"),
        (_set("metadata", {"user_id": 5}), "metadata.user_id"),
        (_set("tools", {"name": "x"}), "tools"),
        (_set("tools", [{"type": "web_search_20250305", "name": "web_search"}]), "tools.0.type"),
        (_set("tools", [{"name": "x"}]), "tools.0.input_schema"),
        (_set("tools", [{"input_schema": {}}]), "tools.0.name"),
        (
            _set("tools", [{"name": "x", "input_schema": {}, "description": 1}]),
            "tools.0.description",
        ),
        (_set("tool_choice", "auto"), "tool_choice"),
        (_set("tool_choice", {"type": "required"}), "tool_choice.type"),
        (_set("tool_choice", {"type": "tool"}), "tool_choice.name"),
        (_set("tool_choice", {"type": "tool", "name": "nope"}), "tool_choice.name"),
        (
            _set("tool_choice", {"type": "auto", "disable_parallel_tool_use": 1}),
            "tool_choice.disable_parallel_tool_use",
        ),
        (_set("thinking", True), "thinking"),
        (_set("thinking", {"type": "on"}), "thinking.type"),
        (_set("thinking", {"type": "enabled"}), "thinking.budget_tokens"),
        (_set("chat_template_kwargs", []), "chat_template_kwargs"),
    ],
)
def test_bad_input_names_the_field(change: Callable[[dict[str, Any]], None], param: str) -> None:
    body = _request(messages=copy.deepcopy(_CONVERSATION), tools=[WEATHER_TOOL])
    messages_to_chat(copy.deepcopy(body))  # the unchanged body is fine
    change(body)
    with pytest.raises(FieldError) as info:
        messages_to_chat(body)
    assert info.value.param == param
    assert info.value.status == 400


def test_tool_choice_any_needs_tools() -> None:
    with pytest.raises(FieldError) as info:
        messages_to_chat(_request(tool_choice={"type": "any"}))
    assert info.value.param == "tool_choice"


# --------------------------------------------------------------------------- answers


def _chat_answer(**message: Any) -> dict[str, Any]:
    return {
        "choices": [
            {
                "finish_reason": message.pop("finish_reason", "stop"),
                "index": 0,
                "message": {"role": "assistant", "content": None, **message},
            }
        ],
        "created": 1,
        "model": "qwen-engine",
        "object": "chat.completion",
        "usage": {
            "completion_tokens": 12,
            "prompt_tokens": 100,
            "total_tokens": 112,
            "prompt_tokens_details": {"cached_tokens": 80},
        },
        "id": "chatcmpl-1",
        "timings": {"cache_n": 80, "prompt_n": 20, "predicted_n": 12},
    }


def _message_json() -> dict[str, Any]:
    return chat_to_message(_chat_answer(content="hello"), model="qwen")


def test_chat_answer_becomes_a_valid_message() -> None:
    chat = _chat_answer(
        reasoning_content="think",
        content="Calling.",
        tool_calls=[
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {"id": "", "type": "function", "function": {"name": "get_time", "arguments": "{bad"}},
        ],
        finish_reason="tool_calls",
    )
    message = chat_to_message(chat, model="claude-sonnet-4-5")
    Message.model_validate(message)
    assert message["id"].startswith("msg_") and message["id"] != _message_json()["id"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["model"] == "claude-sonnet-4-5"
    assert message["content"][:3] == [
        {"type": "thinking", "thinking": "think", "signature": ""},
        {"type": "text", "text": "Calling."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
    ]
    broken = message["content"][3]
    assert broken["name"] == "get_time" and broken["input"] == {}
    assert broken["id"].startswith("toolu_")
    assert message["stop_reason"] == "tool_use" and message["stop_sequence"] is None
    # Anthropic's input_tokens excludes what was read from the cache.
    assert message["usage"] == {
        "input_tokens": 20,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 80,
        "output_tokens": 12,
    }


@pytest.mark.parametrize(
    ("finish_reason", "report", "stops", "expected"),
    [
        ("stop", None, (), ("end_turn", None)),
        ("length", None, (), ("max_tokens", None)),
        ("tool_calls", None, (), ("tool_use", None)),
        (None, None, (), ("end_turn", None)),
        ("stop", {"stop_type": "word", "stopping_word": "###"}, ("###",), ("stop_sequence", "###")),
        # A stop word of the chat template, not the client's: the turn just ended.
        (
            "stop",
            {"stop_type": "word", "stopping_word": "<|im_end|>"},
            ("###",),
            ("end_turn", None),
        ),
        ("stop", {"stop_type": "eos", "stopping_word": ""}, ("###",), ("end_turn", None)),
    ],
)
def test_stop_reason(
    finish_reason: str | None,
    report: dict[str, Any] | None,
    stops: tuple[str, ...],
    expected: tuple[str, str | None],
) -> None:
    chat = _chat_answer(content="x", finish_reason=finish_reason)
    if report is not None:
        chat["__verbose"] = report
    message = chat_to_message(chat, model="m", stop_sequences=stops)
    Message.model_validate(message)
    assert (message["stop_reason"], message["stop_sequence"]) == expected


def test_the_sdk_client_reads_the_message() -> None:
    expected = chat_to_message(_chat_answer(content="hi", reasoning_content="hmm"), model="qwen")
    client = _client(lambda request: _HTTPX.Response(200, json=expected))
    got = client.messages.create(
        model="qwen", max_tokens=10, messages=[{"role": "user", "content": "x"}]
    )
    assert got.model_dump(exclude_unset=True) == expected


# --------------------------------------------------------------------------- stream

_TOP = {
    "created": 1,
    "id": "chatcmpl-7",
    "model": "qwen-engine",
    "system_fingerprint": "b10434",
    "object": "chat.completion.chunk",
}


def _chunk(delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "choices": [{"finish_reason": finish_reason, "index": 0, "delta": delta}],
        **_TOP,
        **extra,
    }


def _tool(index: int, arguments: str, **head: str) -> dict[str, Any]:
    call: dict[str, Any] = {"index": index}
    if head:
        call.update(id=head["id"], type="function")
    function = {"arguments": arguments} if arguments else {}
    if "name" in head:
        function["name"] = head["name"]
    if function:
        call["function"] = function
    return _chunk({"tool_calls": [call]})


TEXT = ["Let me ", "check the ", "weather."]
ARGS = ['{"ci', 'ty": "Pa', 'ris"}']
ARGS_2 = ["{}"]
USAGE = {
    "completion_tokens": 31,
    "prompt_tokens": 250,
    "total_tokens": 281,
    "prompt_tokens_details": {"cached_tokens": 200},
}


def _recorded_stream() -> list[dict[str, Any]]:
    """Chunks in the shape llama-server's chat route sends them (server-task.cpp):
    a role chunk, content diffs, a tool call whose first diff carries id and name,
    its arguments over several chunks, a second call, the finish chunk, and the
    usage chunk with empty choices and timings (``include_usage``)."""
    return [
        _chunk({"role": "assistant", "content": None}),
        *(_chunk({"content": piece}) for piece in TEXT),
        _tool(0, "", id="call_A", name="get_weather"),
        *(_tool(0, piece) for piece in ARGS),
        _tool(1, ARGS_2[0], id="call_B", name="get_time"),
        _chunk({}, "tool_calls"),
        {
            "choices": [],
            **_TOP,
            "usage": USAGE,
            "timings": {"cache_n": 200, "prompt_n": 50, "predicted_n": 31},
        },
    ]


def _parse_sse(raw: bytes) -> Iterator[tuple[str, dict[str, Any]]]:
    assert raw.endswith(b"\n\n") or raw == b""
    for frame in raw.decode().split("\n\n"):
        if not frame:
            continue
        lines = frame.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: ")
        name, data = lines[0][len("event: ") :], json.loads(lines[1][len("data: ") :])
        assert data["type"] == name
        yield name, data


def _run(stream: MessageStream, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    raw = b"".join(stream.feed(chunk) for chunk in chunks) + stream.finish()
    return [data for _name, data in _parse_sse(raw)]


def _check_order(events: list[dict[str, Any]]) -> None:
    """Anthropic's grammar: message_start, blocks one at a time and numbered in order,
    deltas that fit their block, then message_delta and message_stop."""
    kinds = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "thinking"}
    kinds["input_json_delta"] = "tool_use"
    assert events[0]["type"] == "message_start"
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]
    open_block: dict[str, Any] | None = None
    started = 0
    for event in events[1:-2]:
        kind = event["type"]
        if kind == "ping":
            continue
        if kind == "content_block_start":
            assert open_block is None and event["index"] == started
            open_block, started = event, started + 1
        elif kind == "content_block_delta":
            assert open_block is not None and event["index"] == open_block["index"]
            assert kinds[event["delta"]["type"]] == open_block["content_block"]["type"]
        else:
            assert kind == "content_block_stop"
            assert open_block is not None and event["index"] == open_block["index"]
            open_block = None
    assert open_block is None


def _validate(events: list[dict[str, Any]]) -> Message:
    """Every event validates as the SDK's RawMessageStreamEvent; the SDK's own
    accumulator builds the final message from them."""
    snapshot = None
    json_bufs: dict[int, bytes] = {}
    for data in events:
        if data["type"] == "ping":
            continue
        event = EVENT.validate_python(data)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=json_bufs)
    assert snapshot is not None
    return Message.model_validate(snapshot.model_dump())


def test_recorded_llama_server_stream_becomes_a_legal_anthropic_stream() -> None:
    stream = MessageStream("claude-sonnet-4-5", message_id="msg_test")
    events = _run(stream, _recorded_stream())
    _check_order(events)
    final = _validate(events)

    text = "".join(
        e["delta"]["text"] for e in events if e["type"] == "content_block_delta" and e["index"] == 0
    )
    assert text == "".join(TEXT)
    partial = "".join(
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["index"] == 1
    )
    assert partial == "".join(ARGS)

    assert final.id == "msg_test" and final.model == "claude-sonnet-4-5"
    assert [block.type for block in final.content] == ["text", "tool_use", "tool_use"]
    assert final.content[0].text == "".join(TEXT)  # type: ignore[union-attr]
    first, second = final.content[1], final.content[2]
    assert first.type == "tool_use" and second.type == "tool_use"
    assert (first.id, first.name, first.input) == ("call_A", "get_weather", {"city": "Paris"})
    assert (second.id, second.name, second.input) == ("call_B", "get_time", {})
    assert final.stop_reason == "tool_use" and final.stop_sequence is None
    assert final.usage.input_tokens == 50
    assert final.usage.cache_read_input_tokens == 200
    assert final.usage.output_tokens == 31
    assert stream.finish() == b"" and stream.feed(_chunk({"content": "late"})) == b""


def test_thinking_then_text_streams_as_two_blocks_with_a_signature() -> None:
    chunks = [
        _chunk({"role": "assistant", "content": None}),
        _chunk({"reasoning_content": "Hmm, "}),
        _chunk({"reasoning_content": "easy."}),
        _chunk({"content": "42"}),
        _chunk({}, "stop"),
        {"choices": [], **_TOP, "usage": USAGE},
    ]
    events = _run(MessageStream("m"), chunks)
    _check_order(events)
    final = _validate(events)
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "Hmm, easy."  # type: ignore[union-attr]
    assert final.content[1].text == "42"  # type: ignore[union-attr]
    signatures = [e for e in events if e.get("delta", {}).get("type") == "signature_delta"]
    assert [e["index"] for e in signatures] == [0]
    assert final.stop_reason == "end_turn"


def test_message_start_reports_the_prompt_when_timings_come_first() -> None:
    first = _chunk({"role": "assistant", "content": None})
    first["timings"] = {"cache_n": 300, "prompt_n": 12, "predicted_n": 1}
    events = [data for _n, data in _parse_sse(MessageStream("m").feed(first))]
    assert [e["type"] for e in events] == ["message_start", "ping"]
    usage = events[0]["message"]["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (12, 300)
    EVENT.validate_python(events[0])


def test_message_start_waits_for_the_first_token_s_figures() -> None:
    """llama-server sends its opening role delta without ``timings`` and the first token's
    figures on the next chunk (``timings_per_token``): message_start carries those, as
    the engine's own /v1/messages stream does, never zeros."""
    stream = MessageStream("m")
    assert stream.feed(_chunk({"role": "assistant", "content": None})) == b""
    assert not stream.statistics().started
    first_token = _chunk({"content": "Hi"})
    first_token["timings"] = {"cache_n": 40, "prompt_n": 7, "predicted_n": 1}
    later = _chunk({"content": "!"})
    later["timings"] = {"cache_n": 40, "prompt_n": 7, "predicted_n": 2}
    events = _run(stream, [first_token, later, _chunk({}, "stop")])
    _check_order(events)
    usage = events[0]["message"]["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (7, 40)
    assert usage["output_tokens"] == 0
    assert _validate(events).content[0].text == "Hi!"  # type: ignore[union-attr]
    # without figures, the first output still starts the message (with zeros)
    bare = _run(MessageStream("m"), [_chunk({"content": "x"}), _chunk({}, "stop")])
    assert bare[0]["type"] == "message_start" and _validate(bare).content[0].type == "text"


def test_stream_stop_sequence_is_told_from_the_engine_report() -> None:
    chunks = [
        _chunk({"content": "a, b"}),
        _chunk({}, "stop", __verbose={"stop_type": "word", "stopping_word": "\n\n"}),
    ]
    events = _run(MessageStream("m", stop_sequences=["\n\n"]), chunks)
    final = _validate(events)
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "\n\n")


def test_finish_closes_a_stream_the_engine_cut_short() -> None:
    stream = MessageStream("m")
    chunks = [
        _chunk({"role": "assistant", "content": None}),
        _chunk({"content": "partial"}),
        _tool(0, '{"a": ', id="c1", name="f"),
    ]
    events = _run(stream, chunks)
    _check_order(events)
    final = _validate(events)
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.stop_reason == "tool_use"
    assert events[-2]["usage"] == {"output_tokens": 0}
    assert stream.statistics().done is True


def test_finish_without_any_chunk_is_an_empty_message() -> None:
    events = [data for _n, data in _parse_sse(MessageStream("m").finish())]
    _check_order(events)
    final = _validate(events)
    assert final.content == [] and final.stop_reason == "end_turn"


def test_tool_arguments_before_the_name_wait_for_the_block() -> None:
    chunks = [
        _chunk({"tool_calls": [{"index": 0, "id": "c9", "function": {"arguments": '{"x"'}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": ": 1}"}}]}),
        _chunk({}, "tool_calls"),
    ]
    final = _validate(_run(MessageStream("m"), chunks))
    block = final.content[0]
    assert block.type == "tool_use" and (block.id, block.name, block.input) == ("c9", "f", {"x": 1})


def test_engine_error_mid_stream_becomes_an_error_event() -> None:
    stream = MessageStream("m")
    head = stream.feed(_chunk({"content": "par"}))
    error = {
        "error": {
            "code": 400,
            "message": "request (9000 tokens) exceeds the available context size (8192 tokens)",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": 9000,
            "n_ctx": 8192,
        }
    }
    tail = stream.feed(error)
    assert next(name for name, _d in _parse_sse(head)) == "message_start"
    (name, data), *rest = list(_parse_sse(tail))
    assert name == "error" and rest == []
    ErrorResponse.model_validate(data)
    assert data["error"] == {
        "type": "invalid_request_error",
        "message": "prompt is too long: 9000 tokens > 8192 maximum",
    }
    assert stream.finish() == b""
    assert stream.error("api_error", "again") == b""


def test_error_method_and_the_sdk_raising_on_it() -> None:
    stream = MessageStream("m")
    raw = stream.feed(_chunk({"content": "x"})) + stream.error("overloaded_error", "engine gone")
    client = _client(lambda request: _sse_response(raw))
    with pytest.raises(anthropic.APIStatusError) as info:  # noqa: SIM117
        with client.messages.stream(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}]
        ) as events:
            events.get_final_message()
    assert "engine gone" in str(info.value)


def test_the_sdk_streaming_client_reads_the_stream() -> None:
    stream = MessageStream("qwen")
    raw = b"".join(stream.feed(chunk) for chunk in _recorded_stream()) + stream.finish()
    client = _client(lambda request: _sse_response(raw))
    with client.messages.stream(
        model="qwen", max_tokens=100, messages=[{"role": "user", "content": "x"}]
    ) as events:
        text = "".join(events.text_stream)
        final = events.get_final_message()
    assert text == "".join(TEXT)
    tool = final.content[1]
    assert tool.type == "tool_use" and tool.input == {"city": "Paris"}
    assert final.usage.output_tokens == 31


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("status", "type_"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (422, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (529, "overloaded_error"),
    ],
)
def test_error_body_uses_anthropic_types(status: int, type_: str) -> None:
    body = error_body(status, "boom")
    assert body == {"type": "error", "error": {"type": type_, "message": "boom"}}
    if type_ != "request_too_large":  # documented by Anthropic, absent from the SDK's union
        ErrorResponse.model_validate(body)


def test_engine_errors_map_by_code_then_type() -> None:
    assert engine_error(
        {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
    ) == (
        503,
        {"type": "error", "error": {"type": "overloaded_error", "message": "Loading model"}},
    )
    status, body = engine_error({"message": "bad", "type": "invalid_request_error"})
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = engine_error("not json")
    assert status == 500 and body["error"] == {"type": "api_error", "message": "not json"}


# --------------------------------------------------------------------------- helpers


def _client(handler: Callable[[Any], Any]) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        api_key="test",
        base_url="http://host.test",
        max_retries=0,
        http_client=_HTTPX.Client(transport=_HTTPX.MockTransport(handler)),
    )


def _sse_response(raw: bytes) -> Any:
    return _HTTPX.Response(200, content=raw, headers={"content-type": "text/event-stream"})
