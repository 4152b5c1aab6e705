"""The client commands of ``gezel-trio``: ``ps``, ``load``, ``unload``, ``logs``, ``status``,
``sessions``: a running host, seen and driven from a terminal.

Each talks to the host's HTTP API at ``--url`` (or ``GEZEL_URL``, default
``http://127.0.0.1:8080``; ``127.0.0.1:8080`` means ``http://127.0.0.1:8080``) with
``--api-key`` (or ``GEZEL_API_KEY``) as the bearer key. Output is a table in a terminal
and JSON with ``--json``. A host that does not answer is one line naming the URL tried,
exit status 1; a server that answers but is not a gezel-trio host (a plain llama-server,
say) is one line saying so, exit status 1; an error the host answers is its message,
exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TextIO
from urllib.parse import quote

import httpx

from ..engine.units import format_bytes

__all__ = ["DEFAULT_URL", "add_client_commands"]

DEFAULT_URL = "http://127.0.0.1:8080"


class HostUnreachable(Exception):
    """No host answered at the URL (its message is the one line to print)."""


class HostError(Exception):
    """The host answered with an error."""


class NotAHost(HostError):
    """Something answers at the URL, but not a gezel-trio host (its message says what)."""


def normalize_url(url: str) -> str:
    """``url`` with ``http://`` in front when it names no scheme (``127.0.0.1:8080``,
    ``localhost:8080/``), without a trailing slash."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/")


