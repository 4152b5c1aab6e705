"""Session identity: which caller a chat belongs to, and the short form shown of it.

A chat names itself with ``prompt_cache_key`` (or ``X-Session-Id``). Names are
the caller's own: two API keys that both say ``chat-1`` are two chats, which
must never share a slot's KV, a parked file or a cache hit. So the host never
uses a name as it came. :class:`SessionKeys` holds a secret kept in the state
dir and derives, with HMAC-SHA256:

- a **caller** from the API key that authenticated the request
  (:meth:`SessionKeys.caller`; without keys, one local caller), and
- a **session** from the caller and the chat's name
  (:meth:`SessionKeys.session`): the identity the scheduler, the slot table
  and KV parking use from the API inward. They never see a raw name.
- a **keyless owner** from the caller alone (:meth:`SessionKeys.keyless`): the
  one owner of all the caller's requests that name no session, with
  ``[scheduler] keyless = "shared"``. No name of any caller gives it.

:meth:`SessionKeys.owner` picks the right one for a request.

What logs, status, metrics and park file names show is :func:`session_hash`
of a session: a prefix of that HMAC. Without the secret nobody can tell which
name (or key) it came from, nor test a guess.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
from pathlib import Path

from ..config.schema import KeylessMode
from ..errors import ConfigError

log = logging.getLogger("gezel_trio.kv.sessions")

__all__ = [
    "KEY_FILE",
    "SECRET_BYTES",
    "SessionKeys",
    "is_session_id",
    "session_hash",
]

KEY_FILE = "session.key"
"""The secret's file name in the state dir."""
SECRET_BYTES = 32

# Domain separation: a caller, the local caller and a session are HMACs of
# messages that cannot be confused with one another.
_CALLER = b"gezel-trio/caller/v1\x00key\x00"
_LOCAL = b"gezel-trio/caller/v1\x00local"
_SESSION = b"gezel-trio/session/v1\x00"
_KEYLESS = b"gezel-trio/keyless/v1\x00"
_CONVERSATION = b"gezel-trio/conversation/v1\x00"

_ID = re.compile(r"[0-9a-f]{64}")


def is_session_id(value: str) -> bool:
    """Whether ``value`` has the form of a derived identity (64 lowercase hex digits)."""
    return _ID.fullmatch(value) is not None


def session_hash(session: str | None) -> str | None:
    """The short id of a session for logs, status, metrics and park file names.

    A session derived by :meth:`SessionKeys.session` shows as its first 16 hex
    digits: a prefix of an HMAC under the host's secret. Any other string (a
    name handed to the scheduler directly, as its unit tests do) is hashed with
    sha256 first, so a raw name is never shown. None for keyless jobs.
    """
    if session is None:
        return None
    if is_session_id(session):
        return session[:16]
    return hashlib.sha256(session.encode("utf-8", "surrogatepass")).hexdigest()[:16]


