"""Which model architectures keep recurrent state (and so must not be co-batched blindly).

llama-server decodes recurrent and hybrid architectures (Mamba, RWKV, gated-delta-net,
short-conv, ...) through ``llama_memory_recurrent``; co-batching two or more sequences
on those has been seen to corrupt answers and to crash the server (see the calibration
issue). :func:`keeps_recurrent_state` tells such a model from its GGUF metadata.

The lists below mirror upstream ``src/llama-arch.cpp`` (``llm_arch_is_recurrent`` and
``llm_arch_is_hybrid``), checked against the llama.cpp source of build b10435, one
commit after the pinned b10434. A name missing here is still caught by its keys or
tensors (``<arch>.ssm.*``, ``<arch>.wkv.head_size``, ``blk.N.ssm_*``, ...).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "HYBRID_ARCHITECTURES",
    "PURE_RECURRENT_ARCHITECTURES",
    "RECURRENT_ARCHITECTURES",
    "ArchVerdict",
    "keeps_recurrent_state",
    "verdict_from_metadata",
]

#: ``llm_arch_is_recurrent``: every layer keeps recurrent state.
PURE_RECURRENT_ARCHITECTURES: frozenset[str] = frozenset(
    {"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"}
)

#: ``llm_arch_is_hybrid``: attention layers mixed with recurrent ones.
HYBRID_ARCHITECTURES: frozenset[str] = frozenset(
    {
        "jamba",
        "falcon-h1",
        "plamo2",
        "granitehybrid",
        "lfm2",
        "lfm2moe",
        "nemotron_h",
        "nemotron_h_moe",
        "qwen3next",
        "kimi-linear",
        "qwen35",
        "qwen35moe",
        "deepseek4",
    }
)

#: Every architecture llama-server runs with recurrent state.
RECURRENT_ARCHITECTURES: frozenset[str] = PURE_RECURRENT_ARCHITECTURES | HYBRID_ARCHITECTURES

# Metadata keys (after the ``<arch>.`` prefix) that only recurrent layers use.
_RECURRENT_KEY_SUFFIXES: tuple[str, ...] = (
    ".ssm.conv_kernel",
    ".ssm.inner_size",
    ".ssm.state_size",
    ".ssm.time_step_rank",
    ".ssm.group_count",
    ".wkv.head_size",
    ".time_mix_extra_dim",
    ".time_decay_extra_dim",
    ".token_shift_count",
    ".shortconv.l_cache",
    ".kda.head_dim",
    ".attention.recurrent_layers",
    ".full_attention_interval",
)

# Per-block tensors that only recurrent layers have: ssm_* (Mamba, gated delta net),
# time_mix_* / channel_mix_* (RWKV), shortconv.* (LFM2).
_RECURRENT_TENSOR = re.compile(r"^blk\.\d+\.(ssm_|time_mix_|channel_mix_|shortconv\.)")


@dataclass(frozen=True, slots=True)
class ArchVerdict:
    """Whether a model keeps recurrent state, its ``general.architecture``, and why."""

    recurrent: bool
    architecture: str
    reason: str


def verdict_from_metadata(
    metadata: Mapping[str, object], tensor_names: Iterable[str] = ()
) -> ArchVerdict:
    """Decide from GGUF key/values (``general.architecture`` etc.) and tensor names."""
    raw = metadata.get("general.architecture")
    arch = raw if isinstance(raw, str) else ""
    if arch in PURE_RECURRENT_ARCHITECTURES:
        return ArchVerdict(True, arch, f"architecture {arch!r} is recurrent")
    if arch in HYBRID_ARCHITECTURES:
        return ArchVerdict(True, arch, f"architecture {arch!r} is a recurrent/attention hybrid")
    for key in metadata:
        for suffix in _RECURRENT_KEY_SUFFIXES:
            if key.endswith(suffix):
                return ArchVerdict(True, arch, f"metadata key {key!r} belongs to recurrent layers")
    for name in tensor_names:
        if _RECURRENT_TENSOR.match(name):
            return ArchVerdict(True, arch, f"tensor {name!r} belongs to a recurrent layer")
    if not arch:
        return ArchVerdict(False, arch, "no general.architecture and no recurrent keys or tensors")
    return ArchVerdict(False, arch, f"architecture {arch!r} has no recurrent keys or tensors")


def _read_gguf(path: Path) -> tuple[dict[str, object], list[str]]:
    """Key names (values only for ``general.architecture``) and tensor names of a GGUF."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    metadata: dict[str, object] = dict.fromkeys(reader.fields)
    field = reader.get_field("general.architecture")
    if field is not None:
        metadata["general.architecture"] = field.contents()
    return metadata, [t.name for t in reader.tensors]


def keeps_recurrent_state(
    source: str | os.PathLike[str] | Mapping[str, object],
    *,
    tensor_names: Iterable[str] = (),
) -> ArchVerdict:
    """Tell whether a model keeps recurrent state.

    ``source`` is a GGUF file path, or metadata already read (key -> value, at least
    ``general.architecture``; pass ``tensor_names`` too when known). Reads the whole
    GGUF header (memory-mapped); raises :class:`OSError`/:class:`ValueError` on an
    unreadable file.
    """
    if isinstance(source, Mapping):
        return verdict_from_metadata(source, tensor_names)
    metadata, names = _read_gguf(Path(source))
    return verdict_from_metadata(metadata, [*names, *tensor_names])
