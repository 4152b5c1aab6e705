"""Sessions belong to callers.

- :class:`SessionKeys` on its own: the secret in the state dir (created 0600,
  stable across reloads, replaced when corrupt), identities that are HMACs and
  never a raw key or name, two callers with one name apart.
- Against a real llama-server through the host: two API keys that send the same
  long prompt under the same ``prompt_cache_key`` never share the one slot's KV,
  a parked file or a cache hit, and no raw name or key (nor its unsalted hash)
  shows in status, metrics, logs or park file names.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.demo_model import EOS_ID
from gezel_trio.engine.supervisor import default_slot_save_dir
from gezel_trio.host import Host
from gezel_trio.kv.sessions import (
    KEY_FILE,
    SECRET_BYTES,
    SessionKeys,
    _create_secret,
    is_session_id,
    session_hash,
)

from .conftest import make_config, running
from .fault_tools import wait_nothing_held

KEY1 = "sk-tenant-one-0123456789"
KEY2 = "sk-tenant-two-9876543210"
NAME = "shared-chat-name-7f3a"


def _unsalted(name: str) -> str:
    """What the session hash was before sessions had callers."""
    return hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]


# --------------------------------------------------------------------------- SessionKeys


def test_the_secret_is_created_private_and_stable_across_reloads(tmp_path: Path) -> None:
    keys = SessionKeys.load(tmp_path)
    path = tmp_path / KEY_FILE
    assert keys.path == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(path.read_bytes()) == SECRET_BYTES
    assert [p.name for p in tmp_path.iterdir()] == [KEY_FILE]  # no temporary file left
    again = SessionKeys.load(tmp_path)
    for api_key in (None, KEY1):
        assert again.caller(api_key) == keys.caller(api_key)
        c = keys.caller(api_key)
        assert again.session(c, NAME) == keys.session(c, NAME)


def test_different_state_dirs_give_different_identities(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = SessionKeys.load(tmp_path / "a"), SessionKeys.load(tmp_path / "b")
    assert a.caller(KEY1) != b.caller(KEY1)
    assert a.caller(None) != b.caller(None)
    assert a.session(a.caller(KEY1), NAME) != b.session(b.caller(KEY1), NAME)
    assert session_hash(a.session(a.caller(None), NAME)) != session_hash(
        b.session(b.caller(None), NAME)
    )


def test_two_callers_with_one_name_are_two_sessions() -> None:
    keys = SessionKeys(os.urandom(SECRET_BYTES))
    callers = [keys.caller(None), keys.caller(""), keys.caller(KEY1), keys.caller(KEY2)]
    assert len(set(callers)) == 4  # the local caller is no key's, not even the empty one's
    sessions = {keys.session(c, NAME) for c in callers}
    assert len(sessions) == 4
    assert len({session_hash(s) for s in sessions}) == 4
    # one caller, one name: one session; another name: another
    c = keys.caller(KEY1)
    assert keys.session(c, NAME) == keys.session(c, NAME)
    assert keys.session(c, NAME) != keys.session(c, NAME + "x")


def test_no_raw_key_name_or_secret_in_any_output() -> None:
    secret = os.urandom(SECRET_BYTES)
    keys = SessionKeys(secret)
    names = [NAME, "chat-1", "", "ü-ünïcödé", "\ud800-lone-surrogate", "x" * 512]
    outputs: list[str] = [repr(keys)]
    for api_key in (None, KEY1, KEY2):
        caller = keys.caller(api_key)
        outputs.append(caller)
        for name in names:
            session = keys.session(caller, name)
            assert is_session_id(session) and is_session_id(caller)
            display = session_hash(session)
            assert display == session[:16]  # the display form is a prefix of the HMAC
            outputs += [session, display]
    text = "\n".join(outputs)
    for raw in (KEY1, KEY2, NAME, "chat-1", "ünïcödé", secret.hex(), _unsalted(NAME)):
        assert raw not in text
    for name in names:
        assert _unsalted(name) not in text


def test_a_session_needs_a_caller_identity() -> None:
    keys = SessionKeys(os.urandom(SECRET_BYTES))
    with pytest.raises(ValueError, match="caller"):
        keys.session(KEY1, NAME)  # a raw key is not a caller
    with pytest.raises(ValueError, match="32 bytes"):
        SessionKeys(b"short")


def test_session_hash_never_shows_a_raw_name() -> None:
    """Names handed to the scheduler directly (its own tests) are hashed, not shown."""
    assert session_hash(None) is None
    assert session_hash("chat-1") == _unsalted("chat-1")
    assert session_hash("secret-chat-key") != "secret-chat-key"


@pytest.mark.parametrize(
    "content", [b"", b"short", b"x" * (SECRET_BYTES + 1)], ids=["empty", "short", "long"]
)
def test_a_corrupt_secret_is_replaced_with_a_warning(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / KEY_FILE
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="gezel_trio.kv.sessions"):
        keys = SessionKeys.load(tmp_path)
    assert any("replacing it" in r.getMessage() for r in caplog.records)
    assert len(path.read_bytes()) == SECRET_BYTES
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert SessionKeys.load(tmp_path).caller(KEY1) == keys.caller(KEY1)  # stable from now on


def test_a_secret_readable_by_others_is_made_private(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / KEY_FILE
    secret = os.urandom(SECRET_BYTES)
    path.write_bytes(secret)
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="gezel_trio.kv.sessions"):
        keys = SessionKeys.load(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert any("0600" in r.getMessage() for r in caplog.records)
    assert keys.caller(KEY1) == SessionKeys(secret).caller(KEY1)  # the same secret, kept


def test_creation_never_clobbers_a_secret_that_appeared_meanwhile(tmp_path: Path) -> None:
    """Two processes starting on one state dir end up with one secret: the first one's."""
    path = tmp_path / KEY_FILE
    theirs = os.urandom(SECRET_BYTES)
    path.write_bytes(theirs)
    path.chmod(0o600)
    assert _create_secret(path, replace=False) == theirs
    assert path.read_bytes() == theirs
    assert [p.name for p in tmp_path.iterdir()] == [KEY_FILE]


