"""An image model in the config (``kind = "image"``): what is accepted, what is refused
with the key named, what ``check-config`` shows, how ``ps`` shows it, and how its
progress is read from sd-server's output. No engine runs here except check-config's
binary resolution."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gezel_trio.cli.client import ps_rows
from gezel_trio.config.schema import config_from_mapping
from gezel_trio.engine.demo_image_model import DemoImageModel, demo_image_model_path
from gezel_trio.engine.sd_argv import sd_argv, sd_footprint
from gezel_trio.errors import ConfigError
from gezel_trio.images.job import ImageProgress
from gezel_trio.images.progress import last_progress

from .test_cli_errors import env, gezel  # noqa: F401  (env is a fixture)


@pytest.fixture(scope="session")
def image_model(models_dir: Path) -> DemoImageModel:
    return demo_image_model_path(cache_dir=models_dir)


def _files(model: DemoImageModel) -> dict[str, str]:
    return {
        "diffusion_model": str(model.diffusion_model),
        "llm": str(model.llm),
        "taesd": str(model.vae),
    }


def _problems(**entry: object) -> list[str]:
    with pytest.raises(ConfigError) as refused:
        config_from_mapping({"models": [{"id": "img", "kind": "image", **entry}]})
    detail = refused.value.detail
    assert isinstance(detail, list)
    return [str(p) for p in detail]


def test_an_image_model_is_read_with_its_files(image_model: DemoImageModel) -> None:
    cfg = config_from_mapping(
        {
            "models": [
                {
                    "id": "img",
                    "kind": "image",
                    "files": _files(image_model),
                    "args": ["--steps", "4"],
                }
            ]
        }
    )
    (model,) = cfg.models
    assert model.kind == "image" and model.files["llm"] == str(image_model.llm)
    argv = sd_argv("sd-server", files=model.files, path=None, port=4321, user_args=model.args)
    assert argv == [
        "sd-server",
        "--diffusion-model",
        str(image_model.diffusion_model),
        "--llm",
        str(image_model.llm),
        "--taesd",
        str(image_model.vae),
        "--listen-ip",
        "127.0.0.1",
        "--listen-port",
        "4321",
        "--steps",
        "4",
    ]
    sizes = sum(p.stat().st_size for p in image_model.paths())
    assert sd_footprint(model.files) > sizes


def test_an_image_model_is_named_after_its_file_by_default(image_model: DemoImageModel) -> None:
    cfg = config_from_mapping(
        {
            "models": [
                {"kind": "image", "files": _files(image_model)},
                {"kind": "image", "id": "mine", "files": _files(image_model)},
            ]
        }
    )
    assert [m.id for m in cfg.models] == ["diffusion_model", "mine"]
    with pytest.raises(ConfigError, match=r"models\[0\]\.id: required key missing"):
        config_from_mapping({"models": [{"path": "x.gguf"}]})  # a text model names itself


def test_an_image_model_s_mistakes_are_named(image_model: DemoImageModel, tmp_path: Path) -> None:
    problems = _problems(
        files={"diffusion_model": str(image_model.diffusion_model), "text_encoder": "x.gguf"},
        parallel=2,
        args=["--listen-port", "9"],
    )
    assert any(
        p.startswith("models[0].files.text_encoder: not a model-file flag") for p in problems
    )
    assert any(p.startswith("models[0].parallel: not an image model's key") for p in problems)
    assert any(p.startswith("models[0].args: --listen-port is the host's") for p in problems)
    missing = _problems(files={"llm": str(tmp_path / "gone.gguf")})
    assert missing == [f"models[0].files.llm: no such file {str(tmp_path / 'gone.gguf')!r}"]
    assert _problems()[0].startswith("models[0]: an image model needs its files")
    assert _problems(files={"llm": 3})[0].startswith("models[0].files.llm: expected a string")
    with pytest.raises(ConfigError, match=r"models\[0\].files: files are an image model's"):
        config_from_mapping({"models": [{"id": "t", "path": "t.gguf", "files": {"llm": "x"}}]})
    with pytest.raises(ConfigError, match=r"models\[0\].kind: expected one of 'text', 'image'"):
        config_from_mapping({"models": [{"id": "t", "path": "t.gguf", "kind": "video"}]})


def test_check_config_shows_an_image_model(
    env: dict[str, str],  # noqa: F811
    tmp_path: Path,
    image_model: DemoImageModel,
) -> None:
    files = ", ".join(f'{k} = "{v}"' for k, v in _files(image_model).items())
    cfg = tmp_path / "gezel.toml"
    cfg.write_text(
        f'[engine]\nstate_dir = "{tmp_path / "state"}"\n'
        f'[[models]]\nid = "img"\nkind = "image"\nfiles = {{{files}}}\n'
    )
    result = gezel(env, "check-config", "--json", "--config", str(cfg))
    report = json.loads(result.stdout)
    plan = report["plans"]["img"]
    assert plan["kind"] == "image" and "sd-server" in plan["engine"], report
    assert plan["total_bytes"] == sd_footprint(_files(image_model))
    assert not any("img" in p for p in report["problems"]), report


def test_ps_shows_an_image_model_and_its_render() -> None:
    row = {
        "model": "img",
        "kind": "image",
        "state": "ready",
        "parallel": 1,
        "plan": {"total_bytes": 600 * 1024**2},
        "job": {"step": 3, "steps": 8},
        "idle_seconds": 0,
    }
    status = {"engines": [row], "scheduler": {"running": {"img": 1}}}
    ((model, state, memory, busy, context, *_),) = ps_rows(status)
    assert (model, state, busy, context) == ("img", "ready", "1/1", "image 3/8")
    assert memory and "MiB" in str(memory)
    ((*_, idle_context, _s, _p, _i),) = ps_rows({"engines": [{**row, "job": None}]})
    assert idle_context == "image"


def test_progress_is_read_from_sd_server_s_carriage_return_updates() -> None:
    out = b"\r|=====>          | 2/8 - 1.23s/it\x1b[K\r|=======>        | 3/8 - 1.10s/it\x1b[K"
    assert last_progress(out) == ImageProgress(3, 8)
    assert last_progress(b"[INFO ] stable-diffusion.cpp:123 - sampling using Euler\n") is None
    assert last_progress(b"\r|==================| 8/8 - 1.01it/s\x1b[K\n") == ImageProgress(8, 8)
    # the same bar while the engine loads tensors is no render's progress
    loading = b"\r|==================================================| 196/196 - 212.54MB/s\x1b[K\n"
    assert last_progress(loading) is None
    assert last_progress(b"\r|=======| 196/196 - 1.02GB/s\x1b[K" + out) == ImageProgress(3, 8)
