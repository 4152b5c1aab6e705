"""Build a llama-server command line from a model profile.

The host's defaults come first and the user's ``args`` last: llama-server's
parser lets the last occurrence of a flag win, so the user's choice always
does. :func:`last_arg_value` reads back what will take effect.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

# Flags the host must own: it connects to the engine on this host and port.
_RESERVED = {"--host": "host", "--port": "port"}
# llama-server's RAM prompt cache is one cache for every session of the engine: a request
# whose prompt shares a prefix with another session's cached prompt is given that KV,
# even on a slot the host has just erased (measured: 600 of 600 shared tokens came back
# after an erase). The host turns it off and parks each session's KV in its own store.
_CACHE_RAM = ("--cache-ram", "-cram")
_ALIASES: dict[str, tuple[str, ...]] = {
    "--parallel": ("--parallel", "-np"),
    "--ctx-size": ("--ctx-size", "-c"),
    "--slot-save-path": ("--slot-save-path",),
    "--n-gpu-layers": ("--n-gpu-layers", "-ngl", "--gpu-layers"),
    "--cache-type-k": ("--cache-type-k", "-ctk"),
    "--cache-type-v": ("--cache-type-v", "-ctv"),
    "--batch-size": ("--batch-size", "-b"),
    "--ubatch-size": ("--ubatch-size", "-ub"),
    "--tensor-split": ("--tensor-split", "-ts"),
    "--device": ("--device", "-dev"),
}

DEFAULT_UBATCH = 512
"""llama-server's physical batch (``--ubatch-size``) when no flag sets it."""

# Flags that shape the KV cache, so decide whether a saved slot file loads again.
_KV_VALUE_FLAGS = ("--cache-type-k", "--cache-type-v")
_KV_SWITCHES = {
    "--swa-full": (("--swa-full",), ()),
    "--kv-unified": (("--kv-unified", "-kvu"), ("--no-kv-unified", "-no-kvu")),
}
_FLASH_ATTN = ("--flash-attn", "-fa")


def last_arg_value(args: Sequence[str], flag: str) -> str | None:
    """The value of the last occurrence of ``flag`` (or an alias), as llama-server reads it."""
    names = _ALIASES.get(flag, (flag,))
    value: str | None = None
    for i, arg in enumerate(args):
        if arg in names and i + 1 < len(args):
            value = args[i + 1]
        else:
            for name in names:
                if name.startswith("--") and arg.startswith(name + "="):
                    value = arg.split("=", 1)[1]
    return value


def context_shift(args: Sequence[str]) -> bool:
    """Whether llama-server runs with context shift (``--context-shift``; off by default
    on b10435, and the last of ``--context-shift``/``--no-context-shift`` wins):
    with it, a slot that fills up drops old tokens and generates on; without it,
    generation stops when the slot is full."""
    on = False
    for arg in args:
        if arg == "--context-shift":
            on = True
        elif arg == "--no-context-shift":
            on = False
    return on


