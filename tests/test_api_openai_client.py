"""The official ``openai`` Python client against the host: sync and async, streaming and not.

The sync client runs in a worker thread; the async one (anyio on asyncio)
runs in its own ``asyncio.run`` inside a worker thread, while Trio serves.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import openai
import pytest
import trio

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.kv.sessions import session_hash

from .conftest import make_config, running

KEY = "sk-test-openai-client"
MESSAGES: Any = [{"role": "user", "content": "Tell me a story."}]


def _cfg(tiny_model: Path, state_dir: Path, engine_binary: EngineBinary) -> Any:
    return make_config(
        [
            ModelConfig(id="tiny", path=str(tiny_model), parallel=2, ctx_per_slot=512),
            ModelConfig(
                id="tiny-embed",
                path=str(tiny_model),
                parallel=1,
                ctx_per_slot=256,
                embeddings=True,
                args=["--pooling", "mean"],
            ),
        ],
        state_dir=state_dir,
        engine_binary=engine_binary,
        server={"api_keys": [KEY]},
    )


def _request_sessions(caplog: pytest.LogCaptureFixture) -> list[str | None]:
    return [
        r.fields.get("session")  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "gezel_trio.requests" and isinstance(getattr(r, "fields", None), dict)
    ]


async def test_sync_client(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gezel_trio.requests")
    with trio.fail_after(60):
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (host, http):
            base = str(http.base_url).rstrip("/") + "/v1"

            def scenario() -> dict[str, Any]:
                out: dict[str, Any] = {}
                client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=30)
                chat = client.chat.completions.create(
                    model="tiny", messages=MESSAGES, max_tokens=12, temperature=0, seed=1
                )
                out["chat"] = chat
                stream = client.chat.completions.create(
                    model="tiny",
                    messages=MESSAGES,
                    max_tokens=12,
                    temperature=0,
                    seed=1,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                out["chunks"] = list(stream)
                out["chunks_no_usage"] = list(
                    client.chat.completions.create(
                        model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, stream=True
                    )
                )
                out["text"] = client.completions.create(
                    model="tiny", prompt="Once upon", max_tokens=6, temperature=0
                )
                out["text_chunks"] = list(
                    client.completions.create(
                        model="tiny",
                        prompt="Once upon",
                        max_tokens=6,
                        temperature=0,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                )
                out["models"] = list(client.models.list())
                out["model"] = client.models.retrieve("tiny")
                # the session: X-Session-Id header, and prompt_cache_key winning over it
                client.chat.completions.create(
                    model="tiny",
                    messages=MESSAGES,
                    max_tokens=2,
                    extra_headers={"X-Session-Id": "header-session"},
                )
                client.chat.completions.create(
                    model="tiny",
                    messages=MESSAGES,
                    max_tokens=2,
                    extra_headers={"X-Session-Id": "header-session"},
                    extra_body={"prompt_cache_key": "body-session"},
                )
                emb = client.embeddings.create(model="tiny-embed", input=["hello", "world"])
                out["embeddings"] = emb
                with pytest.raises(openai.BadRequestError) as bad:
                    client.embeddings.create(model="tiny", input="hello")
                out["bad_embed"] = bad.value
                with pytest.raises(openai.NotFoundError) as missing:
                    client.chat.completions.create(model="nope", messages=MESSAGES)
                out["missing"] = missing.value
                wrong = openai.OpenAI(base_url=base, api_key="sk-wrong", max_retries=0)
                with pytest.raises(openai.AuthenticationError) as denied:
                    wrong.models.list()
                out["denied"] = denied.value
                return out

            out = await trio.to_thread.run_sync(scenario)

            chat = out["chat"]
            assert chat.object == "chat.completion"
            assert chat.choices[0].message.role == "assistant"
            assert isinstance(chat.choices[0].message.content, str)
            assert chat.usage is not None and chat.usage.completion_tokens > 0

            # streaming: deltas, then (include_usage) one final chunk with usage and no choices
            chunks = out["chunks"]
            assert all(c.object == "chat.completion.chunk" for c in chunks)
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert streamed == chat.choices[0].message.content  # greedy, same seed
            assert [c.usage is not None for c in chunks].count(True) == 1
            last = chunks[-1]
            assert last.choices == [] and last.usage is not None
            assert last.usage.completion_tokens == chat.usage.completion_tokens
            assert last.usage.prompt_tokens == chat.usage.prompt_tokens
            assert any(c.choices and c.choices[0].finish_reason for c in chunks)
            assert all(c.usage is None for c in out["chunks_no_usage"])

            text = out["text"]
            assert text.object == "text_completion" and text.usage.completion_tokens > 0
            text_chunks = out["text_chunks"]
            assert (
                "".join(c.choices[0].text for c in text_chunks if c.choices) == text.choices[0].text
            )
            assert text_chunks[-1].usage is not None
            assert text_chunks[-1].usage.completion_tokens == text.usage.completion_tokens

            models = {m.id: m for m in out["models"]}
            assert set(models) == {"tiny", "tiny-embed"}
            assert models["tiny"].owned_by == "gezel-trio"
            assert abs(models["tiny"].created - host.started_at) < 60
            assert (models["tiny"].model_extra or {})["state"] == "ready"
            assert out["model"].id == "tiny"

            emb = out["embeddings"]
            assert [d.index for d in emb.data] == [0, 1]
            assert len(emb.data[0].embedding) == len(emb.data[1].embedding) > 0
            assert emb.data[0].embedding != emb.data[1].embedding
            assert out["bad_embed"].status_code == 400
            assert "does not serve embeddings" in str(out["bad_embed"])
            assert out["missing"].status_code == 404
            assert out["denied"].status_code == 401

    sessions = _request_sessions(caplog)
    caller = host.sessions.caller(KEY)  # sessions are scoped to the key that sent them
    header = session_hash(host.sessions.session(caller, "header-session"))
    body = session_hash(host.sessions.session(caller, "body-session"))
    assert header in sessions
    assert body in sessions
    assert sessions.index(body) > sessions.index(header)


async def test_async_client(tiny_model: Path, state_dir: Path, engine_binary: EngineBinary) -> None:
    with trio.fail_after(60):
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (host, http):
            base = str(http.base_url).rstrip("/") + "/v1"

            async def scenario() -> dict[str, Any]:
                out: dict[str, Any] = {}
                async with openai.AsyncOpenAI(
                    base_url=base, api_key=KEY, max_retries=0, timeout=30
                ) as client:
                    out["chat"] = await client.chat.completions.create(
                        model="tiny", messages=MESSAGES, max_tokens=10, temperature=0
                    )
                    stream = await client.chat.completions.create(
                        model="tiny",
                        messages=MESSAGES,
                        max_tokens=10,
                        temperature=0,
                        stream=True,
                        stream_options={"include_usage": True},
                        extra_headers={"X-Session-Id": "async-session"},
                    )
                    out["chunks"] = [c async for c in stream]

                    # two streams at once, on the two slots
                    async def one(i: int) -> list[Any]:
                        s = await client.completions.create(
                            model="tiny",
                            prompt=f"Story {i}:",
                            max_tokens=8,
                            temperature=0,
                            stream=True,
                            extra_body={"prompt_cache_key": f"parallel-{i}"},
                        )
                        return [c async for c in s]

                    out["parallel"] = await asyncio.gather(one(0), one(1))
                    out["models"] = [m async for m in client.models.list()]
                    out["emb"] = await client.embeddings.create(model="tiny-embed", input="hello")
                return out

            out = await trio.to_thread.run_sync(lambda: asyncio.run(scenario()))

            assert out["chat"].choices[0].message.content is not None
            chunks = out["chunks"]
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert streamed == out["chat"].choices[0].message.content
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
            for stream in out["parallel"]:
                assert stream and stream[-1].choices[0].finish_reason in ("length", "stop")
            owners = host.scheduler.statistics().as_dict()["slot_owners"]["tiny"]  # type: ignore[union-attr]
            assert sum(1 for o in owners.values() if o) == 2  # each session holds a slot
            assert {m.id for m in out["models"]} == {"tiny", "tiny-embed"}
            assert len(out["emb"].data) == 1 and len(out["emb"].data[0].embedding) > 0