class SessionKeys:
    """The host's session secret, and the identities derived from it.

    ``SessionKeys.load(state_dir)`` reads ``<state_dir>/session.key`` (32
    random bytes), creating it atomically with mode 0600 when it is absent. A
    file of the wrong size (truncated, empty, not ours) is replaced by a new
    secret, with a warning: that renames every session (their hashes change and
    parked KV is not found again, costing one re-prefill each), which is safe,
    where starting without isolation is not. A file readable by others is made
    0600, with a warning.

    Every identity is 64 lowercase hex digits: HMAC-SHA256 under the secret.
    Nothing here returns, logs or shows a raw key or name, nor the secret.
    """

    __slots__ = ("_secret", "path")

    def __init__(self, secret: bytes, *, path: Path | None = None) -> None:
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"a session secret is {SECRET_BYTES} bytes, got {len(secret)}")
        self._secret = bytes(secret)
        self.path = path
        """The file the secret came from (None: given directly, as tests do)."""

    def __repr__(self) -> str:
        return f"<SessionKeys {self.path or 'in memory'}>"

    @classmethod
    def load(cls, state_dir: Path) -> SessionKeys:
        """The secret of ``state_dir`` (created there if absent). Blocking file I/O:
        call it once, at startup, from a thread."""
        path = Path(state_dir) / KEY_FILE
        secret = _read_secret(path)
        if secret is None:
            secret = _create_secret(path, replace=path.exists())
        return cls(secret, path=path)

    def caller(self, api_key: str | None) -> str:
        """The stable identity of the API key that authenticated a request (an HMAC,
        never the key). ``None`` (no keys configured: a local single user) is one
        caller, which no key can be."""
        if api_key is None:
            return self._mac(_LOCAL)
        return self._mac(_CALLER + api_key.encode("utf-8", "surrogatepass"))

    def session(self, caller: str, name: str) -> str:
        """The session identity of ``caller``'s chat ``name`` (its ``prompt_cache_key``
        or ``X-Session-Id``): what the host uses for the chat from the API inward.

        ``caller`` must come from :meth:`caller`; another caller's same name is
        another session.
        """
        if not is_session_id(caller):
            raise ValueError("caller must be an identity from SessionKeys.caller()")
        return self._mac(
            _SESSION + caller.encode("ascii") + b"\x00" + name.encode("utf-8", "surrogatepass")
        )

    def keyless(self, caller: str) -> str:
        """The owner of ``caller``'s keyless requests (``[scheduler] keyless = "shared"``):
        distinct from every session of every caller, and from every other caller's.

        ``caller`` must come from :meth:`caller`.
        """
        if not is_session_id(caller):
            raise ValueError("caller must be an identity from SessionKeys.caller()")
        return self._mac(_KEYLESS + caller.encode("ascii"))

    def conversation(self, caller: str, opening: str) -> str:
        """The owner of ``caller``'s keyless conversation that opens with ``opening``
        (``[scheduler] keyless = "conversation"``): distinct from every named session,
        every keyless owner and every other caller's. ``caller`` must come from
        :meth:`caller`."""
        if not is_session_id(caller):
            raise ValueError("caller must be an identity from SessionKeys.caller()")
        return self._mac(
            _CONVERSATION
            + caller.encode("ascii")
            + b"\x00"
            + opening.encode("utf-8", "surrogatepass")
        )

    def owner(
        self, caller: str, name: str | None, *, keyless: KeylessMode, opening: str | None = None
    ) -> str | None:
        """The owner of a request of ``caller`` that names the session ``name`` (None:
        none), for the scheduler's ``session``: :meth:`session` for a name; for a
        keyless request, :meth:`keyless` in ``shared`` mode, :meth:`conversation` of
        its ``opening`` in ``conversation`` mode (:meth:`keyless` when it has none),
        and None in ``blind`` mode (a blind job, sent with ``cache_prompt`` off)."""
        if name is not None:
            return self.session(caller, name)
        if keyless == "conversation" and opening is not None:
            return self.conversation(caller, opening)
        if keyless in ("shared", "conversation"):
            return self.keyless(caller)
        if not is_session_id(caller):
            raise ValueError("caller must be an identity from SessionKeys.caller()")
        return None

    def _mac(self, message: bytes) -> str:
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()


def _read_secret(path: Path) -> bytes | None:
    """The secret in ``path``; None when there is none to use (absent or corrupt)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(SECRET_BYTES + 1)
            mode = os.fstat(fh.fileno()).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read the session secret {path}: {exc}") from exc
    if len(data) != SECRET_BYTES:
        log.warning(
            "the session secret %s holds %s bytes, not %d: replacing it with a new one "
            "(sessions are renamed; parked KV from before is not reused)",
            path,
            f"more than {SECRET_BYTES}" if len(data) > SECRET_BYTES else len(data),
            SECRET_BYTES,
        )
        return None
    if stat.S_IMODE(mode) & 0o077:
        log.warning("the session secret %s was readable by others: made it 0600", path)
        try:
            os.chmod(path, 0o600)
        except OSError as exc:
            raise ConfigError(f"cannot make the session secret {path} private: {exc}") from exc
    return data


def _create_secret(path: Path, *, replace: bool) -> bytes:
    """Write a new secret to ``path`` atomically (mode 0600) and return the one in force.

    The bytes are complete on disk (fsync) before the name appears. With
    ``replace`` (the file there is corrupt) it is replaced; otherwise it is
    created without clobbering one another process wrote meanwhile (that one
    wins).
    """
    secret = secrets.token_bytes(SECRET_BYTES)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(secret)
            fh.flush()
            os.fsync(fh.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            _link_or_replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as exc:
        raise ConfigError(f"cannot write the session secret {path}: {exc}") from exc
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return _read_secret(path) or secret  # the one on disk (another process's may have won)


def _link_or_replace(tmp: Path, path: Path) -> None:
    try:
        os.link(tmp, path)  # no clobber: fails if the file appeared meanwhile
    except FileExistsError:
        pass  # another process's secret wins (the caller reads it back)
    except OSError:
        os.replace(tmp, path)  # no hard links on this file system


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
