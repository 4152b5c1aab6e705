"""What every image dialect's translation shares: sd-server's native request schema (the
body of its ``/sdcpp/v1/img_gen``), and the rules sd-server's own compatibility routes
apply on the way to it (``examples/server/routes_openai.cpp``, ``routes_sdapi.cpp``).
Plain functions, no I/O.

- ``<sd_cpp_extra_args>{json}</sd_cpp_extra_args>`` in a prompt: sd-server's own
  routes cut it out and apply it over the fields they built, with the native schema's
  rules (:func:`apply_extra_args`); the translations here do the same, so a client that
  used it against sd-server gets the same render through the host.
- Output formats: ``png``, ``jpeg`` (``jpg``) and ``webp`` (webp only where the route
  allows it, and only when sd-server was built with it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Final

from ..errors import BadRequest, FieldError

__all__ = [
    "EXTRA_ARGS",
    "apply_extra_args",
    "as_int",
    "as_number",
    "merge_native",
    "output_format",
    "parse_size",
    "split_extra_args",
]

EXTRA_ARGS: Final = re.compile(r"<sd_cpp_extra_args>(.*?)</sd_cpp_extra_args>", re.DOTALL)


def split_extra_args(prompt: str) -> tuple[str, dict[str, Any] | None]:
    """The prompt without its ``<sd_cpp_extra_args>`` blocks, and the first block's JSON
    object (None when there is none). A block that is not a JSON object is a 400, as
    sd-server answers ``invalid sd_cpp_extra_args``."""
    match = EXTRA_ARGS.search(prompt)
    if match is None:
        return prompt, None
    try:
        extra = json.loads(match.group(1))
    except ValueError:
        extra = None
    if not isinstance(extra, dict):
        raise BadRequest("invalid sd_cpp_extra_args: expected a JSON object of native fields")
    return EXTRA_ARGS.sub("", prompt), extra


def merge_native(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``extra`` over ``base``, as sd-server applies a native body over its defaults:
    objects (``sample_params``, ``guidance``, ``hires``, ...) field by field, everything
    else replaced."""
    out = dict(base)
    for key, value in extra.items():
        old = out.get(key)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            out[key] = merge_native(old, value)
        else:
            out[key] = value
    return out


def apply_extra_args(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with the ``<sd_cpp_extra_args>`` of its ``prompt`` applied over it and cut
    from the prompt (sd-server's own compatibility routes do exactly this)."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        return body
    prompt, extra = split_extra_args(prompt)
    if extra is None:
        return body
    merged = merge_native(body, extra)
    merged["prompt"] = prompt
    return merged


def output_format(value: object, *, param: str = "output_format", webp: bool = True) -> str:
    """A normalized output format (``jpg`` is ``jpeg``); a 400 in sd-server's words for
    another."""
    allowed = ("png", "jpeg", "webp") if webp else ("png", "jpeg")
    if value is None:
        return "png"
    if isinstance(value, str):
        fmt = value.strip().lower()
        fmt = "jpeg" if fmt == "jpg" else fmt
        if fmt in allowed:
            return fmt
    raise FieldError(param, f"invalid output_format, must be one of [{', '.join(allowed)}]")


def parse_size(value: object, *, param: str = "size") -> tuple[int, int] | None:
    """``"WIDTHxHEIGHT"`` as two integers; None for none (or ``auto``: the input's own).
    Anything else is a 400 naming what to send (sd-server would silently render at
    its default size instead)."""
    if value is None or value == "" or value == "auto":
        return None
    if isinstance(value, str):
        w, sep, h = value.strip().lower().partition("x")
        if sep and w.isdigit() and h.isdigit() and int(w) > 0 and int(h) > 0:
            return int(w), int(h)
    raise FieldError(param, 'expected "WIDTHxHEIGHT" in pixels, such as "512x512"')


def as_int(value: object, param: str) -> int:
    """An integer field; an integral float passes (JSON clients send 512.0)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise FieldError(param, "expected an integer")


def as_number(value: object, param: str) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool) and value == value:
        return float(value)
    raise FieldError(param, "expected a number")
