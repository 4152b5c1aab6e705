"""A deterministic random-weight image model that a real ``sd-server`` loads and renders.

The image counterpart of :mod:`gezel_trio.engine.demo_model`: a model of the right
shape exercises the image engine (text encoding, sampling, decoding, PNG encoding)
without a download, and renders a small image in seconds on a CPU. It is three GGUF
files, the "diffusion model with its text encoder and VAE" form sd-server takes:

- ``diffusion_model``: a FLUX.2 [klein]-shaped DiT (``--diffusion-model``).
  stable-diffusion.cpp recognises FLUX.2 by ``double_stream_modulation_img`` and
  tells klein from the full model by the absence of ``single_blocks.47``; it reads the
  depth, hidden size and text width from the tensors, so one double block and one
  single block of width 128 (one head: the rope axes fix ``head_dim`` at 128) suffice.
- ``llm``: a Qwen3-shaped text encoder (``--llm``) with one layer. The tokenizer is
  built into sd-server (Qwen2's), so only ``embed_tokens`` must span its vocabulary;
  the head counts are fixed by the architecture, the hidden size is read from the
  embedding. With one layer no FLUX.2 output layer exists, so the encoder's final
  norm is the text embedding, of the hidden size the DiT's ``txt_in`` expects.
- ``vae``: a FLUX.2 tiny autoencoder, TAEF2 (``--taesd``), encoder and decoder
  (sd-server loads the encoder too, for img2img). Its widths are fixed (64 channels);
  it is about 3 MB.

The weights are drawn from ``numpy.random.default_rng(seed)`` with a fan-in scale, so
activations stay finite and the picture is noise with structure, not a constant. The
same seed gives byte-identical files.

Everything here is synchronous file I/O; call it from Trio through
``trio.to_thread.run_sync``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from .demo_model import default_model_cache_dir, write_gguf

__all__ = [
    "DEMO_IMAGE_MODEL_FORMAT_VERSION",
    "DemoImageModel",
    "demo_image_model_path",
    "write_demo_image_model",
]

#: Bumped whenever the generator's output changes, so cached files are regenerated.
DEMO_IMAGE_MODEL_FORMAT_VERSION = 1

#: The DiT's width: FLUX.2's rope axes (4 x 32) fix the head size at 128; one head.
DIT_HIDDEN = 128
DIT_MLP = 3 * DIT_HIDDEN  # FLUX.2's mlp_ratio 3
LATENT_CHANNELS = 128  # FLUX.2's 32 latent channels, patchified 2x2
TIMESTEP_DIM = 256

#: The text encoder: Qwen3's vocabulary (the tokenizer is sd-server's own) and fixed heads.
LLM_VOCAB = 151_936
LLM_HIDDEN = 32
LLM_MLP = 64
LLM_HEAD_DIM = 128
LLM_HEADS = 32  # sd.cpp's Qwen3 text encoder: 32 query heads unless it has 28 layers
LLM_KV_HEADS = 8

TAE_CHANNELS = 64
TAE_Z_CHANNELS = 32  # TAEF2: FLUX.2's latent channels before patchifying


@dataclass(frozen=True)
class DemoImageModel:
    """The three files of a demo image model."""

    diffusion_model: Path
    llm: Path
    vae: Path

    def server_args(self) -> list[str]:
        """The sd-server (or sd-cli) flags that load this model."""
        return [
            "--diffusion-model",
            str(self.diffusion_model),
            "--llm",
            str(self.llm),
            "--taesd",
            str(self.vae),
        ]

    def paths(self) -> tuple[Path, Path, Path]:
        return self.diffusion_model, self.llm, self.vae


class _Tensors:
    """Adds tensors to a writer with weights drawn from one generator."""

    def __init__(self, writer: GGUFWriter, rng: np.random.Generator) -> None:
        self._writer = writer
        self._rng = rng

    def normal(self, name: str, shape: tuple[int, ...], *, f16: bool = False) -> None:
        """A weight in torch's layout (``[out, in, ...]``), scaled by 1/sqrt(fan-in)."""
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
        data = self._rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)
        self._writer.add_tensor(name, data.astype(np.float16 if f16 else np.float32))

    def linear(self, name: str, out_dim: int, in_dim: int, *, bias: bool = False) -> None:
        self.normal(f"{name}.weight", (out_dim, in_dim))
        if bias:
            self.zeros(f"{name}.bias", out_dim)

    def conv(self, name: str, out_ch: int, in_ch: int, k: int, *, bias: bool = True) -> None:
        # sd.cpp holds every conv kernel in f16
        self.normal(f"{name}.weight", (out_ch, in_ch, k, k), f16=True)
        if bias:
            self.zeros(f"{name}.bias", out_ch)

    def ones(self, name: str, n: int) -> None:
        self._writer.add_tensor(name, np.ones(n, dtype=np.float32))

    def zeros(self, name: str, n: int) -> None:
        self._writer.add_tensor(name, np.zeros(n, dtype=np.float32))


