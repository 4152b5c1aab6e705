"""What the memory planner needs to know about a GGUF model, read from its header.

:func:`read_gguf_info` opens the file with :class:`gguf.GGUFReader` (a memory
map: tensor data is never read, only the header and the tensor table) and
returns a :class:`GGUFInfo`. :func:`kv_bytes_per_token` and
:func:`recurrent_state_bytes_per_seq` turn it into KV-cache and recurrent-state
sizes the way llama.cpp allocates them.

Approximations (all documented where they are computed):

* Attention layers are the blocks that carry ``attn_k``/``attn_qkv`` (or
  MLA ``attn_kv_a_mqa``/``attn_k_b``) tensors; recurrent layers carry
  ``ssm_*``, ``time_mix*`` or ``shortconv`` tensors. Without tensors (a
  synthetic info), layers with ``head_count_kv > 0`` count as attention.
* Sliding-window layers are counted at full context (llama.cpp with
  ``--swa-full`` off keeps fewer cells for them), and MLA models are sized
  from ``key_length``/``value_length`` as if they were ordinary heads: both
  overestimate, which is the safe side for admission.
* Recurrent state is per sequence and in f32, as llama.cpp allocates it
  (``n_embd_r + n_embd_s`` per recurrent layer); for layouts the formula does
  not know, ``recurrent_state_bytes_per_layer`` is ``None``.

This module is synchronous file I/O: call it from Trio through
``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from gezel_trio.errors import ConfigError

__all__ = [
    "CACHE_TYPES",
    "GGUFError",
    "GGUFInfo",
    "cache_type_row_bytes",
    "kv_bytes_per_token",
    "kv_bytes_per_token_by_layer",
    "read_gguf_info",
    "recurrent_state_bytes_per_seq",
]


class GGUFError(ConfigError):
    """A model file is not a readable GGUF (not GGUF, truncated, missing keys)."""

    code = "invalid_model_file"


#: KV cache types llama-server accepts for ``--cache-type-k/-v``: (block size, bytes per block).
CACHE_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "iq4_nl": (32, 18),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
}

#: Recurrent state (conv and ssm/wkv) is kept in f32 whatever the KV cache type.
RECURRENT_STATE_ELEM_BYTES = 4

_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(.+)$")
_ATTENTION_PARTS = ("attn_k.", "attn_qkv.", "attn_kv_a_mqa.", "attn_k_b.")
_RECURRENT_TENSOR_MARKERS = ("ssm_", "time_mix", "shortconv")
_EMBEDDING_TENSORS = ("token_embd.", "token_embd_norm.", "pos_embd.", "token_types.")
_OUTPUT_TENSORS = ("output.", "output_norm.")


@dataclass(frozen=True, slots=True)
class GGUFInfo:
    """A model's shape and sizes. Per-layer tuples have ``block_count`` entries."""

    path: str
    architecture: str
    name: str | None
    file_size: int
    block_count: int
    embedding_length: int
    head_count: int
    #: Per layer (a scalar in the file is repeated); 0 for a layer without attention.
    head_count_kv: tuple[int, ...]
    context_length: int | None
    key_length: int | None
    value_length: int | None
    feed_forward_length: int | None
    vocab_size: int | None
    #: Sum of every tensor's bytes (what the weights occupy in memory).
    tensor_bytes: int
    layer_tensor_bytes: tuple[int, ...]
    #: ``token_embd`` & co: llama.cpp keeps the input embedding on the CPU.
    embedding_bytes: int
    #: ``output``/``output_norm``: on the GPU whenever ``-ngl >= 1``.
    output_bytes: int
    #: Tensors that are neither in a block, the embedding nor the output.
    other_bytes: int
    #: No ``output.weight``: the output reuses ``token_embd`` (llama.cpp duplicates it).
    tied_embeddings: bool
    attention_layers: tuple[bool, ...]
    recurrent_layers: tuple[bool, ...]
    #: Whether any tensor name or metadata key indicates SSM/recurrent state.
    recurrent: bool
    #: What indicated it (tensor-name fragments and metadata keys), for status.
    recurrent_markers: tuple[str, ...] = ()
    #: f32 state bytes per recurrent layer per sequence, when derivable.
    recurrent_state_bytes_per_layer: int | None = None
    sliding_window: int | None = None
    expert_count: int | None = None
    #: ``tokenizer.chat_template`` (None: the file has none).
    chat_template: str | None = dataclasses.field(default=None, repr=False)

    @property
    def head_dim_k(self) -> int:
        if self.key_length:
            return self.key_length
        return self.embedding_length // self.head_count if self.head_count else 0

    @property
    def head_dim_v(self) -> int:
        if self.value_length:
            return self.value_length
        return self.embedding_length // self.head_count if self.head_count else 0

    @property
    def n_attention_layers(self) -> int:
        return sum(self.attention_layers)

    @property
    def n_recurrent_layers(self) -> int:
        return sum(self.recurrent_layers)

    @property
    def output_gpu_bytes(self) -> int:
        """Bytes the output layer puts on the GPU (the duplicated embedding when tied)."""
        return self.output_bytes + (self.embedding_bytes if self.tied_embeddings else 0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "architecture": self.architecture,
            "name": self.name,
            "file_size": self.file_size,
            "block_count": self.block_count,
            "embedding_length": self.embedding_length,
            "head_count": self.head_count,
            "head_count_kv": max(self.head_count_kv, default=0),
            "context_length": self.context_length,
            "head_dim_k": self.head_dim_k,
            "head_dim_v": self.head_dim_v,
            "vocab_size": self.vocab_size,
            "tensor_bytes": self.tensor_bytes,
            "attention_layers": self.n_attention_layers,
            "recurrent": self.recurrent,
            "recurrent_layers": self.n_recurrent_layers,
            "recurrent_markers": list(self.recurrent_markers),
        }


