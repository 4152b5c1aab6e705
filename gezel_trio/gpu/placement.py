"""Which GPUs an engine goes on (policy, no I/O).

Given each GPU's free bytes (its ledger budget less what other engines hold) and a way to
plan the model against a budget, :func:`place` picks:

1. the GPU with the most room, if the whole model fits it alone (one device, no split);
2. else every GPU together, the layers split in proportion to their room
   (``--tensor-split``), if the whole model fits their sum;
3. else the roomiest GPU alone with part of the layers offloaded, or all GPUs together
   with part of them, whichever fits (one device first);
4. else nothing fits: the plan against the roomiest GPU, whose reasons say why.

"The whole model" is every layer offloaded, as a plan with no limit on its budget
offloads them.

Each chosen device is then reserved its share of the plan's bytes in the ledger, and the
device's thermal gate and memory pressure apply to the engine (see
:class:`~gezel_trio.gpu.health.HealthGate`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

__all__ = ["Placement", "device_flags", "place", "shares"]

_UNLIMITED = 1 << 60  # a budget no plan runs out of: what "every layer offloaded" is


class _Plan(Protocol):
    @property
    def fits(self) -> bool: ...

    @property
    def total_bytes(self) -> int: ...

    @property
    def n_gpu_layers(self) -> int: ...


P = TypeVar("P", bound=_Plan)


@dataclass(frozen=True, slots=True)
class Placement(Generic[P]):
    """The plan, the devices it runs on (ledger ids, ``gpu:N``), and each one's share."""

    plan: P
    devices: tuple[str, ...]
    split: tuple[float, ...] | None = None
    """Fractions of the layers per device (None: one device)."""

    @property
    def fits(self) -> bool:
        return self.plan.fits


def place(free: Mapping[str, int], plan_for: Callable[[int], P]) -> Placement[P] | None:
    """Place a model over the GPUs in ``free`` (device id -> free bytes); ``plan_for(budget)``
    plans it against a budget. None without GPUs."""
    gpus = sorted(free, key=lambda d: (-free[d], _index(d)))
    if not gpus:
        return None
    roomiest = gpus[0]
    alone = plan_for(max(0, free[roomiest]))
    usable = sorted((d for d in gpus if free[d] > 0), key=_index)
    if len(usable) < 2:
        return Placement(alone, (roomiest,))
    whole = plan_for(_UNLIMITED).n_gpu_layers
    total = sum(free[d] for d in usable)
    together = plan_for(total)
    split = Placement(together, tuple(usable), tuple(free[d] / total for d in usable))
    single = Placement(alone, (roomiest,))
    for candidate in (single, split):
        if candidate.plan.fits and candidate.plan.n_gpu_layers >= whole:
            return candidate
    for candidate in (single, split):
        if candidate.plan.fits:
            return candidate
    return single


def shares(placement: Placement[P]) -> dict[str, int]:
    """The bytes to reserve on each device: the plan's bytes in proportion to the split
    (the last device takes the rounding, so the shares add up to the whole plan)."""
    total = placement.plan.total_bytes
    if placement.split is None:
        return {placement.devices[0]: total}
    out = {d: int(total * f) for d, f in zip(placement.devices[:-1], placement.split, strict=False)}
    out[placement.devices[-1]] = total - sum(out.values())
    return out


def device_flags(placement: Placement[P], backend: str | None) -> list[str]:
    """llama-server flags that put the engine on the placement's devices: ``--device``
    names (``CUDA0``, ``Vulkan1``: the backend's name and the NVML index) and, for a
    split, ``--split-mode layer --tensor-split``. No flags for an unknown or CPU backend:
    the engine then uses what it finds."""
    name = {"cuda": "CUDA", "vulkan": "Vulkan", "rocm": "ROCm", "hip": "ROCm", "sycl": "SYCL"}.get(
        (backend or "").lower()
    )
    if name is None:
        return []
    flags = ["--device", ",".join(f"{name}{_index(d)}" for d in placement.devices)]
    if placement.split is not None:
        flags += [
            "--split-mode",
            "layer",
            "--tensor-split",
            ",".join(f"{f:.3f}" for f in placement.split),
        ]
    return flags


def _index(device: str) -> int:
    _, _, n = device.partition(":")
    return int(n) if n.isdigit() else 0
