"""Anthropic's Messages API, translated to and from llama-server's OpenAI chat route.

The host serves ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` by
sending each request to the engine's ``/v1/chat/completions``: llama-server's
own ``/v1/messages`` ignores ``id_slot`` and ``cache_prompt``, the chat route
honours both. This module is the translation, plain functions over decoded
JSON with no I/O:

- :func:`messages_to_chat`, :func:`count_tokens_to_chat`: check an Anthropic
  request (a :class:`~gezel_trio.errors.FieldError` names the field and says
  what to send) and build the chat body. The output never carries ``id_slot``
  or ``cache_prompt``; the caller adds them.
- :func:`chat_to_message`: a chat completion -> an Anthropic ``Message``.
- :class:`MessageStream`: decoded chat stream chunks -> Anthropic SSE bytes.
- :func:`error_body`, :func:`engine_error`: Anthropic's error shape.

Ported from llama.cpp b10435: ``server_chat_convert_anthropic_to_oai`` and
``normalize_anthropic_billing_header`` (tools/server/server-chat.cpp),
``to_json_anthropic`` and ``to_json_anthropic_stream`` of the final and
partial results (tools/server/server-task.cpp). Where upstream and Anthropic's
documented API disagree, this module follows Anthropic and says so:

- a user turn's ``tool_result`` blocks become ``tool`` messages *before* the
  user message holding its other blocks (upstream puts them after, which
  separates them from the assistant's ``tool_calls``);
- several text blocks of a ``tool_result`` join with a newline, the way
  llama-server itself joins text parts (upstream joins them with nothing; the
  top-level ``system`` blocks are joined as upstream does, so the prompt of a
  Claude Code request is the engine's own, token for token);
- ``tool_choice`` ``none`` becomes ``"none"``, ``tool`` forces the named tool by
  sending only that one, ``disable_parallel_tool_use`` becomes
  ``parallel_tool_calls: false`` (upstream maps ``none`` to nothing and ``tool``
  to any tool, and ignores the flag);
- ``thinking: {"type": "disabled"}`` turns thinking off through
  ``chat_template_kwargs.enable_thinking`` (upstream ignores it);
- a stop on one of the client's ``stop_sequences`` is ``stop_reason:
  "stop_sequence"`` (upstream says ``end_turn``); the request asks the engine
  for ``__verbose.stop_type``/``stopping_word`` to tell;
- unknown content block types, server tools, PDF documents and malformed
  fields are a 400 naming the field (upstream drops them or answers 500), in
  Anthropic's words and path style (``messages.1.content.0.type: ...``).

Every message role that upstream passes on to the chat template is kept where it
stands: ``user``, ``assistant``, a mid-conversation ``system`` message (Claude Code
sends one with the beta ``mid-conversation-system-2026-04-07``), and any other.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeGuard

from ..errors import FieldError

__all__ = [
    "MessageStream",
    "MessageStreamStatistics",
    "chat_to_message",
    "count_tokens_to_chat",
    "engine_error",
    "error_body",
    "error_type_for",
    "messages_to_chat",
    "new_message_id",
]

# --------------------------------------------------------------------------- errors

_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}

# llama-server's error types (format_error_response in server-common.cpp) and
# their HTTP status, for an error that carries no usable ``code``.
_ENGINE_ERROR_STATUS: dict[str, int] = {
    "invalid_request_error": 400,
    "exceed_context_size_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "server_error": 500,
    "not_supported_error": 501,
    "unavailable_error": 503,
}


def error_type_for(status: int) -> str:
    """The Anthropic error ``type`` for an HTTP status (by class when not listed)."""
    known = _ERROR_TYPES.get(status)
    if known is not None:
        return known
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": error_type_for(status), "message": message}}


def engine_error(payload: object) -> tuple[int, dict[str, Any]]:
    """The Anthropic status and body for an error the engine answered in OpenAI's shape.

    ``payload`` is the engine's ``{"error": {...}}`` (or the inner object). A context
    overflow says ``prompt is too long: N tokens > M maximum``, Anthropic's wording,
    which clients such as Claude Code read to compact the conversation.
    """
    error = payload.get("error", payload) if isinstance(payload, dict) else payload
    if not isinstance(error, dict):
        error = {"message": str(error)}
    kind = error.get("type")
    message = error.get("message")
    if not isinstance(message, str) or not message:
        message = "the engine failed without a message"
    code = error.get("code")
    if _is_int(code) and 400 <= code <= 599:
        status = code
    else:
        status = _ENGINE_ERROR_STATUS.get(kind, 500) if isinstance(kind, str) else 500
    if kind == "exceed_context_size_error":
        status = 400
        n_prompt, n_ctx = error.get("n_prompt_tokens"), error.get("n_ctx")
        if _is_int(n_prompt) and _is_int(n_ctx):
            message = f"prompt is too long: {n_prompt} tokens > {n_ctx} maximum"
    return status, error_body(status, message)


# --------------------------------------------------------------------------- requests

_IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
_BILLING_HEADER = "x-anthropic-billing-header:"
_CCH_LENGTH = 5

# Ask llama-server to say why it stopped (``__verbose.stop_type``, ``stopping_word``)
# and nothing else of its debug record (``response_fields`` filters it).
_STOP_REPORT: dict[str, Any] = {
    "verbose": True,
    "response_fields": ["stop_type", "stopping_word"],
}


def messages_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """Check an Anthropic ``POST /v1/messages`` body and return the chat body for the engine.

    Raises :class:`FieldError` naming the field in Anthropic's path style
    (``"messages.2.content.0.type"``).
    A streamed request asks for ``stream_options.include_usage`` and
    ``timings_per_token`` (the prompt's figures for ``message_start``). Fields the API does
    not define are ignored; ``metadata`` is checked and not forwarded.
    """
    chat = _prompt_to_chat(body)
    max_tokens = _max_tokens(body.get("max_tokens"))
    if max_tokens is not None:
        chat["max_tokens"] = max_tokens
    _add_sampling(body, chat)
    stops = _stop_sequences(body.get("stop_sequences"))
    if stops:
        chat["stop"] = stops
        chat.update(_STOP_REPORT)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise FieldError("stream", "expected true or false")
    chat["stream"] = stream
    if stream:
        # the usage chunk at the end, and the prompt's figures (``timings``) on every
        # token's chunk: ``message_start`` carries the first one's input and cached tokens
        chat["stream_options"] = {"include_usage": True}
        chat["timings_per_token"] = True
    _check_metadata(body.get("metadata"))
    return chat


def count_tokens_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """Check an Anthropic ``POST /v1/messages/count_tokens`` body; return the chat body
    whose prompt is the one to count (no ``max_tokens``: that endpoint has none)."""
    return _prompt_to_chat(body)


def _prompt_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The fields that shape the prompt: model, system, messages, tools, thinking."""
    chat: dict[str, Any] = {}
    if _model(body.get("model")):
        chat["model"] = body["model"]
    chat["messages"] = [
        *_system_messages(body.get("system")),
        *_chat_messages(body.get("messages")),
    ]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    _add_tool_choice(body.get("tool_choice"), tools, chat)
    _add_thinking(body.get("thinking"), body.get("chat_template_kwargs"), chat)
    return chat


def _model(model: object) -> str | None:
    """The model named, if any: without one the host serves its first model, as on
    every route (the engine serves its only one)."""
    if model is None:
        return None
    if not isinstance(model, str):
        raise FieldError("model", "expected a string naming the model")
    return model


def _max_tokens(value: object) -> int | None:
    """Anthropic requires it; the engine does not (none: generate until the end of the
    turn or of the slot), and takes 0 and -1 (no limit: it stops when the slot is full)
    as well, so the host does too."""
    if value is None:
        return None
    if not _is_int(value) or value < -1:
        raise FieldError(
            "max_tokens", "expected an integer >= 0 (or -1: no limit), the most tokens to generate"
        )
    return value


def _add_sampling(body: dict[str, Any], chat: dict[str, Any]) -> None:
    """Any number, as the engine takes them (Anthropic's own range is 0 to 1; the
    engine samples greedily at 0 and below, and caps ``top_p`` at 1)."""
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is None:
            continue
        if not _is_number(value):
            raise FieldError(name, "expected a number")
        chat[name] = value
    top_k = body.get("top_k")
    if top_k is not None:
        if not _is_int(top_k):
            raise FieldError("top_k", "expected an integer (0 or less: no top-k)")
        chat["top_k"] = top_k


def _stop_sequences(value: object) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise FieldError("stop_sequences", "expected an array of strings")
    return list(value)


def _check_metadata(metadata: object) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise FieldError("metadata", 'expected an object such as {"user_id": "..."}')
    user_id = metadata.get("user_id")
    if user_id is not None and not isinstance(user_id, str):
        raise FieldError("metadata.user_id", "expected a string or null")


# ------------------------------------------------------------------ system


def _system_messages(system: object) -> list[dict[str, Any]]:
    """``system`` as one chat system message (as upstream: present means sent, even empty;
    text blocks joined with nothing between them, so the prompt is the engine's own)."""
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": _normalize_billing_header(system)}]
    if not isinstance(system, list):
        raise FieldError("system", "expected a string or an array of text blocks")
    texts = [_normalize_billing_header(_text_of(f"system.{i}", b)) for i, b in enumerate(system)]
    return [{"role": "system", "content": "".join(texts)}]


def _text_of(where: str, block: object) -> str:
    """The text of a block that must be ``{"type": "text", "text": ...}``."""
    checked = _block(where, block)
    if checked["type"] != "text":
        raise FieldError(f"{where}.type", 'expected "text"')
    return _text(where, checked)


def _normalize_billing_header(text: str) -> str:
    """Claude Code's ``x-anthropic-billing-header: ...; cch=a5145;`` system block carries
    a stamp that changes on every request and so ends every cached prefix there; it
    becomes ``cch=fffff`` (llama-server's ``normalize_anthropic_billing_header``)."""
    if not text.startswith(_BILLING_HEADER):
        return text
    at = text.find("cch=", len(_BILLING_HEADER))
    if at < 0:
        return text
    start = at + len("cch=")
    end = start + _CCH_LENGTH
    if end < len(text) and text[end] == ";":
        return text[:start] + "f" * _CCH_LENGTH + text[end:]
    return text


# ------------------------------------------------------------------ messages


def _chat_messages(messages: object) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise FieldError("messages", "required: an array of {role, content} objects")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        out.extend(_chat_message(f"messages.{i}", message))
    return out


def _chat_message(where: str, message: object) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages, in place (a user turn with tool results
    gives several). Every role the engine's converter passes on is kept: ``user`` and
    ``assistant``, a mid-conversation ``system`` message (Claude Code sends one after
    the first user turn), and any other role the chat template may render. A message
    whose blocks give nothing (an empty array) is dropped, as upstream drops it."""
    if not isinstance(message, dict):
        raise FieldError(where, "expected an object with role and content")
    role = message.get("role")
    if not isinstance(role, str):
        raise FieldError(
            f"{where}.role",
            f"Unexpected role {_compact_json(role)}. The Messages API accepts "
            '"user", "assistant" or "system" as an input message role',
        )
    if "content" not in message:
        if role == "assistant":  # upstream skips it
            return []
        raise FieldError(f"{where}.content", "Field required: a string or an array of blocks")
    content = message["content"]
    if content is None:  # the engine renders a null content as empty
        return [{"role": role, "content": ""}]
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise FieldError(f"{where}.content", "expected a string or an array of content blocks")
    if role == "user":
        return _user_messages(where, content)
    if role == "assistant":
        return _assistant_messages(where, content)
    return _instruction_messages(where, role, content)


def _user_messages(where: str, content: list[Any]) -> list[dict[str, Any]]:
    """Tool results first (they answer the previous assistant turn), then the rest."""
    parts: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, raw in enumerate(content):
        at = f"{where}.content.{j}"
        block = _block(at, raw)
        kind = block["type"]
        if (common := _content_parts(at, block)) is not None:
            parts.extend(common)
        elif kind == "tool_result":
            results.append(_tool_message(at, block))
        else:
            raise FieldError(
                f"{at}.type",
                f'"{kind}" is not supported in a user message; '
                "send text, image, document or tool_result blocks",
            )
    if parts:
        results.append({"role": "user", "content": parts})
    return results


def _content_parts(at: str, block: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The chat parts of a text, image or document block (any role may send these);
    None for another type, which each role treats its own way."""
    kind = block["type"]
    if kind == "text":
        return [_text_part(at, block)]
    if kind == "image":
        return [_image_part(at, block)]
    if kind == "document":
        return _document_parts(at, block)
    return None


def _assistant_messages(where: str, content: list[Any]) -> list[dict[str, Any]]:
    """Text, thinking (as ``reasoning_content``) and tool_use (as ``tool_calls``) in one
    message; ``redacted_thinking`` is dropped: it is encrypted for Anthropic's models."""
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for j, raw in enumerate(content):
        at = f"{where}.content.{j}"
        block = _block(at, raw)
        kind = block["type"]
        if kind == "text":
            parts.append(_text_part(at, block))
        elif kind == "thinking":
            reasoning.append(_string_field(at, block, "thinking"))
        elif kind == "tool_use":
            calls.append(_tool_call(at, block))
        elif kind != "redacted_thinking":
            raise FieldError(
                f"{at}.type",
                f'"{kind}" is not supported in an assistant message; '
                "send text, thinking, redacted_thinking or tool_use blocks",
            )
    if not (parts or calls or reasoning):
        return []
    message: dict[str, Any] = {"role": "assistant", "content": parts or ""}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    return [message]


def _instruction_messages(where: str, role: str, content: list[Any]) -> list[dict[str, Any]]:
    """A ``system`` message (or another role's) in blocks: its text, image and document
    blocks as parts of one message of that role, as upstream sends them."""
    parts: list[dict[str, Any]] = []
    for j, raw in enumerate(content):
        at = f"{where}.content.{j}"
        block = _block(at, raw)
        if (common := _content_parts(at, block)) is not None:
            parts.extend(common)
        else:
            raise FieldError(
                f"{at}.type",
                f"{_compact_json(block['type'])} is not supported in a "
                f"{_compact_json(role)} message; send text, image or document blocks",
            )
    return [{"role": role, "content": parts}] if parts else []


def _block(where: str, block: object) -> dict[str, Any]:
    """A content block: an object with a string ``type``."""
    if not isinstance(block, dict):
        raise FieldError(where, "expected a content block object with a type")
    if not isinstance(block.get("type"), str):
        raise FieldError(f"{where}.type", 'required: a string such as "text"')
    return block


def _string_field(where: str, block: dict[str, Any], name: str) -> str:
    value = block.get(name)
    if not isinstance(value, str):
        raise FieldError(f"{where}.{name}", "required: a string")
    return value


def _text(where: str, block: dict[str, Any]) -> str:
    return _string_field(where, block, "text")


def _text_part(where: str, block: dict[str, Any]) -> dict[str, Any]:
    return {"type": "text", "text": _text(where, block)}


def _image_part(where: str, block: dict[str, Any]) -> dict[str, Any]:
    """An image block as an OpenAI ``image_url`` part (a ``data:`` URL for base64)."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise FieldError(f"{where}.source", 'required: {"type": "base64", "media_type", "data"}')
    kind = source.get("type")
    if kind == "base64":
        media_type = source.get("media_type")
        if media_type not in _IMAGE_MEDIA_TYPES:
            raise FieldError(f"{where}.source.media_type", f"expected one of {_IMAGE_MEDIA_TYPES}")
        data = _string_field(f"{where}.source", source, "data")
        url = f"data:{media_type};base64,{data}"
    elif kind == "url":
        url = _string_field(f"{where}.source", source, "url")
    else:
        raise FieldError(
            f"{where}.source.type", 'expected "base64" or "url" (the Files API is not served here)'
        )
    return {"type": "image_url", "image_url": {"url": url}}


def _document_parts(where: str, block: dict[str, Any]) -> list[dict[str, Any]]:
    """A document whose source is text: its text as parts. PDFs cannot be read here."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise FieldError(f"{where}.source", 'required: {"type": "text", "data": "..."}')
    kind = source.get("type")
    if kind == "text":
        return [{"type": "text", "text": _string_field(f"{where}.source", source, "data")}]
    if kind == "content":
        content = source.get("content")
        if isinstance(content, str):
            return [{"type": "text", "text": content}]
        if isinstance(content, list):
            return [_media_part(f"{where}.source.content.{k}", c) for k, c in enumerate(content)]
        raise FieldError(f"{where}.source.content", "expected a string or an array of blocks")
    raise FieldError(
        f"{where}.source.type",
        "only text documents can be read here; send a PDF's text as a text block "
        'or as a document with {"type": "text"} source',
    )


def _media_part(where: str, raw: object) -> dict[str, Any]:
    """A text or image block inside a tool result or a document."""
    block = _block(where, raw)
    kind = block["type"]
    if kind == "text":
        return _text_part(where, block)
    if kind == "image":
        return _image_part(where, block)
    raise FieldError(f"{where}.type", f'"{kind}" is not supported here; send text or image blocks')


def _tool_message(where: str, block: dict[str, Any]) -> dict[str, Any]:
    """A ``tool_result`` as a ``tool`` message: text-only content collapses to a string,
    content with images stays a list of parts (upstream). ``is_error`` is not forwarded:
    the chat format has no such flag, and the result's text says what failed."""
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str) or not tool_use_id:
        raise FieldError(f"{where}.tool_use_id", "required: the id of the tool_use it answers")
    if "is_error" in block and not isinstance(block["is_error"], bool):
        raise FieldError(f"{where}.is_error", "expected true or false")
    content = block.get("content")
    result: str | list[dict[str, Any]]
    if content is None:
        result = ""
    elif isinstance(content, str):
        result = content
    elif isinstance(content, list):
        parts = [_media_part(f"{where}.content.{k}", c) for k, c in enumerate(content)]
        if all(part["type"] == "text" for part in parts):
            result = "\n".join(part["text"] for part in parts)
        else:
            result = parts
    else:
        raise FieldError(f"{where}.content", "expected a string or an array of text/image blocks")
    return {"role": "tool", "tool_call_id": tool_use_id, "content": result}


