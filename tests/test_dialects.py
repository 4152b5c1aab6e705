"""Every dialect the engine speaks, through the host, against the real engine.

For each route the engine's own behaviour is measured in the same test (a request
sent to the engine directly with ``id_slot``), and the host is checked against it:
every completion the host sends runs on the slot the scheduler granted, whatever
the engine itself would do with the route's fields.
"""

from __future__ import annotations

import json
import os
import re
import signal
from functools import partial
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.demo_model import write_demo_reranker
from gezel_trio.host import ModelRuntime

from .conftest import make_config, running
from .fault_tools import slots_busy, wait_nothing_held, wait_until

KEY = "sk-dialects-1"
OTHER_KEY = "sk-dialects-2"
AUTH = {"Authorization": f"Bearer {KEY}"}
LAUNCH = re.compile(r"launch_slot_: id +(\d+) \| task (\d+)")


def _cfg(tiny_model: Path, state_dir: Path, engine_binary: EngineBinary) -> Any:
    return make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=3, ctx_per_slot=1024)],
        state_dir=state_dir,
        engine_binary=engine_binary,
        server={"api_keys": [KEY, OTHER_KEY]},
    )


def launched_slots(runtime: ModelRuntime) -> list[int]:
    """The slot of every task the engine launched, from its own log, oldest first."""
    return [int(m.group(1)) for line in runtime.engine.log.tail(400) if (m := LAUNCH.search(line))]


async def wait_for_launches(runtime: ModelRuntime, count: int) -> list[int]:
    await wait_until(
        lambda: len(launched_slots(runtime)) >= count, within=10, what="the engine's log line"
    )
    return launched_slots(runtime)


def granted_slot(runtime: ModelRuntime, path: str) -> int | None:
    """The slot the host pinned its last request on ``path`` to."""
    sent = [call for call in runtime.client.recent if call.action == path]
    return sent[-1].slot if sent else None


async def direct(runtime: ModelRuntime, path: str, body: dict[str, Any]) -> httpx.Response:
    assert runtime.engine.base_url is not None
    async with httpx.AsyncClient(base_url=runtime.engine.base_url, timeout=30) as engine:
        return await engine.post(path, json=body)


CHAT_ROUTE = "/v1/chat/completions"
CHAT = {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 3}
MESSAGES_BODY = {"max_tokens": 3, "messages": [{"role": "user", "content": "hello world"}]}
INFILL = {  # llama.vscode's shape, with its hard-coded slot
    "id_slot": 0,
    "input_prefix": "def hello(",
    "input_suffix": "):\n    return world\n",
    "input_extra": [{"filename": "util.py", "text": "world = 1\n"}],
    "prompt": "",
    "n_predict": 3,
    "t_max_prompt_ms": 5000,
    "t_max_predict_ms": 5000,
}
ROUTES: list[tuple[str, dict[str, Any], str]] = [
    # (host route, body, engine route it runs on)
    ("/v1/chat/completions", CHAT, "/v1/chat/completions"),
    ("/chat/completions", CHAT, "/v1/chat/completions"),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 3}, "/v1/completions"),
    ("/completion", {"prompt": "hello", "n_predict": 3}, "/completion"),
    ("/completions", {"prompt": "hello", "n_predict": 3}, "/completion"),
    ("/v1/responses", {"input": "hello world", "max_output_tokens": 3}, "/v1/responses"),
    ("/responses", {"input": "hello world", "max_output_tokens": 3}, "/v1/responses"),
    ("/v1/messages", MESSAGES_BODY, "/v1/chat/completions"),
    ("/infill", INFILL, "/infill"),
]


