"""Isolation under concurrent multi-conversation load on a real engine.

The detector works on a random-weight model:

1. **Greedy references.** Every prompt of every conversation is first run on a
   *fresh* llama-server, one request at a time (temperature 0, top-k 1, a fixed
   seed). Greedy decoding of the tiny model is deterministic whatever the cache
   or the batch (checked here: the same prompts give the same tokens with and
   without ``cache_prompt``), so an answer that differs from its reference was
   computed from someone else's state.
2. **Cached-token accounting.** Conversations start with distinct tokens, so
   ``timings.cache_n`` of an answer can never exceed the longest common prefix
   of its prompt with that conversation's *own* sequences (its prompts plus
   their answers); more means the slot served another conversation's KV.

Prompts are token ids sent to ``/completion``, each turn being the previous
turn's prompt, its reference answer and new tokens, so every turn's prompt is
known in advance and identical in every run. Through the host the count of
contaminated answers must be zero; the same workload sent directly to a
llama-server with its default flags is measured and printed, not asserted.
"""

from __future__ import annotations

import random
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.argv import build_argv
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.ports import free_port
from gezel_trio.errors import ConfigError

from ._engine_bin import ENGINE_LIMITS
from .conftest import make_config, running
from .fault_tools import wait_nothing_held, wait_until

SESSIONS, TURNS, ROUNDS = 8, 5, 4
FIRST_TOKENS, NEW_TOKENS, GENERATE = 30, 10, 8
CTX_PER_SLOT = 1024
Key = tuple[int, int]  # (session, turn)


def _body(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "n_predict": GENERATE,
        "temperature": 0,
        "top_k": 1,
        "seed": 1,
        "cache_prompt": True,
        "return_tokens": True,
        "ignore_eos": True,
        **extra,
    }


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Workload:
    prompts: dict[Key, list[int]] = field(default_factory=dict)
    reference: dict[Key, list[int]] = field(default_factory=dict)

    def cache_bound(self, key: Key) -> int:
        """The most tokens of this prompt the session's own history can supply."""
        session, _ = key
        prompt = self.prompts[key]
        own = [self.prompts[(session, t)] + self.reference[(session, t)] for t in range(TURNS)]
        return max(_lcp(prompt, seq) for seq in own)


@dataclass
class Verdict:
    checked: int = 0
    wrong_tokens: list[str] = field(default_factory=list)
    foreign_cache: list[str] = field(default_factory=list)
    cache_hits: int = 0
    answers: dict[Key, dict[str, Any]] = field(default_factory=dict)

    @property
    def contaminated(self) -> int:
        return len(self.wrong_tokens) + len(self.foreign_cache)

    def judge(self, work: Workload, key: Key, answer: dict[str, Any]) -> None:
        self.checked += 1
        tokens = answer["tokens"]
        cache_n = int(answer["timings"]["cache_n"])
        self.cache_hits += cache_n > 0
        if tokens != work.reference[key]:
            self.wrong_tokens.append(f"{key}: {tokens} != {work.reference[key]}")
        bound = work.cache_bound(key)
        if cache_n > bound:
            self.foreign_cache.append(f"{key}: cache_n {cache_n} > own prefix {bound}")

    def summary(self) -> str:
        return (
            f"{self.checked} answers checked, {self.contaminated} contaminated "
            f"({len(self.wrong_tokens)} wrong tokens, {len(self.foreign_cache)} foreign cache), "
            f"{self.cache_hits} with cache hits"
        )


