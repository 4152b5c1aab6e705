"""Calibration through the host, on real llama-server engines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from gezel_trio.config import ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.demo_model import write_demo_model

from .conftest import make_config, running


@pytest.fixture(scope="module")
def mamba_model(models_dir: Path) -> Path:
    return write_demo_model(models_dir / "mamba.gguf", size="tiny", arch="mamba")


def _body(prompt: list[int], n: int = 12) -> dict[str, Any]:
    return {
        "model": "rec",
        "prompt": prompt,
        "n_predict": n,
        "temperature": 0,
        "top_k": 1,
        "seed": 7,
        "cache_prompt": False,
    }


async def test_recurrent_model_is_serialized_until_calibrated_and_survives_load(
    mamba_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    cfg = make_config(
        [ModelConfig(id="rec", path=str(mamba_model), parallel=4, ctx_per_slot=256)],
        state_dir=state_dir,
        engine_binary=engine_binary,
    )
    with trio.fail_after(180):
        async with running(cfg) as (host, client):
            rt = host.models["rec"]
            cal = rt.calibration
            assert cal.arch is not None and cal.arch.recurrent
            # not calibrated yet: one sequence at a time
            assert rt.parallel == 1
            assert "recurrent" in (rt.ceiling_reason or "")

            prompts = [[300 + ((i * 37 + j * 11) % 300) for j in range(24)] for i in range(8)]
            # reference answers, one at a time (the first request also starts the engine
            # and triggers the calibration, an exclusive operation)
            alone = []
            for p in prompts:
                r = await client.post("/completion", json=_body(p))
                assert r.status_code == 200, r.text
                alone.append(r.json()["content"])
            while cal.result is None:  # noqa: ASYNC110 - polling a plain attribute
                await trio.sleep(0.05)
            status = (await client.get("/api/status")).json()
            (eng,) = status["engines"]
            assert eng["calibration"]["status"] in ("passed", "failed")
            assert eng["calibration"]["result"]["prompts_tried"] >= 3
            if cal.result["verdict"] == "passed":
                assert rt.parallel == 4
            else:
                assert rt.parallel == 1 and "calibration failed" in (rt.ceiling_reason or "")

            # concurrent load: every answer equals the prompt decoded alone, and the
            # engine (4 configured slots) survives
            got: dict[int, str] = {}

            async def ask(i: int) -> None:
                r = await client.post("/completion", json=_body(prompts[i]))
                assert r.status_code == 200, r.text
                got[i] = r.json()["content"]

            async with trio.open_nursery() as nursery:
                for _ in range(2):
                    for i in range(len(prompts)):
                        nursery.start_soon(ask, i)
            assert [got[i] for i in range(len(prompts))] == alone
            assert rt.engine.crashes == 0 or cal.result["crashed"]


async def test_dense_model_calibrates_on_demand_and_passes(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=3, ctx_per_slot=256)],
        state_dir=state_dir,
        engine_binary=engine_binary,
    )
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            rt = host.models["tiny"]
            assert rt.calibration.arch is not None and not rt.calibration.arch.recurrent
            assert rt.parallel == 3  # dense attention: no ceiling before calibration
            resp = await client.post("/api/models/tiny/calibrate")
            assert resp.status_code == 200, resp.text
            result = resp.json()
            assert result["verdict"] == "passed" and not result["crashed"]
            assert result["admission_ceiling"] == 3
            assert result["distinct_answers"] == 1
            assert rt.parallel == 3 and rt.ceiling is None
            # remembered per model file and engine build
            book = host.calibration_book.get(
                host.calibration_book.key(str(tiny_model), rt.calibration.fingerprint or "")
            )
            assert book is not None and book["verdict"] == "passed"
