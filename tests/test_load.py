"""Bounded load: many concurrent clients, every answer exactly once, a bounded queue, bounded RSS.

Against a fast fake engine (its own process, so the host's process is measured
alone with its clients) and against the real tiny model. Each request to the
fake engine carries a unique ``x_marker`` that the engine echoes in its answer
and counts, so a lost, duplicated or misrouted answer is caught both at the
client and at the engine.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import trio

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.host import Host

from .conftest import make_config, running
from .fake_engine import spawn_fake_engine
from .fault_tools import read_sse, rss_bytes, wait_nothing_held

RSS_GROWTH_LIMIT = 100 * 1024 * 1024


def _limits(n: int) -> httpx.Limits:
    return httpx.Limits(max_connections=n, max_keepalive_connections=n)


async def _one(
    client: httpx.AsyncClient, marker: str, *, stream: bool, model: str = "fake"
) -> tuple[int, list[str], httpx.Headers]:
    """Send one chat request; returns (status, markers seen in the answer, headers)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": marker}],
        "max_tokens": 4,
        "x_marker": marker,
        "stream": stream,
        "prompt_cache_key": f"session-{hash(marker) % 16}",
    }
    if stream:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return resp.status_code, [], resp.headers
            events = await read_sse(resp)
            assert events and events[-1] == "[DONE]", events[-2:]
            seen = {json.loads(e).get("x_marker") for e in events[:-1]}
            return 200, sorted(str(s) for s in seen), resp.headers
    resp = await client.post("/v1/chat/completions", json=body)
    if resp.status_code != 200:
        return resp.status_code, [], resp.headers
    return 200, [resp.json()["x_marker"]], resp.headers


