"""The context a llama-server slot gets, read from the command line as the engine reads it.

llama-server (b10435) turns ``--ctx-size`` (``-c``; 0: the model's trained context)
and ``--parallel`` into each slot's context this way:

1. the total is padded up to a multiple of 256;
2. with a unified KV buffer (``--kv-unified``; the default only with ``-np auto``)
   every slot may use the whole total; otherwise each slot gets the total divided by
   the slots, padded up to a multiple of 256;
3. the server caps a slot at the model's trained context (``n_ctx_train``, which
   ``--override-kv <arch>.context_length=int:N`` replaces).

:func:`slot_context` is that rule, over the flags :func:`slot_flags` lists in the order
the host passes them; :func:`extension_flags` are the flags that let the engine run a
context above the trained one (the override, and YaRN rope scaling from the trained
length); :func:`slot_request` is what the memory planner is asked for, where the flags
themselves set the context (the KV the engine allocates, before its cap). Pure
functions: the host predicts with them before an engine runs (check-config, the
listing of a stopped model); a running engine's own ``/slots`` ``n_ctx`` is the truth
once it is READY.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .argv import last_arg_value

__all__ = [
    "PAD",
    "SlotRequest",
    "extension_flags",
    "slot_context",
    "slot_flags",
    "slot_request",
    "trained_context",
]

PAD = 256
"""llama.cpp pads the context (total and per sequence) to this many tokens."""

_UNIFIED_ON = ("--kv-unified", "-kvu")
_UNIFIED_OFF = ("--no-kv-unified", "-no-kvu")


def _pad(n: int) -> int:
    return (n + PAD - 1) // PAD * PAD


def _unified(args: Sequence[str]) -> bool:
    unified = False
    for arg in args:
        if arg in _UNIFIED_ON:
            unified = True
        elif arg in _UNIFIED_OFF:
            unified = False
    return unified


def _whole(value: str | None) -> int | None:
    return int(value) if value is not None and value.strip().isdigit() else None


def trained_context(args: Sequence[str], n_ctx_train: int | None) -> int | None:
    """The trained context the engine believes: the last ``--override-kv
    <arch>.context_length=int:N`` in ``args``, else the file's ``n_ctx_train``."""
    found = n_ctx_train
    for i, arg in enumerate(args):
        value = None
        if arg == "--override-kv" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--override-kv="):
            value = arg.split("=", 1)[1]
        if value is None:
            continue
        for item in value.split(","):
            key, _, typed = item.partition("=")
            kind, _, number = typed.partition(":")
            if key.endswith(".context_length") and kind == "int" and number.strip().isdigit():
                found = int(number)
    return found


def slot_context(args: Sequence[str], *, n_ctx_train: int | None) -> int | None:
    """Each slot's context for an engine started with ``args`` (the last occurrence of a
    flag wins) on a model trained on ``n_ctx_train`` tokens; None when it cannot be
    known (no ``--ctx-size`` or 0, and no trained context)."""
    trained = trained_context(args, n_ctx_train)
    try:
        total = int(last_arg_value(args, "--ctx-size") or 0)
        parallel = int(last_arg_value(args, "--parallel") or 1)
    except ValueError:
        return None
    if total <= 0:
        if not trained:
            return None
        total = trained
    total = _pad(total)
    per_slot = total if _unified(args) else _pad(total // max(1, parallel))
    if trained:
        per_slot = min(per_slot, trained)
    return per_slot


def extension_flags(architecture: str, n_ctx_train: int | None, ctx_per_slot: int) -> list[str]:
    """The flags an engine needs to run ``ctx_per_slot`` tokens per slot on a model
    trained on ``n_ctx_train`` (none when it is within it): the trained context
    overridden (else the server caps each slot at it), and YaRN rope scaling by the
    ratio, from the trained length."""
    if not n_ctx_train or ctx_per_slot <= n_ctx_train:
        return []
    return [
        "--override-kv",
        f"{architecture}.context_length=int:{ctx_per_slot}",
        "--rope-scaling",
        "yarn",
        "--rope-scale",
        f"{ctx_per_slot / n_ctx_train:g}",
        "--yarn-orig-ctx",
        str(n_ctx_train),
    ]


def slot_flags(
    *,
    parallel: int,
    ctx_per_slot: int,
    extended: Sequence[str],
    extra_args: Sequence[str],
    model_args: Sequence[str],
) -> list[str]:
    """The flags that decide an engine's slots, in the order the host gives them: the
    plan's slots and context (``extended``: its :func:`extension_flags`), then
    ``engine.extra_args``, then the model's ``args`` (the last occurrence wins)."""
    return [
        "--ctx-size",
        str(ctx_per_slot * parallel),
        "--parallel",
        str(parallel),
        *extended,
        *extra_args,
        *model_args,
    ]


@dataclass(frozen=True, slots=True)
class SlotRequest:
    """What the memory planner is asked for: a context per slot and slots (None: its
    defaults). ``fixed``: the engine flags set the context themselves, so the plan
    counts the KV they allocate, as it is: no default, no shrinking, no extension."""

    ctx_per_slot: int | None
    parallel: int | None
    fixed: bool = False


def slot_request(
    *,
    ctx_per_slot: int | None,
    parallel: int | None,
    flags: Sequence[str],
    n_ctx_train: int | None,
    default_parallel: int,
) -> SlotRequest:
    """The planner's request for a model configured with ``ctx_per_slot`` and
    ``parallel`` whose engine flags (``engine.extra_args`` then its ``args``) are
    ``flags``. The last ``--parallel`` there wins over ``parallel``; a ``--ctx-size``
    there wins over ``ctx_per_slot`` and decides the KV the engine allocates, whatever
    each slot is capped at: every slot holds the total over the slots, padded (a
    unified KV: the total, shared), so the plan counts that many cells per slot. Its
    slots are then ``default_parallel`` when nothing sets them (the host passes the
    plan's ``--parallel``, and a fixed plan does not choose)."""
    slots = _whole(last_arg_value(flags, "--parallel")) or parallel
    total = _whole(last_arg_value(flags, "--ctx-size"))
    if total is None:
        return SlotRequest(ctx_per_slot, slots)
    total = _pad(total or n_ctx_train or 0)
    if total <= 0:
        return SlotRequest(ctx_per_slot, slots)
    slots = slots or default_parallel
    per_slot = total // slots if _unified(flags) else _pad(total // slots)
    return SlotRequest(max(1, per_slot), slots, fixed=True)
