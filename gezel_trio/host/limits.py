"""The limits a client may overshoot, and what the host serves instead: plain policy, no I/O.

The rule is the engine's: a request that bare llama-server serves, the host serves.

- **Output limits** (``max_tokens``, ``max_completion_tokens``, ``n_predict``,
  ``max_output_tokens``, and Ollama's ``num_predict`` once translated): llama-server
  takes any value, generates until the limit, the end of the answer, or the slot's
  context is full, and then stops with ``finish_reason: "length"`` (``stop_type:
  "limit"``, ``truncated: true`` on ``/completion``). Measured on b10435 with a
  2,048-token slot and ``max_tokens: 32000``: prompt + completion = 2,048 on the chat,
  Messages, Responses and ``/completion`` routes. A value above the slot's context is
  lowered to the slot's context (:func:`fit_output_limits`): the engine serves it
  exactly as it serves the client's value (it stops when the slot is full, before
  that limit, whatever the prompt), and the host needs no tokenization to know it.
  An engine run with ``--context-shift`` generates past its context by shifting:
  there the host lowers nothing, as the engine does not. A value above
  :data:`ENGINE_MAX` (2**31 - 1) is a 400 on the engine (``Value must be between -1 <=
  value <= 2147483647``) and on the host, naming the field.
- **Ollama's** ``options.num_ctx`` asks for a context per request, which llama-server
  cannot change per request: the request is served with the slot's context
  (:func:`fit_num_ctx`), as Ollama lowers a ``num_ctx`` above the model's trained
  context, with a warning once per model (:class:`OnceNotes`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import FieldError

__all__ = [
    "ENGINE_MAX",
    "OUTPUT_LIMITS",
    "Clamp",
    "OnceNotes",
    "clamp_fields",
    "fit_num_ctx",
    "fit_output_limits",
]

ENGINE_MAX = 2**31 - 1
"""The largest output limit llama-server reads (an int32); above it, it answers 400."""

OUTPUT_LIMITS = ("max_tokens", "max_completion_tokens", "n_predict", "max_output_tokens")
"""The body fields (engine-bound, every dialect translated) that bound what is generated."""


@dataclass(frozen=True, slots=True)
class Clamp:
    """A field a request asked more of than the host serves: what it asked, what it got."""

    field: str
    asked: int
    served: int

    def __str__(self) -> str:
        return f"{self.field} {self.asked} -> {self.served}"


def fit_output_limits(
    body: Mapping[str, Any], *, ctx_per_slot: int, context_shift: bool = False
) -> tuple[dict[str, Any], tuple[Clamp, ...]]:
    """``body`` with each output limit above ``ctx_per_slot`` lowered to it, and the
    clamps made (none: ``body`` itself, as a dict). With ``context_shift`` (the engine
    generates past its context) nothing is lowered. A bool is not a limit. Raises
    FieldError (400) for a limit above :data:`ENGINE_MAX`, as the engine does."""
    limits = [
        (name, value)
        for name in OUTPUT_LIMITS
        if isinstance(value := body.get(name), int) and not isinstance(value, bool)
    ]
    for name, value in limits:
        if value > ENGINE_MAX:
            raise FieldError(
                name, f"{value} is more than the engine reads: ask for at most {ENGINE_MAX}"
            )
    if context_shift:
        return dict(body), ()
    clamps = tuple(
        Clamp(name, value, ctx_per_slot) for name, value in limits if value > ctx_per_slot
    )
    if not clamps:
        return dict(body), ()
    return {**body, **{c.field: c.served for c in clamps}}, clamps


def fit_num_ctx(num_ctx: int | None, *, ctx_per_slot: int) -> Clamp | None:
    """The clamp of an Ollama ``options.num_ctx`` above ``ctx_per_slot`` (None: it fits,
    or none was asked). A smaller one is served with the slot's context too: the engine
    cannot narrow a slot per request, and a larger context never cuts an answer short."""
    if num_ctx is None or num_ctx <= ctx_per_slot:
        return None
    return Clamp("options.num_ctx", num_ctx, ctx_per_slot)


def clamp_fields(clamps: tuple[Clamp, ...]) -> dict[str, dict[str, int]] | None:
    """The request log's ``clamped`` field: ``{field: {"asked": n, "served": m}}``
    (None: nothing was clamped)."""
    if not clamps:
        return None
    return {c.field: {"asked": c.asked, "served": c.served} for c in clamps}


class OnceNotes:
    """Which notices have been given already: :meth:`first` is true once per key. Bounded
    (the keys are a model's few facts; past ``limit`` keys the oldest are forgotten and
    may be noted again)."""

    __slots__ = ("_limit", "_seen")

    def __init__(self, limit: int = 1024) -> None:
        self._seen: dict[Hashable, None] = {}
        self._limit = limit

    def __repr__(self) -> str:
        return f"<OnceNotes {len(self._seen)} given>"

    def __len__(self) -> int:
        return len(self._seen)

    def first(self, key: Hashable) -> bool:
        """Whether ``key`` is new (it is remembered from now on)."""
        if key in self._seen:
            return False
        if len(self._seen) >= self._limit:
            self._seen.pop(next(iter(self._seen)))
        self._seen[key] = None
        return True
