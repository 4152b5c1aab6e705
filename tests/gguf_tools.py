"""Reading generated GGUF files in tests: a file's digest and one metadata field."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from gguf import GGUFReader


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def gguf_field(reader: GGUFReader, key: str) -> Any:
    """The value of metadata ``key`` (fails the test when the file lacks it)."""
    f = reader.get_field(key)
    assert f is not None, key
    return f.contents()