async def _fake_stats(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as c:
        stats = (await c.get(url + "/stats")).json()
    assert isinstance(stats, dict)
    return stats


async def test_2000_requests_from_200_clients_each_answered_once(state_dir: Path) -> None:
    clients, total = 200, 2000
    async with spawn_fake_engine(parallel=8, max_tokens=4) as (fake_url, _proc):
        cfg = make_config(
            [ModelConfig(id="fake", url=fake_url, parallel=8)],
            state_dir=state_dir,
            scheduler={"max_queue": 4096},
            server={"log_level": "warning"},
        )
        with trio.fail_after(200):
            async with running(cfg) as (host, _):
                async with httpx.AsyncClient(
                    base_url=host.urls[0], timeout=60, limits=_limits(clients)
                ) as client:
                    # warm up: connections, the engine's READY state, lazy imports
                    for i in range(20):
                        assert (await _one(client, f"warm-{i}", stream=i % 2 == 0))[0] == 200
                    rss_before = rss_bytes()
                    answers: dict[str, list[str]] = {}
                    statuses: Counter[int] = Counter()
                    todo = list(range(total))
                    rng = random.Random(7)
                    t0 = trio.current_time()

                    async def worker() -> None:
                        while todo:
                            i = todo.pop()
                            marker = f"req-{i}"
                            status, seen, _ = await _one(client, marker, stream=rng.random() < 0.3)
                            statuses[status] += 1
                            answers[marker] = seen

                    async with trio.open_nursery() as nursery:
                        for _ in range(clients):
                            nursery.start_soon(worker)
                    took = trio.current_time() - t0
                    rss_after = rss_bytes()
                await wait_nothing_held(host)
                stats = await _fake_stats(fake_url)
                sched = _stats(host)
    print(
        f"load: {total} requests from {clients} clients in {took:.1f}s "
        f"({total / took:.0f} req/s); RSS {rss_before >> 20} -> {rss_after >> 20} MiB; "
        f"engine max concurrent {stats['max_concurrent']}; erases {sched.erases}"
    )
    assert statuses == Counter({200: total}), statuses
    # every answer came back, to the client that asked, exactly once
    assert len(answers) == total
    wrong = {m: seen for m, seen in answers.items() if seen != [m]}
    assert not wrong, list(wrong.items())[:5]
    assert stats["served_markers"] == total + 20 and not stats["duplicates"], stats
    assert stats["max_concurrent"] <= 8
    assert sched.queued == 0 and not sched.running
    assert rss_after - rss_before < RSS_GROWTH_LIMIT, (rss_before, rss_after)


async def test_slots_are_never_handed_over_unerased_under_load(state_dir: Path) -> None:
    """Sixteen chats on eight slots under load: every request is pinned to an idle slot,
    and a slot goes to another chat only after an erase (or a restore of that chat's own
    parked cache). The fake engine counts every violation."""
    clients, total = 64, 600
    async with spawn_fake_engine(parallel=8, max_tokens=4) as (fake_url, _proc):
        cfg = make_config(
            [ModelConfig(id="fake", url=fake_url, parallel=8)],
            state_dir=state_dir,
            scheduler={"max_queue": 4096},
            server={"log_level": "warning"},
        )
        with trio.fail_after(120):
            async with running(cfg) as (host, _):
                async with httpx.AsyncClient(
                    base_url=host.urls[0], timeout=60, limits=_limits(clients)
                ) as client:
                    todo = list(range(total))

                    async def worker() -> None:
                        while todo:
                            i = todo.pop()
                            status, _, _ = await _one(client, f"iso-{i}", stream=i % 4 == 0)
                            assert status == 200

                    async with trio.open_nursery() as nursery:
                        for _ in range(clients):
                            nursery.start_soon(worker)
                await wait_nothing_held(host)
                stats = await _fake_stats(fake_url)
                sched = _stats(host)
    print(
        f"isolation under load: pinned {stats['pinned']}/{stats['requests']}, "
        f"admissions {sched.admissions}, pinned to a busy slot "
        f"{stats['pinned_to_busy']}, bleeds {stats['bleeds']} {stats['bleed_examples']}, "
        f"erases {stats['erases']}, saves {stats['saves']}, restores {stats['restores']}"
    )
    assert stats["pinned"] == stats["requests"], stats  # nothing reached the engine unpinned
    assert stats["pinned_to_busy"] == 0, stats
    assert stats["bleeds"] == 0, stats


def _stats(host: Host) -> Any:
    assert host.scheduler is not None
    return host.scheduler.statistics()


async def test_small_queue_sheds_load_with_503_and_retry_after(state_dir: Path) -> None:
    """Two slots, 160 ms a request, a queue of 16, 200 clients at once: the excess is
    refused at once with 503 + Retry-After, the queue never grows past 16, nothing hangs."""
    clients, max_queue = 200, 16
    async with spawn_fake_engine(parallel=2, token_delay=0.04, max_tokens=4) as (fake_url, _):
        cfg = make_config(
            [ModelConfig(id="fake", url=fake_url, parallel=2)],
            state_dir=state_dir,
            scheduler={"max_queue": max_queue},
            server={"log_level": "warning"},
        )
        with trio.fail_after(120):
            async with running(cfg) as (host, _):
                async with httpx.AsyncClient(
                    base_url=host.urls[0], timeout=60, limits=_limits(clients)
                ) as client:
                    assert (await _one(client, "warm", stream=False))[0] == 200
                    statuses: Counter[int] = Counter()
                    retry_after: list[str | None] = []
                    codes: Counter[str] = Counter()
                    answers: dict[str, list[str]] = {}
                    max_queued = 0
                    done = trio.Event()

                    async def sample_queue() -> None:
                        nonlocal max_queued
                        while not done.is_set():
                            max_queued = max(max_queued, _stats(host).queued)
                            await trio.sleep(0.002)

                    async def one(i: int) -> None:
                        marker = f"burst-{i}"
                        status, seen, headers = await _one(client, marker, stream=i % 3 == 0)
                        statuses[status] += 1
                        if status == 503:
                            retry_after.append(headers.get("retry-after"))
                        elif status == 200:
                            answers[marker] = seen

                    t0 = trio.current_time()
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(sample_queue)
                        async with trio.open_nursery() as burst:
                            for i in range(clients):
                                burst.start_soon(one, i)
                        done.set()
                    took = trio.current_time() - t0

                    # a refused client that retries after Retry-After gets served
                    resp = await client.post(
                        "/v1/chat/completions",
                        json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
                    )
                    if resp.status_code == 503:
                        codes[resp.json()["error"]["code"]] += 1
                        await trio.sleep(float(resp.headers["retry-after"]))
                        resp = await client.post(
                            "/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
                        )
                    assert resp.status_code == 200, resp.text
                await wait_nothing_held(host)
    print(
        f"burst: {dict(statuses)} in {took:.2f}s, max queued {max_queued}, "
        f"Retry-After values {sorted(Counter(retry_after).items(), key=str)}"
    )
    assert set(statuses) <= {200, 503} and sum(statuses.values()) == clients, statuses
    assert statuses[503] > 0, "nothing was refused: the queue is not bounded"
    assert statuses[200] >= max_queue, statuses  # the queue's worth was served
    assert max_queued <= max_queue
    assert all(r is not None and r.isdigit() and 1 <= int(r) <= 60 for r in retry_after)
    assert all(seen == [m] for m, seen in answers.items())
    # refusals are immediate: the whole burst takes about (served / slots) x 160 ms
    assert took < statuses[200] / 2 * 0.16 * 3 + 5, took


async def test_real_tiny_model_under_load(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    clients, total = 50, 300
    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=4, ctx_per_slot=256)],
        state_dir=state_dir,
        engine_binary=engine_binary,
        server={"log_level": "warning"},
    )
    with trio.fail_after(200):
        async with running(cfg) as (host, _):
            async with httpx.AsyncClient(
                base_url=host.urls[0], timeout=60, limits=_limits(clients)
            ) as client:
                ids: list[str] = []
                statuses: Counter[int] = Counter()
                tokens: Counter[int] = Counter()
                todo = list(range(total))
                body = {"model": "tiny", "max_tokens": 4, "temperature": 0}
                for i in range(4):
                    warm = {**body, "messages": [{"role": "user", "content": f"warm {i}"}]}
                    assert (await client.post("/v1/chat/completions", json=warm)).status_code == 200
                rss_before = rss_bytes()
                t0 = trio.current_time()

                async def worker() -> None:
                    while todo:
                        i = todo.pop()
                        req = {
                            **body,
                            "messages": [{"role": "user", "content": f"request {i}: hello"}],
                            "prompt_cache_key": f"s{i % 10}",
                        }
                        if i % 4 == 0:
                            async with client.stream(
                                "POST", "/v1/chat/completions", json={**req, "stream": True}
                            ) as resp:
                                statuses[resp.status_code] += 1
                                events = await read_sse(resp)
                            assert events[-1] == "[DONE]"
                            chunks = [json.loads(e) for e in events[:-1]]
                            ids.append(chunks[0]["id"])
                            assert len({c["id"] for c in chunks}) == 1
                            tokens[
                                sum(
                                    bool(c["choices"] and c["choices"][0]["delta"].get("content"))
                                    for c in chunks
                                )
                            ] += 1
                        else:
                            resp = await client.post("/v1/chat/completions", json=req)
                            statuses[resp.status_code] += 1
                            data = resp.json()
                            ids.append(data["id"])
                            tokens[data["usage"]["completion_tokens"]] += 1

                async with trio.open_nursery() as nursery:
                    for _ in range(clients):
                        nursery.start_soon(worker)
                took = trio.current_time() - t0
                rss_after = rss_bytes()
            await wait_nothing_held(host)
            engine = host.models["tiny"].engine
            assert engine.crashes == 0 and engine.starts == 1
            sched = _stats(host)
    print(
        f"tiny load: {total} requests from {clients} clients in {took:.1f}s "
        f"({total / took:.0f} req/s); RSS {rss_before >> 20} -> {rss_after >> 20} MiB; "
        f"completion tokens {dict(tokens)}; erases {sched.erases}"
    )
    assert statuses == Counter({200: total}), statuses
    assert len(ids) == total and len(set(ids)) == total  # no answer delivered twice
    assert all(0 < n <= 4 for n in tokens), tokens
    assert rss_after - rss_before < RSS_GROWTH_LIMIT
