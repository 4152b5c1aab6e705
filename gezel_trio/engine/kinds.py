"""The kinds of engine the supervisor runs, and what tells them apart to it.

A kind is chosen once, when a model's engine is opened (``Catalog.open_model``): the
supervisor asks its ``health_path`` whether the engine is ready and reads the engine's
slot shape only from a kind that has one. Nothing else in the life cycle differs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["LLAMA_SERVER", "SD_SERVER", "EngineKind"]


@dataclass(frozen=True, slots=True)
class EngineKind:
    """What the supervisor needs to know of an engine program."""

    name: str
    health_path: str
    """The route that answers 200 once the engine serves (and not before)."""
    slot_shape: bool
    """Whether the engine reports its slots (``/slots``, ``/props``) once ready."""
    env_defaults: Mapping[str, str] = field(default_factory=dict)
    """Environment the engine runs with unless the host's environment sets it."""

    def environment(self, env: Mapping[str, str]) -> dict[str, str]:
        """``env`` with :attr:`env_defaults` for what it does not set."""
        return {**self.env_defaults, **env}


LLAMA_SERVER = EngineKind("llama-server", "/health", slot_shape=True)
"""llama.cpp's server: ``/health`` answers 503 while it loads, 200 once it serves."""

SD_SERVER = EngineKind(
    "sd-server",
    "/v1/models",
    slot_shape=False,
    env_defaults={"OMP_WAIT_POLICY": "passive"},
)
"""stable-diffusion.cpp's server: no ``/health``; it loads its model before it listens,
so ``/v1/models`` answering is readiness. One job at a time, no slots to read.

Its CPU build runs on OpenMP (libgomp). Measured on a 2-core machine at a load of 6 to 7:
a job of its async API (the one the host uses) sampled the demo model's 4 steps in 2 to
7 s with OpenMP's default (active, spinning) waits, against 0.35 to 0.9 s with passive
waits; its synchronous route (what a client of sd-server alone uses) took 0.35 to 0.75 s
with the default. The cause upstream is not known (the same ``generate_image`` call, from
its job thread instead of an HTTP thread). A user's own ``OMP_WAIT_POLICY`` wins."""
