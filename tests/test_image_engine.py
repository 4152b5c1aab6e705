"""The image engine's foundation, for real: the built (or the user's own) sd-server loads
the generated demo image model and renders through its own OpenAI route.

Nothing is built here: the binary resolves like the host's (``sd_server_binary``), and
without one the test fails with the resolver's message.
"""

from __future__ import annotations

import base64
import struct
import subprocess
import time
from pathlib import Path

import httpx

from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.demo_image_model import write_demo_image_model
from gezel_trio.engine.ports import free_port

from ._engine_bin import run_llama_server

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (which must come first)."""
    assert data[:8] == PNG_SIGNATURE, f"not a PNG: {data[:16]!r}"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13, f"first chunk is {kind!r}, not IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_sd_server_runs(sd_server_binary: EngineBinary) -> None:
    out = subprocess.run(
        [str(sd_server_binary.path), "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        env=sd_server_binary.launch_env(),
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "--listen-port" in out.stdout + out.stderr


async def test_sd_server_renders_the_demo_image_model(
    sd_server_binary: EngineBinary, tmp_path: Path
) -> None:
    model = write_demo_image_model(tmp_path / "image-model", seed=0)
    port = free_port()
    argv = [
        str(sd_server_binary.path),
        *model.server_args(),
        "--listen-ip",
        "127.0.0.1",
        "--listen-port",
        str(port),
        "--steps",
        "4",
    ]
    async with (
        run_llama_server(
            argv,
            sd_server_binary.launch_env(),
            tmp_path / "sd-server.log",
            port=port,
            ready_timeout=120,
            ready_path="/v1/models",  # sd-server loads the model before it listens
        ) as server,
        httpx.AsyncClient(base_url=server.base_url, timeout=300) as client,
    ):
        started = time.monotonic()
        r = await client.post(
            "/v1/images/generations",
            json={"prompt": "a red apple", "size": "64x48", "n": 1, "output_format": "png"},
        )
        elapsed = time.monotonic() - started
        assert r.status_code == 200, r.text[:500] + "\n" + server.log_tail()
        body = r.json()
        assert body["output_format"] == "png"
        (image,) = body["data"]
        png = base64.b64decode(image["b64_json"], validate=True)
        assert png_size(png) == (64, 48)
        print(f"rendered 64x48 in 4 steps in {elapsed:.2f} s ({len(png)} bytes)")
