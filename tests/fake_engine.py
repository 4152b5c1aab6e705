"""A small, fast stand-in for llama-server, for load, fault and hostile-input tests.

It speaks the part of llama-server's HTTP API the host uses:

- ``GET /health`` (200, or 503 while ``loading``),
- ``GET /slots`` (``id`` and ``is_processing`` per slot),
- ``POST /slots/{id}?action=erase`` (and ``save`` / ``restore`` with a ``filename``),
- ``POST /v1/chat/completions``, ``/v1/completions`` and ``/completion``,
  streaming (SSE) or not, honouring ``id_slot`` (a pinned request waits for its
  slot, as llama-server defers it) and ``max_tokens`` / ``n_predict``.

Every answer echoes the request's ``x_marker`` field (the host forwards unknown
fields untouched), so a load test can check that each request's answer came
back exactly once and to the right client; ``GET /stats`` reports how often the
engine served each marker (a marker served twice is a duplicated request), and
every *bleed*: a request of one chat (``prompt_cache_key``) landing on a slot
whose cache holds another chat's, with no erase or restore in between.

Run it in-process with :func:`open_fake_engine` (a raw ASGI app on hypercorn,
port 0), or as its own process with ``python -m tests.fake_engine`` (prints
``READY <url>`` on stdout once it listens; stops on SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import parse_qs

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

__all__ = ["FakeEngine", "open_fake_engine", "spawn_fake_engine"]


@dataclass
class _Slot:
    id: int
    busy: bool = False
    owner: str | None = None  # the x_marker of the request on it
    kv: str | None = None  # whose conversation the slot's cache holds (prompt_cache_key)


class FakeEngine:
    """The engine's state and its ASGI app. ``token_delay`` seconds per generated token."""

    def __init__(self, *, parallel: int = 2, token_delay: float = 0.0, max_tokens: int = 8) -> None:
        self.parallel = parallel
        self.token_delay = token_delay
        self.default_tokens = max_tokens
        self.loading = False
        self.slots = [_Slot(i) for i in range(parallel)]
        self._changed = trio.Event()
        self.served: Counter[str] = Counter()
        self.requests = 0
        self.erases = 0
        self.saves = 0
        self.restores = 0
        self.saved: dict[str, str | None] = {}
        self.bleeds: list[str] = []
        """A request landed on a slot holding another chat's cache (not erased, not restored)."""
        self.cancelled = 0
        self.pinned = 0
        self.pinned_to_busy = 0
        self.concurrent = 0
        self.max_concurrent = 0
        self.started = time.time()

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        dup = {m: n for m, n in self.served.items() if n > 1}
        return {
            "requests": self.requests,
            "served_markers": len(self.served),
            "duplicates": dup,
            "erases": self.erases,
            "saves": self.saves,
            "restores": self.restores,
            "bleeds": len(self.bleeds),
            "bleed_examples": self.bleeds[:5],
            "cancelled": self.cancelled,
            "pinned": self.pinned,
            "pinned_to_busy": self.pinned_to_busy,
            "max_concurrent": self.max_concurrent,
            "busy": [s.id for s in self.slots if s.busy],
        }

    # ------------------------------------------------------------------ ASGI

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":  # pragma: no cover - websockets are not served
            return
        method: str = scope["method"]
        path: str = scope["path"]
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        if method == "GET" and path == "/health":
            if self.loading:
                await _json(send, 503, {"error": {"code": 503, "message": "Loading model"}})
            else:
                await _json(send, 200, {"status": "ok"})
            return
        if method == "GET" and path == "/slots":
            rows = [{"id": s.id, "n_ctx": 4096, "is_processing": s.busy} for s in self.slots]
            await _json(send, 200, rows)
            return
        if method == "GET" and path == "/stats":
            await _json(send, 200, self.stats())
            return
        if method == "POST" and path.startswith("/slots/"):
            raw = await _read_body(receive)
            try:
                slot_id = int(path.rsplit("/", 1)[1])
            except ValueError:
                await _json(send, 400, {"error": {"code": 400, "message": "bad slot id"}})
                return
            action = (query.get("action") or [""])[0]
            if action not in ("erase", "save", "restore") or not 0 <= slot_id < self.parallel:
                await _json(send, 400, {"error": {"code": 400, "message": "bad slot action"}})
                return
            slot = self.slots[slot_id]
            if action == "erase":
                self.erases += 1
                slot.kv = None
                await _json(send, 200, {"id_slot": slot_id, "n_erased": 0})
                return
            try:
                filename = json.loads(raw)["filename"]
                assert isinstance(filename, str) and filename
            except (ValueError, KeyError, TypeError, AssertionError):
                await _json(send, 400, {"error": {"code": 400, "message": "filename required"}})
                return
            if action == "save":
                self.saves += 1
                self.saved[filename] = slot.kv
                await _json(send, 200, {"id_slot": slot_id, "filename": filename, "n_saved": 1})
                return
            if filename not in self.saved:
                await _json(send, 400, {"error": {"code": 400, "message": "no such file"}})
                return
            self.restores += 1
            slot.kv = self.saved[filename]
            await _json(send, 200, {"id_slot": slot_id, "filename": filename, "n_restored": 1})
            return
        if method == "POST" and path in ("/v1/chat/completions", "/v1/completions", "/completion"):
            raw = await _read_body(receive)
            try:
                body = json.loads(raw)
            except ValueError:
                await _json(send, 400, {"error": {"code": 400, "message": "invalid JSON"}})
                return
            if not isinstance(body, dict):
                await _json(send, 400, {"error": {"code": 400, "message": "expected an object"}})
                return
            await self._complete(path, body, send)
            return
        await _json(send, 404, {"error": {"code": 404, "message": "File Not Found"}})

    async def _acquire(self, id_slot: object) -> _Slot:
        """A free slot: the pinned one (waiting for it, as llama-server defers), else any."""
        pin: int | None = None
        if isinstance(id_slot, int) and not isinstance(id_slot, bool):
            pin = id_slot if 0 <= id_slot < self.parallel else None
        if pin is not None:
            self.pinned += 1
            self.pinned_to_busy += self.slots[pin].busy
        while True:
            candidates = [self.slots[pin]] if pin is not None else self.slots
            found = next((s for s in candidates if not s.busy), None)
            if found is not None:
                found.busy = True
                return found
            await self._changed.wait()

    def _release(self, slot: _Slot) -> None:
        slot.busy = False
        self._changed.set()
        self._changed = trio.Event()

    async def _complete(self, path: str, body: dict[str, Any], send: Send) -> None:
        self.requests += 1
        marker = body.get("x_marker")
        marker = marker if isinstance(marker, str) else None
        n = body.get("max_tokens", body.get("n_predict", self.default_tokens))
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            n = self.default_tokens
        n = min(n, 4096)
        stream = body.get("stream") is True
        chat = path == "/v1/chat/completions"
        slot = await self._acquire(body.get("id_slot"))
        self.concurrent += 1
        self.max_concurrent = max(self.max_concurrent, self.concurrent)
        completed = False
        try:
            if marker is not None:
                self.served[marker] += 1
            slot.owner = marker
            session = body.get("prompt_cache_key")
            session = session if isinstance(session, str) else None
            # cache_prompt off: the prompt is evaluated afresh, nothing the slot held is read
            reads = body.get("cache_prompt") is not False
            if reads and slot.kv is not None and slot.kv != session:
                self.bleeds.append(f"{session} on slot {slot.id} holding {slot.kv}")
            slot.kv = session if session is not None else f"<keyless {self.requests}>"
            words = [f"t{i}" for i in range(n)]
            if not stream:
                for _ in words:
                    if self.token_delay:
                        await trio.sleep(self.token_delay)
                text = " ".join(words)
                await _json(send, 200, _answer(path, text, marker, slot.id, n), slot=slot.id)
                completed = True
                return
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream"),
                        (b"x-fake-slot", str(slot.id).encode()),
                    ],
                }
            )
            for i, w in enumerate(words):
                if self.token_delay:
                    await trio.sleep(self.token_delay)
                chunk = _chunk(path, w if i == 0 else " " + w, marker, slot.id)
                await send({"type": "http.response.body", "body": _sse(chunk), "more_body": True})
            final = _chunk(path, "", marker, slot.id, finish=True)
            if not chat and path == "/completion":
                final["stop"] = True
            tail = _sse(final) + (b"data: [DONE]\n\n" if path != "/completion" else b"")
            await send({"type": "http.response.body", "body": tail, "more_body": False})
            completed = True
        finally:
            self.concurrent -= 1
            if not completed:
                self.cancelled += 1
            self._release(slot)


