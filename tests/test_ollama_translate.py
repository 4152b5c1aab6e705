"""The Ollama translation layer (gezel_trio.api.ollama_translate), without an engine.

Requests: each Ollama field lands on the engine field llama-server reads, and bad
input is a FieldError naming the field. Answers: every shape built here is parsed
by the official ``ollama`` client, both with its pydantic types and through its
own HTTP code (an ``httpx.MockTransport`` serving our bodies), and uses only the
JSON names Ollama's ``api/types.go`` declares.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import httpx
import ollama
import pytest

from gezel_trio.api import ollama_translate as o
from gezel_trio.api.validation import check_completion_body
from gezel_trio.errors import FieldError, QueueFull, UnknownModel

NOW_NS = 1_700_000_000_123_456_789
WALL = o.WallTimes(total_ns=2_500_000_000, load_ns=400_000_000)


def clock() -> int:
    return NOW_NS


PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 24).decode()
JPEG = base64.b64encode(b"\xff\xd8\xff\xe0" + b"\0" * 24).decode()

# JSON names from Ollama's api/types.go (the structs each answer marshals).
METRICS = {
    "total_duration",
    "load_duration",
    "prompt_eval_count",
    "prompt_eval_duration",
    "eval_count",
    "eval_duration",
}
CHAT_FIELDS = {
    "model",
    "remote_model",
    "remote_host",
    "created_at",
    "message",
    "done",
    "done_reason",
    "_debug_info",
    "logprobs",
} | METRICS
GENERATE_FIELDS = {
    "model",
    "remote_model",
    "remote_host",
    "created_at",
    "response",
    "thinking",
    "done",
    "done_reason",
    "context",
    "tool_calls",
    "_debug_info",
    "logprobs",
} | METRICS
MESSAGE_FIELDS = {
    "role",
    "content",
    "thinking",
    "images",
    "tool_calls",
    "tool_name",
    "tool_call_id",
}
TOOL_CALL_FIELDS = {"id", "function"}
TOOL_FUNCTION_FIELDS = {"index", "name", "arguments"}
DETAILS_FIELDS = {
    "parent_model",
    "format",
    "family",
    "families",
    "parameter_size",
    "quantization_level",
    "context_length",
    "embedding_length",
}
LIST_MODEL_FIELDS = {
    "name",
    "model",
    "remote_model",
    "remote_host",
    "modified_at",
    "size",
    "digest",
    "details",
    "capabilities",
}
PROCESS_MODEL_FIELDS = {
    "name",
    "model",
    "size",
    "digest",
    "details",
    "expires_at",
    "size_vram",
    "context_length",
}
SHOW_FIELDS = {
    "license",
    "modelfile",
    "parameters",
    "template",
    "system",
    "renderer",
    "parser",
    "details",
    "messages",
    "remote_model",
    "remote_host",
    "model_info",
    "projector_info",
    "tensors",
    "capabilities",
    "modified_at",
    "requires",
}
EMBED_FIELDS = {"model", "embeddings", "total_duration", "load_duration", "prompt_eval_count"}


def assert_only(
    value: Mapping[str, Any], allowed: set[str], *, required: Iterable[str] = ()
) -> None:
    assert set(value) <= allowed, set(value) - allowed
    missing = set(required) - set(value)
    assert not missing, missing


def assert_chat_shape(answer: Mapping[str, Any]) -> None:
    assert_only(answer, CHAT_FIELDS, required={"model", "created_at", "message", "done"})
    message = answer["message"]
    assert_only(message, MESSAGE_FIELDS, required={"role", "content"})
    for call in message.get("tool_calls", ()):
        assert_only(call, TOOL_CALL_FIELDS, required={"function"})
        assert_only(call["function"], TOOL_FUNCTION_FIELDS, required={"name", "arguments"})
    ollama.ChatResponse.model_validate(answer)


def assert_generate_shape(answer: Mapping[str, Any]) -> None:
    assert_only(answer, GENERATE_FIELDS, required={"model", "created_at", "response", "done"})
    ollama.GenerateResponse.model_validate(answer)


def lines_of(data: bytes) -> list[dict[str, Any]]:
    assert data.endswith(b"\n")
    return [json.loads(line) for line in data.decode().splitlines()]


def raises_field(param: str, fn: Callable[..., Any], *args: Any) -> FieldError:
    with pytest.raises(FieldError) as info:
        fn(*args)
    assert info.value.param == param, info.value.message
    return info.value


# ============================================================================ requests


def test_chat_request_routes_to_the_chat_route_with_messages() -> None:
    req = o.chat_request(
        {"model": "demo:latest", "messages": [{"role": "User", "content": "hi"}], "stream": False}
    )
    assert req.kind == "chat" and req.path == o.CHAT_PATH
    assert req.model == "demo:latest" and req.model_ids == ("demo:latest", "demo")
    assert req.body == {"messages": [{"role": "user", "content": "hi"}], "stream": False}
    assert not req.stream and not req.load_only and req.images == 0
    assert "id_slot" not in req.body and "cache_prompt" not in req.body and "model" not in req.body


def test_stream_defaults_to_true_and_asks_for_usage() -> None:
    chat = o.chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    gen = o.generate_request({"model": "m", "prompt": "x"})
    raw = o.generate_request({"model": "m", "prompt": "x", "raw": True})
    for req in (chat, gen, raw):
        assert req.stream is True and req.body["stream"] is True
    assert chat.body["stream_options"] == {"include_usage": True}
    assert gen.body["stream_options"] == {"include_usage": True}
    assert "stream_options" not in raw.body  # the native route has no such field
    quiet = o.chat_request({"model": "m", "messages": [], "stream": False})
    assert "stream_options" not in quiet.body


def test_options_map_to_engine_fields() -> None:
    options = {
        "num_predict": 64,
        "temperature": 0.25,
        "top_k": 20,
        "top_p": 0.9,
        "min_p": 0.05,
        "typical_p": 0.7,
        "seed": 42,
        "stop": ["\n", "user:"],
        "repeat_penalty": 1.1,
        "repeat_last_n": 33,
        "presence_penalty": 1.5,
        "frequency_penalty": 1.0,
        "num_keep": 5,
        "mirostat": 2,
        "mirostat_tau": 5.0,
        "mirostat_eta": 0.1,
        "num_ctx": 4096,
        # runner options and unknown ones: ignored, as Ollama ignores unknown ones
        "num_gpu": 99,
        "num_thread": 8,
        "use_mmap": True,
        "penalize_newline": True,
        "made_up": "x",
    }
    chat = o.chat_request({"model": "m", "messages": [], "options": options, "stream": False})
    expected = {
        "temperature": 0.25,
        "top_k": 20,
        "top_p": 0.9,
        "min_p": 0.05,
        "typical_p": 0.7,
        "seed": 42,
        "stop": ["\n", "user:"],
        "repeat_penalty": 1.1,
        "repeat_last_n": 33,
        "presence_penalty": 1.5,
        "frequency_penalty": 1.0,
        "n_keep": 5,
        "mirostat": 2,
        "mirostat_tau": 5.0,
        "mirostat_eta": 0.1,
    }
    assert chat.body == {"messages": [], "stream": False, "max_tokens": 64, **expected}
    assert chat.num_ctx == 4096
    raw = o.generate_request(
        {"model": "m", "prompt": "p", "raw": True, "options": options, "stream": False}
    )
    assert raw.body == {"stream": False, "prompt": "p", "n_predict": 64, **expected}
    assert raw.num_ctx == 4096


@pytest.mark.parametrize("num_predict", [-1, -2])
def test_a_negative_num_predict_means_no_limit(num_predict: int) -> None:
    req = o.chat_request({"model": "m", "messages": [], "options": {"num_predict": num_predict}})
    assert "max_tokens" not in req.body and "n_predict" not in req.body


def test_integral_floats_are_integers_as_in_ollama() -> None:
    req = o.chat_request({"model": "m", "messages": [], "options": {"seed": 7.0, "top_k": 3.0}})
    assert req.body["seed"] == 7 and isinstance(req.body["seed"], int)
    assert req.body["top_k"] == 3


def test_a_single_stop_string_is_accepted() -> None:
    req = o.chat_request({"model": "m", "messages": [], "options": {"stop": "###"}})
    assert req.body["stop"] == ["###"]


def test_format_json_and_schema() -> None:
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    json_mode = o.chat_request({"model": "m", "messages": [], "format": "json"})
    assert json_mode.body["response_format"] == {"type": "json_object"}
    structured = o.chat_request({"model": "m", "messages": [], "format": schema})
    assert structured.body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "schema", "schema": schema},
    }
    none = o.chat_request({"model": "m", "messages": [], "format": ""})
    assert "response_format" not in none.body
    raw = o.generate_request({"model": "m", "prompt": "p", "raw": True, "format": "json"})
    assert raw.body["json_schema"] == {"type": "object"}
    infill = o.generate_request({"model": "m", "prompt": "p", "suffix": "s", "format": schema})
    assert infill.body["json_schema"] == schema
    gen = o.generate_request({"model": "m", "prompt": "p", "format": schema})
    assert gen.body["response_format"]["json_schema"]["schema"] == schema


@pytest.mark.parametrize(
    ("think", "kwargs"),
    [
        (True, {"enable_thinking": True}),
        (False, {"enable_thinking": False}),
        ("low", {"enable_thinking": True, "reasoning_effort": "low"}),
        ("max", {"enable_thinking": True, "reasoning_effort": "max"}),
    ],
)
def test_think_becomes_template_kwargs(think: object, kwargs: dict[str, Any]) -> None:
    chat = o.chat_request({"model": "m", "messages": [], "think": think})
    assert chat.body["chat_template_kwargs"] == kwargs
    gen = o.generate_request({"model": "m", "prompt": "p", "think": think})
    assert gen.body["chat_template_kwargs"] == kwargs


def test_think_left_out_is_not_sent() -> None:
    assert "chat_template_kwargs" not in o.chat_request({"model": "m", "messages": []}).body


def test_tools_and_tool_calls_in_history() -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    req = o.chat_request(
        {
            "model": "m",
            "tools": tools,
            "messages": [
                {"role": "user", "content": "weather in Tokyo and Paris, and the time?"},
                {
                    "role": "assistant",
                    "content": "",
                    "thinking": "two cities",
                    "tool_calls": [
                        {"function": {"name": "get_weather", "arguments": {"city": "Tokyo"}}},
                        {"function": {"name": "get_time", "arguments": {}}},
                        {
                            "id": "given",
                            "function": {"name": "get_weather", "arguments": '{"x":1}'},
                        },
                    ],
                },
                # answered out of order, by name only, and one by its id
                {"role": "tool", "content": "12:00", "tool_name": "get_time"},
                {"role": "tool", "content": "11 C", "tool_name": "get_weather"},
                {"role": "tool", "content": "9 C", "tool_call_id": "given"},
            ],
        }
    )
    assert req.body["tools"] == tools
    assistant = req.body["messages"][1]
    assert assistant["reasoning_content"] == "two cities"
    assert assistant["tool_calls"] == [
        {
            "id": "call_1_0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'},
        },
        {"id": "call_1_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        {
            "id": "given",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"x":1}'},
        },
    ]
    time_result, weather_result, given_result = req.body["messages"][2:]
    assert time_result == {
        "role": "tool",
        "content": "12:00",
        "name": "get_time",
        "tool_call_id": "call_1_1",
    }
    assert weather_result["name"] == "get_weather" and weather_result["tool_call_id"] == "call_1_0"
    assert given_result["tool_call_id"] == "given" and "name" not in given_result
    # the host's own checks of what llama-server would choke on accept the body
    check_completion_body({**req.body, "stream": True}, kind="chat")


def test_images_become_data_uri_parts() -> None:
    req = o.chat_request(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "what is this?", "images": [PNG, JPEG]}],
        }
    )
    assert req.images == 2
    assert req.body["messages"][0]["content"] == [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
        {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{JPEG}"}},
    ]
    check_completion_body(req.body, kind="chat")


def test_generate_puts_system_and_prompt_in_chat_messages() -> None:
    req = o.generate_request(
        {"model": "m", "prompt": "Why is the sky blue?", "system": "Be brief.", "images": [PNG]}
    )
    assert req.path == o.CHAT_PATH and req.kind == "generate" and req.images == 1
    assert req.body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Why is the sky blue?"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
            ],
        },
    ]


def test_generate_raw_sends_the_prompt_as_is() -> None:
    req = o.generate_request({"model": "m", "prompt": "[INST] hi [/INST]", "raw": True})
    assert req.path == o.COMPLETION_PATH
    assert req.body == {"stream": True, "prompt": "[INST] hi [/INST]"}


def test_generate_suffix_is_fill_in_the_middle() -> None:
    req = o.generate_request(
        {"model": "m", "prompt": "def gcd(a, b):", "suffix": "    return r", "stream": False}
    )
    assert req.path == o.INFILL_PATH
    assert req.body == {
        "stream": False,
        "input_prefix": "def gcd(a, b):",
        "input_suffix": "    return r",
        "prompt": "",
    }


def test_empty_messages_or_prompt_only_load_or_unload() -> None:
    load = o.chat_request({"model": "m", "messages": []})
    unload = o.chat_request({"model": "m", "keep_alive": 0})
    assert load.load_only and unload.load_only
    assert unload.keep_alive is not None and unload.keep_alive.unload
    assert o.generate_request({"model": "m"}).load_only
    assert not o.generate_request({"model": "m", "prompt": "x"}).load_only

    loaded = o.load_answer(load, clock_ns=clock)
    assert loaded["done_reason"] == "load" and loaded["done"] is True
    assert_chat_shape(loaded)
    unloaded = o.load_answer(unload, clock_ns=clock)
    assert unloaded["done_reason"] == "unload"
    gen = o.load_answer(o.generate_request({"model": "m", "keep_alive": "0"}), clock_ns=clock)
    assert gen["done_reason"] == "unload" and gen["response"] == ""
    assert_generate_shape(gen)
    empty_embed = o.load_answer(o.embed_request({"model": "m", "input": []}))
    assert empty_embed == {"model": "m", "embeddings": []}
    ollama.EmbedResponse.model_validate(empty_embed)
    assert o.load_answer(o.embeddings_request({"model": "m", "prompt": ""})) == {"embedding": []}


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (0, 0.0),
        ("0", 0.0),
        (30, 30.0),
        (2.5, 2.5),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("1.5h", 5400.0),
        ("300ms", 0.3),
        ("2h45m10s", 9910.0),
        ("120", 120.0),
        (-1, None),
        ("-1m", None),
        ("-1", None),
    ],
)
def test_keep_alive(value: object, seconds: float | None) -> None:
    keep = o.parse_keep_alive(value)
    assert keep is not None
    if seconds is None:
        assert keep.forever and keep.seconds is None and not keep.unload
    else:
        assert keep.seconds == pytest.approx(seconds)
        assert keep.unload == (seconds == 0)
    req = o.chat_request({"model": "m", "messages": [], "keep_alive": value})
    assert req.keep_alive == keep


def test_keep_alive_left_out_is_none() -> None:
    assert o.parse_keep_alive(None) is None
    assert o.chat_request({"model": "m", "messages": []}).keep_alive is None


@pytest.mark.parametrize("value", ["soon", "5 minutes", "1x", "", "h", True, [5], {"m": 5}])
def test_bad_keep_alive_names_the_field(value: object) -> None:
    raises_field("keep_alive", o.chat_request, {"model": "m", "messages": [], "keep_alive": value})


GOOD_CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"model": None}, "model"),
        ({"model": 3}, "model"),
        ({"stream": "yes"}, "stream"),
        ({"messages": "hi"}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": ["x"]}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x", "images": "abc"}]}, "messages[0].images"),
        (
            {"messages": [{"role": "user", "content": "x", "images": ["not base64!"]}]},
            "messages[0].images[0]",
        ),
        ({"messages": [{"role": "tool", "content": "x", "tool_name": 5}]}, "messages[0].tool_name"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]},
            "messages[0].tool_calls[0]",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": 5}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"options": [1]}, "options"),
        ({"options": {"temperature": "hot"}}, "options.temperature"),
        ({"options": {"temperature": -1}}, "options.temperature"),
        ({"options": {"top_k": 1.5}}, "options.top_k"),
        ({"options": {"seed": True}}, "options.seed"),
        ({"options": {"num_predict": "10"}}, "options.num_predict"),
        ({"options": {"num_ctx": 0}}, "options.num_ctx"),
        ({"options": {"stop": [1]}}, "options.stop"),
        ({"options": {"top_p": math.inf}}, "options.top_p"),
        ({"format": "yaml"}, "format"),
        ({"format": 5}, "format"),
        ({"think": "very"}, "think"),
        ({"think": 1}, "think"),
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0].function"),
        ({"tools": ["f"]}, "tools[0]"),
    ],
)
def test_chat_field_errors_name_the_field(patch: dict[str, Any], param: str) -> None:
    raises_field(param, o.chat_request, {**GOOD_CHAT, **patch})


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"prompt": 5}, "prompt"),
        ({"suffix": ["x"]}, "suffix"),
        ({"system": {}}, "system"),
        ({"raw": "true"}, "raw"),
        ({"raw": True, "system": "be nice"}, "raw"),
        ({"template": "{{ .Prompt }}"}, "template"),
        ({"context": [1, 2, 3]}, "context"),
        ({"context": "abc"}, "context"),
        ({"images": [PNG], "raw": True}, "images"),
        ({"images": [PNG], "suffix": "s"}, "images"),
        ({"images": ["%%%"]}, "images[0]"),
        ({"think": "lots"}, "think"),
        ({"think": "lots", "raw": True}, "think"),
        ({"format": []}, "format"),
    ],
)
def test_generate_field_errors_name_the_field(patch: dict[str, Any], param: str) -> None:
    raises_field(param, o.generate_request, {"model": "m", "prompt": "p", **patch})


def test_template_and_context_refusals_say_what_to_do() -> None:
    err = raises_field("template", o.generate_request, {"model": "m", "template": "{{ .System }}"})
    assert "raw" in err.message
    err = raises_field("context", o.generate_request, {"model": "m", "context": [1]})
    assert "/api/chat" in err.message
    # empty ones are what clients send when they have none: accepted
    ok = o.generate_request({"model": "m", "prompt": "p", "template": "", "context": []})
    assert ok.path == o.CHAT_PATH


def test_embed_request() -> None:
    one = o.embed_request({"model": "e", "input": "Why is the sky blue?", "keep_alive": "10m"})
    assert one.path == o.EMBEDDINGS_PATH and one.kind == "embed"
    assert one.body == {"input": ["Why is the sky blue?"]} and not one.stream
    assert one.keep_alive == o.KeepAlive(600.0)
    many = o.embed_request({"model": "e", "input": ["a", "b"], "dimensions": 2, "truncate": True})
    assert many.body == {"input": ["a", "b"]} and many.dimensions == 2
    legacy = o.embeddings_request({"model": "e", "prompt": "llamas"})
    assert legacy.kind == "embeddings" and legacy.body == {"input": ["llamas"]}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "e", "input": 5}, "input"),
        ({"model": "e", "input": ["a", 1]}, "input"),
        ({"model": "e", "input": "a", "dimensions": "2"}, "dimensions"),
        ({"model": "e", "input": "a", "truncate": "no"}, "truncate"),
        ({"input": "a"}, "model"),
    ],
)
def test_embed_field_errors(body: dict[str, Any], param: str) -> None:
    raises_field(param, o.embed_request, body)


def test_model_names_with_tags() -> None:
    assert o.ollama_name("demo") == "demo:latest"
    assert o.ollama_name("qwen3:8b") == "qwen3:8b"
    assert o.ollama_name("host:5000/ns/demo") == "host:5000/ns/demo:latest"
    assert o.model_id_candidates("demo:latest") == ("demo:latest", "demo")
    assert o.model_id_candidates("demo:7b") == ("demo:7b",)
    assert o.resolve_model_name("demo:latest", {"demo", "other"}) == "demo"
    assert o.resolve_model_name("demo", {"demo"}) == "demo"
    assert o.resolve_model_name("qwen3:8b", {"qwen3:8b", "qwen3"}) == "qwen3:8b"
    assert o.resolve_model_name("demo:7b", {"demo"}) is None
    assert o.show_request({"name": "demo:latest", "verbose": True}) == ("demo:latest", True)


def test_check_against_model() -> None:
    """num_ctx and num_predict above the model are served (the host's limits fit them:
    tests/test_limits.py); images for a model without a projector are a 400."""
    req = o.chat_request(
        {"model": "m", "messages": [], "options": {"num_ctx": 100_000, "num_predict": 9000}}
    )
    assert o.check_against_model(req, has_projector=False) is req
    assert req.num_ctx == 100_000 and req.body["max_tokens"] == 9000
    pictures = o.chat_request(
        {"model": "m", "messages": [{"role": "user", "content": "x", "images": [PNG]}]}
    )
    raises_field("images", lambda: o.check_against_model(pictures, has_projector=False))
    assert o.check_against_model(pictures, has_projector=True) is pictures


# ============================================================================ answers

TIMINGS = {
    "cache_n": 3,
    "prompt_n": 20,
    "prompt_ms": 12.5,
    "prompt_per_token_ms": 0.625,
    "prompt_per_second": 1600.0,
    "predicted_n": 9,
    "predicted_ms": 45.25,
    "predicted_per_token_ms": 5.03,
    "predicted_per_second": 198.9,
}
FIGURES = {
    "total_duration": 2_500_000_000,
    "load_duration": 400_000_000,
    "prompt_eval_count": 23,  # cache_n + prompt_n: the whole prompt, as Ollama counts it
    "prompt_eval_duration": 12_500_000,
    "eval_count": 9,
    "eval_duration": 45_250_000,
}


def chat_completion(**message: Any) -> dict[str, Any]:
    return {
        "choices": [
            {"finish_reason": "stop", "index": 0, "message": {"role": "assistant", **message}}
        ],
        "created": 1_700_000_000,
        "model": "demo",
        "system_fingerprint": "b10434-0000000",
        "object": "chat.completion",
        "usage": {"completion_tokens": 9, "prompt_tokens": 23, "total_tokens": 32},
        "id": "chatcmpl-abc",
        "timings": TIMINGS,
    }


def test_rfc3339_nano() -> None:
    assert o.rfc3339_nano(NOW_NS) == "2023-11-14T22:13:20.123456789Z"
    assert o.rfc3339_nano(1_700_000_000_120_000_000) == "2023-11-14T22:13:20.12Z"
    assert o.rfc3339_nano(1_700_000_000_000_000_000) == "2023-11-14T22:13:20Z"


def test_chat_answer_carries_the_engine_figures() -> None:
    req = o.chat_request({"model": "demo:latest", "messages": [], "stream": False})
    answer = chat_completion(content="Hello!", reasoning_content="greet")
    out = o.chat_answer(req, answer, WALL, clock_ns=clock)
    assert out == {
        "model": "demo:latest",
        "created_at": "2023-11-14T22:13:20.123456789Z",
        "message": {"role": "assistant", "content": "Hello!", "thinking": "greet"},
        "done_reason": "stop",
        "done": True,
        **FIGURES,
    }
    assert_chat_shape(out)


def test_chat_answer_tool_calls_have_object_arguments() -> None:
    req = o.chat_request({"model": "m", "messages": [], "stream": False})
    answer = chat_completion(
        content=None,
        tool_calls=[
            {
                "type": "function",
                "id": "call_x",
                "function": {"name": "get_weather", "arguments": '{"city":"Tokyo"}'},
            },
            {"type": "function", "function": {"name": "now", "arguments": ""}},
        ],
    )
    answer["choices"][0]["finish_reason"] = "tool_calls"
    out = o.chat_answer(req, answer, WALL, clock_ns=clock)
    assert out["message"]["content"] == ""
    assert out["message"]["tool_calls"] == [
        {
            "id": "call_x",
            "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Tokyo"}},
        },
        {"function": {"index": 1, "name": "now", "arguments": {}}},
    ]
    assert out["done_reason"] == "stop"
    assert_chat_shape(out)
    parsed = ollama.ChatResponse.model_validate(out)
    assert parsed.message.tool_calls is not None
    assert parsed.message.tool_calls[0].function.arguments == {"city": "Tokyo"}


def test_tool_call_arguments_that_are_not_an_object_are_an_engine_error() -> None:
    req = o.chat_request({"model": "m", "messages": [], "stream": False})
    answer = chat_completion(tool_calls=[{"function": {"name": "f", "arguments": "[1"}}])
    with pytest.raises(o.BadEngineAnswer) as info:
        o.chat_answer(req, answer, WALL)
    assert info.value.status == 500 and "'f'" in info.value.message


def test_a_token_limit_is_done_reason_length() -> None:
    req = o.chat_request({"model": "m", "messages": [], "stream": False})
    answer = chat_completion(content="cut")
    answer["choices"][0]["finish_reason"] = "length"
    assert o.chat_answer(req, answer, WALL)["done_reason"] == "length"


def test_figures_fall_back_to_usage_and_zeros_are_left_out() -> None:
    req = o.chat_request({"model": "m", "messages": [], "stream": False})
    answer = chat_completion(content="x")
    del answer["timings"]
    out = o.chat_answer(req, answer, o.WallTimes(total_ns=1000), clock_ns=clock)
    assert out["prompt_eval_count"] == 23 and out["eval_count"] == 9
    assert out["total_duration"] == 1000
    for absent in ("load_duration", "prompt_eval_duration", "eval_duration"):
        assert absent not in out


def test_generate_answer_from_the_chat_route() -> None:
    req = o.generate_request({"model": "m", "prompt": "p", "stream": False})
    out = o.generate_answer(
        req, chat_completion(content="blue", reasoning_content="hmm"), WALL, clock_ns=clock
    )
    assert out == {
        "model": "m",
        "created_at": "2023-11-14T22:13:20.123456789Z",
        "response": "blue",
        "thinking": "hmm",
        "done_reason": "stop",
        "done": True,
        **FIGURES,
    }
    assert "context" not in out
    assert_generate_shape(out)


@pytest.mark.parametrize(
    ("body", "stop_type", "reason"),
    [
        ({"prompt": "p", "raw": True}, "eos", "stop"),
        ({"prompt": "p", "raw": True}, "word", "stop"),
        ({"prompt": "p", "suffix": "s"}, "limit", "length"),
    ],
)
def test_generate_answer_from_native_routes(
    body: dict[str, Any], stop_type: str, reason: str
) -> None:
    req = o.generate_request({"model": "m", "stream": False, **body})
    native = {
        "index": 0,
        "content": "    r = a % b",
        "tokens": [],
        "id_slot": 0,
        "stop": True,
        "model": "demo",
        "tokens_predicted": 9,
        "tokens_evaluated": 23,
        "generation_settings": {},
        "prompt": "",
        "has_new_line": False,
        "truncated": False,
        "stop_type": stop_type,
        "stopping_word": "",
        "tokens_cached": 22,
        "timings": TIMINGS,
    }
    out = o.answer_body(req, native, WALL, clock_ns=clock)
    assert out["response"] == "    r = a % b" and out["done_reason"] == reason
    assert {k: out[k] for k in FIGURES} == FIGURES
    assert_generate_shape(out)
    del native["timings"]
    bare = o.generate_answer(req, native, o.WallTimes(5), clock_ns=clock)
    assert bare["prompt_eval_count"] == 23 and bare["eval_count"] == 9


def test_embed_answer_normalizes_and_cuts_dimensions() -> None:
    engine = {
        "model": "e",
        "object": "list",
        "usage": {"prompt_tokens": 7, "total_tokens": 7},
        "data": [
            {"embedding": [0.0, 3.0, 4.0], "index": 1, "object": "embedding"},
            {"embedding": [2.0, 0.0, 0.0], "index": 0, "object": "embedding"},
        ],
    }
    req = o.embed_request({"model": "e:latest", "input": ["a", "b"]})
    out = o.embed_answer(req, engine, WALL)
    assert out["model"] == "e:latest"
    assert out["embeddings"] == [[1.0, 0.0, 0.0], [0.0, pytest.approx(0.6), pytest.approx(0.8)]]
    assert out["prompt_eval_count"] == 7 and out["total_duration"] == WALL.total_ns
    assert_only(out, EMBED_FIELDS, required={"model", "embeddings"})
    ollama.EmbedResponse.model_validate(out)
    cut = o.embed_answer(
        o.embed_request({"model": "e", "input": "a", "dimensions": 2}), engine, WALL
    )
    assert cut["embeddings"][1] == [0.0, 1.0]
    legacy = o.answer_body(o.embeddings_request({"model": "e", "prompt": "x"}), engine, WALL)
    assert legacy == {"embedding": [2.0, 0.0, 0.0]}
    ollama.EmbeddingsResponse.model_validate(legacy)


# ---------------------------------------------------------------------------- streams


def sse_chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    """One ``chat.completion.chunk`` as llama-server streams it."""
    return {
        "choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
        "created": 1_700_000_000,
        "id": "chatcmpl-abc",
        "model": "demo",
        "system_fingerprint": "b10434-0000000",
        "object": "chat.completion.chunk",
        **extra,
    }


# The shape of a streamed llama-server chat answer with thinking, text and a tool
# call (server-task.cpp to_json_oaicompat_chat_stream): a role chunk, deltas, the
# tool call's name then its arguments in pieces, the finish chunk, and with
# include_usage a last chunk with no choices that carries usage and timings.
RECORDED_CHAT_STREAM: list[dict[str, Any]] = [
    sse_chunk({"role": "assistant", "content": None}),
    sse_chunk({"reasoning_content": "The user wants"}),
    sse_chunk({"reasoning_content": " the weather."}),
    sse_chunk({"content": "Let me"}),
    sse_chunk({"content": " check."}),
    sse_chunk(
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_9f",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ""},
                }
            ]
        }
    ),
    sse_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
    sse_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Tokyo"}'}}]}),
    sse_chunk({}, "tool_calls"),
    {
        "choices": [],
        "created": 1_700_000_000,
        "id": "chatcmpl-abc",
        "model": "demo",
        "system_fingerprint": "b10434-0000000",
        "object": "chat.completion.chunk",
        "usage": {"completion_tokens": 9, "prompt_tokens": 23, "total_tokens": 32},
        "timings": TIMINGS,
    },
]


def run_stream(req: o.EngineRequest, events: Iterable[object], wall: o.WallTimes) -> bytes:
    stream = o.NdjsonStream(req, clock_ns=clock)
    out = b"".join(line for event in events for line in stream.feed(event))
    return out + stream.finish(wall)


def test_recorded_chat_stream_becomes_ndjson() -> None:
    req = o.chat_request({"model": "demo:latest", "messages": [{"role": "user", "content": "w?"}]})
    data = run_stream(req, RECORDED_CHAT_STREAM, WALL)
    lines = lines_of(data)
    for line in lines:
        assert_chat_shape(line)
        assert line["model"] == "demo:latest"
        assert line["created_at"] == "2023-11-14T22:13:20.123456789Z"
    *body, last = lines
    assert [line["done"] for line in body] == [False] * len(body)
    assert [line["message"].get("thinking") for line in body[:2]] == [
        "The user wants",
        " the weather.",
    ]
    assert "".join(line["message"]["content"] for line in body) == "Let me check."
    calls = [call for line in body for call in line["message"].get("tool_calls", ())]
    assert calls == [
        {
            "id": "call_9f",
            "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Tokyo"}},
        }
    ]
    assert last == {
        "model": "demo:latest",
        "created_at": "2023-11-14T22:13:20.123456789Z",
        "message": {"role": "assistant", "content": ""},
        "done_reason": "stop",
        "done": True,
        **FIGURES,
    }


def test_the_official_client_reads_the_stream() -> None:
    req = o.chat_request({"model": "demo", "messages": [{"role": "user", "content": "w?"}]})
    data = run_stream(req, RECORDED_CHAT_STREAM, WALL)
    client = mock_client({("POST", "/api/chat"): lambda _: (200, data)})
    parts = list(
        client.chat(model="demo", messages=[{"role": "user", "content": "w?"}], stream=True)
    )
    assert "".join(p.message.content or "" for p in parts) == "Let me check."
    assert "".join(p.message.thinking or "" for p in parts) == "The user wants the weather."
    calls = [c for p in parts for c in (p.message.tool_calls or ())]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Tokyo"})
    ]
    final = parts[-1]
    assert final.done and final.done_reason == "stop"
    assert final.eval_count == 9 and final.eval_duration == 45_250_000
    assert final.prompt_eval_count == 23 and final.prompt_eval_duration == 12_500_000
    assert final.total_duration == 2_500_000_000 and final.load_duration == 400_000_000


def test_generate_stream_over_the_chat_route() -> None:
    req = o.generate_request({"model": "m", "prompt": "p"})
    events = [e for e in RECORDED_CHAT_STREAM if "tool_calls" not in str(e)]
    lines = lines_of(run_stream(req, events, WALL))
    for line in lines:
        assert_generate_shape(line)
    assert "".join(line["response"] for line in lines) == "Let me check."
    assert "".join(line.get("thinking", "") for line in lines) == "The user wants the weather."
    assert lines[-1]["done"] and lines[-1]["eval_duration"] == 45_250_000


def test_native_stream_for_raw_and_infill() -> None:
    events: list[object] = [
        {"index": 0, "content": "    r", "tokens": [], "stop": False, "id_slot": 0},
        {"index": 0, "content": " = a", "tokens": [], "stop": False, "id_slot": 0},
        {
            "index": 0,
            "content": "",
            "tokens": [],
            "stop": True,
            "id_slot": 0,
            "model": "demo",
            "tokens_predicted": 9,
            "tokens_evaluated": 23,
            "stop_type": "limit",
            "stopping_word": "",
            "tokens_cached": 22,
            "timings": TIMINGS,
        },
    ]
    for body in ({"raw": True}, {"suffix": "return r"}):
        req = o.generate_request({"model": "m", "prompt": "def f(a):", **body})
        lines = lines_of(run_stream(req, events, WALL))
        for line in lines:
            assert_generate_shape(line)
        assert [line["response"] for line in lines] == ["    r", " = a", ""]
        assert lines[-1] == {
            "model": "m",
            "created_at": "2023-11-14T22:13:20.123456789Z",
            "response": "",
            "done_reason": "length",
            "done": True,
            **FIGURES,
        }


def test_an_engine_error_event_ends_the_stream_with_an_error_line() -> None:
    req = o.chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    stream = o.NdjsonStream(req, clock_ns=clock)
    first = stream.feed(sse_chunk({"content": "Hel"}))
    error = stream.feed(
        {
            "error": {
                "code": 500,
                "message": "Context size has been exceeded.",
                "type": "server_error",
            }
        }
    )
    assert error == [b'{"error":"Context size has been exceeded."}\n']
    assert stream.feed(sse_chunk({"content": "lo"})) == []
    assert stream.finish(WALL) == b""
    assert stream.failed
    client = mock_client({("POST", "/api/chat"): lambda _: (200, b"".join(first + error))})
    with pytest.raises(ollama.ResponseError, match="Context size has been exceeded"):
        list(client.chat(model="m", messages=[{"role": "user", "content": "x"}], stream=True))


def test_bad_tool_call_arguments_mid_stream_are_an_error_line() -> None:
    req = o.chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    events = [
        sse_chunk({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": "{oops"}}]}),
        sse_chunk({}, "tool_calls"),
    ]
    lines = lines_of(run_stream(req, events, WALL))
    assert len(lines) == 1 and "error" in lines[0] and "'f'" in lines[0]["error"]


def test_tool_calls_left_without_a_finish_reason_still_go_out() -> None:
    req = o.chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    events = [
        sse_chunk({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": "{}"}}]})
    ]
    lines = lines_of(run_stream(req, events, o.WallTimes(1)))
    assert lines[0]["message"]["tool_calls"][0]["function"]["name"] == "f"
    assert lines[-1]["done"] and lines[-1]["done_reason"] == "stop"


def test_stream_error_helper_and_repr() -> None:
    stream = o.NdjsonStream(o.generate_request({"model": "m", "prompt": "p"}), clock_ns=clock)
    assert stream.error("the engine crashed") == b'{"error":"the engine crashed"}\n'
    assert "failed=True" in repr(stream)
    with pytest.raises(ValueError):
        o.NdjsonStream(o.embed_request({"model": "m", "input": "x"}))


def test_wall_times_from_monotonic_stamps() -> None:
    wall = o.WallTimes.since(1_000, loaded_ns=1_400, now_ns=3_000)
    assert wall == o.WallTimes(total_ns=2_000, load_ns=400)
    assert o.WallTimes.since(1_000, now_ns=1_500) == o.WallTimes(500, 0)


# ============================================================================ listings

FACTS = o.ModelFacts(
    model_id="demo",
    size=4_683_075_271,
    modified_ns=1_700_000_000_639_712_648,
    digest=o.model_digest("/models/demo.gguf", 4_683_075_271, 1_700_000_000_639_712_648),
    architecture="qwen2",
    parameter_count=7_615_616_512,
    file_type=15,
    context_length=32768,
    embedding_length=3584,
    chat_template="{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}{% endif %}",
    capabilities=o.model_capabilities(tools=True, fim=True, vision=True),
    parameters=(("num_ctx", 4096), ("stop", ["<|im_end|>", "<|endoftext|>"]), ("temperature", 0.7)),
    metadata=(("qwen2.block_count", 28),),
)
EMBEDDER = o.ModelFacts(
    model_id="minilm:f16",
    size=45_000_000,
    modified_ns=1_600_000_000_000_000_000,
    digest=o.model_digest("/models/minilm.gguf", 45_000_000, 1_600_000_000_000_000_000),
    architecture="bert",
    parameter_count=22_565_760,
    file_type=1,
    capabilities=o.model_capabilities(completion=False, embedding=True),
)


def test_digest_is_stable_and_follows_the_file() -> None:
    digest = o.model_digest("/models/demo.gguf", 10, 20)
    assert len(digest) == 64 and int(digest, 16) >= 0
    assert digest == o.model_digest("/models/demo.gguf", 10, 20)
    assert digest != o.model_digest("/models/demo.gguf", 10, 21)
    assert digest != o.model_digest("/models/demo.gguf", 11, 20)
    assert digest != o.model_digest("/models/other.gguf", 10, 20)


@pytest.mark.parametrize(
    ("count", "text"),
    [
        (8_030_261_248, "8.0B"),
        (8_000_000_000, "8B"),
        (7_615_616_512, "7.6B"),
        (135_000_000, "135M"),
        (22_565_760, "22.57M"),
        (15_000, "15K"),
        (999, "999"),
        (None, ""),
    ],
)
def test_parameter_size_as_ollama_writes_it(count: int | None, text: str) -> None:
    assert o.human_parameter_count(count) == text


@pytest.mark.parametrize(
    ("file_type", "name"),
    [(0, "F32"), (1, "F16"), (2, "Q4_0"), (7, "Q8_0"), (15, "Q4_K_M"), (18, "Q6_K"),
     (32, "BF16"), (38, "MXFP4_MOE"), (4, "unknown"), (999, "unknown"), ("Q5_K_M", "Q5_K_M"),
     (None, "")],
)  # fmt: skip
def test_quantization_names(file_type: int | str | None, name: str) -> None:
    assert o.quantization_name(file_type) == name


def test_capabilities_and_template_hints() -> None:
    assert o.model_capabilities() == ("completion",)
    assert o.model_capabilities(
        tools=True, fim=True, vision=True, embedding=True, thinking=True
    ) == (
        "completion",
        "tools",
        "insert",
        "vision",
        "embedding",
        "thinking",
    )
    assert o.template_supports_tools("{% if tools %}...{% endif %}")
    assert not o.template_supports_tools("{{ messages }}") and not o.template_supports_tools(None)
    assert o.template_supports_thinking("{% if enable_thinking %}<think>{% endif %}")
    assert not o.template_supports_thinking("{{ messages }}")


def test_tags() -> None:
    body = o.tags_body([EMBEDDER, FACTS])
    first, second = body["models"]  # newest first
    assert first == {
        "name": "demo:latest",
        "model": "demo:latest",
        "modified_at": "2023-11-14T22:13:20.639712648Z",
        "size": 4_683_075_271,
        "digest": FACTS.digest,
        "details": {
            "parent_model": "",
            "format": "gguf",
            "family": "qwen2",
            "families": ["qwen2"],
            "parameter_size": "7.6B",
            "quantization_level": "Q4_K_M",
            "context_length": 32768,
            "embedding_length": 3584,
        },
        "capabilities": ["completion", "tools", "insert", "vision"],
    }
    assert second["capabilities"] == ["embedding"] and "context_length" not in second["details"]
    assert second["name"] == "minilm:f16" and second["details"]["quantization_level"] == "F16"
    for row in body["models"]:
        assert_only(
            row, LIST_MODEL_FIELDS, required={"name", "model", "modified_at", "size", "digest"}
        )
        assert_only(row["details"], DETAILS_FIELDS)
    parsed = ollama.ListResponse.model_validate(body)
    assert parsed.models[0].model == "demo:latest" and parsed.models[0].size == 4_683_075_271
    assert o.tags_body([]) == {"models": []}


def test_ps_orders_by_expiry_and_keeps_forever_as_ollama_does() -> None:
    later = NOW_NS + 300 * 10**9
    body = o.ps_body(
        [
            (EMBEDDER, o.LoadedFacts(size=90_000_000, size_vram=90_000_000, expires_ns=later)),
            (
                FACTS,
                o.LoadedFacts(
                    size=6 << 30, size_vram=5 << 30, expires_ns=None, context_length=4096
                ),
            ),
        ],
        now_ns=NOW_NS,
    )
    forever, soon = body["models"]
    assert forever["name"] == "demo:latest" and forever["expires_at"].startswith("2316-")
    assert forever["size"] == 6 << 30 and forever["size_vram"] == 5 << 30
    assert forever["context_length"] == 4096 and forever["digest"] == FACTS.digest
    assert soon["expires_at"] == "2023-11-14T22:18:20.123456789Z" and soon["context_length"] == 0
    for row in body["models"]:
        assert_only(row, PROCESS_MODEL_FIELDS, required=PROCESS_MODEL_FIELDS)
    parsed = ollama.ProcessResponse.model_validate(body)
    assert parsed.models[0].context_length == 4096
    assert parsed.models[1].expires_at is not None and parsed.models[1].expires_at.minute == 18


def test_show() -> None:
    body = o.show_body(FACTS)
    assert_only(body, SHOW_FIELDS, required={"model_info"})
    assert body["template"] == FACTS.chat_template
    assert body["capabilities"] == ["completion", "tools", "insert", "vision"]
    assert body["model_info"] == {
        "general.architecture": "qwen2",
        "general.file_type": 15,
        "general.parameter_count": 7_615_616_512,
        "qwen2.context_length": 32768,
        "qwen2.embedding_length": 3584,
        "qwen2.block_count": 28,
    }
    assert body["parameters"].splitlines() == [
        "num_ctx                        4096",
        'stop                           "<|im_end|>"',
        'stop                           "<|endoftext|>"',
        "temperature                    0.7",
    ]
    assert "FROM demo:latest" in body["modelfile"]
    assert 'PARAMETER stop                           "<|im_end|>"' in body["modelfile"]
    parsed = ollama.ShowResponse.model_validate(body)
    assert parsed.modelinfo is not None and parsed.modelinfo["qwen2.context_length"] == 32768
    assert parsed.details is not None and parsed.details.family == "qwen2"
    embedder = o.show_body(EMBEDDER, verbose=True)
    assert embedder["capabilities"] == ["embedding"]
    ollama.ShowResponse.model_validate(embedder)


def test_version() -> None:
    assert o.version_body() == {"version": o.OLLAMA_API_VERSION}
    assert o.version_body("1.2.3") == {"version": "1.2.3"}


# ============================================================================ errors


def test_errors_in_ollamas_shape_and_statuses() -> None:
    assert o.error_body("boom") == {"error": "boom"}
    assert o.error_status(UnknownModel("no model 'x' is configured"), model="x") == (
        404,
        {"error": "model 'x' not found"},
    )
    assert o.error_status(UnknownModel("no model 'x' is configured")) == (
        404,
        {"error": "no model 'x' is configured"},
    )
    assert o.error_status(FieldError("options.top_k", "expected an integer")) == (
        400,
        {"error": "options.top_k: expected an integer"},
    )
    assert o.error_status(QueueFull("queue full"))[0] == 503
    for route in ("pull", "push", "create", "copy", "delete"):
        body = o.not_implemented_body(route)
        assert body["error"].startswith(f"/api/{route} is not supported")
    assert "models_dir" in o.not_implemented_body("pull")["error"]


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ({"error": {"code": 400, "message": "bad", "type": "invalid_request_error"}}, "bad"),
        ({"error": "plain"}, "plain"),
        (b"  text body \n", "text body"),
        (None, "the engine failed"),
    ],
)
def test_engine_error_message(answer: object, message: str) -> None:
    assert o.engine_error_message(answer) == message


# ============================================================================ the client


def mock_client(
    routes: Mapping[tuple[str, str], Callable[[httpx.Request], tuple[int, bytes]]],
) -> ollama.Client:
    def handle(request: httpx.Request) -> httpx.Response:
        status, body = routes[(request.method, request.url.path)](request)
        return httpx.Response(status, content=body)

    return ollama.Client(host="http://ollama.test", transport=httpx.MockTransport(handle))


def test_the_official_client_reads_every_answer() -> None:
    """The ollama client's own calls, answered with the bodies built here from what
    its requests say (so the request parsing is exercised too)."""

    def dumps(value: Any) -> bytes:
        return json.dumps(value).encode()

    def chat(request: httpx.Request) -> tuple[int, bytes]:
        req = o.chat_request(json.loads(request.content))
        answer = chat_completion(content="Hi there")
        return 200, dumps(o.answer_body(req, answer, WALL))

    def generate(request: httpx.Request) -> tuple[int, bytes]:
        req = o.generate_request(json.loads(request.content))
        return 200, dumps(o.answer_body(req, chat_completion(content="blue"), WALL))

    def embed(request: httpx.Request) -> tuple[int, bytes]:
        req = o.embed_request(json.loads(request.content))
        engine = {"data": [{"embedding": [3.0, 4.0], "index": 0}], "usage": {"prompt_tokens": 2}}
        return 200, dumps(o.answer_body(req, engine, WALL))

    def show(request: httpx.Request) -> tuple[int, bytes]:
        name, _ = o.show_request(json.loads(request.content))
        if o.resolve_model_name(name, {"demo"}) is None:
            return 404, dumps(o.error_body(o.not_found_message(name)))
        return 200, dumps(o.show_body(FACTS))

    client = mock_client(
        {
            ("POST", "/api/chat"): chat,
            ("POST", "/api/generate"): generate,
            ("POST", "/api/embed"): embed,
            ("POST", "/api/show"): show,
            ("GET", "/api/tags"): lambda _: (200, dumps(o.tags_body([FACTS]))),
            ("GET", "/api/ps"): lambda _: (
                200,
                dumps(o.ps_body([(FACTS, o.LoadedFacts(1, 1, None, 2048))])),
            ),
        }
    )
    reply = client.chat(
        model="demo:latest",
        messages=[{"role": "user", "content": "hi", "images": [PNG]}],
        options={"temperature": 0, "num_predict": 8},
        keep_alive="5m",
        format="json",
        think=False,
        stream=False,
    )
    assert reply.message.content == "Hi there" and reply.done and reply.eval_count == 9
    assert reply.model == "demo:latest"
    text = client.generate(model="demo", prompt="Why?", system="brief", stream=False)
    assert text.response == "blue" and text.done_reason == "stop"
    vectors = client.embed(model="demo", input="x")
    assert [list(v) for v in vectors.embeddings] == [[pytest.approx(0.6), pytest.approx(0.8)]]
    assert client.list().models[0].model == "demo:latest"
    assert client.ps().models[0].context_length == 2048
    assert client.show("demo:latest").capabilities == ["completion", "tools", "insert", "vision"]
    with pytest.raises(ollama.ResponseError) as info:
        client.show("nope")
    assert info.value.status_code == 404 and info.value.error == "model 'nope' not found"
