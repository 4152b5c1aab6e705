"""The API key as HTTP Basic's password, as Open WebUI's AUTOMATIC1111 engine sends its
"API auth" setting (``Authorization: Basic base64(user:password)``)."""

from __future__ import annotations

import base64

from gezel_trio.api.auth import _presented_key


def _basic(text: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(text.encode()).decode()}


def test_the_basic_password_is_the_key() -> None:
    assert _presented_key(_basic("webui:sk-1")) == "sk-1"
    assert _presented_key(_basic(":sk-1")) == "sk-1"
    assert _presented_key(_basic("sk-1")) == "sk-1"  # no user part: the whole is the key
    assert _presented_key(_basic("a:b:c")) == "b:c"  # a password may hold colons
    assert _presented_key({"Authorization": "Basic %%%"}) is None
    assert _presented_key({"Authorization": "Bearer sk-2"}) == "sk-2"
    assert _presented_key({"X-Api-Key": "sk-3"}) == "sk-3"
    assert _presented_key({}) is None