def _answer(path: str, text: str, marker: str | None, slot: int, n: int) -> dict[str, Any]:
    usage = {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": 4 + n}
    if path == "/v1/chat/completions":
        return {
            "object": "chat.completion",
            "x_marker": marker,
            "id_slot": slot,
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "length",
                    "message": {"role": "assistant", "content": f"[{marker}] {text}"},
                }
            ],
            "usage": usage,
        }
    if path == "/v1/completions":
        return {
            "object": "text_completion",
            "x_marker": marker,
            "id_slot": slot,
            "choices": [{"index": 0, "finish_reason": "length", "text": f"[{marker}] {text}"}],
            "usage": usage,
        }
    return {
        "content": f"[{marker}] {text}",
        "x_marker": marker,
        "id_slot": slot,
        "stop": True,
        "tokens_predicted": n,
        "timings": {"cache_n": 0, "prompt_n": 4, "predicted_n": n},
    }


def _chunk(
    path: str, piece: str, marker: str | None, slot: int, *, finish: bool = False
) -> dict[str, Any]:
    if path == "/v1/chat/completions":
        return {
            "object": "chat.completion.chunk",
            "x_marker": marker,
            "id_slot": slot,
            "choices": [
                {
                    "index": 0,
                    "delta": {} if finish else {"content": piece},
                    "finish_reason": "length" if finish else None,
                }
            ],
        }
    if path == "/v1/completions":
        return {
            "object": "text_completion",
            "x_marker": marker,
            "id_slot": slot,
            "choices": [{"index": 0, "text": piece, "finish_reason": "length" if finish else None}],
        }
    return {"content": piece, "x_marker": marker, "id_slot": slot, "stop": finish}


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _read_body(receive: Receive) -> bytes:
    parts: list[bytes] = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            break
        parts.append(msg.get("body", b""))
        if not msg.get("more_body", False):
            break
    return b"".join(parts)