def cache_type_row_bytes(cache_type: str, n_elements: int) -> int:
    """Bytes of ``n_elements`` values stored as ``cache_type`` (whole blocks)."""
    try:
        block, size = CACHE_TYPES[cache_type.lower()]
    except KeyError:
        known = ", ".join(CACHE_TYPES)
        raise ConfigError(f"unknown KV cache type {cache_type!r} (one of: {known})") from None
    return math.ceil(n_elements / block) * size


def kv_bytes_per_token_by_layer(info: GGUFInfo, cache_type: str = "f16") -> tuple[int, ...]:
    """K plus V bytes one token costs in each layer (0 for layers without attention)."""
    out: list[int] = []
    for i in range(info.block_count):
        if not info.attention_layers[i]:
            out.append(0)
            continue
        n_kv = info.head_count_kv[i]
        k = cache_type_row_bytes(cache_type, n_kv * info.head_dim_k)
        v = cache_type_row_bytes(cache_type, n_kv * info.head_dim_v)
        out.append(k + v)
    return tuple(out)


def kv_bytes_per_token(info: GGUFInfo, cache_type: str = "f16") -> int:
    """KV-cache bytes per token of context, over every attention layer.

    For uniform heads this is ``2 * n_attention_layers * n_head_kv * head_dim *
    bytes_per_elem`` (K and V); per layer it uses that layer's ``head_count_kv``
    and ``key_length``/``value_length`` when they differ. Recurrent layers cost
    nothing per token; see :func:`recurrent_state_bytes_per_seq`.
    """
    return sum(kv_bytes_per_token_by_layer(info, cache_type))


def recurrent_state_bytes_per_seq(info: GGUFInfo) -> int:
    """Fixed recurrent state per sequence (f32), over every recurrent layer; 0 if none/unknown."""
    if not info.recurrent_state_bytes_per_layer:
        return 0
    return info.recurrent_state_bytes_per_layer * info.n_recurrent_layers


# --- reading ---------------------------------------------------------------------------


def _scalar(field: Any) -> Any:
    return None if field is None else field.contents()


def _int_or_none(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, list):
        return max((int(v) for v in value), default=None)
    return int(value)


