"""Responses input items as OpenAI reads them (:func:`gezel_trio.api.responses.typed_input`)."""

from __future__ import annotations

import copy
from typing import Any

from gezel_trio.api.responses import typed_input


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
