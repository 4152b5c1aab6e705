"""A Responses input item's ``id`` is no part of the prompt.

Codex starts every ``codex exec`` as a new session whose input items carry new ids
(``msg_...``) around the same instructions, tools and environment. The engine renders
no id: bare llama-server reuses all but the last message of the first session's
prompt for the second. The host's prefix blocks leave the ids out, so a new session of
the same caller starts from that prefix too (issue 37: it started from nothing).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import httpx
import trio

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.ports import free_port
from gezel_trio.host.completion import prompt_blocks
from gezel_trio.kv.prefix import shared_blocks

from .conftest import make_config, running
from .fault_tools import wait_until

INSTRUCTIONS = "".join(f"Rule {i}: keep the build green and the diff small. " for i in range(40))
KEY = "key-ann"


def _body(session: int, question: str) -> dict[str, Any]:
    """A Codex-like Responses request: no ``instructions``, its own in a developer item,
    every item named anew by each session."""
    env = "<environment_context>cwd /w</environment_context>"
    items = [
        {"type": "message", "id": f"msg_{session}_rules", "role": "developer",
         "content": [{"type": "input_text", "text": INSTRUCTIONS}]},
        {"type": "message", "id": f"msg_{session}_env", "role": "user",
         "content": [{"type": "input_text", "text": env}]},
        {"type": "message", "id": f"msg_{session}_ask", "role": "user",
         "content": [{"type": "input_text", "text": question}]},
    ]  # fmt: skip
    return {
        "model": "tiny",
        "input": items,
        "max_output_tokens": 2,
        "temperature": 0,
        "prompt_cache_key": f"session-{session}",
    }


def test_an_items_id_is_not_in_its_blocks() -> None:
    one, two = prompt_blocks(_body(1, "Say hi.")), prompt_blocks(_body(2, "Say hi."))
    assert one == two
    other = prompt_blocks(_body(2, "Say bye."))
    assert shared_blocks(one, other) == len(one) - 1  # all but the last item's text
    call = {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{}"}
    assert prompt_blocks({"input": [call]}) == prompt_blocks({"input": [{**call, "id": "fc_2"}]})
    assert prompt_blocks({"input": [call]}) != prompt_blocks({"input": [{**call, "call_id": "c2"}]})


async def _cached(client: httpx.AsyncClient, body: dict[str, Any], **extra: Any) -> int:
    r = await client.post("/v1/responses", json={**body, **extra})
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["input_tokens_details"]["cached_tokens"])


async def test_a_new_session_reuses_what_the_engine_reuses(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """The engine's truth first: on a bare llama-server, session 2's request after
    session 1's on the same slot reuses E tokens. Then the host (two slots, one API
    key): session 2 reuses the same E, placed on session 1's slot though the other is
    free."""
    port = free_port("127.0.0.1")
    argv = [str(engine_binary.path), "-m", str(tiny_model), "--port", str(port), "--jinja"]
    argv += ["--parallel", "1", "--cache-ram", "0"]
    with trio.fail_after(240):
        engine = await trio.lowlevel.open_process(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as bare:

                async def healthy() -> bool:
                    try:
                        return (await bare.get("/health")).status_code == 200
                    except httpx.HTTPError:
                        return False

                await wait_until(healthy, within=120, interval=0.1, what="the bare engine up")
                assert await _cached(bare, _body(1, "Say hi."), id_slot=0) == 0
                expected = await _cached(bare, _body(2, "Say bye."), id_slot=0)
        finally:
            engine.kill()
            with trio.move_on_after(10, shield=True):
                await engine.wait()
        assert expected > len(INSTRUCTIONS) // 8  # the instructions, at least

        models = [ModelConfig(id="tiny", path=str(tiny_model), parallel=2, ctx_per_slot=2048)]
        cfg = make_config(
            models, state_dir=state_dir, engine_binary=engine_binary, server={"api_keys": [KEY]}
        )
        async with running(cfg) as (host, client):
            client.headers["Authorization"] = f"Bearer {KEY}"
            assert await _cached(client, _body(1, "Say hi.")) == 0
            scheduler = host.scheduler
            assert scheduler is not None
            await wait_until(
                lambda: not scheduler.statistics().as_dict()["running"],
                within=60,
                what="the first request settled",
            )
            assert await _cached(client, _body(2, "Say bye.")) == expected
            assert scheduler.statistics().parking["shared_within_caller"] == 1