class Client:
    """The HTTP calls the commands make (one ``httpx.Client``; blocking)."""

    def __init__(self, url: str, api_key: str | None, *, timeout: float = 30.0) -> None:
        self.url = normalize_url(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.close()

    def call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            resp = self._http.request(method, path, **kw)
        except httpx.TransportError as exc:
            why = str(exc) or type(exc).__name__
            raise HostUnreachable(f"no gezel-trio host answers at {self.url} ({why})") from exc
        try:
            body = resp.json()
        except ValueError:
            body = None
        if resp.status_code == 404 and path.startswith("/api/"):
            self._check_identity(path, resp.status_code)
        if resp.status_code >= 400:
            message = resp.text[:300]
            if isinstance(body, dict) and isinstance(body.get("error"), dict):
                message = str(body["error"].get("message") or message)
            raise HostError(f"{method} {path}: {resp.status_code}: {message}")
        if path == "/api/status" and not _is_host_status(body):
            raise self._not_a_host(f"GET {path} answered 200 without a host's status")
        return body

    def _check_identity(self, path: str, status: int) -> None:
        """After a 404 on ``path``: raise :class:`NotAHost` unless ``/api/status``
        answers as a gezel-trio host's does (every host has it)."""
        if path != "/api/status":
            try:
                resp = self._http.get("/api/status")
            except httpx.TransportError:
                return
            if resp.status_code != 404:
                try:
                    body = resp.json()
                except ValueError:
                    body = None
                if resp.status_code != 200 or _is_host_status(body):
                    return  # a host (or one that wants a key): the 404 was its answer
            path, status = "/api/status", resp.status_code
        raise self._not_a_host(f"GET {path}: {status}")

    def _not_a_host(self, why: str) -> NotAHost:
        what = "a server"
        try:
            props = self._http.get("/props", timeout=5)
            body = props.json() if props.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            body = None
        if isinstance(body, dict) and (
            "default_generation_settings" in body or "build_info" in body
        ):
            what = "a plain llama-server"
        return NotAHost(
            f"{self.url} is not a gezel-trio host: {what} answers there ({why}). "
            "Point --url (or $GEZEL_URL) at the host's own address."
        )


def _is_host_status(body: object) -> bool:
    return isinstance(body, dict) and isinstance(body.get("engines"), list)


# ------------------------------------------------------------------ formatting


def table(rows: Sequence[Sequence[object]], headers: Sequence[str]) -> str:
    """Plain aligned columns (what ``ollama ps`` prints), no colour, no borders."""
    cells = [[str(h) for h in headers], *[["-" if c is None else str(c) for c in r] for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in cells
    )


def human_bytes(n: object) -> str | None:
    """A size read from the host's JSON as the tables write it; None when it is none."""
    if not isinstance(n, int | float) or n < 0:
        return None
    return format_bytes(n, "short")


def human_seconds(s: object) -> str | None:
    if not isinstance(s, int | float):
        return None
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"


HOLDS_MEMORY = frozenset({"starting", "ready", "stopping"})
"""The engine states in which a process holds (or is taking) its planned memory."""


def failure_of(engine: dict[str, Any]) -> str | None:
    """Why a model is down (its engine's last failure), while it is: a failed start or a
    crash (``failed``), or the backoff before the next try; None otherwise."""
    failure = engine.get("failure")
    if failure:
        return str(failure)
    if engine.get("state") == "failed" and engine.get("last_crash"):
        return str(engine["last_crash"])
    return None


def ps_rows(status: dict[str, Any]) -> list[list[object]]:
    """One row per model from ``/api/status``. MEMORY is the engine's planned bytes while
    its process holds them (starting, ready, stopping); a stopped or failed one holds none.
    CONTEXT is each slot's context: the engine's own while it runs, else what it will run;
    an image model's says ``image``, with the running render's sampling step."""
    sched = status.get("scheduler") or {}
    running = sched.get("running") or {}
    tables = sched.get("slots") or {}
    rows: list[list[object]] = []
    for e in status.get("engines") or []:
        model = e.get("model")
        plan = e.get("plan") or {}
        kv = e.get("kv_parking") or {}
        slots = tables.get(model) or {}
        contents = slots.get("contents") or {}
        parallel = e.get("parallel") or slots.get("slots")
        state = e.get("state")
        if e.get("external"):
            memory: str | None = "external"
        elif state in HOLDS_MEMORY:
            memory = human_bytes(plan.get("total_bytes"))
        else:
            memory = None
        context = e.get("ctx_per_slot")
        if e.get("kind") == "image":  # no context: what it renders now, if anything
            job = e.get("job")
            context = f"image {job['step']}/{job['steps']}" if job else "image"
        rows.append(
            [
                model,
                state,
                memory,
                f"{running.get(model, 0)}/{parallel}" if parallel else None,
                context,
                contents.get("owned", 0),
                f"{kv.get('parked', 0)} ({human_bytes(kv.get('bytes', 0))})" if kv else "off",
                human_seconds(e.get("idle_seconds")) if state == "ready" else None,
            ]
        )
    return rows


PS_HEADERS = ("MODEL", "STATE", "MEMORY", "BUSY", "CONTEXT", "SESSIONS", "PARKED", "IDLE")


def ps_text(status: dict[str, Any]) -> str:
    """The ``ps`` table, then one line per model that is down saying why."""
    lines = [table(ps_rows(status), PS_HEADERS)]
    for e in status.get("engines") or []:
        why = failure_of(e)
        if why:
            lines.append(f"{e.get('model')} {e.get('state')}: {why}")
    return "\n".join(lines)


def ps_json(status: dict[str, Any]) -> list[dict[str, object]]:
    """``ps --json``: the table's rows as objects, with REASON (:func:`failure_of`)."""
    return [
        {**dict(zip(PS_HEADERS, row, strict=True)), "REASON": failure_of(e)}
        for row, e in zip(ps_rows(status), status.get("engines") or [], strict=True)
    ]


# ------------------------------------------------------------------ commands


def _emit(out: TextIO, value: Any, *, as_json: bool, text: Callable[[Any], str]) -> None:
    out.write((json.dumps(value, indent=2) if as_json else text(value)) + "\n")


def cmd_ps(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    status = client.call("GET", "/api/status")
    _emit(out, ps_json(status), as_json=args.json, text=lambda _v: ps_text(status))
    return 0


def cmd_status(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    status = client.call("GET", "/api/status")

    def text(s: dict[str, Any]) -> str:
        cfg = s.get("config") or {}
        sched = s.get("scheduler") or {}
        head = (
            f"gezel-trio {s.get('version')} up {human_seconds(s.get('uptime_s'))}, "
            f"policy {cfg.get('policy')} ({cfg.get('resolved_policy')}), "
            f"queue {sched.get('queued', 0)}/{sched.get('max_queue', '?')}"
        )
        return head + "\n\n" + ps_text(s)

    _emit(out, status, as_json=args.json, text=text)
    return 0


def cmd_load(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    result = client.call("POST", f"/api/models/{args.model}/load", timeout=None)
    _emit(out, result, as_json=args.json, text=lambda r: f"{r['model']}: {r['state']}")
    return 0


def cmd_unload(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    result = client.call("POST", f"/api/models/{args.model}/unload", timeout=None)
    _emit(out, result, as_json=args.json, text=lambda r: f"{r['model']}: {r['state']}")
    return 0


def cmd_logs(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    path = f"/api/models/{args.model}/logs"
    page = client.call("GET", path, params={"lines": args.lines})
    _print_lines(out, page.get("lines", []), as_json=args.json)
    if not args.follow:
        return 0
    cursor = page.get("next")
    while True:  # until Ctrl-C (exit 130) or the host goes away (exit 1)
        time.sleep(args.interval)
        page = client.call("GET", path, params={"since": cursor})
        _print_lines(out, page.get("lines", []), as_json=args.json)
        cursor = page.get("next", cursor)


def _print_lines(out: TextIO, lines: Iterable[str], *, as_json: bool) -> None:
    for line in lines:
        out.write((json.dumps(line) if as_json else line) + "\n")
    out.flush()


def cmd_sessions(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    if args.action == "rm":
        if not args.session:
            raise HostError("sessions rm: name the session, by the name your client sent or its id")
        gone = client.call("DELETE", "/api/sessions/" + quote(args.session, safe=""))
        _emit(
            out,
            gone,
            as_json=args.json,
            text=lambda v: (
                f"removed {v['id']}: {v['slots_erased']} slot(s) erased, "
                f"{v['files_deleted']} parked file(s) deleted"
            ),
        )
        return 0
    listing = client.call("GET", "/api/sessions")

    def text(value: dict[str, Any]) -> str:
        rows = []
        for s in value.get("sessions", []):
            slots = ", ".join(f"{x['model']}#{x['slot']}" for x in s.get("slots", []))
            parked = ", ".join(
                f"{p['model']} {p['tokens']} tok {human_bytes(p['bytes'])}"
                for p in s.get("parked", [])
            )
            rows.append([s.get("name"), s["id"], slots or None, parked or None])
        return table(rows, ("NAME", "SESSION", "IN SLOT", "PARKED"))

    _emit(out, listing, as_json=args.json, text=text)
    return 0


def add_client_commands(sub: Any) -> None:
    """Register the client commands on the ``gezel-trio`` subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url",
        help=f"the host, e.g. 127.0.0.1:8080 (default: $GEZEL_URL, else {DEFAULT_URL})",
        default=None,
    )
    common.add_argument("--api-key", help="bearer key (default: $GEZEL_API_KEY)", default=None)
    common.add_argument("--json", action="store_true", help="JSON instead of a table")
    specs: list[tuple[str, str, Callable[[Client, argparse.Namespace, TextIO], int]]] = [
        ("ps", "models with their state, memory, busy slots, sessions, parked KV", cmd_ps),
        ("status", "the host's status (everything with --json)", cmd_status),
        ("load", "start a model's engine and wait until it is ready", cmd_load),
        ("unload", "stop a model's engine (its sessions are parked first)", cmd_unload),
        ("logs", "a model's engine log", cmd_logs),
        ("sessions", "the sessions your key holds (an admin key: all); rm NAME", cmd_sessions),
    ]
    for name, help_, func in specs:
        p = sub.add_parser(name, help=help_, parents=[common])
        if name in ("load", "unload", "logs"):
            p.add_argument("model", help="the model id")
        if name == "sessions":
            p.add_argument("action", nargs="?", choices=("rm",), help="rm: remove one")
            p.add_argument("session", nargs="?", help="its name (as your client sent it) or id")
        if name == "logs":
            p.add_argument("--lines", "-n", type=int, default=100, help="lines to show first")
            p.add_argument("--follow", "-f", action="store_true", help="keep printing new lines")
            p.add_argument("--interval", type=float, default=0.5, help=argparse.SUPPRESS)
        p.set_defaults(func=_runner(func))


def _runner(
    func: Callable[[Client, argparse.Namespace, TextIO], int],
) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        url = args.url or os.environ.get("GEZEL_URL") or DEFAULT_URL
        key = args.api_key or os.environ.get("GEZEL_API_KEY") or None
        try:
            with Client(url, key) as client:
                return func(client, args, sys.stdout)
        except (HostUnreachable, HostError) as exc:
            print(f"gezel-trio: {exc}", file=sys.stderr)
            return 1

    return run