# --------------------------------------------------------------------------- through the host

CHAT_PATH = "/v1/chat/completions"
LONG = " ".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." for i in range(24))


def _body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": LONG}],
        "temperature": 0,
        "max_tokens": 2,
        **extra,
    }


async def _turn(
    host: Host,
    client: httpx.AsyncClient,
    api_key: str,
    *,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> tuple[list[str], int]:
    """One keyed chat turn under ``api_key``: (the upstream calls sent for it, up to and
    including its completion; its cached tokens)."""
    upstream = host.models["tiny"].client
    since = upstream.recent[-1].seq if upstream.recent else 0
    resp = await client.post(
        CHAT_PATH,
        json=_body(**extra),
        headers={"Authorization": f"Bearer {api_key}", **(headers or {})},
    )
    assert resp.status_code == 200, resp.text
    await wait_nothing_held(host)
    calls = [c.action for c in upstream.recent if c.seq > since and c.action != "slots"]
    cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return calls[: calls.index(CHAT_PATH) + 1], cached


def _hash_of(host: Host, api_key: str, name: str) -> str:
    shown = session_hash(host.sessions.session(host.sessions.caller(api_key), name))
    assert shown is not None
    return shown


def _log_text(records: list[logging.LogRecord]) -> str:
    return "\n".join(
        f"{r.getMessage()} {json.dumps(getattr(r, 'fields', None), default=str)}" for r in records
    )


async def test_two_keys_with_one_session_name_share_nothing(
    tiny_model: Path,
    state_dir: Path,
    engine_binary: EngineBinary,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=1, ctx_per_slot=2048)],
        state_dir=state_dir,
        engine_binary=engine_binary,
        server={"api_keys": [KEY1, KEY2]},
        scheduler={"save_idle_slots": False},  # every save at its handoff, counted there
    )
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            # key 1's chat, twice: the second turn reuses its own KV
            assert await _turn(host, client, KEY1, prompt_cache_key=NAME) == ([CHAT_PATH], 0)
            calls, cached = await _turn(host, client, KEY1, prompt_cache_key=NAME)
            assert calls == [CHAT_PATH] and cached > 0
            first_cached = cached

            # key 2, the same name and prompt, on the one slot: another session. Key 1's KV
            # is parked, key 2's completion is sent with cache_prompt off (the engine
            # empties the slot, no erase call), and nothing is cached.
            calls, cached = await _turn(host, client, KEY2, prompt_cache_key=NAME)
            assert calls == ["save", CHAT_PATH]
            assert cached == 0

            # key 1 returns: key 2 is parked under its own file, key 1's own KV is restored
            calls, cached = await _turn(host, client, KEY1, prompt_cache_key=NAME)
            assert calls == ["save", "restore", CHAT_PATH] and cached > 0
            # key 2 again, naming its chat by header this time: its own parked KV comes back
            calls, cached = await _turn(host, client, KEY2, headers={"X-Session-Id": NAME})
            assert calls == ["save", "restore", CHAT_PATH] and 0 < cached <= first_cached

            h1, h2 = _hash_of(host, KEY1, NAME), _hash_of(host, KEY2, NAME)
            assert h1 != h2
            parked = sorted(p.name for p in default_slot_save_dir(state_dir, "tiny").iterdir())
            # one file per session, named by its hash (kv-<hash>-<save stamp>.bin)
            assert sorted(name.split("-")[1] for name in parked) == sorted([h1, h2])

            # a bad session name is still a 400 naming the field
            for bad in ("x" * 513, 42):
                resp = await client.post(
                    CHAT_PATH,
                    json=_body(prompt_cache_key=bad),
                    headers={"Authorization": f"Bearer {KEY1}"},
                )
                assert resp.status_code == 400, resp.text
                assert resp.json()["error"]["param"] == "prompt_cache_key"

            auth = {"Authorization": f"Bearer {KEY1}"}
            status = (await client.get("/api/status", headers=auth)).text
            metrics = (await client.get("/metrics", headers=auth)).text
            assert h2 in json.dumps(json.loads(status)["scheduler"]["slot_owners"])

    logged = [
        r.fields["session"]  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "gezel_trio.requests" and isinstance(getattr(r, "fields", None), dict)
    ]
    assert logged[:5] == [h1, h1, h2, h1, h2]
    outputs = "\n".join([status, metrics, _log_text(caplog.records), *parked])
    for raw in (NAME, KEY1, KEY2, _unsalted(NAME), _unsalted(KEY1), _unsalted(KEY2)):
        assert raw not in outputs