def _tool_call(where: str, block: dict[str, Any]) -> dict[str, Any]:
    """A ``tool_use`` block as an OpenAI tool call (``input`` as compact JSON)."""
    call_id = block.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise FieldError(f"{where}.id", "required: the tool_use id (as the model returned it)")
    name = block.get("name")
    if not isinstance(name, str) or not name:
        raise FieldError(f"{where}.name", "required: the name of the tool")
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise FieldError(f"{where}.input", "expected an object of the tool's arguments")
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": _compact_json(arguments)},
    }


# ------------------------------------------------------------------ tools


def _tools(tools: object) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise FieldError("tools", "expected an array of tools with name and input_schema")
    return [_function_tool(f"tools.{i}", tool) for i, tool in enumerate(tools)]


def _function_tool(where: str, tool: object) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise FieldError(where, "expected an object with name, description and input_schema")
    kind = tool.get("type")
    if kind is not None and kind != "custom":
        raise FieldError(
            f"{where}.type",
            f"{json.dumps(kind)} is a server or Anthropic-defined tool, which this host cannot "
            'run; define a custom tool (no type, or "custom") with name and input_schema',
        )
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise FieldError(f"{where}.name", "required: a non-empty string")
    description = tool.get("description", "")
    if not isinstance(description, str):
        raise FieldError(f"{where}.description", "expected a string")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise FieldError(
            f"{where}.input_schema", 'required: a JSON Schema object such as {"type": "object"}'
        )
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": schema},
    }


