from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES

from gezel_trio.engine.arch import (
    HYBRID_ARCHITECTURES,
    PURE_RECURRENT_ARCHITECTURES,
    RECURRENT_ARCHITECTURES,
    keeps_recurrent_state,
)
from gezel_trio.engine.demo_model import write_demo_model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("arch")
    return {
        a: write_demo_model(d / f"{a}.gguf", size="tiny", arch=a)
        for a in ("llama", "mamba", "qwen35")
    }


def test_list_names_the_upstream_recurrent_and_hybrid_architectures() -> None:
    expected = {
        "mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7", "lfm2", "lfm2moe",
        "qwen3next", "qwen35", "qwen35moe", "jamba", "falcon-h1", "granitehybrid",
        "nemotron_h", "nemotron_h_moe", "plamo2", "kimi-linear",
    }  # fmt: skip
    assert expected <= RECURRENT_ARCHITECTURES
    assert PURE_RECURRENT_ARCHITECTURES.isdisjoint(HYBRID_ARCHITECTURES)
    assert not {"llama", "qwen3", "qwen2", "gemma3", "mistral3"} & RECURRENT_ARCHITECTURES


def test_list_agrees_with_the_gguf_package_tensor_map() -> None:
    """Every architecture whose tensors include recurrent ones is listed, and spelled right."""
    recurrent_tensor = re.compile(r"^blk\.\{bid\}\.(ssm_|time_mix_|channel_mix_|shortconv\.)")
    with_state = {
        MODEL_ARCH_NAMES[arch]
        for arch, tensors in MODEL_TENSORS.items()
        if any(recurrent_tensor.match(TENSOR_NAMES[t]) for t in tensors)
    }
    assert with_state <= RECURRENT_ARCHITECTURES
    # Names the installed gguf package does not know yet must be upstream-only additions.
    assert RECURRENT_ARCHITECTURES - set(MODEL_ARCH_NAMES.values()) <= {"deepseek4"}


def test_generated_models(models: dict[str, Path]) -> None:
    llama = keeps_recurrent_state(models["llama"])
    assert (llama.recurrent, llama.architecture) == (False, "llama")
    mamba = keeps_recurrent_state(models["mamba"])
    assert (mamba.recurrent, mamba.architecture) == (True, "mamba")
    assert "recurrent" in mamba.reason
    hybrid = keeps_recurrent_state(str(models["qwen35"]))
    assert (hybrid.recurrent, hybrid.architecture) == (True, "qwen35")
    assert "hybrid" in hybrid.reason


@pytest.mark.parametrize(
    ("metadata", "tensors", "recurrent", "why"),
    [
        ({"general.architecture": "lfm2"}, [], True, "hybrid"),
        ({"general.architecture": "rwkv7"}, [], True, "recurrent"),
        ({"general.architecture": "newmamba", "newmamba.ssm.state_size": 16}, [], True, "ssm"),
        ({"general.architecture": "x", "x.wkv.head_size": 64}, [], True, "wkv"),
        ({"general.architecture": "x", "x.shortconv.l_cache": 3}, [], True, "shortconv"),
        ({"general.architecture": "x"}, ["blk.3.ssm_conv1d.weight"], True, "ssm_conv1d"),
        ({"general.architecture": "x"}, ["blk.0.time_mix_key.weight"], True, "time_mix"),
        ({"general.architecture": "llama"}, ["blk.0.attn_q.weight"], False, "no recurrent"),
        ({"general.architecture": "llama", "llama.context_length": 4096}, [], False, "llama"),
        ({}, [], False, "no general.architecture"),
    ],
)
def test_metadata_and_tensor_detection(
    metadata: dict[str, object], tensors: list[str], recurrent: bool, why: str
) -> None:
    verdict = keeps_recurrent_state(metadata, tensor_names=tensors)
    assert verdict.recurrent is recurrent
    assert why in verdict.reason
    assert verdict.architecture == metadata.get("general.architecture", "")


def test_unknown_architecture_file_with_ssm_tensors(tmp_path: Path) -> None:
    path = tmp_path / "future.gguf"
    writer = GGUFWriter(path, "futuressm")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.add_tensor("blk.0.ssm_out.weight", np.zeros((8, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    verdict = keeps_recurrent_state(path)
    assert verdict.recurrent and verdict.architecture == "futuressm"
    assert "blk.0.ssm_out.weight" in verdict.reason


def test_unreadable_file_raises(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises((ValueError, OSError)):
        keeps_recurrent_state(bad)
