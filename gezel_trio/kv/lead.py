"""A conversation's lead: the system prompt and tools that every session of an agent
opens with, as a request the engine can prefill alone.

A model with recurrent state (Mamba, RWKV, a recurrent/attention hybrid) cannot cut a
slot back to a prefix it shares with a new request: llama-server then clears the slot
and prefills everything again. Such a model can only start a new session warm from a
copy that ends *exactly* where the request goes on. The host makes that copy: on a
session's first request it prefills the lead alone (the same route, the request's
system and developer messages, tools and template arguments, without the generation
prompt and with ``max_tokens`` 0), saves the slot (the *lead snapshot*), then sends the
request, which continues from it. Another session of the same caller whose request
opens with the same lead has the snapshot restored into its slot first.

Exactness is the engine's: a snapshot that is not a token prefix of the request
(a template that renders the lead otherwise when more follows) is cleared by the engine
and reused by nothing; the host sees it in the answer's cached tokens and stops making
leads for that model (:meth:`~gezel_trio.host.runtime.ModelRuntime.verify_lead`).

A snapshot belongs to one caller: its owner id is derived from the caller's identity
and the lead (:func:`lead_owner`), and no request of another caller can name it. Pure
functions, no I/O.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from .prefix import Prefix

__all__ = ["MIN_LEAD_CHARS", "BlocksOf", "Lead", "LeadOf", "LeadStart", "lead_of", "lead_owner"]

MIN_LEAD_CHARS = 1024
"""A lead shorter than this (its messages, instructions and tools as JSON) is not worth
a snapshot: its prefill costs about what a save and a restore do."""

_LEAD_ROLES = ("system", "developer")

# The body keys that shape how the engine renders a lead (besides the conversation).
_CHAT_KEYS = (
    "model",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "reasoning_effort",
    "reasoning_format",
)
_RESPONSES_KEYS = (
    "model",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "reasoning",
)


@dataclass(frozen=True, slots=True)
class Lead:
    """The lead of a request: what to send (``body`` to ``path``) to prefill it alone,
    the blocks it covers (a prefix of the request's own
    :func:`~gezel_trio.host.completion.prompt_blocks`), and ``key``, which names it
    (equal keys: equal bodies)."""

    path: str
    body: dict[str, Any] = field(repr=False, compare=False)
    blocks: Prefix = field(repr=False, compare=False)
    key: str = ""
    caller: str | None = field(default=None, compare=False)
    """The caller whose snapshot it is (set by :meth:`for_caller`)."""
    owner: str = field(default="", compare=False)
    """The owner id its snapshot is parked under (:func:`lead_owner`)."""

    def for_caller(self, caller: str) -> Lead:
        """This lead as ``caller``'s: its snapshot is parked under :func:`lead_owner`."""
        return replace(self, caller=caller, owner=lead_owner(caller, self))


@dataclass(frozen=True, slots=True)
class LeadStart:
    """How a slot was started from a lead: the ``tokens`` it holds (0: it failed),
    the upstream ``calls`` made, and whether the snapshot was ``restored`` (else the
    lead was prefilled, and saved when ``saved``)."""

    tokens: int
    calls: int
    restored: bool = False
    saved: bool = False


LeadOf = Callable[[], "Lead | None"]
"""A request's lead, read when asked (:func:`lead_of` of its body): only a job that
starts from a lead needs it."""

BlocksOf = Callable[[list[Any], "str | None"], Prefix]
"""The blocks of a conversation (and a Responses request's instructions), cut as the
whole request is."""


def lead_of(
    path: str, body: dict[str, Any], blocks_of: BlocksOf, *, min_chars: int = MIN_LEAD_CHARS
) -> Lead | None:
    """The lead of a chat (``messages``) or Responses (``input``) request to ``path``:
    its leading system and developer messages (and a Responses request's
    ``instructions``), with the tools and template arguments it carries. None when
    there is none worth saving: no such message, nothing after it (the request is all
    lead), or under ``min_chars`` of it. ``blocks_of`` is the caller's block function
    for a list of messages (the same that cuts the whole request), so the lead's
    blocks are a prefix of the request's."""
    if isinstance(body.get("messages"), list):
        conversation, keys, limit = body["messages"], _CHAT_KEYS, "max_tokens"
        instructions = None
    elif isinstance(body.get("input"), list):
        conversation, keys, limit = body["input"], _RESPONSES_KEYS, "max_output_tokens"
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            return None
    else:
        return None
    n = 0
    while n < len(conversation) and _leads(conversation[n]):
        n += 1
    if n == len(conversation) or (n == 0 and not instructions):
        return None
    lead_body = {k: body[k] for k in keys if k in body}
    lead_body[_conversation_key(body)] = conversation[:n]
    text = json.dumps(lead_body, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    if len(text) < min_chars:
        return None
    blocks: Prefix = blocks_of(conversation[:n], instructions)
    key = hashlib.blake2b(f"{path}\x00{text}".encode("utf-8", "surrogatepass")).hexdigest()
    lead_body.update({limit: 0, "add_generation_prompt": False, "stream": False})
    return Lead(path=path, body=lead_body, blocks=blocks, key=key)


def _conversation_key(body: dict[str, Any]) -> str:
    return "messages" if isinstance(body.get("messages"), list) else "input"


def _leads(message: object) -> bool:
    """Whether a message belongs to the lead: a system or developer message (a
    Responses item of type ``message`` or with no type)."""
    return (
        isinstance(message, dict)
        and message.get("role") in _LEAD_ROLES
        and message.get("type", "message") == "message"
    )


def lead_owner(caller: str, lead: Lead) -> str:
    """The owner id ``caller``'s snapshot of ``lead`` is parked under: 64 hex digits
    derived from the caller's identity (an HMAC under the host's secret) and the
    lead, which no session name of any caller gives."""
    data = b"gezel-trio/lead/v1\x00" + caller.encode("ascii") + b"\x00" + lead.key.encode()
    return hashlib.sha256(data).hexdigest()