def _add_tool_choice(choice: object, tools: list[dict[str, Any]], chat: dict[str, Any]) -> None:
    """``auto`` -> ``auto``, ``any`` -> ``required``, ``tool`` -> ``required`` over that
    one tool, ``none`` -> ``none``; ``disable_parallel_tool_use`` -> no parallel calls."""
    if choice is None:
        return
    if not isinstance(choice, dict):
        raise FieldError("tool_choice", 'expected an object such as {"type": "auto"}')
    kind = choice.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise FieldError("tool_choice.type", 'expected "auto", "any", "tool" or "none"')
    serial = choice.get("disable_parallel_tool_use", False)
    if not isinstance(serial, bool):
        raise FieldError("tool_choice.disable_parallel_tool_use", "expected true or false")
    if kind in ("any", "tool") and not tools:
        raise FieldError(
            "tool_choice", f'"{kind}" needs tools; send tools or leave tool_choice out'
        )
    if not tools:
        return
    if kind == "tool":
        chat["tools"] = [_named_tool(choice.get("name"), tools)]
    chat["tool_choice"] = {"auto": "auto", "any": "required", "tool": "required"}.get(kind, "none")
    if serial and kind != "none":
        chat["parallel_tool_calls"] = False


def _named_tool(name: object, tools: list[dict[str, Any]]) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise FieldError("tool_choice.name", 'required with type "tool": the name of a tool')
    for tool in tools:
        if tool["function"]["name"] == name:
            return tool
    raise FieldError("tool_choice.name", f"no tool named {json.dumps(name)} is in tools")


