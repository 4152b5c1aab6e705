"""``gezel-trio check-config`` checks what serving would hit: files, flags, the memory plan,
the engine binary. Each negative names the key to fix and exits 2; nothing is started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .test_cli_errors import env, gezel  # noqa: F401  (env is a fixture)


def _write(tmp_path: Path, body: str) -> Path:
    cfg = tmp_path / "gezel.toml"
    cfg.write_text(f'[engine]\nstate_dir = "{tmp_path / "state"}"\n' + body)
    return cfg


def _model(path: Path | str, *, extra: str = "") -> str:
    return f'[[models]]\nid = "m"\npath = "{path}"\nparallel = 2\nctx_per_slot = 1024\n{extra}\n'


def test_a_good_config_prints_its_plan(
    env: dict[str, str],  # noqa: F811
    tmp_path: Path,
    tiny_model: Path,
) -> None:
    result = gezel(env, "check-config", "--config", str(_write(tmp_path, _model(tiny_model))))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "m: 2 slot(s) x 1024 tokens" in out and out.strip().endswith("ok")
    report = json.loads(
        gezel(env, "check-config", "--json", "--config", str(tmp_path / "gezel.toml")).stdout
    )
    assert report["ok"] is True and report["plans"]["m"]["fits"] is True
    assert report["engine_binary"] and not (tmp_path / "state").exists()  # nothing written


@pytest.mark.parametrize(
    ("case", "expect"),
    [
        ("missing", "models[0] (m).path: '{path}' does not exist"),
        ("not-gguf", "is not a usable GGUF"),
        ("port-flag", "models[0] (m).args: models.args: --port is chosen by the host"),
        ("no-engine", "engine.binary:"),
    ],
)
def test_what_serving_would_hit_is_refused_with_the_key_named(
    env: dict[str, str],  # noqa: F811
    tmp_path: Path,
    tiny_model: Path,
    case: str,
    expect: str,
) -> None:
    path: Path = tiny_model
    extra = ""
    engine = ""
    if case == "missing":
        path = tmp_path / "nope.gguf"
    elif case == "not-gguf":
        path = tmp_path / "text.gguf"
        path.write_text("this is not a model")
    elif case == "port-flag":
        extra = 'args = ["--port", "9999"]'
    elif case == "no-engine":
        engine = f'binary = "{tmp_path / "no-llama-server"}"\n'
        env = {k: v for k, v in env.items() if k != "GEZEL_LLAMA_SERVER"}
    body = _model(path, extra=extra)
    cfg = tmp_path / "gezel.toml"
    cfg.write_text(f'[engine]\nstate_dir = "{tmp_path / "state"}"\n{engine}' + body)
    result = gezel(env, "check-config", "--config", str(cfg))
    assert result.returncode == 2, result.stdout + result.stderr
    assert expect.format(path=path) in result.stdout, result.stdout
    assert "Traceback" not in result.stderr


def test_a_plan_that_does_not_fit_the_device_is_refused(tiny_model: Path) -> None:
    from gezel_trio.config import Config, ModelConfig, validate
    from gezel_trio.config_check import check_config
    from gezel_trio.gpu.probe import DeviceHealth, GpuReading

    gpu = GpuReading(
        index=0,
        name="Fake GPU",
        temperature_c=40.0,
        memory_used_bytes=0,
        memory_total_bytes=64 * 1024**2,
    )
    health = DeviceHealth(readings=(gpu,), available=True, reason=None, taken_at=0.0)
    config = Config()
    config.models = [ModelConfig(id="m", path=str(tiny_model), parallel=256, ctx_per_slot=4096)]
    validate(config)
    report = check_config(config, health)
    assert not report.ok and report.device == "gpu:0"
    assert report.problems[0].startswith("models[0] (m): does not fit gpu:0")
    assert "no layer offloaded" in report.plans["m"]["summary"]
