"""Session identity: a chat's ``prompt_cache_key``, shown only as a short hash."""

from __future__ import annotations

import hashlib


def session_hash(key: str | None) -> str | None:
    """A stable, non-reversible short id for logs and status; None for keyless jobs."""
    if key is None:
        return None
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]
