"""A recording HTTP proxy for the real-client tests: it forwards every request to one
upstream (the host or a bare engine, switched with :meth:`RecordingProxy.target`) and
keeps what went each way, so a test can read the client's requests and the answers'
token counts, and replay the requests elsewhere.

h11 on a trio socket, httpx upstream; answers are streamed back as they come. Bodies
are kept whole: these are a test's few requests. On cancellation the listener and
every open connection close.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import h11
import httpx
import trio

from gezel_trio._trio import unwrapping

# headers that describe one hop, not the request
_HOP = {
    b"connection",
    b"keep-alive",
    b"transfer-encoding",
    b"content-length",
    b"host",
    b"accept-encoding",
    b"upgrade",
    b"proxy-connection",
}


@dataclass
class Exchange:
    """One request a client sent and what came back, as the proxy saw them."""

    upstream: str  # the label of the upstream it went to
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes
    status: int = 0
    response: bytes = b""
    response_headers: list[tuple[str, str]] = field(default_factory=list)
    sent_at: float = 0.0  # perf_counter when the request went upstream
    chunks_at: list[tuple[float, int]] = field(default_factory=list)
    """(perf_counter, length of ``response`` then) as each chunk of the answer came."""

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None


class RecordingProxy:
    def __init__(self) -> None:
        self.url = ""
        self.exchanges: list[Exchange] = []
        self._upstream = ""
        self._label = ""
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(900.0), trust_env=False)

    def __repr__(self) -> str:
        return f"<RecordingProxy {self.url} -> {self._label} ({len(self.exchanges)} recorded)>"

    def target(self, upstream: str, label: str) -> None:
        """Send what comes next to ``upstream`` (a base URL), recorded under ``label``."""
        self._upstream = upstream.rstrip("/")
        self._label = label

    def recorded(self, label: str) -> list[Exchange]:
        return [e for e in self.exchanges if e.upstream == label]

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        async with stream:
            while True:
                request = await _next_event(conn, stream)
                if not isinstance(request, h11.Request):
                    return
                body = bytearray()
                while True:
                    event = await _next_event(conn, stream)
                    if isinstance(event, h11.Data):
                        body += event.data
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    else:
                        return
                ok = await self._forward(conn, stream, request, bytes(body))
                if not ok or conn.our_state is not h11.DONE:
                    return
                try:
                    conn.start_next_cycle()
                except h11.LocalProtocolError:
                    return

    async def _forward(
        self, conn: h11.Connection, stream: trio.SocketStream, request: h11.Request, body: bytes
    ) -> bool:
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in request.headers
            if k.lower() not in _HOP
        ]
        exchange = Exchange(
            upstream=self._label,
            method=request.method.decode(),
            path=request.target.decode("latin-1"),
            headers=headers,
            body=body,
        )
        self.exchanges.append(exchange)
        upstream = self._http.build_request(
            exchange.method,
            self._upstream + exchange.path,
            headers=[*headers, ("accept-encoding", "identity")],
            content=body,
        )
        exchange.sent_at = time.perf_counter()
        try:
            response = await self._http.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            exchange.status = 502
            exchange.response = repr(exc).encode()
            await stream.send_all(
                conn.send(h11.Response(status_code=502, headers=[("content-length", "0")]))
                + conn.send(h11.EndOfMessage())
            )
            return False
        try:
            exchange.status = response.status_code
            exchange.response_headers = list(response.headers.items())
            out = [
                (k, v)
                for k, v in response.headers.raw
                if k.lower() not in _HOP - {b"content-length"}
            ]
            await stream.send_all(
                conn.send(h11.Response(status_code=response.status_code, headers=out))
            )
            received = bytearray()
            async for chunk in response.aiter_raw():
                received += chunk
                exchange.response = bytes(received)
                exchange.chunks_at.append((time.perf_counter(), len(received)))
                await stream.send_all(conn.send(h11.Data(data=chunk)))
            await stream.send_all(conn.send(h11.EndOfMessage()))
        except (trio.BrokenResourceError, trio.ClosedResourceError, httpx.HTTPError):
            return False  # the client left, or the upstream cut its answer
        finally:
            await response.aclose()
        return True


async def _next_event(conn: h11.Connection, stream: trio.SocketStream) -> Any:
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            return None
        if event is h11.NEED_DATA:
            try:
                data = await stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return None
            conn.receive_data(data)
            continue
        return event


@asynccontextmanager
async def open_recording_proxy() -> AsyncIterator[RecordingProxy]:
    """A proxy on 127.0.0.1, on a free port (``proxy.url``); call ``target`` before use.
    On exit (or cancellation) the listener and its connections close."""
    proxy = RecordingProxy()
    async with proxy._http, unwrapping(), trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, proxy._serve_connection, 0, host="127.0.0.1")
        )
        port = listeners[0].socket.getsockname()[1]
        proxy.url = f"http://127.0.0.1:{port}"
        yield proxy
        nursery.cancel_scope.cancel()


def json_events(body: bytes) -> Iterator[Any]:
    """The JSON objects of an answer: the whole body, SSE ``data:`` lines, or NDJSON lines
    (Ollama's streams)."""
    try:
        yield json.loads(body)
        return
    except ValueError:
        pass
    for line in body.splitlines():
        line = line.strip()
        if line.startswith(b"data:"):
            line = line[5:].strip()
        if line.startswith(b"{"):
            try:
                yield json.loads(line)
            except ValueError:
                continue


def prompt_counts(body: bytes) -> tuple[int | None, int | None]:
    """(prompt tokens, of which read from cache) from an answer in any dialect the engine
    or the host speaks: OpenAI chat usage, Responses usage, Anthropic usage
    (``input_tokens`` + ``cache_read_input_tokens``), llama.cpp ``timings``, Ollama's
    ``prompt_eval_count`` (no cache figure). The last event that says wins."""
    prompt: int | None = None
    cached: int | None = None
    for obj in json_events(body):
        if not isinstance(obj, dict):
            continue
        for candidate in (obj, obj.get("response"), obj.get("message")):
            if not isinstance(candidate, dict):
                continue
            p, c = _counts_of(candidate)
            if p is not None and (p > 0 or prompt is None):
                prompt, cached = p, c
    return prompt, cached


def _counts_of(obj: dict[str, Any]) -> tuple[int | None, int | None]:
    usage = obj.get("usage")
    if isinstance(usage, dict):
        if "cache_read_input_tokens" in usage:  # Anthropic: input_tokens excludes the cache
            read = int(usage.get("cache_read_input_tokens") or 0)
            made = int(usage.get("cache_creation_input_tokens") or 0)
            if "input_tokens" in usage:
                return int(usage["input_tokens"]) + read + made, read
        if "input_tokens" in usage and "output_tokens" in usage:  # Responses
            details = usage.get("input_tokens_details") or {}
            return int(usage["input_tokens"]), details.get("cached_tokens")
        if "prompt_tokens" in usage:
            details = usage.get("prompt_tokens_details") or {}
            return int(usage["prompt_tokens"]), details.get("cached_tokens")
    timings = obj.get("timings")
    if isinstance(timings, dict) and "prompt_n" in timings:
        cache_n = int(timings.get("cache_n") or 0)
        return int(timings["prompt_n"]) + cache_n, cache_n
    if "prompt_eval_count" in obj:
        return int(obj["prompt_eval_count"]), None
    return None, None


# what an answer's first generated token looks like, in each dialect's stream (text,
# reasoning, a tool call's arguments), or any non-streamed answer (its one chunk)
_TOKEN_MARKS = (
    b'"content":"',
    b'"reasoning_content":"',
    b"text_delta",
    b"thinking_delta",
    b"input_json_delta",
    b"output_text.delta",
    b"arguments.delta",
    b'"arguments":"',
)


def ttft_s(exchange: Exchange) -> float | None:
    """Seconds from the request going upstream to the chunk of the answer that brought
    its first generated token (:data:`_TOKEN_MARKS`; else its last chunk). None when
    nothing came back."""
    if not exchange.chunks_at:
        return None
    body = exchange.response
    first = min(
        (i for i in (body.find(mark) for mark in _TOKEN_MARKS) if i >= 0), default=len(body) - 1
    )
    for at, length in exchange.chunks_at:
        if length > first:
            return at - exchange.sent_at
    return exchange.chunks_at[-1][0] - exchange.sent_at