def _add_thinking(thinking: object, template_kwargs: object, chat: dict[str, Any]) -> None:
    """``enabled`` -> ``thinking_budget_tokens`` (the reasoning budget llama-server
    enforces); ``disabled`` -> ``chat_template_kwargs.enable_thinking: false``;
    ``adaptive`` and no ``thinking`` -> the engine's default. The llama.cpp extension
    ``chat_template_kwargs`` passes through (upstream) and wins over ``disabled``."""
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise FieldError("chat_template_kwargs", "expected an object")
    kwargs = dict(template_kwargs or {})
    if thinking is not None:
        if not isinstance(thinking, dict):
            raise FieldError(
                "thinking",
                'expected {"type": "enabled", "budget_tokens": N}, {"type": "adaptive"} '
                'or {"type": "disabled"}',
            )
        kind = thinking.get("type")
        if kind == "enabled":
            budget = thinking.get("budget_tokens")
            if not _is_int(budget) or budget < 1:
                raise FieldError(
                    "thinking.budget_tokens", 'required with type "enabled": an integer >= 1'
                )
            chat["thinking_budget_tokens"] = budget
        elif kind == "disabled":
            kwargs.setdefault("enable_thinking", False)
        elif kind not in ("adaptive", "between_tools"):
            raise FieldError("thinking.type", 'expected "enabled", "adaptive" or "disabled"')
    if kwargs:
        chat["chat_template_kwargs"] = kwargs