def _dit(t: _Tensors) -> None:
    """FLUX.2 [klein]'s DiT, original (BFL) tensor names, no biases (FLUX.2 has none)."""
    h, mlp = DIT_HIDDEN, DIT_MLP
    t.linear("img_in", h, LATENT_CHANNELS)
    t.linear("txt_in", h, LLM_HIDDEN)
    t.linear("time_in.in_layer", h, TIMESTEP_DIM)
    t.linear("time_in.out_layer", h, h)
    t.linear("double_stream_modulation_img.lin", 6 * h, h)
    t.linear("double_stream_modulation_txt.lin", 6 * h, h)
    t.linear("single_stream_modulation.lin", 3 * h, h)
    for stream in ("img", "txt"):
        block = f"double_blocks.0.{stream}"
        t.linear(f"{block}_attn.qkv", 3 * h, h)
        t.ones(f"{block}_attn.norm.query_norm.scale", h)
        t.ones(f"{block}_attn.norm.key_norm.scale", h)  # its length is the head size
        t.linear(f"{block}_attn.proj", h, h)
        t.linear(f"{block}_mlp.0", 2 * mlp, h)  # SiLU-gated
        t.linear(f"{block}_mlp.2", h, mlp)
    t.linear("single_blocks.0.linear1", 3 * h + 2 * mlp, h)
    t.linear("single_blocks.0.linear2", h, h + mlp)
    t.ones("single_blocks.0.norm.query_norm.scale", h)
    t.ones("single_blocks.0.norm.key_norm.scale", h)
    t.linear("final_layer.adaLN_modulation.1", 2 * h, h)
    t.linear("final_layer.linear", LATENT_CHANNELS, h)


def _llm(t: _Tensors) -> None:
    """A one-layer Qwen3 text model, Hugging Face tensor names."""
    d = LLM_HIDDEN
    t.normal("model.embed_tokens.weight", (LLM_VOCAB, d), f16=True)
    layer = "model.layers.0"
    t.ones(f"{layer}.input_layernorm.weight", d)
    t.ones(f"{layer}.post_attention_layernorm.weight", d)
    t.linear(f"{layer}.self_attn.q_proj", LLM_HEADS * LLM_HEAD_DIM, d)
    t.linear(f"{layer}.self_attn.k_proj", LLM_KV_HEADS * LLM_HEAD_DIM, d)
    t.linear(f"{layer}.self_attn.v_proj", LLM_KV_HEADS * LLM_HEAD_DIM, d)
    t.linear(f"{layer}.self_attn.o_proj", d, LLM_HEADS * LLM_HEAD_DIM)
    t.ones(f"{layer}.self_attn.q_norm.weight", LLM_HEAD_DIM)
    t.ones(f"{layer}.self_attn.k_norm.weight", LLM_HEAD_DIM)
    t.linear(f"{layer}.mlp.gate_proj", LLM_MLP, d)
    t.linear(f"{layer}.mlp.up_proj", LLM_MLP, d)
    t.linear(f"{layer}.mlp.down_proj", d, LLM_MLP)
    t.ones("model.norm.weight", d)


