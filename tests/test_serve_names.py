"""The names ``serve --model`` and ``models_dir`` give models, and what ``serve`` serves with no
model configured: policy without an engine (``test_serve_default_model`` runs it)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gezel_trio.cli.main import embedded_default, model_ids
from gezel_trio.config.models_dir import scan_models_dir
from gezel_trio.config.schema import Config, ModelConfig
from gezel_trio.engine import real_model

# --- names ---------------------------------------------------------------------------------


def test_serve_names_files_by_their_name_and_suffixes_only_a_collision() -> None:
    assert model_ids(["a/qwen.gguf", "b/llama.gguf"]) == ["qwen", "llama"]
    assert model_ids(["a/qwen.gguf", "b/qwen.gguf", "c/qwen.gguf"]) == [
        "qwen",
        "qwen-1",
        "qwen-2",
    ]
    assert model_ids(["x/qwen.gguf", "y/qwen-1.gguf", "z/qwen.gguf"]) == [
        "qwen",
        "qwen-1",
        "qwen-2",
    ]
    assert model_ids(["qwen.gguf"], taken=["qwen"]) == ["qwen-1"]


def test_models_dir_suffixes_a_folder_and_a_file_of_one_name(tmp_path: Path) -> None:
    (tmp_path / "qwen").mkdir()
    (tmp_path / "qwen" / "model.gguf").write_bytes(b"GGUF")
    (tmp_path / "qwen.gguf").write_bytes(b"GGUF")
    (tmp_path / "llama.gguf").write_bytes(b"GGUF")
    found = {m.id: Path(m.path or "") for m in scan_models_dir(tmp_path)}
    assert found == {
        "llama": tmp_path / "llama.gguf",
        "qwen": tmp_path / "qwen.gguf",
        "qwen-1": tmp_path / "qwen" / "model.gguf",
    }


# --- serve's default model ----------------------------------------------------------------


def test_no_config_serves_smollm2_when_its_wheel_is_installed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gguf = tmp_path / real_model.FILE_NAME
    monkeypatch.setattr(real_model, "find_smollm2", lambda: gguf)
    config = embedded_default(Config())
    assert [(m.id, m.path, m.ctx_per_slot, m.parallel) for m in config.models] == [
        ("smollm2", str(gguf), None, None)
    ]


def test_without_the_wheel_the_demo_model_and_a_line_saying_how(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(real_model, "find_smollm2", lambda: None)
    with caplog.at_level(logging.WARNING, logger="gezel_trio.cli"):
        config = embedded_default(Config())
    assert [m.id for m in config.models] == ["demo"]
    assert config.models[0].ctx_per_slot is None
    assert real_model.INSTALL_COMMAND in caplog.text


def test_a_configured_model_is_served_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(real_model, "find_smollm2", lambda: Path("/never"))
    config = Config(models=[ModelConfig(id="mine", path="/m.gguf")])
    assert [m.id for m in embedded_default(config).models] == ["mine"]
