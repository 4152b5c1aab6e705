"""A new session of a model that cannot cut a slot back (recurrent, hybrid) starts from
its caller's lead: the system prompt and tools, prefilled alone and saved once, then
restored into the slot of each new session of the same caller (gezel_trio.kv.lead).

First the lead of a request, without I/O; then the engine's truth on a bare
llama-server (a lead prefilled alone is a token prefix of its request: the request
reuses all of it, and nothing of a lead it diverges from) and the host against it, for
a Mamba model and a Qwen3.5-style hybrid: a second session of the caller reuses
exactly the lead's tokens, another caller's none, and a model whose template renders
the lead otherwise when the conversation goes on stops making leads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.demo_model import write_demo_model
from gezel_trio.host.completion import Completion, prompt_blocks, request_lead
from gezel_trio.kv.lead import MIN_LEAD_CHARS, lead_owner
from gezel_trio.kv.prefix import is_prefix

from ._engine_bin import ENGINE_LIMITS, open_llama_server
from .conftest import make_config, running
from .test_caller_prefix import _idle, _parking

SYSTEM = "You are a careful coding agent. Read before you write, and say what you did. " * 14
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the workspace",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
KEY_ANN, KEY_BEA = "key-ann-0123456789", "key-bea-0123456789"


def _chat(user: str, *, system: str = SYSTEM, tools: list[Any] = TOOLS) -> dict[str, Any]:
    return {
        "model": "rec",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "tools": tools,
        "max_tokens": 2,
        "temperature": 0,
    }


def _lead(body: dict[str, Any], path: str = "/v1/chat/completions") -> Any:
    return request_lead(Completion(path, body, "chat", stream=False))


# ------------------------------------------------------------------------ no I/O


def test_a_chat_leads_with_its_system_messages_and_tools() -> None:
    body = _chat("hello")
    lead = _lead(body)
    assert lead is not None
    assert lead.body["messages"] == body["messages"][:1]
    assert lead.body["tools"] == TOOLS
    # prefilled alone: no generation prompt, nothing generated, not streamed
    assert lead.body["add_generation_prompt"] is False
    assert lead.body["max_tokens"] == 0 and lead.body["stream"] is False
    assert "temperature" not in lead.body
    # its blocks are a prefix of the request's, cut the same way
    whole = prompt_blocks(body)
    assert is_prefix(lead.blocks, whole) and len(lead.blocks) < len(whole)
    # another session with the same system prompt and tools has the same lead
    assert _lead(_chat("something else entirely")) == lead
    assert _lead(_chat("hello", tools=[])) != lead
    assert _lead(_chat("hello", system=SYSTEM + "!")) != lead


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "system", "content": SYSTEM}],  # all lead: nothing goes on from it
        [{"role": "user", "content": SYSTEM}, {"role": "user", "content": "hi"}],  # none
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    ],
    ids=["all-lead", "no-system", "too-short"],
)
def test_no_lead_worth_a_snapshot(messages: list[dict[str, str]]) -> None:
    assert _lead({"messages": messages}) is None
    assert len('"Be brief."') < MIN_LEAD_CHARS


def test_a_responses_request_leads_with_its_instructions_and_developer_items() -> None:
    developer = {"type": "message", "role": "developer", "content": "Sandbox: read-only."}
    user = {"type": "message", "role": "user", "content": "fix the bug"}
    body = {"instructions": SYSTEM, "input": [developer, user], "tools": [], "stream": True}
    lead = _lead(body, "/v1/responses")
    assert lead is not None and lead.path == "/v1/responses"
    assert lead.body["input"] == [developer] and lead.body["instructions"] == SYSTEM
    assert lead.body["max_output_tokens"] == 0 and lead.body["stream"] is False
    assert is_prefix(lead.blocks, prompt_blocks(body))
    # instructions alone are a lead too
    alone = _lead({"instructions": SYSTEM, "input": [user]}, "/v1/responses")
    assert alone is not None and alone.body["input"] == []


def test_a_snapshot_is_its_callers_own() -> None:
    lead = _lead(_chat("hello"))
    assert lead is not None
    ann, bea = "a" * 64, "b" * 64
    assert lead.for_caller(ann).owner == lead_owner(ann, lead) != lead_owner(bea, lead)
    assert len(lead.for_caller(ann).owner) == 64


# ------------------------------------------------------------------------ the engine


@pytest.fixture(scope="module", params=["mamba", "qwen35"])
def recurrent_model(request: pytest.FixtureRequest, models_dir: Path) -> Path:
    path = models_dir / f"lead-{request.param}.gguf"
    if not path.exists():
        write_demo_model(path, size="tiny", arch=request.param)
    return path


HALF = SYSTEM[: len(SYSTEM) // 2] + "Never mind all that. " * 20


async def _engine_truth(model: Path) -> tuple[int, int, int, int]:
    """On a bare llama-server, one slot: the lead's tokens prefilled alone, then what
    the request reuses of it, then what a request whose system prompt diverges
    halfway reuses of it (at most what the two share: the engine rolls its state back
    only to a checkpoint of its own), and that request's own lead's tokens."""
    lead, other = _lead(_chat("first")), _lead(_chat("x", system=HALF))
    assert lead is not None and other is not None
    async with (
        open_llama_server(model, parallel=1, ctx=2048) as bare,
        httpx.AsyncClient(base_url=bare.base_url, limits=ENGINE_LIMITS, timeout=60) as direct,
    ):

        async def post(body: dict[str, Any]) -> dict[str, Any]:
            r = await direct.post("/v1/chat/completions", json={**body, "id_slot": 0})
            assert r.status_code == 200, r.text
            usage: dict[str, Any] = r.json()["usage"]
            return usage

        tokens = (await post({**lead.body, "cache_prompt": False}))["prompt_tokens"]
        reused = (await post(_chat("second")))["prompt_tokens_details"]["cached_tokens"]
        await post({**lead.body, "cache_prompt": False})
        diverged = (await post(_chat("x", system=HALF)))["prompt_tokens_details"]["cached_tokens"]
        own = (await post({**other.body, "cache_prompt": False}))["prompt_tokens"]
        return tokens, reused, diverged, own


def _config(model: Path, state_dir: Path, engine_binary: EngineBinary, *args: str) -> Any:
    return make_config(
        [ModelConfig(id="rec", path=str(model), parallel=1, ctx_per_slot=2048, args=list(args))],
        state_dir=state_dir,
        engine_binary=engine_binary,
        server={"api_keys": [KEY_ANN, KEY_BEA]},
    )


async def _send(client: httpx.AsyncClient, key: str, session: str, body: dict[str, Any]) -> int:
    """One chat of ``key``'s caller in ``session``: the engine's cached tokens."""
    r = await client.post(
        "/v1/chat/completions",
        json={**body, "prompt_cache_key": session},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_a_new_session_of_the_caller_starts_from_its_lead(
    recurrent_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """One slot. Ann's first session prefills the lead alone and saves it; her second
    session (another user message) has it restored and reuses exactly its tokens, as
    many as the bare engine reuses of a lead prefilled alone. Bea's session with the
    very same request reuses none of Ann's (she gets a lead of her own); a session
    whose system prompt diverges
    halfway starts from a lead of its own (the engine's cached count is then that
    lead's, prefilled just before)."""
    with trio.fail_after(240):
        tokens, reused, diverged, own = await _engine_truth(recurrent_model)
        assert tokens > 100 and reused == tokens and diverged < tokens
        cfg = _config(recurrent_model, state_dir, engine_binary)
        async with running(cfg) as (host, client):
            assert not host.models["rec"].cuts_back
            assert await _send(client, KEY_ANN, "chat-1", _chat("first")) == tokens
            assert _parking(host)["leads_saved"] == 1
            await _idle(host)
            assert await _send(client, KEY_ANN, "chat-2", _chat("second")) == tokens
            assert _parking(host)["leads_restored"] == 1
            await _idle(host)
            assert await _send(client, KEY_BEA, "bea-1", _chat("second")) == tokens
            assert _parking(host)["leads_saved"] == 2  # her own, not Ann's
            assert _parking(host)["leads_restored"] == 1
            await _idle(host)
            assert await _send(client, KEY_ANN, "chat-3", _chat("x", system=HALF)) == own
            assert _parking(host)["leads_saved"] == 3
            assert _parking(host)["leads_failed"] == 0
            assert host.models["rec"].leads_off is None
            kv = host.kv
            assert kv is not None
            owners = {e.session for e in kv.sessions()}
            ann, bea = host.sessions.caller(KEY_ANN), host.sessions.caller(KEY_BEA)
            lead = _lead(_chat("x"))
            assert lead is not None
            assert {lead_owner(ann, lead), lead_owner(bea, lead)} <= owners


LENGTH_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'system' -%}{{- messages|length -}}{%- endif -%}"
    "{{- message['content'] -}}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


async def test_a_lead_the_template_renders_otherwise_turns_leads_off(
    models_dir: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """A template that renders the system message with the number of messages: the
    lead alone is no prefix of its request. The engine reuses none of it (it clears
    the slot, the answer is the model's as without a lead), and the host stops making
    leads for the model; the next session is sent as before."""
    model = models_dir / "lead-mamba-otherwise.gguf"
    if not model.exists():
        write_demo_model(model, size="tiny", arch="mamba")
    cfg = _config(model, state_dir, engine_binary, "--chat-template", LENGTH_TEMPLATE)
    with trio.fail_after(180):
        async with running(cfg) as (host, client):
            assert await _send(client, KEY_ANN, "chat-1", _chat("first")) == 0
            assert _parking(host)["leads_saved"] == 1
            assert host.models["rec"].leads_off is not None
            await _idle(host)
            assert await _send(client, KEY_ANN, "chat-2", _chat("second")) == 0
            assert _parking(host)["leads_restored"] == 0
            assert _parking(host)["leads_saved"] == 1
