"""Memory planning: context x parallel slots and ``-ngl`` that fit a device budget.

:func:`plan_engine` is pure arithmetic over a :class:`GGUFInfo`; it returns an
:class:`EnginePlan` whose ``reasons`` say, in words, why the plan is what it
is (status shows them).

The memory model, per engine, on the budgeted device:

* **weights**: CPU-only, every tensor (``tensor_bytes``). On a GPU with
  ``-ngl k`` (llama.cpp's rule: the *last* ``k - 1`` blocks plus the output
  layer go to the GPU; ``k = block_count + 1`` offloads everything), the
  offloaded blocks' bytes, plus the output layer (the duplicated
  ``token_embd`` when embeddings are tied) and the non-block tensors when
  ``k >= 1``. The input embedding always stays in host memory.
* **kv**: ``kv_bytes_per_token`` of the offloaded attention layers times the
  total context ``ctx_per_slot * parallel``, plus the fixed recurrent state of
  the offloaded recurrent layers times ``parallel`` (one state per sequence).
* **overhead**: a runtime constant (:data:`GPU_RUNTIME_OVERHEAD` for the
  GPU backend's context and allocator slack, :data:`CPU_RUNTIME_OVERHEAD` on a
  CPU-only host) plus a compute-buffer estimate for one micro-batch of
  ``n_ubatch`` tokens: ``4 * n_ubatch * (vocab_size + 4 * max(n_embd, n_ff))``
  bytes (f32 logits and activations), and without flash attention the KQ
  scores ``4 * n_ubatch * ctx_total * head_count``. This is an estimate:
  llama.cpp's real buffer depends on the backend and graph; it errs high.

Policy: the context per slot is the one requested, or, when none is, the
model's trained context (:data:`DEFAULT_CTX_PER_SLOT` when the file does not say),
as bare llama-server gives it (``-c 0``). ``parallel`` is the one requested, or,
when none is, :data:`AUTO_PARALLEL` slots, fewer when that many do not fit at that
context: a slot's context comes before the number of slots. Keep them if they fit.
Otherwise shrink the context per slot (in steps of :data:`CTX_GRANULARITY` tokens,
never below ``min_ctx_per_slot``, default :data:`MIN_CTX_PER_SLOT`); if even the
floor does not fit on a GPU, reduce the offloaded layers until it does and then give
back as much context as fits with that offload. A requested ``parallel`` is never
changed. When nothing fits, the plan says ``fits=False`` with the smallest
configuration tried and by how much it is over.

A context per slot above the trained context is planned as asked: the plan's
:meth:`EnginePlan.argv` then carries the flags the engine needs to run it
(:func:`gezel_trio.engine.context.extension_flags`), and its reasons warn that the
model was not trained on that many tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from gezel_trio.engine.context import extension_flags
from gezel_trio.engine.gguf_meta import (
    GGUFInfo,
    cache_type_row_bytes,
    kv_bytes_per_token_by_layer,
)
from gezel_trio.engine.units import format_bytes

__all__ = [
    "AUTO_PARALLEL",
    "CPU_RUNTIME_OVERHEAD",
    "CTX_GRANULARITY",
    "DEFAULT_CTX_PER_SLOT",
    "DEFAULT_UBATCH",
    "GPU_RUNTIME_OVERHEAD",
    "MIN_CTX_PER_SLOT",
    "EnginePlan",
    "MemoryCost",
    "compute_buffer_bytes",
    "engine_cost",
    "plan_engine",
]

MIB = 1024**2
GIB = 1024**3
#: GPU backend context, cuBLAS/Vulkan workspaces and allocator slack (estimate).
GPU_RUNTIME_OVERHEAD = 384 * MIB
#: Process and allocator slack on a CPU-only host (estimate).
CPU_RUNTIME_OVERHEAD = 64 * MIB
#: The context-per-slot floor: below this an agentic turn does not fit anyway.
MIN_CTX_PER_SLOT = 512
#: Context is shrunk in steps of this many tokens (llama.cpp pads its cache to 256).
CTX_GRANULARITY = 256
#: Context per slot when neither the request nor the model says one.
DEFAULT_CTX_PER_SLOT = 4096
#: Slots when none are requested (fewer when their context does not fit): two agent
#: requests at once (Claude Code sends its title request beside the turn).
AUTO_PARALLEL = 2
#: llama-server's default micro-batch.
DEFAULT_UBATCH = 512


def _fmt(n: int) -> str:
    return format_bytes(n, "plan")


@dataclass(frozen=True, slots=True)
class MemoryCost:
    """Bytes on the budgeted device, and what stays in host memory (GPU plans)."""

    weight_bytes: int
    kv_bytes: int
    overhead_bytes: int
    host_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.overhead_bytes


@dataclass(frozen=True, slots=True)
class EnginePlan:
    """How to start one engine, and why (``reasons``, for status)."""

    ctx_per_slot: int
    parallel: int
    #: The value for ``-ngl`` (0 on a CPU-only host; ``block_count + 1`` = everything).
    n_gpu_layers: int
    weight_bytes: int
    kv_bytes: int
    overhead_bytes: int
    total_bytes: int
    fits: bool
    reasons: list[str]
    device: Literal["gpu", "cpu"] = "cpu"
    budget_bytes: int = 0
    available_bytes: int = 0
    #: Bytes a GPU plan keeps in host memory (embedding, non-offloaded layers and their KV).
    host_bytes: int = 0
    cache_type: str = "f16"
    recurrent: bool = False
    #: Flags that let the engine run a context above the model's trained one (else empty).
    context_flags: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ctx_total(self) -> int:
        """llama-server's ``--ctx-size``: the context of every slot together."""
        return self.ctx_per_slot * self.parallel

    def argv(self) -> list[str]:
        """The llama-server flags this plan decides."""
        args = [
            "--ctx-size",
            str(self.ctx_total),
            "--parallel",
            str(self.parallel),
            "--n-gpu-layers",
            str(self.n_gpu_layers),
        ]
        if self.cache_type != "f16":
            args += ["--cache-type-k", self.cache_type, "--cache-type-v", self.cache_type]
        return args + list(self.context_flags)

    def as_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "ctx_per_slot": self.ctx_per_slot,
            "ctx_total": self.ctx_total,
            "parallel": self.parallel,
            "n_gpu_layers": self.n_gpu_layers,
            "weight_bytes": self.weight_bytes,
            "kv_bytes": self.kv_bytes,
            "overhead_bytes": self.overhead_bytes,
            "total_bytes": self.total_bytes,
            "host_bytes": self.host_bytes,
            "budget_bytes": self.budget_bytes,
            "available_bytes": self.available_bytes,
            "cache_type": self.cache_type,
            "context_flags": list(self.context_flags),
            "fits": self.fits,
            "reasons": list(self.reasons),
        }


