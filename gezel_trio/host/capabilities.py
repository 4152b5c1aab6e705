"""What a model can do, as clients are told: plain policy, no I/O.

Whether a model takes ``tools`` is its chat template's to say, and llama-server says
it: at load it renders the template with a probe tool and reports whether the tool's
name was used (``GET /props`` -> ``chat_template_caps.supports_tools``, b10435). A
template without tool support renders the same prompt with and without ``tools``
(measured with SmolLM2's, on ``/apply-template``): the engine drops them silently, so
the host says so (a warning once per model, and ``tools`` left out of the model's
capabilities in ``/v1/models`` and Ollama's ``/api/show``).

Before the engine has run, the host guesses from the template text as Ollama does
(a template that names ``tools``); the engine's own word replaces the guess once it
has answered ``/props``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "engine_supports_tools",
    "model_capabilities",
    "template_supports_thinking",
    "template_supports_tools",
]


def engine_supports_tools(props: dict[str, Any] | None) -> bool | None:
    """``chat_template_caps.supports_tools`` of an engine's ``/props`` (None: it does not
    say; an engine older than the caps, or not llama-server)."""
    caps = props.get("chat_template_caps") if props else None
    value = caps.get("supports_tools") if isinstance(caps, dict) else None
    return value if isinstance(value, bool) else None


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders tools, guessed from its text (Ollama looks for
    ``tools`` in its template's variables; a Jinja template names them the same way)."""
    return bool(chat_template) and "tools" in str(chat_template)


def template_supports_thinking(chat_template: str | None) -> bool:
    """Whether a chat template has a thinking switch or thinking tags."""
    text = chat_template or ""
    return any(mark in text for mark in ("enable_thinking", "<think>", "reasoning_content"))


def model_capabilities(
    *,
    completion: bool = True,
    tools: bool = False,
    fim: bool = False,
    vision: bool = False,
    embedding: bool = False,
    thinking: bool = False,
) -> tuple[str, ...]:
    """The capability names Ollama lists (``/api/show`` ``capabilities``), in its order;
    llama-server's own ``/v1/models`` uses the same names."""
    flags = (
        ("completion", completion),
        ("tools", tools),
        ("insert", fim),
        ("vision", vision),
        ("embedding", embedding),
        ("thinking", thinking),
    )
    return tuple(name for name, on in flags if on)