def _per_layer(value: Any, n: int, default: int) -> tuple[int, ...]:
    if value is None:
        return (default,) * n
    if isinstance(value, list):
        vals = [int(v) for v in value]
        if len(vals) < n:
            vals += [vals[-1] if vals else default] * (n - len(vals))
        return tuple(vals[:n])
    return (int(value),) * n


def _recurrent_state_per_layer(kv: dict[str, Any], arch: str, n_embd: int) -> int | None:
    """llama.cpp's ``n_embd_r() + n_embd_s()`` times 4 bytes, when the keys allow it."""

    def get(key: str) -> int:
        return _int_or_none(kv.get(key.format(arch=arch))) or 0

    wkv_head = get("{arch}.wkv.head_size")
    l_cache = get("{arch}.shortconv.l_cache")
    d_conv = get("{arch}.ssm.conv_kernel")
    d_inner = get("{arch}.ssm.inner_size")
    d_state = get("{arch}.ssm.state_size")
    n_group = get("{arch}.ssm.group_count")
    if wkv_head:  # RWKV: token shift and wkv state
        shift = get("{arch}.token_shift_count") or 2
        r, s = shift * n_embd, n_embd * wkv_head
    elif l_cache:  # LFM2 short convolution
        r, s = n_embd * (l_cache - 1), d_state * d_inner
    elif d_conv or d_inner or d_state:  # Mamba/Mamba2 (and gated-delta-net layouts, approx.)
        r = (d_conv - 1 if d_conv > 0 else 0) * (d_inner + 2 * n_group * d_state)
        s = d_state * d_inner
    else:
        return None
    total = (r + s) * RECURRENT_STATE_ELEM_BYTES
    return total or None


def read_gguf_info(path: str | os.PathLike[str]) -> GGUFInfo:
    """Read a GGUF file's metadata and tensor table (never its tensor data).

    Raises :class:`GGUFError` (a :class:`ConfigError`, HTTP 400) naming the
    path and what is wrong for a missing, non-GGUF or truncated file.
    """
    from gguf import GGUFReader

    p = os.fspath(path)
    try:
        file_size = os.path.getsize(p)
    except OSError as exc:
        raise GGUFError(f"model file {p!r} cannot be read: {exc.strerror or exc}") from exc
    if file_size < 24:
        raise GGUFError(f"model file {p!r} is not a GGUF file ({file_size} bytes, too short)")
    try:
        reader = GGUFReader(p, "r")
    except Exception as exc:
        raise GGUFError(
            f"model file {p!r} is not a readable GGUF file (not GGUF, or truncated): {exc}"
        ) from exc
    try:
        return _info_from_reader(reader, p, file_size)
    finally:
        del reader


