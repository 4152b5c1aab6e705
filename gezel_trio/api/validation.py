"""Reading and checking request bodies. Every failure is a 400 that names the field."""

from __future__ import annotations

import json
import math
from typing import Any

from quart import request

from ..errors import BadRequest, FieldError
from .exchange import exchange_or_none


async def read_json_object() -> dict[str, Any]:
    """The request body as a JSON object: the one the front read already (the lean
    front), else read through Quart.

    Raises 413 (via Quart) when the body is over the limit, and
    :class:`BadRequest` when it is not UTF-8 JSON or not an object.
    """
    exchange = exchange_or_none()
    raw = exchange.raw if exchange is not None else None
    if raw is None:
        data = await request.get_data(cache=False, as_text=False)
        assert isinstance(data, bytes)
        raw = data
    return parse_json_object(raw)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object; :class:`BadRequest` when it is not UTF-8 JSON or not an
    object."""
    if not raw:
        raise BadRequest("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not valid UTF-8 (byte {exc.start})") from exc
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise BadRequest(
            f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from exc
    except RecursionError as exc:
        raise BadRequest("the request body nests too deeply") from exc
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    if "\\u" in text:
        # A \ud800-style escape decodes to a lone surrogate, which cannot be sent on
        # as UTF-8; find it now rather than when the request is forwarded.
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BadRequest(
                "the request body contains a lone UTF-16 surrogate escape (e.g. \\ud800); "
                "send valid Unicode"
            ) from exc
    return body


def _reject_constant(name: str) -> Any:
    raise BadRequest(f"the request body contains {name}, which is not valid JSON")


_NUMBER = (int, float)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, _NUMBER) and not isinstance(v, bool) and math.isfinite(v)


def check_completion_body(body: dict[str, Any], *, kind: str) -> None:
    """Check the fields the host reads or that would make the engine misbehave."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise FieldError("model", "expected a string naming a model")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise FieldError("stream", "expected true or false")
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise FieldError("stream_options", "expected an object")
        if "include_usage" in so and not isinstance(so["include_usage"], bool):
            raise FieldError("stream_options.include_usage", "expected true or false")
    pck = body.get("prompt_cache_key")
    if pck is not None and (not isinstance(pck, str) or len(pck) > 512):
        raise FieldError("prompt_cache_key", "expected a string of at most 512 characters")
    if kind == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise FieldError("messages", "expected a non-empty array of messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise FieldError(f"messages[{i}]", "expected an object with role and content")
            if not isinstance(m.get("role"), str):
                raise FieldError(f"messages[{i}].role", "expected a string")
            _check_message(i, m)
    elif kind in ("text", "native"):
        prompt = body.get("prompt")
        if kind == "text" and prompt is None:
            raise FieldError(
                "prompt", "required: a string, an array of token ids, or an array of strings"
            )
        if prompt is not None and not _valid_prompt(prompt):
            raise FieldError(
                "prompt", "expected a string, an array of token ids, or an array of strings"
            )
    for name in ("max_tokens", "max_completion_tokens", "n_predict"):
        v = body.get(name)
        if v is not None:
            if not _is_int(v):
                raise FieldError(name, "expected an integer")
            if v < -1:  # -1: no limit (the engine's; it stops when the slot is full)
                raise FieldError(name, "expected -1 (no limit) or a non-negative integer")
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repeat_penalty",
    ):
        v = body.get(name)
        if v is not None and not _is_number(v):
            raise FieldError(name, "expected a finite number")
    t = body.get("temperature")
    if t is not None and _is_number(t) and t < 0:
        raise FieldError("temperature", "expected a number >= 0")
    for name in ("top_k", "seed", "n_probs", "logprobs_count"):
        v = body.get(name)
        if v is not None and not _is_int(v):
            raise FieldError(name, "expected an integer")
    _check_openai_shapes(body)
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise FieldError("n", "only n = 1 is supported")
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise FieldError("stop", "expected a string or an array of strings")


def _valid_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    if isinstance(prompt, list):
        if not prompt:
            return False
        if _token_ids(prompt):
            return True
        return all(isinstance(p, str) for p in prompt) or all(
            isinstance(p, list) and (not p or _token_ids(p)) for p in prompt
        )
    return False