def _tae_block(t: _Tensors, name: str, *, midblock_gn: bool = False) -> None:
    c = TAE_CHANNELS
    for i in (0, 2, 4):
        t.conv(f"{name}.conv.{i}", c, c, 3)
    if midblock_gn:
        t.conv(f"{name}.pool.0", 4 * c, c, 1, bias=False)
        t.ones(f"{name}.pool.1.weight", 4 * c)
        t.zeros(f"{name}.pool.1.bias", 4 * c)
        t.conv(f"{name}.pool.3", c, 4 * c, 1, bias=False)


def _tae(t: _Tensors) -> None:
    """TAEF2 (taesd's layout with FLUX.2's 32 latent channels and mid-block group norms)."""
    c, z = TAE_CHANNELS, TAE_Z_CHANNELS
    enc = "encoder.layers"
    t.conv(f"{enc}.0", c, 3, 3)
    _tae_block(t, f"{enc}.1")
    index = 2
    for stage in range(3):
        t.conv(f"{enc}.{index}", c, c, 3, bias=False)  # stride 2
        for i in range(1, 4):
            _tae_block(t, f"{enc}.{index + i}", midblock_gn=stage == 2)
        index += 4
    t.conv(f"{enc}.{index}", z, c, 3)

    dec = "decoder.layers"
    t.conv(f"{dec}.0", c, z, 3)  # then a ReLU (index 1)
    for i in (2, 3, 4):
        _tae_block(t, f"{dec}.{i}", midblock_gn=True)
    for first in (6, 11, 16):  # each after an upsample
        t.conv(f"{dec}.{first}", c, c, 3, bias=False)
        if first < 16:
            for i in range(1, 4):
                _tae_block(t, f"{dec}.{first + i}")
    _tae_block(t, f"{dec}.17")
    t.conv(f"{dec}.18", 3, c, 3)


_PARTS: dict[str, Callable[[_Tensors], None]] = {"diffusion_model": _dit, "llm": _llm, "vae": _tae}


def _write_part(
    writer: GGUFWriter, *, part: str, build: Callable[[_Tensors], None], seed: int, stream: int
) -> None:
    writer.add_name(f"gezel-trio demo image {part} seed {seed}")
    build(_Tensors(writer, np.random.default_rng([seed, stream])))


def write_demo_image_model(directory: Path, *, seed: int = 0) -> DemoImageModel:
    """Write the three files of a random-weight image model into ``directory``.

    Deterministic: the same seed gives byte-identical files. Each file is written beside
    its final name and renamed over it, so readers only ever see complete files.
    """
    directory = Path(directory)
    paths: dict[str, Path] = {}
    for i, (part, build) in enumerate(_PARTS.items()):
        add = partial(_write_part, part=part, build=build, seed=seed, stream=i)
        paths[part] = write_gguf(directory / f"{part}.gguf", "gezel-demo-image", add)
    return DemoImageModel(**paths)


def demo_image_model_path(*, cache_dir: Path | None = None) -> DemoImageModel:
    """The demo image model (seed 0), generated into the cache dir on first use.

    Cheap when the files exist. The folder name carries
    :data:`DEMO_IMAGE_MODEL_FORMAT_VERSION`, so a generator change regenerates it.
    """
    base = default_model_cache_dir() if cache_dir is None else Path(cache_dir)
    directory = base / f"gezel-demo-image-v{DEMO_IMAGE_MODEL_FORMAT_VERSION}"
    model = DemoImageModel(*(directory / f"{part}.gguf" for part in _PARTS))
    if not all(p.is_file() for p in model.paths()):
        model = write_demo_image_model(directory, seed=0)
    return model
