"""``/api/sessions``: a caller's chats as the host keeps them, and removing one.

A session is listed where its KV lives: in an engine slot, parked on disk, or
both. A caller sees only its own sessions (the API key that made them); an
admin key sees every caller's. ``DELETE /api/sessions/{id}`` removes the
session's KV everywhere: each idle slot holding it is erased and its parked
files are deleted; ``{id}`` may also be the name the client sent, looked up
among the caller's own sessions. Ids are the session hashes shown in logs and
status; a row's ``name`` is the name its client sent, shown to that caller alone
(kept in memory, the last 4096 named sessions; ``null`` after a restart).
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response, current_app, g

from ..errors import SessionBusy, SessionNotFound
from ..host import Host
from ..kv.sessions import session_hash
from .auth import ADMIN_ATTR, CALLER_ATTR, MAX_SESSION_NAME, session_names
from .errors import json_response

bp = Blueprint("sessions", __name__)


def _host() -> Host:
    host: Host = current_app.config["GEZEL_HOST"]
    return host


def _visible(caller: str | None, owner: str | None) -> bool:
    return bool(g.get(ADMIN_ATTR)) or (caller is not None and owner == caller)


def _listing(host: Host) -> dict[str, dict[str, Any]]:
    """Session id -> what the host holds of it, for the requesting caller."""
    caller = g.get(CALLER_ATTR)
    kv = host.kv
    out: dict[str, dict[str, Any]] = {}

    names = session_names()

    def row(sid: str, session: str, owner: str | None) -> dict[str, Any]:
        found = out.setdefault(sid, {"id": sid, "name": None, "slots": [], "parked": []})
        if found["name"] is None and caller is not None and owner == caller:
            found["name"] = names.name_of(session)  # its own chat's name, to its owner alone
        return found

    if kv is not None:
        for entry in kv.sessions():
            owner = entry.caller or kv.caller_of(entry.session)
            if _visible(caller, owner):
                r = row(entry.session_id, entry.session, owner)
                r["parked"].append(
                    {
                        "model": entry.model,
                        "tokens": entry.tokens,
                        "bytes": entry.bytes,
                        "saved_at": entry.saved_at,
                        "used_at": entry.used_at,
                    }
                )
    if host.scheduler is not None:
        for model_id, slot, session in host.scheduler.sessions_in_slots():
            owner = kv.caller_of(session) if kv is not None else None
            if _visible(caller, owner):
                found = row(session_hash(session) or "", session, owner)
                found["slots"].append({"model": model_id, "slot": slot})
    return out


@bp.get("/api/sessions")
async def list_sessions() -> Response:
    host = _host()
    sessions = sorted(_listing(host).values(), key=lambda r: r["id"])
    return json_response({"sessions": sessions, "kv_parking": host.kv is not None})


@bp.delete("/api/sessions/<session_id>")
async def delete_session(session_id: str) -> Response:
    """Remove a session by its id, or by the name its client sent (``prompt_cache_key``,
    ``X-Session-Id``, ...): a name is looked up among the caller's own sessions only, so
    another caller cannot learn that it exists."""
    host = _host()
    listing = _listing(host)
    if session_id not in listing:
        named = _id_of_name(host, session_id)
        if named not in listing:
            raise SessionNotFound(
                f"no session {session_id[:64]!r} of yours is held here (by id or by name); "
                "GET /api/sessions lists the ids"
            )
        session_id = named
    sessions = _full_sessions(host, session_id)
    erased = busy = 0
    if host.scheduler is not None:
        for session in sessions:
            e, b = await host.scheduler.erase_session(session)
            erased, busy = erased + e, busy + b
    files = 0
    if host.kv is not None:
        entries = host.kv.by_id(session_id)
        files = len(entries)
        await host.kv.drop(entries)
    if busy:
        raise SessionBusy(
            f"session {session_id} is running a request in {busy} slot(s); its parked KV "
            f"was removed ({files} file(s)) and {erased} idle slot(s) erased. Retry once "
            "the request has finished"
        )
    return json_response({"id": session_id, "slots_erased": erased, "files_deleted": files})


def _id_of_name(host: Host, name: str) -> str | None:
    """The id of the requesting caller's session named ``name``."""
    caller = g.get(CALLER_ATTR)
    if not isinstance(caller, str) or not name:
        return None
    return session_hash(host.sessions.session(caller, name[:MAX_SESSION_NAME]))


def _full_sessions(host: Host, session_id: str) -> set[str]:
    """The full session identities behind a shown id (in slots or parked)."""
    found: set[str] = set()
    if host.kv is not None:
        found.update(e.session for e in host.kv.by_id(session_id))
    if host.scheduler is not None:
        for _model, _slot, session in host.scheduler.sessions_in_slots():
            if session_hash(session) == session_id:
                found.add(session)
    return found
