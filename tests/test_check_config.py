"""``gezel-trio check-config`` checks what serving would hit: files, flags, the memory plan,
the engine binary. Each negative names the key to fix and exits 2; nothing is started."""

from __future__ import annotations

import json
import os
import stat
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
        ("port-flag", "models[0] (m).args: --port is chosen by the host"),
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
    from gezel_trio.config.check import check_config
    from gezel_trio.config.schema import Config, ModelConfig, validate
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


def test_eight_mistakes_are_reported_in_one_pass_each_labelled_once(
    env: dict[str, str],  # noqa: F811
    tmp_path: Path,
    tiny_model: Path,
) -> None:
    """The issue's file: two wrong types, an unknown key, a wrong choice, flags the engine
    does not know (checked by the engine's own help), flags the host owns, a missing file.
    Every one is reported in one run, each once, under the key to fix."""
    cfg = tmp_path / "gezel.toml"
    cfg.write_text(
        '[server]\nport = "8080"\nprot = 1\n'  # 1: a wrong type, 2: an unknown key
        f'[engine]\nstate_dir = "{tmp_path / "state"}"\n'
        'extra_args = ["--no-such-engine-flag"]\n'  # 3: not a flag of this engine
        '[gpu]\npolicy = "fast"\n'  # 4: not a policy
        f'[[models]]\nid = "alpha"\npath = "{tiny_model}"\n'
        'ctx_per_slot = "4k"\n'  # 5: a wrong type, hidden before behind the first
        'args = ["--cache-ram", "1024", "--port", "9999"]\n'  # 6, 7: the host's flags
        f'[[models]]\nid = "beta"\npath = "{tmp_path / "missing.gguf"}"\n'  # 8: no file
    )
    result = gezel(env, "check-config", "--config", str(cfg))
    assert result.returncode == 2, result.stdout + result.stderr
    problems = [
        line.removeprefix("problem: ")
        for line in result.stdout.splitlines()
        if line.startswith("problem: ")
    ]
    assert result.stdout.strip().endswith("8 problem(s)"), result.stdout
    expected = [
        "server.port: expected an integer, got '8080'",
        "server.prot: unknown key",
        "engine.extra_args: --no-such-engine-flag: llama-server has no such flag",
        "gpu.policy: expected one of",
        "models[0].ctx_per_slot: expected an integer, got '4k'",
        "models[0] (alpha).args: --cache-ram is chosen by the host",
        "models[0] (alpha).args: --port is chosen by the host",
        "models[1] (beta).path:",
    ]
    for want in expected:
        assert sum(p.startswith(want) for p in problems) == 1, (want, problems)
    assert len(problems) == 8, problems
    for p in problems:  # one label each: no key names another key after it
        rest = p.partition(": ")[2]
        assert not rest.startswith(("models.args", "engine.extra_args", "models[")), p
    report = json.loads(gezel(env, "check-config", "--json", "--config", str(cfg)).stdout)
    assert report["problems"] == problems and report["ok"] is False


def test_config_errors_are_collected_not_raised_at_the_first() -> None:
    from gezel_trio.config.schema import config_from_mapping
    from gezel_trio.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        config_from_mapping(
            {
                "server": {"port": "x"},
                "models": [
                    {"path": "/no-id.gguf"},
                    {"id": "b", "path": "/b.gguf", "ctx_per_slot": "big", "parallel": 0},
                ],
            }
        )
    assert info.value.detail == [
        "server.port: expected an integer, got 'x'",
        "models[0].id: required key missing",
        "models[1].ctx_per_slot: expected an integer, got 'big'",
        "models[1].parallel: expected 1..256, got 0",  # the entry after a bad one: its own index
    ]
    assert info.value.message.startswith("server.port: expected an integer")


_FAKE_HELP = """----- common params -----

-h,    --help, --usage                  print usage and exit
--version                               show version and build info
-t,    --threads N                      number of CPU threads to use during generation
                                        (env: LLAMA_ARG_THREADS)
-np,   --parallel N                     number of server slots (default: -1)
--only-in-this-build FNAME              a flag no other llama-server has
--mmap, --no-mmap                       whether to memory-map model
-fa,   --flash-attn [on|off|auto]       set Flash Attention use
--a-very-long-flag-name-that-wraps, --and-its-other-name N
                                        described on the next line
--metrics                               enable prometheus compatible metrics endpoint
--no-webui                              Disable the Web UI
--slot-save-path PATH                   path to save slot kv cache
"""


def _fake_engine(tmp_path: Path) -> tuple[Path, Path]:
    runs = tmp_path / "runs"
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!/bin/sh\necho run >> '{runs}'\ncat <<'EOF'\n{_FAKE_HELP}EOF\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe, runs


def test_engine_flags_are_the_engines_own_read_once_per_binary(tmp_path: Path) -> None:
    """What is checked comes from the binary's --help, not from a list of ours: a flag
    only this (fake) engine has passes, a real llama-server flag it lacks does not. The
    help runs once per binary path and mtime."""
    from gezel_trio.engine.flags import engine_flags

    exe, runs = _fake_engine(tmp_path)
    flags = engine_flags(exe)
    assert flags.problems(["--only-in-this-build", "x.bin", "-t", "4", "--no-mmap"]) == []
    assert flags.problems(["-fa", "on", "--and-its-other-name", "3", "--threads", "-1"]) == []
    assert flags.problems(["--ctx-size", "4096"]) == ["--ctx-size: llama-server has no such flag"]
    assert flags.problems(["--only_in_this_build", "x"]) == []  # '_' is read as '-'
    assert flags.problems(["--threads=4"])[0].startswith(
        "--threads=4: llama-server does not read name=value"
    )
    assert flags.problems(["--metrcs"]) == [
        "--metrcs: llama-server has no such flag (did you mean --metrics?)"
    ]
    assert flags.problems(["--slot-save-path"]) == ["--slot-save-path needs a value after it"]
    assert engine_flags(exe) is flags and runs.read_text().count("run") == 1
    st = exe.stat()
    os.utime(exe, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert engine_flags(exe) is not flags and runs.read_text().count("run") == 2


def test_engine_flags_of_the_real_engine(engine_binary: object) -> None:
    from gezel_trio.engine.binary import EngineBinary
    from gezel_trio.engine.flags import engine_flags

    assert isinstance(engine_binary, EngineBinary)
    flags = engine_flags(engine_binary.path, env=engine_binary.launch_env())
    for name, takes in {
        "--ctx-size": True,
        "-c": True,
        "--flash-attn": True,
        "--no-mmap": False,
        "--metrics": False,
        "--slot-save-path": True,
        "--cache-ram": True,
        "--n-gpu-layers": True,
    }.items():
        assert flags.takes_value.get(name) is takes, name
    assert flags.problems(["--no-such-flag"]) == ["--no-such-flag: llama-server has no such flag"]


def test_a_binary_that_lists_no_flags_is_a_warning_not_a_pass(
    env: dict[str, str],  # noqa: F811
    tmp_path: Path,
    tiny_model: Path,
) -> None:
    exe = tmp_path / "not-llama"
    exe.write_text("#!/bin/sh\necho 'usage: not-llama FILE' >&2\nexit 1\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    cfg = _write(tmp_path, _model(tiny_model, extra='args = ["--no-such-flag"]'))
    cfg.write_text(cfg.read_text().replace("[engine]\n", f'[engine]\nbinary = "{exe}"\n', 1))
    result = gezel(env, "check-config", "--config", str(cfg))
    assert "warning: engine flags not checked against the engine" in result.stdout, result.stdout