# --------------------------------------------------------------------------- answers


def new_message_id() -> str:
    """A fresh Anthropic-style message id (``msg_`` and 24 hex digits)."""
    return "msg_" + uuid.uuid4().hex[:24]


def _new_tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True, slots=True)
class _Usage:
    """Token figures in Anthropic's sense: ``input`` excludes what was read from cache."""

    input: int = 0
    cached: int = 0
    output: int = 0

    @classmethod
    def from_chat(cls, usage: object, timings: object) -> _Usage | None:
        """From the chat ``usage`` (or, lacking it, llama-server's ``timings``)."""
        if isinstance(usage, dict):
            prompt = _count(usage.get("prompt_tokens"))
            details = usage.get("prompt_tokens_details")
            cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else 0
            cached = min(cached, prompt)
            return cls(prompt - cached, cached, _count(usage.get("completion_tokens")))
        if isinstance(timings, dict):
            return cls(
                _count(timings.get("prompt_n")),
                _count(timings.get("cache_n")),
                _count(timings.get("predicted_n")),
            )
        return None

    def to_json(self) -> dict[str, int]:
        return {
            "input_tokens": self.input,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": self.cached,
            "output_tokens": self.output,
        }


def chat_to_message(
    chat: dict[str, Any], *, model: str, stop_sequences: Sequence[str] = ()
) -> dict[str, Any]:
    """A (non-streamed or assembled) chat completion as an Anthropic ``Message``.

    ``model`` is the name the client sent; ``stop_sequences`` are the client's, so a
    stop on one of them (reported in ``__verbose``) is told from a template's own stop.
    """
    choice = _first_choice(chat)
    message = choice.get("message")
    content = _answer_blocks(message if isinstance(message, dict) else {})
    stop_reason, stop_sequence = _stop_reason(
        choice.get("finish_reason"),
        tool_use=any(block["type"] == "tool_use" for block in content),
        report=chat.get("__verbose"),
        stop_sequences=stop_sequences,
    )
    usage = _Usage.from_chat(chat.get("usage"), chat.get("timings")) or _Usage()
    return {
        "id": new_message_id(),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage.to_json(),
    }