@asynccontextmanager
async def open_llama_server(
    engine_binary: EngineBinary, model: Path, *, parallel: int, ctx: int
) -> AsyncIterator[str]:
    """A llama-server with its default flags but for slots, port and context; yields its URL."""
    port = free_port()
    argv = [
        str(engine_binary.path),
        "-m",
        str(model),
        "--parallel",
        str(parallel),
        "-c",
        str(ctx),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    url = f"http://127.0.0.1:{port}"
    async with trio.open_nursery() as nursery:
        proc: trio.Process = await nursery.start(
            partial(
                trio.run_process,
                argv,
                env=engine_binary.launch_env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                check=False,
            )
        )

        async def healthy() -> bool:
            assert proc.returncode is None, f"llama-server exited with {proc.returncode}"
            try:
                async with httpx.AsyncClient(limits=ENGINE_LIMITS, timeout=2) as c:
                    return (await c.get(url + "/health")).status_code == 200
            except httpx.TransportError:
                return False

        await wait_until(healthy, within=60, interval=0.05, what="llama-server healthy")
        try:
            yield url
        finally:
            nursery.cancel_scope.cancel()


async def build_workload(engine_binary: EngineBinary, tiny_model: Path) -> Workload:
    """Every turn's prompt and its greedy reference, on a fresh one-slot engine."""
    rng = random.Random(2024)
    firsts = rng.sample(range(3, 600), SESSIONS)  # distinct first tokens: no shared prefix
    work = Workload()
    async with (
        open_llama_server(engine_binary, tiny_model, parallel=1, ctx=CTX_PER_SLOT) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as c,
    ):
        for s in range(SESSIONS):
            prompt = [firsts[s]] + [rng.randrange(3, 600) for _ in range(FIRST_TOKENS - 1)]
            for t in range(TURNS):
                answer = (await c.post("/completion", json=_body(prompt))).json()
                work.prompts[(s, t)] = prompt
                work.reference[(s, t)] = answer["tokens"]
                assert len(answer["tokens"]) == GENERATE
                prompt = (
                    prompt + answer["tokens"] + [rng.randrange(3, 600) for _ in range(NEW_TOKENS)]
                )
        # the detector's premise: greedy answers do not depend on the cache
        for key, prompt in work.prompts.items():
            again = (await c.post("/completion", json=_body(prompt, cache_prompt=False))).json()
            assert again["tokens"] == work.reference[key], f"{key}: greedy output is not stable"
    return work


async def run_conversations(
    client: httpx.AsyncClient, work: Workload, path: str, *, keyed: bool
) -> Verdict:
    """All sessions at once, each turn after the previous one, ``ROUNDS`` times."""
    verdict = Verdict()

    async def conversation(s: int) -> None:
        for t in range(TURNS):
            extra = {"prompt_cache_key": f"conversation-{s}"} if keyed else {}
            resp = await client.post(path, json=_body(work.prompts[(s, t)], **extra))
            assert resp.status_code == 200, resp.text
            answer = resp.json()
            verdict.judge(work, (s, t), answer)
            verdict.answers[(s, t)] = answer

    for _ in range(ROUNDS):
        async with trio.open_nursery() as nursery:
            for s in range(SESSIONS):
                nursery.start_soon(conversation, s)
    return verdict


async def test_no_conversation_sees_another_ones_state(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    with trio.fail_after(180):
        work = await build_workload(engine_binary, tiny_model)
        cfg = make_config(
            [ModelConfig(id="tiny", path=str(tiny_model), parallel=2, ctx_per_slot=CTX_PER_SLOT)],
            state_dir=state_dir,
            engine_binary=engine_binary,
        )
        async with running(cfg) as (host, client):
            through_host = await run_conversations(client, work, "/completion", keyed=True)
            await wait_nothing_held(host)
            assert host.scheduler is not None
            sched = host.scheduler.statistics()
        async with (
            open_llama_server(engine_binary, tiny_model, parallel=2, ctx=2 * CTX_PER_SLOT) as url,
            httpx.AsyncClient(limits=ENGINE_LIMITS, base_url=url, timeout=60) as direct_client,
        ):
            direct = await run_conversations(direct_client, work, "/completion", keyed=False)
    print(
        f"\nisolation through the host: {through_host.summary()}; scheduler erases {sched.erases}"
    )
    print(f"isolation directly against llama-server (default flags): {direct.summary()}")
    for line in (direct.wrong_tokens + direct.foreign_cache)[:5]:
        print("  direct:", line)
    assert through_host.checked == SESSIONS * TURNS * ROUNDS
    assert through_host.contaminated == 0, through_host.wrong_tokens + through_host.foreign_cache
    # the sessions kept their own KV: the detector's cache side was exercised
    assert through_host.cache_hits > SESSIONS, through_host.summary()
    # the handoffs between sessions were erased (or restored) before the next chat ran
    assert sched.erases["ok"] + sched.parking["restored"] > 0, sched

    # negative controls: the detector flags another conversation's answer, and a cache
    # hit longer than the conversation's own history
    control = Verdict()
    for s in range(SESSIONS):
        control.judge(work, ((s + 1) % SESSIONS, TURNS - 1), through_host.answers[(s, TURNS - 1)])
    assert len(control.wrong_tokens) == SESSIONS, control.summary()
    key = (0, TURNS - 1)
    forged = {**through_host.answers[key], "timings": {"cache_n": work.cache_bound(key) + 1}}
    control.judge(work, key, forged)
    assert len(control.foreign_cache) >= 1


async def test_the_engines_ram_prompt_cache_cannot_hand_a_session_anothers_kv(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """llama-server's RAM prompt cache (``--cache-ram``, on by default) is one cache for
    every session: once a slot moved on to another prompt (or was erased), a prompt that
    shares a prefix with the old one gets that KV back from RAM. Measured here on a plain
    llama-server, then through the host, which keeps that cache off (and refuses a
    ``--cache-ram`` in a model's args)."""
    shared = [300 + (i * 7) % 200 for i in range(200)]
    first = [*shared, *[500 + i % 50 for i in range(100)]]
    second = [*shared, *[600 + i % 40 for i in range(100)]]

    def body(prompt: list[int], **extra: object) -> dict[str, object]:
        return {"prompt": prompt, "n_predict": 2, "temperature": 0, "cache_prompt": True, **extra}

    async with (
        open_llama_server(engine_binary, tiny_model, parallel=1, ctx=2048) as plain,
        httpx.AsyncClient(base_url=plain, limits=ENGINE_LIMITS, timeout=60) as direct,
    ):
        await direct.post("/completion", json=body(first, id_slot=0))
        # another prompt takes the slot (nothing in common: the slot no longer holds it)
        await direct.post("/completion", json=body([7, 8, 9, 10], id_slot=0))
        r = await direct.post("/completion", json=body(second, id_slot=0))
        leaked = int(r.json()["timings"]["cache_n"])
    # the engine's truth on this build (it holds with the RAM cache on by default)
    print(f"plain llama-server: {leaked} tokens of an earlier prompt came back from its RAM cache")

    # Sessions a and b are one caller's: with prefix sharing within a caller on, b would
    # rightly start from a's parked copy. Off, any token b gets back is the RAM cache's.
    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=1, ctx_per_slot=2048)],
        state_dir=state_dir,
        engine_binary=engine_binary,
        scheduler={"share_prefix_within_caller": False},
    )
    async with running(cfg) as (host, client):
        r = await client.post("/completion", json=body(first, model="tiny", prompt_cache_key="a"))
        assert r.status_code == 200
        argv = host.models["tiny"].engine.argv
        assert argv[argv.index("--cache-ram") + 1] == "0"
        await client.post("/completion", json=body([7, 8, 9, 10], model="tiny"))  # keyless
        r = await client.post("/completion", json=body(second, model="tiny", prompt_cache_key="b"))
        assert r.status_code == 200
        assert int(r.json()["timings"]["cache_n"]) == 0  # whatever the plain engine gave
    # and a model cannot turn that cache back on
    with pytest.raises(ConfigError, match="--cache-ram is chosen by the host"):
        build_argv(
            binary=Path("llama-server"),
            model_path=str(tiny_model),
            port=1,
            parallel=1,
            ctx_per_slot=2048,
            slot_save_dir=state_dir,
            user_args=["--cache-ram", "48"],
        )