def compute_buffer_bytes(
    info: GGUFInfo, *, ctx_total: int, n_ubatch: int = DEFAULT_UBATCH, flash_attn: bool = True
) -> int:
    """The compute-buffer estimate (see the module docstring)."""
    vocab = info.vocab_size or 0
    width = max(info.embedding_length, info.feed_forward_length or 0)
    buf = 4 * n_ubatch * (vocab + 4 * width)
    if not flash_attn:
        buf += 4 * n_ubatch * ctx_total * info.head_count
    return buf


def engine_cost(
    info: GGUFInfo,
    *,
    ctx_per_slot: int,
    parallel: int,
    n_gpu_layers: int,
    gpu: bool,
    cache_type: str = "f16",
    n_ubatch: int = DEFAULT_UBATCH,
    flash_attn: bool = True,
) -> MemoryCost:
    """Bytes one configuration costs on the budgeted device (and in host memory)."""
    n_layer = info.block_count
    ctx_total = ctx_per_slot * parallel
    kv_layer = kv_bytes_per_token_by_layer(info, cache_type)
    state = info.recurrent_state_bytes_per_layer or 0
    rec_layer = [state if r else 0 for r in info.recurrent_layers]
    compute = compute_buffer_bytes(
        info, ctx_total=ctx_total, n_ubatch=n_ubatch, flash_attn=flash_attn
    )
    all_kv = sum(kv_layer) * ctx_total + sum(rec_layer) * parallel
    if not gpu:
        return MemoryCost(
            weight_bytes=info.tensor_bytes,
            kv_bytes=all_kv,
            overhead_bytes=CPU_RUNTIME_OVERHEAD + compute,
            host_bytes=0,
        )
    k = max(0, min(n_gpu_layers, n_layer + 1))
    n_blocks = max(0, k - 1)
    first = n_layer - n_blocks
    on_gpu = range(first, n_layer)
    weights = sum(info.layer_tensor_bytes[i] for i in on_gpu)
    if k >= 1:
        weights += info.output_gpu_bytes + info.other_bytes
    kv = sum(kv_layer[i] for i in on_gpu) * ctx_total + sum(rec_layer[i] for i in on_gpu) * parallel
    # A tied embedding is duplicated for the output layer: the host keeps its copy.
    duplicated = info.embedding_bytes if (info.tied_embeddings and k >= 1) else 0
    host = info.tensor_bytes - (weights - duplicated) + (all_kv - kv)
    return MemoryCost(
        weight_bytes=weights,
        kv_bytes=kv,
        overhead_bytes=GPU_RUNTIME_OVERHEAD + compute,
        host_bytes=host,
    )


