"""The kinds of engine the supervisor runs, and what tells them apart to it.

A kind is chosen once, when a model's engine is opened (``Catalog.open_model``): the
supervisor asks its ``health_path`` whether the engine is ready and reads the engine's
slot shape only from a kind that has one. Nothing else in the life cycle differs.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LLAMA_SERVER", "SD_SERVER", "EngineKind"]


@dataclass(frozen=True, slots=True)
class EngineKind:
    """What the supervisor needs to know of an engine program."""

    name: str
    health_path: str
    """The route that answers 200 once the engine serves (and not before)."""
    slot_shape: bool
    """Whether the engine reports its slots (``/slots``, ``/props``) once ready."""


LLAMA_SERVER = EngineKind("llama-server", "/health", slot_shape=True)
"""llama.cpp's server: ``/health`` answers 503 while it loads, 200 once it serves."""

SD_SERVER = EngineKind("sd-server", "/v1/models", slot_shape=False)
"""stable-diffusion.cpp's server: no ``/health``; it loads its model before it listens,
so ``/v1/models`` answering is readiness. One job at a time, no slots to read."""