def _token_ids(items: list[Any]) -> bool:
    """Whether ``items`` (not empty) are token ids: integers (not booleans), none
    negative. In C: a 3,500-token prompt in a fifth of a generator's time."""
    return set(map(type, items)) == {int} and min(items) >= 0


def _check_openai_shapes(body: dict[str, Any]) -> None:
    """Shapes of the OpenAI fields llama-server parses itself and answers 500 for.

    llama-server treats a malformed ``tools`` (and friends) as its own failure
    (HTTP 500); these are the client's mistakes, so they are a 400 naming the
    field before the request is queued.
    """
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise FieldError("tools", "expected an array of tool objects")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or not isinstance(tool.get("type", "function"), str):
                raise FieldError(f"tools[{i}]", "expected an object with a type")
            fn = tool.get("function")
            if fn is not None and (not isinstance(fn, dict) or not isinstance(fn.get("name"), str)):
                raise FieldError(f"tools[{i}].function", "expected an object with a string name")
    choice = body.get("tool_choice")
    if choice is not None and not isinstance(choice, str | dict):
        raise FieldError("tool_choice", "expected a string or an object")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str)):
        raise FieldError("response_format", "expected an object with a string type")
    for name in ("logit_bias", "chat_template_kwargs", "metadata", "json_schema"):
        v = body.get(name)
        if v is not None and not isinstance(v, dict | list) and name != "json_schema":
            raise FieldError(name, "expected an object")
        if name == "json_schema" and v is not None and not isinstance(v, dict):
            raise FieldError(name, "expected an object")
    for name in ("parallel_tool_calls", "logprobs", "echo", "ignore_eos", "cache_prompt"):
        v = body.get(name)
        if v is not None and not isinstance(v, bool):
            raise FieldError(name, "expected true or false")
    for name in ("user", "grammar", "reasoning_format", "reasoning_effort"):
        v = body.get(name)
        if v is not None and not isinstance(v, str):
            raise FieldError(name, "expected a string")


_MESSAGE_STRINGS = ("name", "tool_call_id", "reasoning_content", "refusal")


def _check_message(i: int, m: dict[str, Any]) -> None:
    """One chat message: llama-server's template code answers 500 for wrong types here."""
    where = f"messages[{i}]"
    content = m.get("content")
    if content is not None and not isinstance(content, str):
        if not isinstance(content, list):
            raise FieldError(f"{where}.content", "expected a string or an array of parts")
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise FieldError(f"{where}.content[{j}]", "expected an object with a string type")
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise FieldError(f"{where}.content[{j}].text", "expected a string")
    for key in _MESSAGE_STRINGS:
        if key in m and not isinstance(m[key], str):
            raise FieldError(f"{where}.{key}", "expected a string")
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise FieldError(f"{where}.tool_calls", "expected an array")
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise FieldError(
                    f"{where}.tool_calls[{j}]", "expected an object with function.name"
                )
            args = fn.get("arguments")
            if args is not None and not isinstance(args, str | dict):
                raise FieldError(f"{where}.tool_calls[{j}].function.arguments", "expected a string")


def check_infill_body(body: dict[str, Any]) -> None:
    """Check a fill-in-the-middle request (llama.vscode's and llama.vim's shape), then
    its sampling fields as for any native completion."""
    for name in ("input_prefix", "input_suffix"):
        if not isinstance(body.get(name), str):
            raise FieldError(
                name,
                "required: the code before (input_prefix) and after "
                "(input_suffix) the cursor, as strings (either may be empty)",
            )
    if "prompt" in body and not isinstance(body["prompt"], str):
        raise FieldError("prompt", "expected a string")
    extra = body.get("input_extra")
    if extra is not None:
        if not isinstance(extra, list):
            raise FieldError("input_extra", "expected an array of {filename, text} objects")
        for i, chunk in enumerate(extra):
            if not isinstance(chunk, dict):
                raise FieldError(f"input_extra[{i}]", "expected an object with filename and text")
            for key in ("filename", "text"):
                if key in chunk and not isinstance(chunk[key], str):
                    raise FieldError(f"input_extra[{i}].{key}", "expected a string")
    for name in ("t_max_prompt_ms", "t_max_predict_ms"):
        v = body.get(name)
        if v is not None and not _is_int(v):
            raise FieldError(name, "expected an integer number of milliseconds")
    check_completion_body(body, kind="native")
