"""Live reload (POST /api/reload, as SIGHUP): models added, removed and changed while
streams are in flight; none is cut, and an invalid file changes nothing."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from gezel_trio.config.schema import load_config
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.ports import free_port
from gezel_trio.engine.supervisor import EngineState

from .conftest import host_process, running


def _toml(tmp_path: Path, engine_binary: EngineBinary, models: dict[str, dict[str, Any]]) -> str:
    text = (
        f'[engine]\nstate_dir = "{tmp_path / "state"}"\nbinary = "{engine_binary.path}"\n'
        "[server]\nport = 0\n"
    )
    for model_id, fields in models.items():
        text += f'[[models]]\nid = "{model_id}"\n'
        text += "".join(
            f"{k} = {v!r}\n" if not isinstance(v, str) else f'{k} = "{v}"\n'
            for k, v in fields.items()
        )
    return text


async def _stream_first_line(client: httpx.AsyncClient, model: str) -> tuple[Any, Any]:
    body = {"model": model, "prompt": "Once", "max_tokens": 300, "ignore_eos": True, "stream": True}
    cm = client.stream("POST", "/v1/completions", json=body)
    resp = await cm.__aenter__()
    assert resp.status_code == 200
    lines = resp.aiter_lines()
    first = await lines.__anext__()
    assert first.startswith("data:")
    return cm, lines


async def _rest(cm: Any, lines: Any) -> list[str]:
    out = [line async for line in lines if line]
    await cm.__aexit__(None, None, None)
    return out


async def test_reload_adds_removes_and_changes_models_without_cutting_streams(
    tmp_path: Path, tiny_model: Path, engine_binary: EngineBinary
) -> None:
    path = tmp_path / "gezel.toml"
    common = {"path": str(tiny_model), "parallel": 1, "ctx_per_slot": 512}
    path.write_text(_toml(tmp_path, engine_binary, {"a": common, "b": common}))
    cfg = load_config(path)
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            a_stream = await _stream_first_line(client, "a")
            b_stream = await _stream_first_line(client, "b")
            a_engine = host.models["a"].engine
            starts = a_engine.starts
            changed = {**common, "ctx_per_slot": 768}
            path.write_text(_toml(tmp_path, engine_binary, {"a": changed, "c": common}))
            r = await client.post("/api/reload")
            assert r.status_code == 200, r.text
            result = r.json()
            assert (result["added"], result["removed"], result["changed"]) == (["c"], ["b"], ["a"])
            assert result["restart_needed"] == []
            # new requests for b are refused at once; c serves
            r = await client.post("/v1/completions", json={"model": "b", "prompt": "x"})
            assert r.status_code == 404
            r = await client.post(
                "/v1/completions", json={"model": "c", "prompt": "x", "max_tokens": 2}
            )
            assert r.status_code == 200
            # the streams in flight on a (changed) and b (removed) run to their end
            for stream in (a_stream, b_stream):
                rest = await _rest(*stream)
                assert rest[-1] == "data: [DONE]" and not any('"error"' in x for x in rest)
            # then a restarts with its new settings, b's engine stops
            await host.models["a"].engine.state.wait_value(EngineState.STOPPED)
            r = await client.post(
                "/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 2}
            )
            assert r.status_code == 200
            assert a_engine.starts == starts + 1
            assert a_engine.argv[a_engine.argv.index("--ctx-size") + 1] == "768"
            assert sorted(host.models) == ["a", "c"]


async def test_an_invalid_file_is_refused_and_the_running_config_stays(
    tmp_path: Path, tiny_model: Path, engine_binary: EngineBinary
) -> None:
    path = tmp_path / "gezel.toml"
    path.write_text(_toml(tmp_path, engine_binary, {"a": {"path": str(tiny_model), "parallel": 1}}))
    cfg = load_config(path)
    with trio.fail_after(60):
        async with running(cfg) as (host, client):
            path.write_text(path.read_text().replace("parallel = 1", 'parallel = "one"'))
            r = await client.post("/api/reload")
            assert r.status_code == 400
            assert "models[0].parallel" in r.json()["error"]["message"]
            assert sorted(host.models) == ["a"] and host.models["a"].config.parallel == 1
            path.write_text("[[models]\n")
            r = await client.post("/api/reload")
            assert r.status_code == 400 and "not valid TOML" in r.json()["error"]["message"]


def test_sighup_reloads_a_running_host(
    tmp_path: Path, tiny_model: Path, engine_binary: EngineBinary
) -> None:
    port = free_port()
    path = tmp_path / "gezel.toml"
    one = {"path": str(tiny_model), "parallel": 1}
    path.write_text(
        _toml(tmp_path, engine_binary, {"a": one}).replace("port = 0", f"port = {port}")
    )
    url = f"http://127.0.0.1:{port}"
    with host_process(path, port) as proc:
        text = _toml(tmp_path, engine_binary, {"a": one, "z": one})
        path.write_text(text.replace("port = 0", f"port = {port}"))
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while True:
            ids = [m["id"] for m in httpx.get(url + "/v1/models", timeout=5).json()["data"]]
            if ids == ["a", "z"]:
                break
            assert time.monotonic() < deadline, ids
            time.sleep(0.1)
        assert proc.poll() is None  # a reload, not a shutdown


def test_plan_reload_compares_by_id_and_settings() -> None:
    from gezel_trio.config.schema import ModelConfig
    from gezel_trio.host.catalog import plan_reload

    current = {
        "a": ModelConfig(id="a", path="/m/a.gguf"),
        "b": ModelConfig(id="b", path="/m/b.gguf"),
        "c": ModelConfig(id="c", path="/m/c.gguf"),
        "d": ModelConfig(id="d", path="/m/d.gguf"),
    }
    wanted = [
        ModelConfig(id="a", path="/m/a.gguf"),  # the same
        ModelConfig(id="b", path="/m/b.gguf", parallel=4),  # changed
        ModelConfig(id="d", url="http://10.0.0.5:8080"),  # a file became a URL
        ModelConfig(id="e", path="/m/e.gguf"),  # new
    ]
    plan = plan_reload(current, wanted)
    assert plan.as_dict() == {
        "added": ["d", "e"],
        "removed": ["c", "d"],
        "changed": ["b"],
        "unchanged": ["a"],
    }
