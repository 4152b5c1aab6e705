"""The docs agree with the code: every config key is in docs/configuration.md, and every
route the app serves is in the endpoint table at the top of docs/api.md."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from unittest.mock import MagicMock

from gezel_trio.config.schema import _SECTIONS, Config, ModelConfig

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _tables_by_section(text: str) -> dict[str, set[str]]:
    """``## `[section]``` (or ``[[models]]``) -> the keys in the first column of its
    tables."""
    out: dict[str, set[str]] = {}
    section = None
    for line in text.splitlines():
        heading = re.fullmatch(r"## `\[\[?(\w+)\]\]?`", line.strip())
        if heading:
            section = heading.group(1)
            out[section] = set()
        elif line.startswith("## "):
            section = None
        elif section is not None and line.startswith("| `"):
            out[section].add(line.split("`")[1])
    return out


def test_every_config_key_is_documented() -> None:
    """Every field of every config section is a row of its section's table (or, for a
    field the host sets itself, named in a sentence saying it is not a key)."""
    text = (DOCS / "configuration.md").read_text()
    documented = _tables_by_section(text)
    not_keys = set(re.findall(r"`(\w+)` is not a key", text))
    sections: dict[str, type[object]] = {**_SECTIONS, "models": ModelConfig}
    assert set(sections) == {f.name for f in dataclasses.fields(Config) if f.name != "source"}
    missing = [
        f"[{name}] {field.name}"
        for name, cls in sections.items()
        for field in dataclasses.fields(cls)  # type: ignore[arg-type]
        if field.name not in documented.get(name, set()) | not_keys
    ]
    assert not missing, f"keys missing from docs/configuration.md: {missing}"


def test_the_endpoint_table_lists_every_route() -> None:
    from gezel_trio.api.app import create_app

    host = MagicMock()
    host.config = Config()
    app = create_app(host)
    text = (DOCS / "api.md").read_text()
    table = text[text.index("| Endpoint | Purpose | Key |") :]
    table = table[: table.index("\n\n")]
    listed = {
        path for cell in re.findall(r"`([^`]*)`", table) for path in re.findall(r"/[^\s,`]*", cell)
    }
    missing = sorted(
        {
            re.sub(r"<(?:[a-z]+:)?(\w+)>", r"{\1}", rule.rule)
            for rule in app.url_map.iter_rules()
            if rule.endpoint != "static"
        }
        - listed
    )
    assert not missing, f"routes missing from the table at the top of docs/api.md: {missing}"


def test_coming_from_shows_the_client_setups_the_tests_run() -> None:
    """docs/coming-from.md shows each client's setup exactly as tests/test_real_clients.py
    runs it (the same text, from tests/_clients.py)."""
    from . import _clients

    text = (DOCS / "coming-from.md").read_text()
    missing = [name for name, setup in _clients.SETUPS.items() if setup not in text]
    assert not missing, f"setups missing from docs/coming-from.md: {missing}"
    for client in ("Claude Code", "Codex", "opencode", "aider", "Open WebUI", "Continue"):
        assert f"### {client}" in text, client
    assert "### llama.vscode" in text
