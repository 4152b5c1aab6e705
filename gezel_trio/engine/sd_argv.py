"""The image engine's command line: sd-server's model-file flags and the argv of one start.

Plain functions (only :func:`sd_footprint` reads the file system: a stat per file).
A ``[[models]]`` entry of ``kind = "image"`` names its files in a ``files`` table
whose keys are sd-server's flag names with ``_`` for ``-`` (``diffusion_model``
is ``--diffusion-model``), or one full model file as ``path`` (``--model``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

__all__ = ["SD_COMPUTE_BYTES", "SD_FILE_FLAGS", "sd_argv", "sd_file_args", "sd_footprint"]

SD_COMPUTE_BYTES = 512 * 1024**2
"""What sd-server needs beside its weights (compute buffers, latents, the decoded image)
in the estimate a reservation is made from."""

SD_FILE_FLAGS: Mapping[str, str] = {
    "model": "--model",
    "diffusion_model": "--diffusion-model",
    "high_noise_diffusion_model": "--high-noise-diffusion-model",
    "clip_l": "--clip_l",
    "clip_g": "--clip_g",
    "clip_vision": "--clip_vision",
    "t5xxl": "--t5xxl",
    "llm": "--llm",
    "llm_vision": "--llm_vision",
    "vae": "--vae",
    "taesd": "--taesd",
    "control_net": "--control-net",
    "photo_maker": "--photo-maker",
    "upscale_model": "--upscale-model",
}
"""sd-server's flags that name one model file, by their ``files`` key (sd-server 0.4.7's
``--help``; ``clip_l`` and its kin are spelled with ``_`` there too)."""


def sd_file_args(files: Mapping[str, str], path: str | None = None) -> list[str]:
    """The flags that load a model: ``--model path``, then each of ``files`` in
    :data:`SD_FILE_FLAGS`'s order. An unknown key raises KeyError (the config's
    validation refuses it first)."""
    out = ["--model", path] if path else []
    for key in SD_FILE_FLAGS:
        if key in files:
            out += [SD_FILE_FLAGS[key], files[key]]
    unknown = set(files) - set(SD_FILE_FLAGS)
    if unknown:
        raise KeyError(", ".join(sorted(unknown)))
    return out


def sd_argv(
    binary: str,
    *,
    files: Mapping[str, str],
    path: str | None,
    port: int,
    user_args: Sequence[str] = (),
) -> list[str]:
    """sd-server's argv: its model files, loopback on ``port``, then the model's own
    ``args`` (sd-server reads the last occurrence of a flag)."""
    return [
        binary,
        *sd_file_args(files, path),
        "--listen-ip",
        "127.0.0.1",
        "--listen-port",
        str(port),
        *user_args,
    ]


def sd_footprint(files: Mapping[str, str], path: str | None = None) -> int:
    """The bytes an sd-server with these model files is estimated to hold: the files'
    sizes plus a quarter for the weights' working copies, plus :data:`SD_COMPUTE_BYTES`.
    A file that cannot be read counts 0 (the engine's start then says why)."""
    total = 0
    for file in [*files.values(), *([path] if path else [])]:
        try:
            total += os.stat(os.path.expanduser(file)).st_size
        except OSError:
            continue
    return total + total // 4 + SD_COMPUTE_BYTES