def _largest(lo: int, hi: int, ok: Callable[[int], bool], step: int) -> int | None:
    """Largest c in {lo, multiples of step between, hi} with ok(c); ok is monotone."""
    if ok(hi):
        return hi
    if not ok(lo):
        return None
    a, b = lo // step + 1, (hi - 1) // step  # multiples strictly inside (lo, hi)
    best = lo
    while a <= b:
        mid = (a + b) // 2
        if ok(mid * step):
            best = mid * step
            a = mid + 1
        else:
            b = mid - 1
    return best


def _bind_ngl(fits: Callable[[int, int], bool], ngl: int) -> Callable[[int], bool]:
    return lambda ctx: fits(ctx, ngl)


def plan_engine(
    info: GGUFInfo,
    *,
    budget_bytes: int,
    already_reserved_bytes: int = 0,
    requested_ctx_per_slot: int | None = None,
    requested_parallel: int | None = 1,
    gpu: bool,
    n_gpu_layers: int | None = None,
    cache_type: str = "f16",
    min_ctx_per_slot: int = MIN_CTX_PER_SLOT,
    n_ubatch: int = DEFAULT_UBATCH,
    flash_attn: bool = True,
    fixed: bool = False,
) -> EnginePlan:
    """Plan context, slots and offload for ``info`` within ``budget - already_reserved``.

    ``gpu=False`` plans against RAM with ``n_gpu_layers`` 0. ``n_gpu_layers``
    is the most layers to offload (``None`` or negative: all). ``None`` for
    ``requested_ctx_per_slot`` or ``requested_parallel``: the defaults the module
    docstring describes, with the shrinking policy. ``fixed``: the engine's own flags
    set this context (:func:`gezel_trio.engine.context.slot_request`): it is planned as
    it is, never shrunk or extended (only the offload may give way).
    """
    if requested_parallel is not None and requested_parallel < 1:
        raise ValueError(f"requested_parallel must be >= 1, got {requested_parallel}")
    cache_type_row_bytes(cache_type, 1)  # validates the cache type
    reasons: list[str] = []
    n_layer = info.block_count
    available = max(0, budget_bytes - already_reserved_bytes)
    where = "GPU" if gpu else "RAM"
    budget_line = f"{_fmt(available)} of {where} available"
    if already_reserved_bytes:
        budget_line += (
            f" (budget {_fmt(budget_bytes)} minus {_fmt(already_reserved_bytes)} reserved "
            f"by other engines)"
        )

    parallel = requested_parallel or AUTO_PARALLEL
    ctx_model = info.context_length or None
    if requested_ctx_per_slot is None:
        ctx_req = ctx_model or DEFAULT_CTX_PER_SLOT
    elif requested_ctx_per_slot < 1:
        raise ValueError(f"requested_ctx_per_slot must be >= 1, got {requested_ctx_per_slot}")
    else:
        ctx_req = requested_ctx_per_slot
    floor = ctx_req if fixed else min(min_ctx_per_slot, ctx_req)

    if not gpu:
        max_ngl = 0
    elif n_gpu_layers is None or n_gpu_layers < 0 or n_gpu_layers > n_layer + 1:
        max_ngl = n_layer + 1
    else:
        max_ngl = n_gpu_layers

    def cost(ctx: int, ngl: int) -> MemoryCost:
        return engine_cost(
            info,
            ctx_per_slot=ctx,
            parallel=parallel,
            n_gpu_layers=ngl,
            gpu=gpu,
            cache_type=cache_type,
            n_ubatch=n_ubatch,
            flash_attn=flash_attn,
        )

    def fits(ctx: int, ngl: int) -> bool:
        return cost(ctx, ngl).total_bytes <= available

    if requested_parallel is None:
        # A slot's context before the number of slots: fewer slots, each whole.
        while parallel > 1 and not fits(ctx_req, max_ngl):
            parallel -= 1
        if parallel < AUTO_PARALLEL:
            reasons.append(
                f"{parallel} slot{'s' if parallel > 1 else ''} instead of {AUTO_PARALLEL}: "
                f"{AUTO_PARALLEL} x {ctx_req} tokens do not fit"
            )
    extend = not fixed
    flags = tuple(extension_flags(info.architecture, ctx_model, ctx_req)) if extend else ()
    if fixed and ctx_model and ctx_req > ctx_model:
        reasons.append(
            f"the engine's flags give each slot {ctx_req} tokens of KV; it caps a slot's "
            f"context at the trained {ctx_model}"
        )
    if flags:
        reasons.append(
            f"warning: {ctx_req} tokens per slot is above the model's trained context "
            f"{ctx_model}; the engine runs it with {' '.join(flags)}, and answers past "
            f"{ctx_model} tokens may be worse"
        )

    def layers_text(ngl: int) -> str:
        if ngl >= n_layer + 1:
            return f"all {n_layer} layers and the output offloaded"
        if ngl == 0:
            return "no layer offloaded"
        return f"{ngl - 1} of {n_layer} layers and the output offloaded"

    def make(ctx: int, ngl: int, ok: bool) -> EnginePlan:
        c = cost(ctx, ngl)
        if info.recurrent and parallel > 1:
            reasons.append(
                f"{info.architecture} keeps recurrent state: llama.cpp is known to mix "
                f"sequences that share a batch for such models; parallel={parallel} kept "
                f"as requested"
            )
        return EnginePlan(
            ctx_per_slot=ctx,
            parallel=parallel,
            n_gpu_layers=ngl,
            weight_bytes=c.weight_bytes,
            kv_bytes=c.kv_bytes,
            overhead_bytes=c.overhead_bytes,
            total_bytes=c.total_bytes,
            fits=ok,
            reasons=reasons,
            device="gpu" if gpu else "cpu",
            budget_bytes=budget_bytes,
            available_bytes=available,
            host_bytes=c.host_bytes,
            cache_type=cache_type,
            recurrent=info.recurrent,
            context_flags=tuple(extension_flags(info.architecture, ctx_model, ctx))
            if extend
            else (),
        )

    def summary(ctx: int, ngl: int) -> str:
        c = cost(ctx, ngl)
        text = (
            f"{parallel} x {ctx} tokens needs {_fmt(c.total_bytes)} (weights "
            f"{_fmt(c.weight_bytes)}, KV {_fmt(c.kv_bytes)}, overhead {_fmt(c.overhead_bytes)})"
        )
        return text + (f", {layers_text(ngl)}" if gpu else "")

    # 1. As requested (or by default).
    if fits(ctx_req, max_ngl):
        asked = requested_ctx_per_slot is not None or requested_parallel is not None
        how = "as requested" if asked else "by default (the trained context)"
        reasons.append(f"{how}: {summary(ctx_req, max_ngl)}; {budget_line}")
        return make(ctx_req, max_ngl, True)

    # 2. Shrink the context per slot, down to the floor.
    ctx = _largest(floor, ctx_req, lambda c: fits(c, max_ngl), CTX_GRANULARITY)
    if ctx is not None:
        reasons.append(
            f"context per slot shrunk from {ctx_req} to {ctx} tokens to fit: "
            f"{summary(ctx, max_ngl)}; {budget_line}"
        )
        return make(ctx, max_ngl, True)

    # 3. GPU: fewer offloaded layers at the floor, then give context back.
    if gpu:
        for ngl in range(max_ngl - 1, -1, -1):
            if fits(floor, ngl):
                best = _largest(floor, ctx_req, _bind_ngl(fits, ngl), CTX_GRANULARITY)
                assert best is not None
                reasons.append(
                    f"{parallel} x {floor} tokens does not fit with "
                    f"{layers_text(max_ngl)}: offload reduced to {ngl} (-ngl)"
                )
                if best < ctx_req:
                    reasons.append(f"context per slot shrunk from {ctx_req} to {best} tokens")
                reasons.append(f"plan: {summary(best, ngl)}; {budget_line}")
                return make(best, ngl, True)

    # 4. Nothing fits.
    last_ngl = 0 if gpu else max_ngl
    c = cost(floor, last_ngl)
    reasons.append(
        f"does not fit: even {summary(floor, last_ngl)}, {_fmt(c.total_bytes - available)} "
        f"more than the {budget_line}"
    )
    return make(floor, last_ngl, False)