async def test_without_keys_there_is_one_scope(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """A local single user: a name is the same session however it is sent, and the
    hash shown is the local caller's HMAC, not the name's plain hash."""
    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=1, ctx_per_slot=2048)],
        state_dir=state_dir,
        engine_binary=engine_binary,
    )
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            upstream = host.models["tiny"].client
            for headers, extra in (({}, {"prompt_cache_key": NAME}), ({"X-Session-Id": NAME}, {})):
                since = upstream.recent[-1].seq if upstream.recent else 0
                resp = await client.post(CHAT_PATH, json=_body(**extra), headers=headers)
                assert resp.status_code == 200, resp.text
                await wait_nothing_held(host)
                calls = [c.action for c in upstream.recent if c.seq > since]
                assert "erase" not in calls and "restore" not in calls
            assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert host.scheduler is not None
            owners = host.scheduler.statistics().slot_owners["tiny"]
            shown = session_hash(host.sessions.session(host.sessions.caller(None), NAME))
            assert owners == {0: shown}
            assert shown != _unsalted(NAME)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_blind_handoff_answered_with_no_token_owns_the_slot(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, stream: bool
) -> None:
    """Key 2's chat takes key 1's slot blind (``cache_prompt`` off) and the model ends
    its answer at once (end of generation first: no token of content). The engine ran
    the request, so it emptied the slot and holds key 2's prompt: key 2's next turn
    continues there (no save, no restore, its prompt cached), where before the slot
    stayed unknown and the turn started cold."""
    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=1, ctx_per_slot=2048)],
        state_dir=state_dir,
        engine_binary=engine_binary,
        server={"api_keys": [KEY1, KEY2]},
        scheduler={"save_idle_slots": False},
    )
    eos_first = {"logit_bias": {str(EOS_ID): 100}}
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            assert await _turn(host, client, KEY1, prompt_cache_key=NAME) == ([CHAT_PATH], 0)
            resp = await client.post(
                CHAT_PATH,
                json=_body(prompt_cache_key=NAME, stream=stream, **eos_first),
                headers={"Authorization": f"Bearer {KEY2}"},
            )
            assert resp.status_code == 200, resp.text
            if stream:
                events = [
                    json.loads(line[5:])
                    for line in resp.text.splitlines()
                    if line.startswith("data:") and line.strip() != "data: [DONE]"
                ]
                content = "".join(
                    e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]
                )
                assert content == "" and events[-1]["choices"][0]["finish_reason"] == "stop"
            else:
                answer = resp.json()
                assert answer["choices"][0]["message"]["content"] in ("", None)
                assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            await wait_nothing_held(host)
            assert host.scheduler is not None
            erases = host.scheduler.statistics().erases
            assert erases["sent_blind"] == 1 and erases["blind_unanswered"] == 0
            calls, cached = await _turn(host, client, KEY2, prompt_cache_key=NAME)
            assert calls == [CHAT_PATH] and cached > 0
