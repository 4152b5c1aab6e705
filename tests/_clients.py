"""The real clients the suite drives, where to find them, and how each one is pointed at
the host: the same text docs/coming-from.md shows (tests/test_docs.py checks that every
setup below is in it, word for word).

``tox -e tests`` installs the clients at the versions in :data:`PINS` under
:func:`clients_dir` (``$GEZEL_CLIENTS_DIR``, else ``~/.cache/gezel-trio/clients``) with
``python -m tests.install_clients``: the npm ones with ``npm install --prefix``, aider in
its own venv (its dependencies are pinned hard, so it never shares the test environment).

Every setup names the host as ``http://127.0.0.1:8080`` and the model as ``smollm2``,
as the docs do; :func:`render` puts in the address a test serves on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# client -> (registry kind, package, version the suite was shown to pass with)
PINS: dict[str, tuple[str, str, str]] = {
    "claude": ("npm", "@anthropic-ai/claude-code", "2.1.197"),
    "codex": ("npm", "@openai/codex", "0.171.0"),
    "opencode": ("npm", "opencode-ai", "1.18.33"),
    "aider": ("pypi", "aider-chat", "0.86.2"),
}

DOC_URL = "http://127.0.0.1:8080"
DOC_MODEL = "smollm2"


def clients_dir() -> Path:
    return Path(
        os.environ.get("GEZEL_CLIENTS_DIR") or Path.home() / ".cache" / "gezel-trio" / "clients"
    )


def client_path(name: str) -> Path:
    """The executable of client ``name``; fails the test (never skips) when it is absent."""
    import pytest

    base = clients_dir()
    path = (
        base / "aider" / "bin" / "aider"
        if name == "aider"
        else base / "node_modules" / ".bin" / name
    )
    if not path.exists():
        pytest.fail(
            f"{name} is not installed at {path}: run `python -m tests.install_clients` "
            "(tox -e tests does; or set GEZEL_CLIENTS_DIR)",
            pytrace=False,
        )
    return path


def installed_version(name: str) -> str:
    """The version of client ``name`` installed under :func:`clients_dir`, read from its
    package metadata (no process started)."""
    kind, package, _ = PINS[name]
    base = clients_dir()
    if kind == "npm":
        meta = json.loads((base / "node_modules" / package / "package.json").read_text())
        return str(meta["version"])
    (dist,) = (base / "aider" / "lib").glob(
        f"python3*/site-packages/{package.replace('-', '_')}-*.dist-info"
    )
    return dist.name.removesuffix(".dist-info").split("-")[1]


def render(text: str, url: str) -> str:
    """A setup's text with the host's address in place of the docs' one."""
    return text.replace(DOC_URL, url)


# --- Claude Code: environment variables only --------------------------------------------
CLAUDE_ENV = """\
export ANTHROPIC_BASE_URL=http://127.0.0.1:8080
export ANTHROPIC_AUTH_TOKEN=none
export ANTHROPIC_MODEL=smollm2
export ANTHROPIC_SMALL_FAST_MODEL=smollm2
export CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1
export DISABLE_AUTOUPDATER=1
export DISABLE_TELEMETRY=1
"""

# the tests' own cap on each answer: Claude Code asks for 32,000 tokens, which a 135M
# model on a CPU fills for minutes (the clamp itself is tested with the limits)
CLAUDE_TEST_ENV = {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "128"}

# --- Codex: ~/.codex/config.toml --------------------------------------------------------
CODEX_CONFIG = """\
model = "smollm2"
model_provider = "gezel"
check_for_update_on_startup = false

[model_providers.gezel]
name = "gezel-trio"
base_url = "http://127.0.0.1:8080/v1"
wire_api = "responses"
env_key = "GEZEL_API_KEY"

[analytics]
enabled = false
"""

# --- opencode: opencode.json in the project (or ~/.config/opencode/opencode.json) -------
OPENCODE_CONFIG = """\
{
  "$schema": "https://opencode.ai/config.json",
  "provider": {
    "gezel": {
      "npm": "@ai-sdk/openai-compatible",
      "name": "gezel-trio",
      "options": { "baseURL": "http://127.0.0.1:8080/v1", "apiKey": "none" },
      "models": { "smollm2": { "name": "SmolLM2", "limit": { "context": 8192, "output": 128 } } }
    }
  },
  "model": "gezel/smollm2",
  "small_model": "gezel/smollm2",
  "autoupdate": false,
  "share": "disabled"
}
"""

OPENCODE_ENV = """\
export OPENCODE_DISABLE_AUTOUPDATE=1
export OPENCODE_DISABLE_MODELS_FETCH=1
export OPENCODE_DISABLE_DEFAULT_PLUGINS=1
export OPENCODE_DISABLE_LSP_DOWNLOAD=1
"""

# --- aider: either route, plus a metadata file so it looks nothing up -------------------
AIDER_OPENAI_ENV = """\
export OPENAI_API_BASE=http://127.0.0.1:8080/v1
export OPENAI_API_KEY=none
"""

AIDER_OLLAMA_ENV = """\
export OLLAMA_API_BASE=http://127.0.0.1:8080
"""

AIDER_METADATA = """\
{
  "openai/smollm2": {"max_input_tokens": 8192, "max_output_tokens": 128,
                     "input_cost_per_token": 0, "output_cost_per_token": 0,
                     "litellm_provider": "openai", "mode": "chat"},
  "ollama_chat/smollm2": {"max_input_tokens": 8192, "max_output_tokens": 128,
                          "input_cost_per_token": 0, "output_cost_per_token": 0,
                          "litellm_provider": "ollama_chat", "mode": "chat"}
}
"""

AIDER_SETTINGS = """\
- name: openai/smollm2
  extra_params:
    max_tokens: 128
- name: ollama_chat/smollm2
  extra_params:
    max_tokens: 128
"""

AIDER_FLAGS = (
    "--model-metadata-file .aider.model.metadata.json "
    "--model-settings-file .aider.model.settings.yml "
    "--no-git --no-analytics --no-check-update --no-show-model-warnings --yes-always"
)

SETUPS = {
    "CLAUDE_ENV": CLAUDE_ENV,
    "CODEX_CONFIG": CODEX_CONFIG,
    "OPENCODE_CONFIG": OPENCODE_CONFIG,
    "OPENCODE_ENV": OPENCODE_ENV,
    "AIDER_OPENAI_ENV": AIDER_OPENAI_ENV,
    "AIDER_OLLAMA_ENV": AIDER_OLLAMA_ENV,
    "AIDER_METADATA": AIDER_METADATA,
    "AIDER_SETTINGS": AIDER_SETTINGS,
    "AIDER_FLAGS": AIDER_FLAGS,
}


def env_of(exports: str, url: str) -> dict[str, str]:
    """``export K=V`` lines (with the host's address put in) as a dict."""
    out = {}
    for line in render(exports, url).splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        out[key] = value
    return out