def _first_choice(chat: dict[str, Any]) -> dict[str, Any]:
    choices = chat.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    return {}


def _answer_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """thinking, then text, then one tool_use per call (upstream's order)."""
    blocks: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        blocks.append(_thinking_block(reasoning))
    text = _message_text(message.get("content"))
    if text:
        blocks.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or ():
        if isinstance(call, dict):
            blocks.append(_tool_use_block(call))
    return blocks


def _thinking_block(thinking: str) -> dict[str, Any]:
    # A local model has no signature to give; Anthropic's clients need the field.
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def _message_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    function = function if isinstance(function, dict) else {}
    call_id = call.get("id")
    name = function.get("name")
    return {
        "type": "tool_use",
        "id": call_id if isinstance(call_id, str) and call_id else _new_tool_use_id(),
        "name": name if isinstance(name, str) else "",
        "input": _tool_input(function.get("arguments")),
    }


def _tool_input(arguments: object) -> dict[str, Any]:
    """The arguments as an object; ``{}`` when they are not a JSON object (upstream)."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str) and arguments:
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return {}
        if isinstance(parsed, dict):
            return parsed
    return {}


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


def _stop_reason(
    finish_reason: object,
    *,
    tool_use: bool,
    report: object,
    stop_sequences: Sequence[str],
) -> tuple[StopReason, str | None]:
    """``length`` -> ``max_tokens``; tool calls -> ``tool_use``; a stop on a client's
    stop sequence -> ``stop_sequence``; anything else (also no reason) -> ``end_turn``."""
    if finish_reason == "length":
        return "max_tokens", None
    if tool_use or finish_reason == "tool_calls":
        return "tool_use", None
    word = _stopping_word(report, stop_sequences)
    if word is not None:
        return "stop_sequence", word
    return "end_turn", None


def _stopping_word(report: object, stop_sequences: Sequence[str]) -> str | None:
    """The client's stop sequence the engine stopped on (``__verbose``), if any."""
    if not isinstance(report, dict) or report.get("stop_type") != "word":
        return None
    word = report.get("stopping_word")
    return word if isinstance(word, str) and word in stop_sequences else None


# --------------------------------------------------------------------------- stream

BlockKind = Literal["thinking", "text", "tool_use"]


@dataclass(slots=True)
class _ToolCall:
    """One OpenAI tool call of the stream; its block starts once its name is known."""

    id: str = ""
    name: str = ""
    pending: list[str] = field(default_factory=list)
    block: int | None = None


