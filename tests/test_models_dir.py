"""Models from a folder: what a scan finds (unit), and files added or removed while the host
serves (a real llama-server)."""

from __future__ import annotations

import shutil
from pathlib import Path

import trio

from gezel_trio.config.models_dir import models_from_dir, scan_models_dir
from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.supervisor import EngineState

from .conftest import make_config, running
from .fault_tools import wait_until


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF")
    return path


def test_a_scan_finds_files_splits_and_folders(tmp_path: Path) -> None:
    _touch(tmp_path / "alpha.gguf")
    for i in (1, 2, 3):
        _touch(tmp_path / f"big-0000{i}-of-00003.gguf")
    _touch(tmp_path / "half-00001-of-00002.gguf")  # a download in progress
    _touch(tmp_path / "vision" / "model-q4.gguf")
    _touch(tmp_path / "vision" / "mmproj-f16.gguf")
    _touch(tmp_path / "two" / "a.gguf")
    _touch(tmp_path / "two" / "b.gguf")  # two models in one folder: ambiguous, left out
    _touch(tmp_path / ".hidden.gguf")
    _touch(tmp_path / "notes.txt")
    _touch(tmp_path / "deep" / "er" / "x.gguf")  # deeper than one folder: not read
    models = {m.id: m for m in scan_models_dir(tmp_path)}
    assert sorted(models) == ["alpha", "big", "vision"]
    assert models["big"].path == str(tmp_path / "big-00001-of-00003.gguf")
    assert models["vision"].path == str(tmp_path / "vision" / "model-q4.gguf")
    assert models["vision"].args == ["--mmproj", str(tmp_path / "vision" / "mmproj-f16.gguf")]
    assert models["alpha"].args == [] and models["alpha"].parallel == ModelConfig("x").parallel
    assert scan_models_dir(tmp_path) == scan_models_dir(tmp_path)  # stable ids
    assert scan_models_dir(tmp_path / "missing") == []


def test_an_explicit_entry_wins_by_file_or_by_id(tmp_path: Path) -> None:
    alpha = _touch(tmp_path / "alpha.gguf")
    _touch(tmp_path / "beta.gguf")
    _touch(tmp_path / "gamma.gguf")
    explicit = [
        ModelConfig(id="mine", path=str(alpha), parallel=4),
        ModelConfig(id="beta", path=str(tmp_path / "elsewhere.gguf")),
    ]
    merged = models_from_dir(explicit, str(tmp_path))
    assert [(m.id, m.parallel) for m in merged] == [("mine", 4), ("beta", None), ("gamma", None)]
    assert models_from_dir(explicit, None) == explicit


async def test_files_added_and_removed_while_serving(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, tmp_path: Path
) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copyfile(tiny_model, folder / "first.gguf")
    cfg = make_config(
        [], state_dir=state_dir, engine_binary=engine_binary, engine={"models_dir_poll": 0.2}
    )
    cfg.engine.models_dir = str(folder)
    body = {"prompt": "hi", "max_tokens": 2}
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            ids = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
            assert ids == ["first"]
            assert (
                await client.post("/v1/completions", json={**body, "model": "first"})
            ).status_code == 200
            shutil.copyfile(tiny_model, folder / "second.gguf")
            await wait_until(lambda: "second" in host.models, within=10, what="second served")
            r = await client.post("/v1/completions", json={**body, "model": "second"})
            assert r.status_code == 200, r.text
            first = host.models["first"]
            (folder / "first.gguf").unlink()
            await first.engine.state.wait_value(EngineState.STOPPED)
            assert "first" not in host.models
            r = await client.post("/v1/completions", json={**body, "model": "first"})
            assert r.status_code == 404
            ids = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
            assert ids == ["second"]
