"""The Responses body as the host checks it, and input items as OpenAI reads them."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gezel_trio.api.responses import check_responses_body, typed_input
from gezel_trio.errors import FieldError


def test_items_with_a_role_and_no_type_become_messages() -> None:
    body: dict[str, Any] = {
        "model": "m",
        "input": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            {"type": "message", "role": "user", "content": "again"},
        ],
    }
    sent = copy.deepcopy(body)
    typed = typed_input(body)
    assert body == sent  # the client's body is left as it came
    assert [item.get("type") for item in typed["input"]] == [
        "message",
        "message",
        "function_call_output",
        "message",
    ]
    assert typed["input"][1] == {"type": "message", **sent["input"][1]}
    assert typed["input"][2:] == sent["input"][2:]
    assert typed["model"] == "m"


def test_what_needs_no_type_is_returned_as_it_is() -> None:
    for body in (
        {"input": "hi"},
        {"input": [{"type": "message", "role": "user", "content": "x"}]},
        {"input": [{"content": "no role: the engine says what it cannot read"}]},
        {},
    ):
        assert typed_input(body) is body


def test_the_body_check_refuses_only_what_the_host_reads_and_cannot() -> None:
    """An empty input and ``max_output_tokens: 0`` are served by the engine, so they pass;
    a stateful field, an input of the wrong type and a negative limit do not."""
    for body in (
        {"input": []},
        {"input": ""},
        {"input": "hi", "max_output_tokens": 0},
        {"input": [{"role": "user", "content": "hi"}], "temperature": 1.5},
    ):
        check_responses_body(body)
    for body, param in (
        ({"input": 5}, "input"),
        ({"input": ["hi"]}, "input[0]"),
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation"),
        ({"input": "hi", "max_output_tokens": -2}, "max_output_tokens"),
        ({"input": "hi", "instructions": 5}, "instructions"),
    ):
        with pytest.raises(FieldError) as info:
            check_responses_body(body)
        assert info.value.param == param
