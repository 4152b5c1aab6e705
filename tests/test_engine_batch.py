"""The host runs its engines with ``--batch-size`` equal to their physical batch, so that
llama-server's queue (a new request, a slot save, restore or erase) runs after every
``--ubatch-size`` piece of another slot's prefill instead of after up to 2,048 tokens of
it (:func:`gezel_trio.engine.argv.batch_flags`).

On the host's real llama-server: an erase of an idle slot sent while the other slot
prefills a 1,900-token prompt is answered within the first pieces of that prefill. With
the engine's default ``--batch-size`` (2,048) it cannot be: the whole prompt is one decode
call, and the queue waits for it (measured: 8.35 s for an 8.35 s prefill, against 1.8 s
of 8.1 s). The flags themselves are tested without I/O in tests/test_config_and_binary.py.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.argv import DEFAULT_UBATCH
from gezel_trio.engine.binary import EngineBinary

from .conftest import make_config, running
from .fault_tools import slots_busy, wait_until


@pytest.mark.engine
async def test_a_slot_call_runs_while_another_slot_prefills(
    smollm2: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """The host's engine erases an idle slot within the first pieces of another slot's
    1,900-token prefill: measured from the moment the prefill was seen running, the
    erase is answered in under 0.6 of the time the prefill's own answer takes (about a
    quarter to a half with 512-token pieces; the whole of it with one 2,048-token call,
    the engine's default)."""
    cfg = make_config(
        [ModelConfig(id="m", path=str(smollm2), parallel=2, ctx_per_slot=4096)],
        state_dir=state_dir,
        engine_binary=engine_binary,
        scheduler={"save_idle_slots": False},
    )
    long_prompt = " ".join(f"word{i % 97}" for i in range(650))
    async with running(cfg) as (host, client):
        body = {"model": "m", "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        url = host.models["m"].engine.base_url
        assert url is not None
        done: dict[str, float] = {}
        async with httpx.AsyncClient(base_url=url, timeout=60) as direct:
            tokens = (await direct.post("/tokenize", json={"content": long_prompt})).json()
            assert 3 * DEFAULT_UBATCH < len(tokens["tokens"]) < 2048  # one default call

            async def long() -> None:
                r = await client.post("/v1/completions", json={**body, "prompt": long_prompt})
                assert r.status_code == 200, r.text
                done["long"] = trio.current_time()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(long)
                busy: list[int] = []

                async def prefilling() -> bool:
                    busy[:] = await slots_busy(url)
                    return bool(busy)

                await wait_until(prefilling, within=60, what="the long prefill running")
                seen = trio.current_time()
                assert "long" not in done
                (idle,) = {0, 1} - set(busy)
                erased = await direct.post(f"/slots/{idle}?action=erase")
                assert erased.status_code == 200, erased.text
                done["erase"] = trio.current_time()
    erase_s, long_s = done["erase"] - seen, done["long"] - seen
    print(f"\nFIGURES batch: erase {erase_s:.3f} s, the prefill's answer {long_s:.3f} s")
    assert erase_s < 0.6 * long_s, f"erase after {erase_s:.3f}s, the prefill's answer {long_s:.3f}s"