def kv_shape_flags(args: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """The KV-shaping flags of an argv as the engine reads them (last occurrence wins;
    absent flags read as ``default``): cache types, flash attention, full-size SWA
    cache and the unified KV buffer. A saved slot file is loaded only by an engine
    whose flags are equal."""
    out = {flag: last_arg_value(args, flag) or "default" for flag in _KV_VALUE_FLAGS}
    for flag, (on, off) in _KV_SWITCHES.items():
        value = "default"
        for arg in args:
            if arg in on:
                value = "on"
            elif arg in off:
                value = "off"
        out[flag] = value
    fa = "default"
    for i, arg in enumerate(args):
        if arg in _FLASH_ATTN:
            nxt = args[i + 1] if i + 1 < len(args) else ""
            fa = nxt if nxt in ("on", "off", "auto") else "on"
        elif arg.startswith("--flash-attn="):
            fa = arg.split("=", 1)[1]
    out["--flash-attn"] = fa
    return tuple(sorted(out.items()))


def arg_problems(args: Sequence[str]) -> list[str]:
    """What the host refuses in one list of engine flags (a model's ``args`` or
    ``engine.extra_args``), one line each, unlabelled: ``--host``/``--port`` (the host
    chooses them), ``--cache-ram`` (see above), and ``--parallel``/``--ctx-size`` that are
    not whole numbers or a ``--parallel`` below 1. Whether the engine knows a flag at all
    is for its own parser (:mod:`gezel_trio.engine.flags`)."""
    out: list[str] = []
    for flag, what in _RESERVED.items():
        if any(a == flag or a.startswith(flag + "=") for a in args):
            out.append(f"{flag} is chosen by the host (it needs to know the {what}); remove it")
    if any(a in _CACHE_RAM or a.startswith("--cache-ram=") for a in args):
        out.append(
            "--cache-ram is chosen by the host. llama-server's RAM prompt cache "
            "is shared by every session of an engine and hands one session's KV to "
            "another whose prompt shares a prefix, even after an erase; the host keeps it "
            "off and parks each session's KV in its own store instead. Remove it (size "
            "that store with [scheduler] kv_store_bytes)"
        )
    for flag in ("--parallel", "--ctx-size"):
        value = last_arg_value(args, flag)
        if value is None:
            continue
        try:
            number = int(value)
        except ValueError:
            out.append(f"{flag} needs a whole number, got {value!r}")
            continue
        if flag == "--parallel" and number < 1:
            out.append("--parallel must be at least 1 (the host schedules slots)")
    return out


def batch_flags(args: Sequence[str]) -> list[str]:
    """``--batch-size`` equal to the physical batch that ``args`` (the engine's other
    flags) give, :data:`DEFAULT_UBATCH` when they give none; nothing when they set
    ``--batch-size`` themselves or spread the model over several devices.

    llama-server runs its queue (a new request, a slot save, restore or erase, ``/slots``)
    between two decode calls only, and one call takes up to ``--batch-size`` tokens of
    prompt (2,048 by default), computed ``--ubatch-size`` (512) at a time: a handoff's
    slot calls waited for up to four pieces of another slot's prefill (measured on
    SmolLM2 on 2 CPU cores: an erase during a 1,900-token prefill answered after the
    whole 8 s of it; after 1.8 s with the two equal, the prefill as fast). On several
    devices the pieces of one call run as a pipeline across them, which this would
    stop: there the engine's default stays."""
    if last_arg_value(args, "--batch-size") is not None or _several_devices(args):
        return []
    return ["--batch-size", last_arg_value(args, "--ubatch-size") or str(DEFAULT_UBATCH)]


def _several_devices(args: Sequence[str]) -> bool:
    """Whether ``args`` spread the model over more than one device: a tensor split, RPC
    workers, or a ``--device`` list of more than one."""
    if any(last_arg_value(args, flag) is not None for flag in ("--tensor-split", "--rpc")):
        return True
    devices = last_arg_value(args, "--device")
    return devices is not None and "," in devices


def without_cache_ram(args: Sequence[str]) -> list[str]:
    """``args`` less any ``--cache-ram N`` (``-cram N``, ``--cache-ram=N``): the flag the
    host owns (see above), dropped from flags meant for an engine the host runs."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg in _CACHE_RAM:
            skip = True
            continue
        if arg.startswith("--cache-ram="):
            continue
        out.append(arg)
    return out


def server_argv(
    binary: Path | str,
    *,
    serves: Sequence[str],
    host: str,
    port: int,
    parallel: int,
    ctx_total: int,
    short: bool = False,
) -> list[str]:
    """The part of every llama-server command line: the binary, what it serves
    (:func:`model_flags`, or a router's ``--models-dir``), where it listens and its
    slots: ``--parallel`` slots sharing ``ctx_total`` tokens of context. ``short``
    spells the context flag ``-c``, as one types it by hand (the benchmark's plain
    targets)."""
    return [
        str(binary),
        *serves,
        "--host",
        host,
        "--port",
        str(port),
        "--parallel",
        str(parallel),
        "-c" if short else "--ctx-size",
        str(ctx_total),
    ]


def model_flags(model_path: str, *, short: bool = False) -> list[str]:
    """The flags that name the model file (``--model``; ``-m`` when ``short``)."""
    return ["-m" if short else "--model", model_path]


@dataclass(frozen=True)
class LaunchProfile:
    """The effective shape of an engine, read back from its final argv."""

    argv: tuple[str, ...]
    parallel: int
    ctx_total: int

    @property
    def ctx_per_slot(self) -> int:
        return self.ctx_total // max(1, self.parallel)


def build_argv(
    *,
    binary: Path,
    model_path: str,
    port: int,
    parallel: int,
    ctx_per_slot: int,
    slot_save_dir: Path,
    host_args: Sequence[str] = (),
    user_args: Sequence[str] = (),
    n_gpu_layers: int | None = None,
    embeddings: bool = False,
    reranking: bool = False,
    alias: str | None = None,
    rpc: Sequence[str] = (),
) -> LaunchProfile:
    """The full argv. Raises :class:`ConfigError` naming the first of :func:`arg_problems`
    in ``user_args`` (``models.args``), then in ``host_args`` (``engine.extra_args``).

    ``alias`` (the model id) is what the engine names its model in responses.
    """
    for where, args in (("models.args", user_args), ("engine.extra_args", host_args)):
        problems = arg_problems(args)
        if problems:
            raise ConfigError(f"{where}: {problems[0]}", detail=[f"{where}: {p}" for p in problems])
    argv = server_argv(
        binary,
        serves=model_flags(model_path),
        host="127.0.0.1",
        port=port,
        parallel=parallel,
        ctx_total=ctx_per_slot * parallel,
    )
    argv += [
        "--slot-save-path",
        str(slot_save_dir),
        "--metrics",
        "--no-webui",
        "--cache-ram",
        "0",
    ]
    if alias is not None:
        argv += ["--alias", alias]
    if n_gpu_layers is not None:
        argv += ["--n-gpu-layers", str(n_gpu_layers)]
    if embeddings:
        argv += ["--embeddings"]
    if reranking:
        argv += ["--reranking"]
    if rpc:
        argv += ["--rpc", ",".join(rpc)]
    argv += batch_flags([*argv, *host_args, *user_args])
    argv += list(host_args)
    argv += list(user_args)
    try:
        eff_parallel = int(last_arg_value(argv, "--parallel") or parallel)
        eff_ctx = int(last_arg_value(argv, "--ctx-size") or ctx_per_slot * parallel)
    except ValueError as exc:
        raise ConfigError(f"models.args: --parallel and --ctx-size need integers ({exc})") from exc
    if eff_parallel < 1:
        raise ConfigError("models.args: --parallel must be at least 1 (the host schedules slots)")
    return LaunchProfile(argv=tuple(argv), parallel=eff_parallel, ctx_total=eff_ctx)