async def _json(send: Send, status: int, payload: Any, *, slot: int | None = None) -> None:
    data = json.dumps(payload, separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if slot is not None:
        headers.append((b"x-fake-slot", str(slot).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data, "more_body": False})


def _hypercorn_config(port: int) -> HypercornConfig:
    hc = HypercornConfig()
    hc.bind = [f"127.0.0.1:{port}"]
    hc.accesslog = None
    hc.errorlog = None
    hc.keep_alive_timeout = 5  # like llama-server: the host must cope with closed keep-alives
    hc.graceful_timeout = 1
    return hc


@asynccontextmanager
async def open_fake_engine(
    *, parallel: int = 2, token_delay: float = 0.0, max_tokens: int = 8
) -> AsyncIterator[tuple[str, FakeEngine]]:
    """Serve a :class:`FakeEngine` on 127.0.0.1 port 0 for the block; yields (URL, engine)."""
    engine = FakeEngine(parallel=parallel, token_delay=token_delay, max_tokens=max_tokens)
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(
            partial(hypercorn_serve, engine, _hypercorn_config(0))  # type: ignore[arg-type]
        )
        try:
            yield binds[0], engine
        finally:
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def spawn_fake_engine(
    *, parallel: int = 2, token_delay: float = 0.0, max_tokens: int = 8
) -> AsyncIterator[tuple[str, trio.Process]]:
    """Run the fake engine as its own process; yields (base URL, process). Always stops it."""
    argv = [
        sys.executable,
        "-m",
        "tests.fake_engine",
        "--parallel",
        str(parallel),
        "--token-delay",
        str(token_delay),
        "--max-tokens",
        str(max_tokens),
    ]
    import subprocess

    proc = await trio.lowlevel.open_process(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None
    )
    try:
        assert proc.stdout is not None
        buf = b""
        with trio.fail_after(30):
            while b"\n" not in buf:
                data = await proc.stdout.receive_some(4096)
                if not data:
                    raise RuntimeError("the fake engine exited before it was ready")
                buf += data
        line = buf.split(b"\n", 1)[0].decode()
        assert line.startswith("READY "), line
        yield line.split(" ", 1)[1].strip(), proc
    finally:
        with trio.move_on_after(5, shield=True):
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
            with trio.move_on_after(3):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def _main(args: argparse.Namespace) -> None:
    engine = FakeEngine(
        parallel=args.parallel, token_delay=args.token_delay, max_tokens=args.max_tokens
    )
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(
            partial(hypercorn_serve, engine, _hypercorn_config(args.port))  # type: ignore[arg-type]
        )
        print(f"READY {binds[0]}", flush=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                break
        nursery.cancel_scope.cancel()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--token-delay", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=8)
    trio.run(_main, p.parse_args())


if __name__ == "__main__":
    main()
