"""The demo image model's generator: deterministic files whose tensors have the names and
shapes stable-diffusion.cpp detects and sizes FLUX.2 [klein], Qwen3 and TAEF2 by.
(That sd-server renders it is tests/test_image_engine.py.)"""

from __future__ import annotations

import shlex
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from gezel_trio.cli.main import main
from gezel_trio.engine import demo_image_model
from gezel_trio.engine.demo_image_model import (
    DEMO_IMAGE_MODEL_FORMAT_VERSION,
    LLM_HIDDEN,
    LLM_VOCAB,
    DemoImageModel,
    demo_image_model_path,
    write_demo_image_model,
)

from .gguf_tools import sha256_of


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> DemoImageModel:
    return write_demo_image_model(tmp_path_factory.mktemp("image"), seed=0)


def _shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape in torch's order (GGUF stores ggml's, reversed)."""
    return {t.name: tuple(int(n) for n in reversed(t.shape)) for t in GGUFReader(path).tensors}


def test_same_seed_gives_identical_files(tmp_path: Path, model: DemoImageModel) -> None:
    again = write_demo_image_model(tmp_path / "again", seed=0)
    other = write_demo_image_model(tmp_path / "other", seed=1)
    for a, b, c in zip(model.paths(), again.paths(), other.paths(), strict=True):
        assert a.name == b.name == c.name
        assert sha256_of(a) == sha256_of(b)
        assert sha256_of(a) != sha256_of(c)
    # written atomically: no temporary files are left beside them
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == [
        "diffusion_model.gguf",
        "llm.gguf",
        "vae.gguf",
    ]


def test_the_dit_is_flux2_klein_shaped(model: DemoImageModel) -> None:
    dit = _shapes(model.diffusion_model)
    # sd.cpp: FLUX.2 by this tensor, klein by the absence of single_blocks.47
    assert "double_stream_modulation_img.lin.weight" in dit
    assert not any(name.startswith("single_blocks.47.") for name in dit)
    assert not any(name.endswith(".bias") for name in dit)  # FLUX.2 has no biases
    # sized from the tensors: the text width, hidden size and head size (fixed at 128)
    hidden, text_width = dit["txt_in.weight"]
    assert text_width == LLM_HIDDEN and hidden == 128
    assert dit["double_blocks.0.txt_attn.norm.key_norm.scale"] == (128,)
    assert dit["img_in.weight"] == (hidden, 128)  # 32 latent channels, patchified 2x2
    assert dit["final_layer.linear.weight"] == (128, hidden)


def test_the_text_encoder_covers_the_tokenizers_vocabulary(model: DemoImageModel) -> None:
    llm = _shapes(model.llm)
    assert llm["model.embed_tokens.weight"] == (LLM_VOCAB, LLM_HIDDEN)
    assert LLM_VOCAB > 151_668  # Qwen3's highest special token, </think>
    assert llm["model.layers.0.self_attn.q_proj.weight"] == (32 * 128, LLM_HIDDEN)
    assert llm["model.layers.0.self_attn.k_proj.weight"] == (8 * 128, LLM_HIDDEN)
    assert llm["model.layers.0.self_attn.q_norm.weight"] == (128,)
    assert "model.norm.weight" in llm


def test_the_autoencoder_is_taef2_with_encoder_and_decoder(model: DemoImageModel) -> None:
    tae = _shapes(model.vae)
    assert tae["decoder.layers.0.weight"] == (64, 32, 3, 3)  # from 32 latent channels
    assert tae["decoder.layers.18.weight"] == (3, 64, 3, 3)  # to RGB
    assert tae["encoder.layers.0.weight"] == (64, 3, 3, 3)
    assert tae["encoder.layers.14.weight"] == (32, 64, 3, 3)
    assert tae["decoder.layers.2.pool.1.weight"] == (256,)  # TAEF2's mid-block group norm
    assert "decoder.layers.6.bias" not in tae  # the post-upsample convs have none
    conv = GGUFReader(model.vae).get_tensor(0)
    assert conv.data.dtype == np.float16  # sd.cpp holds conv kernels in f16


def test_weights_are_finite_and_scaled_by_fan_in(model: DemoImageModel) -> None:
    for path in model.paths():
        for tensor in GGUFReader(path).tensors:
            data = np.asarray(tensor.data, dtype=np.float32)
            assert np.isfinite(data).all(), tensor.name
            assert float(np.abs(data).max()) < 10.0, tensor.name


def test_demo_image_model_path_generates_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    model = demo_image_model_path()
    folder = tmp_path / "xdg" / "gezel-trio" / "models"
    assert model.llm.parent == folder / f"gezel-demo-image-v{DEMO_IMAGE_MODEL_FORMAT_VERSION}"
    assert all(p.is_file() for p in model.paths())

    def boom(*args: object, **kwargs: object) -> DemoImageModel:
        raise AssertionError("regenerated an existing model")

    monkeypatch.setattr(demo_image_model, "write_demo_image_model", boom)
    assert demo_image_model_path() == model
    model.vae.unlink()  # an incomplete set is written again
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo_image_model_path().vae.is_file()


def test_make_model_kind_image_prints_sd_servers_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["make-model", "--kind", "image", "--seed", "3", "--out", str(tmp_path)]) == 0
    argv = shlex.split(capsys.readouterr().out)
    assert argv == [
        "--diffusion-model",
        str(tmp_path / "diffusion_model.gguf"),
        "--llm",
        str(tmp_path / "llm.gguf"),
        "--taesd",
        str(tmp_path / "vae.gguf"),
    ]
    ref = write_demo_image_model(tmp_path / "ref", seed=3)
    assert sha256_of(tmp_path / "llm.gguf") == sha256_of(ref.llm)