def _info_from_reader(reader: Any, path: str, file_size: int) -> GGUFInfo:
    kv: dict[str, Any] = {}
    for name_, field in reader.fields.items():
        if name_.startswith("GGUF.") or name_ == "tokenizer.ggml.tokens":
            continue
        if name_.startswith("tokenizer.ggml.") and name_ != "tokenizer.ggml.model":
            continue  # big arrays (merges, scores) are not needed
        try:
            kv[name_] = _scalar(field)
        except Exception as exc:
            raise GGUFError(
                f"model file {path!r}: metadata key {name_!r} is unreadable: {exc}"
            ) from exc

    arch = kv.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise GGUFError(f"model file {path!r} has no general.architecture key")

    def key(name: str) -> Any:
        return kv.get(name.format(arch=arch))

    block_count = _int_or_none(key("{arch}.block_count"))
    n_embd = _int_or_none(key("{arch}.embedding_length"))
    if not block_count or block_count < 0:
        raise GGUFError(f"model file {path!r} has no {arch}.block_count")
    if not n_embd:
        raise GGUFError(f"model file {path!r} has no {arch}.embedding_length")

    head_count_per_layer = _per_layer(key("{arch}.attention.head_count"), block_count, 0)
    head_count = max(head_count_per_layer, default=0)
    head_count_kv = _per_layer(key("{arch}.attention.head_count_kv"), block_count, head_count)

    # --- tensors ---
    data_end = 0
    tensor_bytes = 0
    layer_bytes = [0] * block_count
    embedding_bytes = output_bytes = other_bytes = 0
    attn = [False] * block_count
    rec = [False] * block_count
    markers: list[str] = []
    has_output_weight = False
    vocab_from_embd: int | None = None
    for t in reader.tensors:
        nb = int(t.n_bytes)
        tensor_bytes += nb
        data_end = max(data_end, int(t.data_offset) + nb)
        name: str = t.name
        m = _LAYER_TENSOR.match(name)
        if m is not None:
            idx, rest = int(m.group(1)), m.group(2)
            if idx < block_count:
                layer_bytes[idx] += nb
                if rest.startswith(_ATTENTION_PARTS):
                    attn[idx] = True
                for marker in _RECURRENT_TENSOR_MARKERS:
                    if marker in rest:
                        rec[idx] = True
                        if marker not in markers:
                            markers.append(marker)
            else:
                other_bytes += nb
        elif name.startswith(_EMBEDDING_TENSORS):
            embedding_bytes += nb
            if name == "token_embd.weight" and len(t.shape) >= 2:
                vocab_from_embd = int(t.shape[1])
        elif name.startswith(_OUTPUT_TENSORS):
            output_bytes += nb
            has_output_weight = has_output_weight or name == "output.weight"
        else:
            other_bytes += nb
    if data_end > file_size:
        raise GGUFError(
            f"model file {path!r} is truncated: tensor data ends at byte {data_end}, "
            f"the file has {file_size}"
        )

    for k in kv:
        for prefix in (f"{arch}.ssm.", f"{arch}.wkv.", f"{arch}.shortconv."):
            if k.startswith(prefix) and prefix not in markers:
                markers.append(prefix)
        if k == f"{arch}.full_attention_interval" and k not in markers:
            markers.append(k)
    recurrent = bool(markers)

    if not reader.tensors:
        # No tensor table to look at: fall back to metadata.
        interval = _int_or_none(key("{arch}.full_attention_interval"))
        for i in range(block_count):
            attn[i] = head_count_kv[i] > 0 and (not interval or (i + 1) % interval == 0)
            rec[i] = recurrent and not attn[i]
    elif recurrent and not any(rec):
        # Recurrent keys but no recognized recurrent tensor names: every non-attention layer.
        rec = [not a for a in attn]
    head_count_kv = tuple(h if a else 0 for h, a in zip(head_count_kv, attn, strict=True))

    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _int_or_none(key("{arch}.vocab_size"))
    if vocab is None and tokens is not None:
        vocab = len(tokens.data)
    if vocab is None:
        vocab = vocab_from_embd

    name_kv = kv.get("general.name")
    return GGUFInfo(
        path=path,
        architecture=arch,
        name=name_kv if isinstance(name_kv, str) else None,
        file_size=file_size,
        block_count=block_count,
        embedding_length=n_embd,
        head_count=head_count,
        head_count_kv=head_count_kv,
        context_length=_int_or_none(key("{arch}.context_length")),
        key_length=_int_or_none(key("{arch}.attention.key_length")),
        value_length=_int_or_none(key("{arch}.attention.value_length")),
        feed_forward_length=_int_or_none(key("{arch}.feed_forward_length")),
        vocab_size=vocab,
        tensor_bytes=tensor_bytes,
        layer_tensor_bytes=tuple(layer_bytes),
        embedding_bytes=embedding_bytes,
        output_bytes=output_bytes,
        other_bytes=other_bytes,
        tied_embeddings=not has_output_weight,
        attention_layers=tuple(attn),
        recurrent_layers=tuple(rec),
        recurrent=recurrent,
        recurrent_markers=tuple(markers),
        recurrent_state_bytes_per_layer=(
            _recurrent_state_per_layer(kv, arch, n_embd) if recurrent else None
        ),
        sliding_window=_int_or_none(key("{arch}.attention.sliding_window")),
        expert_count=_int_or_none(key("{arch}.expert_count")),
        chat_template=template
        if isinstance(template := kv.get("tokenizer.chat_template"), str)
        else None,
    )