async def test_every_completion_route_runs_on_its_granted_slot(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    with trio.fail_after(120):
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (host, client):
            assert (await client.post("/api/models/tiny/load", headers=AUTH)).status_code == 200
            runtime = host.models["tiny"]
            for i, (route, body, engine_route) in enumerate(ROUTES):
                for stream in (False, True):
                    before = len(launched_slots(runtime))
                    # a session of its own each time, so the scheduler moves between slots
                    headers = {**AUTH, "X-Session-Id": f"pin-{i}-{stream}"}
                    r = await client.post(
                        route, json={**body, "model": "tiny", "stream": stream}, headers=headers
                    )
                    assert r.status_code == 200, (route, r.text)
                    launched = await wait_for_launches(runtime, before + 1)
                    assert launched[-1] == granted_slot(runtime, engine_route), (route, stream)
            assert len({c.slot for c in runtime.client.recent if c.slot is not None}) > 1


async def test_the_engine_pins_these_routes_itself(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """The engine's truth the host relies on: ``id_slot`` places a request on the chat,
    completion and Responses routes (the host forwards them as they are)."""
    with trio.fail_after(120):
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (host, client):
            assert (await client.post("/api/models/tiny/load", headers=AUTH)).status_code == 200
            runtime = host.models["tiny"]
            for route, body, engine_route in ROUTES:
                if route != engine_route:
                    continue  # an alias, or a translation to one of these
                for slot in (2, 1):
                    before = len(launched_slots(runtime))
                    r = await direct(runtime, engine_route, {**body, "id_slot": slot})
                    assert r.status_code == 200, r.text
                    assert (await wait_for_launches(runtime, before + 1))[-1] == slot


async def test_responses_with_the_openai_sdk(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    with trio.fail_after(120):
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (_, http):
            base = str(http.base_url).rstrip("/") + "/v1"

            def scenario() -> dict[str, Any]:
                client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=30)
                out: dict[str, Any] = {}
                ask = {"model": "tiny", "max_output_tokens": 8, "prompt_cache_key": "codex-1"}
                turn: list[Any] = [{"role": "user", "content": "the cache prompt chat"}]
                out["first"] = client.responses.create(input=turn, **ask)
                turn.append({"role": "user", "content": "and then some more"})
                out["second"] = client.responses.create(input=turn, **ask)
                out["events"] = list(
                    client.responses.create(input="the cache prompt chat", stream=True, **ask)
                )
                with pytest.raises(openai.BadRequestError) as stateful:
                    client.responses.create(input="more", previous_response_id="resp_1", **ask)
                out["stateful"] = stateful.value
                with pytest.raises(openai.NotFoundError) as missing:
                    client.responses.create(model="nope", input="hi", max_output_tokens=2)
                out["missing"] = missing.value
                return out

            out = await trio.to_thread.run_sync(scenario)
    first, second = out["first"], out["second"]
    assert first.model == "tiny" and first.status == "completed"
    assert first.usage.output_tokens > 0
    # the second turn of one session reads the first's prompt from its slot
    assert second.usage.input_tokens_details.cached_tokens > 0
    kinds = [e.type for e in out["events"]]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert out["events"][-1].response.model == "tiny"
    assert "previous_response_id" in str(out["stateful"])
    assert "nope" in str(out["missing"])


async def test_slot_free_routes_answer_as_the_engine_does(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    chat = {"messages": [{"role": "user", "content": "hello world"}]}
    calls: list[tuple[str, dict[str, Any]]] = [
        ("/apply-template", chat),
        ("/v1/chat/completions/input_tokens", chat),
        ("/chat/completions/input_tokens", chat),
        ("/v1/responses/input_tokens", {"input": "hello world"}),
        ("/responses/input_tokens", {"input": "hello world"}),
        ("/tokenize", {"content": "hello world"}),
    ]
    with trio.fail_after(120):
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (host, client):
            assert (await client.post("/api/models/tiny/load", headers=AUTH)).status_code == 200
            runtime = host.models["tiny"]
            for path, body in calls:
                through = await client.post(path, json={**body, "model": "tiny"}, headers=AUTH)
                engine = await direct(runtime, path, body)
                assert through.status_code == engine.status_code, (path, through.text)
                assert through.json() == engine.json(), path
            # they hold no slot: nothing was pinned for them
            assert all(c.slot is None for c in runtime.client.recent if c.action in dict(calls))


async def test_unprefixed_aliases_answer_like_their_v1_routes(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    with trio.fail_after(120):
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (_, client):
            models = await client.get("/models", headers=AUTH)
            assert models.status_code == 200
            assert models.json() == (await client.get("/v1/models", headers=AUTH)).json()
            for path in ("/chat/completions", "/v1/chat/completions"):
                r = await client.post(path, json={**CHAT, "model": "tiny"}, headers=AUTH)
                assert r.status_code == 200 and r.json()["object"] == "chat.completion", path
            # llama-server's own /completions is its native completion
            r = await client.post(
                "/completions", json={"prompt": "hi", "n_predict": 2}, headers=AUTH
            )
            assert r.status_code == 200 and "content" in r.json()
            # /embeddings needs a model that serves them: the same 400 as /v1/embeddings
            for path in ("/embeddings", "/v1/embeddings"):
                r = await client.post(path, json={"model": "tiny", "input": "hi"}, headers=AUTH)
                assert r.status_code == 400 and r.json()["error"]["param"] == "model", path


async def test_infill_warm_up_then_completion_keeps_the_slots_cache(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """llama.vscode's rhythm: an ``n_predict: 0`` warm-up, then the real request with the
    same context, on one session: the second reads the warm-up's prompt from its slot."""
    with trio.fail_after(120):
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (host, client):
            headers = {**AUTH, "X-Session-Id": "editor-1"}
            warm = await client.post("/infill", json={**INFILL, "n_predict": 0}, headers=headers)
            assert warm.status_code == 200, warm.text
            real = await client.post("/infill", json=INFILL, headers=headers)
            assert real.status_code == 200, real.text
            runtime = host.models["tiny"]
    assert real.json()["tokens_cached"] > 0 or real.json()["timings"]["cache_n"] > 0
    slots = [c.slot for c in runtime.client.recent if c.action == "/infill"]
    assert len(slots) == 2 and slots[0] == slots[1]  # one session, one slot


async def test_rerank_through_the_host_answers_as_the_engine_does(
    models_dir: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    reranker = write_demo_reranker(models_dir / "reranker.gguf")
    cfg = make_config(
        [
            ModelConfig(
                id="rerank", path=str(reranker), parallel=2, ctx_per_slot=512, reranking=True
            )
        ],
        state_dir=state_dir,
        engine_binary=engine_binary,
        server={"api_keys": [KEY]},
    )
    body = {"query": "hello world", "documents": ["the cache", "hello there world", "slot"]}
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            answers = [
                await client.post(path, json={**body, "model": "rerank"}, headers=AUTH)
                for path in ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking")
            ]
            engine = await direct(host.models["rerank"], "/v1/rerank", body)
    assert engine.status_code == 200
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert answer.json()["results"] == engine.json()["results"]
        assert answer.json()["model"] == "rerank"


async def test_rerank_needs_a_reranking_model(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    with trio.fail_after(60):
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (_, client):
            for path in ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking"):
                r = await client.post(
                    path, json={"model": "tiny", "query": "q", "documents": ["a"]}, headers=AUTH
                )
                assert r.status_code == 400, path
                assert "reranking = true" in r.json()["error"]["message"]
            r = await client.post("/v1/rerank", json={"model": "tiny", "query": "q"}, headers=AUTH)
            assert r.status_code == 400 and r.json()["error"]["param"] == "documents"


async def test_each_route_is_recorded_under_its_path_with_its_tokens(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    with trio.fail_after(120):
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (host, client):
            for route, body, _ in (ROUTES[0], ROUTES[5]):
                for stream in (False, True):
                    r = await client.post(
                        route, json={**body, "model": "tiny", "stream": stream}, headers=AUTH
                    )
                    assert r.status_code == 200
                    _ = r.content  # the stream's body has been read: its line is written
            events = list(host.activity.requests)
            metrics = (await client.get("/metrics", headers=AUTH)).text
    for path in ("/v1/chat/completions", "/v1/responses"):
        mine = [e for e in events if e.path == path]
        assert len(mine) == 2, [e.path for e in events]
        assert all(e.completion_tokens and e.prompt_tokens for e in mine), mine
    assert 'gezel_requests_total{model="tiny",status="200"} 4.0' in metrics


# --------------------------------------------------------------------------- Anthropic


def _text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def _anthropic(base: str, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=30)


async def test_messages_with_the_anthropic_sdk(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    with trio.fail_after(120):
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (_, http):
            base = str(http.base_url).rstrip("/")

            def scenario() -> dict[str, Any]:
                client = _anthropic(base)
                out: dict[str, Any] = {}
                ask: dict[str, Any] = {
                    "model": "tiny",
                    "max_tokens": 8,
                    "system": "You are terse.",
                    "metadata": {"user_id": "user_ab12_account_cd34_session_5678-90"},
                }
                prompt = "the cache prompt chat answer question"
                turn: list[Any] = [{"role": "user", "content": prompt}]
                out["first"] = client.messages.create(messages=turn, **ask)
                turn += [
                    {"role": "assistant", "content": _text_of(out["first"]) or "answer"},
                    {"role": "user", "content": "request server host"},
                ]
                with client.messages.stream(messages=turn, **ask) as stream:
                    out["events"] = [event.type for event in stream]
                    out["streamed"] = stream.get_final_message()
                out["tokens"] = client.messages.count_tokens(model="tiny", messages=turn[:1])
                with pytest.raises(anthropic.NotFoundError) as missing:
                    client.messages.create(
                        model="nope", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
                    )
                out["missing"] = missing.value
                with pytest.raises(anthropic.BadRequestError) as bad:
                    client.messages.create(
                        model="tiny", max_tokens=-2, messages=[{"role": "user", "content": "hi"}]
                    )
                out["bad"] = bad.value
                with pytest.raises(anthropic.AuthenticationError) as unknown_key:
                    _anthropic(base, "sk-nobody").messages.create(
                        model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
                    )
                out["unknown_key"] = unknown_key.value
                return out

            out = await trio.to_thread.run_sync(scenario)
    first, streamed = out["first"], out["streamed"]
    assert first.model == "tiny" and first.type == "message" and first.role == "assistant"
    assert first.usage.output_tokens > 0 and first.stop_reason in ("end_turn", "max_tokens")
    assert streamed.model == "tiny" and streamed.usage.output_tokens > 0
    # the second turn of one Claude Code session reads the first's prompt from its slot
    assert streamed.usage.cache_read_input_tokens > 0
    assert out["events"][0] == "message_start" and "message_stop" in out["events"]
    assert out["tokens"].input_tokens > 0
    for error, kind in (
        (out["missing"], "not_found_error"),
        (out["bad"], "invalid_request_error"),
        (out["unknown_key"], "authentication_error"),
    ):
        assert error.body["type"] == "error" and error.body["error"]["type"] == kind, error.body
    assert "max_tokens" in out["bad"].body["error"]["message"]


async def test_two_keys_never_share_one_conversation_through_messages(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """One Claude Code session name sent with two API keys, on an engine of one slot:
    the second key reads none of the first's KV, and the first keeps its cache.

    Each turn continues the last one message by message, as a client's conversation
    does: parked copies are matched by their message blocks (``KvStore.find``), so a
    turn that rewrote its one message would be another conversation of the owner."""
    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=1, ctx_per_slot=1024)],
        state_dir=state_dir,
        engine_binary=engine_binary,
        server={"api_keys": [KEY, OTHER_KEY]},
    )
    conversation = "the model token hello world slot engine cache prompt chat answer"
    first_turn = [{"role": "user", "content": conversation}]
    second_turn = [
        *first_turn,
        {"role": "assistant", "content": "slot engine"},
        {"role": "user", "content": "question"},
    ]
    third_turn = [
        *second_turn,
        {"role": "assistant", "content": "cache prompt"},
        {"role": "user", "content": "request"},
    ]
    with trio.fail_after(120):
        async with running(cfg) as (_, http):
            base = str(http.base_url).rstrip("/")

            def cached(key: str, messages: list[Any]) -> int:
                message = _anthropic(base, key).messages.create(
                    model="tiny",
                    max_tokens=2,
                    messages=messages,
                    extra_headers={"X-Claude-Code-Session-Id": "one-session"},
                )
                return int(message.usage.cache_read_input_tokens or 0)

            def scenario() -> list[int]:
                return [
                    cached(KEY, first_turn),
                    cached(KEY, second_turn),
                    cached(OTHER_KEY, second_turn),
                    cached(KEY, third_turn),
                ]

            first, again, other, back = await trio.to_thread.run_sync(scenario)
    assert first == 0 and again > 0  # the owner's second turn reads its first
    assert other == 0  # another key, the same name and prompt, on the same slot: nothing
    assert back > 0  # the owner's KV was parked, not lost


async def test_messages_errors_of_the_host_itself_are_in_anthropics_shape(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """A body over the limit (413), a full queue (503 with Retry-After), and an engine
    killed mid-stream (an ``event: error`` after the events already sent)."""
    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=1, ctx_per_slot=2048)],
        state_dir=state_dir,
        engine_binary=engine_binary,
        server={"api_keys": [KEY], "max_body_bytes": 64 * 1024},
        scheduler={"max_queue": 1},
    )
    long_chat = {**CHAT, "model": "tiny", "max_tokens": 1500, "ignore_eos": True}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            big = {**MESSAGES_BODY, "model": "tiny", "system": "x" * 70_000}
            too_big = await client.post("/v1/messages", json=big, headers=headers)
            assert too_big.status_code == 413
            assert too_big.json()["error"]["type"] == "request_too_large"

            runtime = host.models["tiny"]
            scheduler = host.scheduler
            assert scheduler is not None
            async with trio.open_nursery() as nursery:
                # one request on the only slot, one queued: the queue is full
                for _ in range(2):
                    nursery.start_soon(
                        partial(client.post, "/v1/chat/completions", json=long_chat, headers=AUTH)
                    )
                await wait_until(
                    lambda: sum(scheduler.statistics().waiting_model_ids.values()) == 1,
                    within=30,
                    what="a request running and one queued",
                )
                full = await client.post(
                    "/v1/messages", json={**MESSAGES_BODY, "model": "tiny"}, headers=headers
                )
                assert full.status_code == 503, full.text
                assert full.json()["error"]["type"] == "overloaded_error"
                assert int(full.headers["retry-after"]) >= 1
                nursery.cancel_scope.cancel()
            await wait_nothing_held(host)

            events: list[str] = []
            stream = {  # greedy on this prompt, the demo model never stops early
                "model": "tiny",
                "max_tokens": 1500,
                "temperature": 0,
                "messages": [{"role": "user", "content": "the cache prompt chat"}],
                "stream": True,
            }
            async with client.stream("POST", "/v1/messages", json=stream, headers=headers) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()
                async for line in lines:
                    if line.startswith("event: "):
                        events.append(line[7:])
                    if events.count("content_block_delta") >= 2:
                        break
                assert runtime.engine.pid is not None
                os.kill(runtime.engine.pid, signal.SIGKILL)
                async for line in lines:
                    if line.startswith("event: "):
                        events.append(line[7:])
                    elif line.startswith("data: ") and events[-1] == "error":
                        error = json.loads(line[6:])
    assert events[0] == "message_start" and events[-1] == "error", events
    assert "message_stop" not in events
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "tiny" in error["error"]["message"]


async def test_audio_transcriptions_answer_as_the_engine_does(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """A model without an audio projector: the same status and body through the host as
    directly (the engine's own refusal), with the official SDK's multipart upload."""
    wav = b"RIFF$\x00\x00\x00WAVEfmt \x10\x00\x00\x00\x01\x00\x01\x00\x80>\x00\x00"
    wav += b"\x00}\x00\x00\x02\x00\x10\x00data\x00\x00\x00\x00"
    with trio.fail_after(120):
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (host, http):
            assert (await http.post("/api/models/tiny/load", headers=AUTH)).status_code == 200
            engine_url = host.models["tiny"].engine.base_url
            assert engine_url is not None
            base = str(http.base_url).rstrip("/")

            def transcribe(url: str) -> openai.APIStatusError:
                client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
                with pytest.raises(openai.APIStatusError) as refused:
                    client.audio.transcriptions.create(model="tiny", file=("a.wav", wav))
                return refused.value

            through = await trio.to_thread.run_sync(transcribe, base)
            direct_ = await trio.to_thread.run_sync(transcribe, engine_url)
            no_file = await http.post(
                "/v1/audio/transcriptions", files={"model": (None, "tiny")}, headers=AUTH
            )
    assert direct_.status_code == through.status_code == 501
    assert through.body == direct_.body
    assert no_file.status_code == 400 and no_file.json()["error"]["param"] == "file"


@pytest.mark.parametrize("mode", ["shared", "conversation", "blind"])
async def test_keyless_modes_over_http(
    mode: str, tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """Two keyless chats of one key taking turns on one slot, and a second key's chat
    with the first's very prompt. What each reads from the cache, as the engine reports
    it: never anything across keys; the same chat's earlier turn in ``shared`` mode only
    while it holds the slot, in ``conversation`` mode even after the other chat took
    the slot (its KV was parked), and never in ``blind`` mode."""
    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=1, ctx_per_slot=1024)],
        state_dir=state_dir,
        engine_binary=engine_binary,
        server={"api_keys": [KEY, OTHER_KEY]},
        scheduler={"keyless": mode},
    )
    system = {"role": "system", "content": "the model token hello world slot engine cache"}

    def chat(opening: str, turns: int) -> list[dict[str, str]]:
        out = [system, {"role": "user", "content": opening}]
        for i in range(turns):
            out += [
                {"role": "assistant", "content": f"answer {i}"},
                {"role": "user", "content": f"question {i}"},
            ]
        return out

    async def cached(client: Any, messages: list[dict[str, str]], key: str = KEY) -> int:
        r = await client.post(
            CHAT_ROUTE,
            json={"model": "tiny", "messages": messages, "max_tokens": 2},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    with trio.fail_after(120):
        async with running(cfg) as (_, client):
            a1 = await cached(client, chat("prompt chat answer", 0))
            a2 = await cached(client, chat("prompt chat answer", 1))  # A continues
            b1 = await cached(client, chat("request server host", 0))  # B takes the slot
            a3 = await cached(client, chat("prompt chat answer", 2))  # A comes back
            other = await cached(client, chat("prompt chat answer", 2), OTHER_KEY)
    assert a1 == 0 and other == 0  # nothing crosses keys, in every mode
    if mode == "blind":
        assert a2 == b1 == a3 == 0
    else:
        assert a2 > 0  # its own earlier turn, in its slot
    if mode == "shared":
        assert b1 > 0 and a3 > 0  # one owner: the shared system prompt stays in the slot
    if mode == "conversation":
        assert b1 == 0  # another conversation: the slot was parked and erased first
        assert a3 > a2  # A's KV came back from its parked copy, with its second turn


LONG = "the cache prompt chat"  # greedy on this prompt, the demo model never stops early


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/messages", {"max_tokens": 1000, "temperature": 0, "stream": True}),
        ("/v1/messages", {"max_tokens": 1000, "temperature": 0, "stream": False}),
        ("/v1/responses", {"max_output_tokens": 1000, "temperature": 0, "stream": True}),
        ("/v1/responses", {"max_output_tokens": 1000, "temperature": 0, "stream": False}),
    ],
)
async def test_a_client_that_walks_away_stops_generation_within_a_second(
    route: str,
    body: dict[str, Any],
    tiny_model: Path,
    state_dir: Path,
    engine_binary: EngineBinary,
) -> None:
    """A long answer on the translated (Anthropic) and forwarded (Responses) routes,
    streamed or not: the client leaves once the engine is generating, and the engine's
    own ``/slots`` shows the slot idle within 1 s, with nothing held by the host."""
    prompt = (
        {"messages": [{"role": "user", "content": LONG}]} if route == "/v1/messages"
        else {"input": [{"role": "user", "content": LONG}]}
    )  # fmt: skip
    with trio.fail_after(120):
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (host, client):
            assert (await client.post("/api/models/tiny/load", headers=AUTH)).status_code == 200
            base_url = host.models["tiny"].engine.base_url
            assert base_url is not None

            async def ask() -> None:
                await client.post(route, json={**prompt, **body, "model": "tiny"}, headers=AUTH)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask)
                await wait_until(lambda: _busy(base_url), within=20, what="the engine generating")
                nursery.cancel_scope.cancel()  # the client walks away
            await wait_until(lambda: _idle(base_url), within=1.0, what="the slot idle")
            await wait_nothing_held(host)


async def _busy(base_url: str) -> bool:
    return bool(await slots_busy(base_url))


async def _idle(base_url: str) -> bool:
    return not await slots_busy(base_url)