@dataclass(frozen=True, slots=True)
class MessageStreamStatistics:
    """What a :class:`MessageStream` has done so far."""

    started: bool
    done: bool
    blocks: int
    open_block: BlockKind | None
    tool_calls: int
    finish_reason: str | None
    dropped_argument_chars: int


class MessageStream:
    """Turns a chat completion stream into Anthropic's Messages stream.

    Feed each decoded chunk (one dict per ``data:`` line, as llama-server sends with
    ``stream_options.include_usage`` and ``timings_per_token``) to :meth:`feed`, then
    call :meth:`finish`. Each returns the SSE bytes to send
    (``event: NAME\\ndata: JSON\\n\\n``), maybe ``b""``.

    Events: ``message_start`` (and a ``ping``) on the first chunk with the prompt's
    figures or any output (the engine's opening role delta has neither, and its
    ``input_tokens`` and ``cache_read_input_tokens`` are the engine's); one content block at
    a time, numbered in order: ``thinking`` (``thinking_delta``, then an empty
    ``signature_delta`` before it stops), ``text`` (``text_delta``), ``tool_use``
    (``input_json_delta``); ``message_delta`` with ``stop_reason`` and the usage;
    ``message_stop``. An engine error chunk, or :meth:`error`, ends the stream with
    an ``error`` event.
    """

    def __init__(
        self, model: str, *, stop_sequences: Sequence[str] = (), message_id: str | None = None
    ) -> None:
        self.model = model
        self.message_id = message_id or new_message_id()
        self._stop_sequences = tuple(stop_sequences)
        self._out: list[bytes] = []
        self._started = False
        self._done = False
        self._blocks = 0
        self._open: BlockKind | None = None
        self._tools: dict[int, _ToolCall] = {}
        self._finish_reason: str | None = None
        self._report: object = None
        self._usage: _Usage | None = None
        self._timed: _Usage | None = None
        self._dropped = 0

    def __repr__(self) -> str:
        state = "done" if self._done else "streaming" if self._started else "new"
        return (
            f"<MessageStream {self.message_id} model={self.model!r} {state} "
            f"blocks={self._blocks} open={self._open}>"
        )

    def statistics(self) -> MessageStreamStatistics:
        """What the stream has done so far."""
        return MessageStreamStatistics(
            started=self._started,
            done=self._done,
            blocks=self._blocks,
            open_block=self._open,
            tool_calls=len(self._tools),
            finish_reason=self._finish_reason,
            dropped_argument_chars=self._dropped,
        )

    # ------------------------------------------------------------------ API

    def feed(self, event: dict[str, Any]) -> bytes:
        """One decoded chat chunk in, the Anthropic events it makes out."""
        if self._done or not isinstance(event, dict):
            return b""
        if "error" in event and "choices" not in event:
            return self.engine_error(event["error"])
        self._note_figures(event)
        if not self._started and self._figures() is None and not _carries_output(event):
            return b""  # the opening role delta: message_start waits for the prompt's figures
        self._start()
        for choice in event.get("choices") or ():
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                self._apply_choice(choice)
        return self._flush()

    def finish(self) -> bytes:
        """Close the open blocks, then ``message_delta`` and ``message_stop``. Safe when
        the engine's stream ended without a ``finish_reason``; a no-op once done."""
        if self._done:
            return b""
        self._start()
        self._close_block()
        for call in self._tools.values():
            if call.block is None:
                self._start_tool(call)
                self._close_block()
        stop_reason, stop_sequence = _stop_reason(
            self._finish_reason,
            tool_use=bool(self._tools),
            report=self._report,
            stop_sequences=self._stop_sequences,
        )
        known = self._figures()
        usage = known.to_json() if known else {"output_tokens": 0}
        self._emit(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": usage,
            },
        )
        self._emit("message_stop", {"type": "message_stop"})
        self._done = True
        return self._flush()

    def error(self, type_: str, message: str) -> bytes:
        """An ``error`` event that ends the stream (``type_``: an Anthropic error type)."""
        if self._done:
            return b""
        self._done = True
        self._emit("error", {"type": "error", "error": {"type": type_, "message": message}})
        return self._flush()

    def engine_error(self, error: object) -> bytes:
        """The ``error`` event for an engine's OpenAI-shaped error (``{"error": {...}}``)."""
        _status, body = engine_error(error)
        return self.error(body["error"]["type"], body["error"]["message"])

    def ping(self) -> bytes:
        """A ``ping`` event, to keep a quiet stream alive (clients ignore it)."""
        if self._done:
            return b""
        return _sse("ping", {"type": "ping"})

    # ------------------------------------------------------------------ chunks

    def _start(self) -> None:
        """``message_start``, whose usage is the prompt's input and cached tokens as the
        engine's own ``/v1/messages`` stream gives them (from the first token's
        ``timings``), and no output yet."""
        if self._started:
            return
        self._started = True
        usage = self._figures() or _Usage()
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**usage.to_json(), "output_tokens": 0},
        }
        self._emit("message_start", {"type": "message_start", "message": message})
        self._emit("ping", {"type": "ping"})

    def _figures(self) -> _Usage | None:
        """The latest token figures: the usage chunk's, else the last ``timings``."""
        return self._usage or self._timed

    def _note_figures(self, event: dict[str, Any]) -> None:
        """Keep the latest usage (a ``usage`` chunk wins over ``timings``) and the stop report."""
        usage = _Usage.from_chat(event.get("usage"), None)
        if usage is not None:
            self._usage = usage
        timed = _Usage.from_chat(None, event.get("timings"))
        if timed is not None:
            self._timed = timed
        if "__verbose" in event:
            self._report = event["__verbose"]

    def _apply_choice(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            reasoning = delta.get("reasoning_content")
            if isinstance(reasoning, str) and reasoning:
                self._text_delta("thinking", reasoning)
            content = delta.get("content")
            if isinstance(content, str) and content:
                self._text_delta("text", content)
            for call in delta.get("tool_calls") or ():
                if isinstance(call, dict):
                    self._tool_delta(call)
        finish_reason = choice.get("finish_reason")
        if isinstance(finish_reason, str):
            self._finish_reason = finish_reason
            self._close_block()

    def _text_delta(self, kind: Literal["thinking", "text"], text: str) -> None:
        if self._open != kind:
            self._close_block()
            block = _thinking_block("") if kind == "thinking" else {"type": "text", "text": ""}
            self._open_block(kind, block)
        if kind == "thinking":
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            delta = {"type": "text_delta", "text": text}
        self._emit_delta(delta)

    def _tool_delta(self, call: dict[str, Any]) -> None:
        """A piece of tool call ``index``: its block starts when its name is known; later
        pieces of a call whose block was closed cannot be sent, and are counted."""
        index = call.get("index")
        if not _is_int(index):
            index = len(self._tools)
        state = self._tools.setdefault(index, _ToolCall())
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        if state.block is None:
            call_id, name = call.get("id"), function.get("name")
            if isinstance(call_id, str) and call_id:
                state.id = call_id
            if isinstance(name, str):
                state.name += name
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            if state.block is None:
                state.pending.append(arguments)
            elif state.block == self._blocks - 1 and self._open == "tool_use":
                self._emit_delta({"type": "input_json_delta", "partial_json": arguments})
            else:
                self._dropped += len(arguments)
        if state.block is None and state.name:
            self._start_tool(state)

    def _start_tool(self, call: _ToolCall) -> None:
        self._close_block()
        block = {
            "type": "tool_use",
            "id": call.id or _new_tool_use_id(),
            "name": call.name,
            "input": {},
        }
        call.block = self._open_block("tool_use", block)
        if call.pending:
            self._emit_delta({"type": "input_json_delta", "partial_json": "".join(call.pending)})
            call.pending.clear()

    # ------------------------------------------------------------------ blocks

    def _open_block(self, kind: BlockKind, block: dict[str, Any]) -> int:
        index = self._blocks
        self._blocks += 1
        self._open = kind
        self._emit(
            "content_block_start",
            {"type": "content_block_start", "index": index, "content_block": block},
        )
        return index

    def _emit_delta(self, delta: dict[str, Any]) -> None:
        self._emit(
            "content_block_delta",
            {"type": "content_block_delta", "index": self._blocks - 1, "delta": delta},
        )

    def _close_block(self) -> None:
        if self._open is None:
            return
        if self._open == "thinking":
            self._emit_delta({"type": "signature_delta", "signature": ""})
        self._emit("content_block_stop", {"type": "content_block_stop", "index": self._blocks - 1})
        self._open = None

    def _emit(self, name: str, data: dict[str, Any]) -> None:
        self._out.append(_sse(name, data))

    def _flush(self) -> bytes:
        out = b"".join(self._out)
        self._out.clear()
        return out


def _carries_output(event: dict[str, Any]) -> bool:
    """Whether a chat chunk has text, thinking, a tool call or a finish reason."""
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if isinstance(choice.get("finish_reason"), str):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(
            delta.get(name) for name in ("content", "reasoning_content", "tool_calls")
        ):
            return True
    return False


def _sse(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {_compact_json(data)}\n\n".encode()


# --------------------------------------------------------------------------- helpers


def _compact_json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: object) -> int:
    """A token count from the engine: a non-negative int, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
