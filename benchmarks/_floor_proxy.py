"""The floor: the least a Python proxy on trio does, to put the host's added latency beside
what any Python proxy adds on the same machine.

    python -m benchmarks._floor_proxy PORT UPSTREAM_PORT [--streamed | --hypercorn | --front]

Listens on 127.0.0.1:PORT and forwards every request to the llama-server on
127.0.0.1:UPSTREAM_PORT, as the host and llama-server's router do: one new upstream
connection per request, the client's kept alive. It parses only what framing needs (the
request's ``Content-Length``, the answer's ``Content-Length`` or chunked end) on bare trio
sockets, or behind an HTTP server. Four ways:

- relayed (the default): the answer's head and body are copied through unchanged (a
  ``Connection: close`` too: the client then reconnects, as llama-server's own clients do
  after its errors);
- ``--streamed``: a completion the client asked for whole (``/v1/chat/completions`` or
  ``/v1/completions`` without ``stream``) is asked of the engine as a stream and its
  events are assembled into one answer, as the host does so that a client who leaves
  stops the engine at once (``benchmarks.engine_disconnect`` says why). Every other
  request is relayed.
- ``--hypercorn``: ``--streamed``'s forwarding as an ASGI app, which
  ``hypercorn.trio.serve`` serves with hypercorn's default settings: what an app adds
  when hypercorn parses its requests and writes its answers (a relayed stream is
  re-chunked by hypercorn);
- ``--front``: the same app served as the host serves its own: by
  :func:`gezel_trio.front_guard.serve_front`, with the hypercorn settings and write
  deadline a default configuration gives (:func:`gezel_trio.server.hypercorn_config`).

No routing, scheduling, validation, model names, logs, metrics, deadlines or error
handling: it is not a product, only a measure. ``proxy_overhead`` runs each, as its
``floor``, ``floor_streamed``, ``floor_hypercorn`` and ``floor_front`` paths.
"""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as serve_asgi

from gezel_trio.config.schema import config_from_mapping
from gezel_trio.front_guard import FrontGuard, serve_front
from gezel_trio.server import drain_timeout, hypercorn_config

HEAD_END = b"\r\n\r\n"
CHUNKED_END = b"0\r\n\r\n"
ASSEMBLED = (b"/v1/chat/completions", b"/v1/completions")


class _Closed(Exception):
    """The peer closed its connection."""


async def _receive(sock: trio.socket.SocketType) -> bytes:
    data = await sock.recv(65536)
    if not data:
        raise _Closed
    return data


async def _send(sock: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[await sock.send(view) :]


async def _head(sock: trio.socket.SocketType, buffer: bytes) -> tuple[bytes, bytes]:
    """(head up to and with its blank line, what followed it)."""
    while HEAD_END not in buffer:
        buffer += await _receive(sock)
    head, _, rest = buffer.partition(HEAD_END)
    return head + HEAD_END, rest


def _header(head: bytes, name: bytes) -> bytes | None:
    """The value of header ``name`` (lower case) in ``head``, or None."""
    at = head.lower().find(b"\r\n" + name + b":")
    return None if at < 0 else head[at + len(name) + 3 :].split(b"\r\n", 1)[0].strip()


def _content_length(head: bytes) -> int | None:
    value = _header(head, b"content-length")
    return None if value is None else int(value)


def _request(line: bytes, body: bytes) -> bytes:
    """A JSON request to the engine: its request line, head and ``body``."""
    head = b"%s\r\nHost: engine\r\nContent-Type: application/json\r\nContent-Length: %d"
    return head % (line, len(body)) + HEAD_END + body


async def _relay_answer(upstream: trio.socket.SocketType, client: trio.socket.SocketType) -> None:
    """Copy one answer from ``upstream`` to ``client``, up to the end its framing gives."""
    head, body = await _head(upstream, b"")
    await _send(client, head + body)
    length = _content_length(head)
    if length is not None:
        sent = len(body)
        while sent < length:
            data = await _receive(upstream)
            await _send(client, data)
            sent += len(data)
        return
    tail = body[-len(CHUNKED_END) :]
    while not tail.endswith(CHUNKED_END):
        data = await _receive(upstream)
        await _send(client, data)
        tail = (tail + data)[-len(CHUNKED_END) :]


def _as_stream(request: bytes) -> bytes | None:
    """``request`` (head and body) asking for its completion as a stream, or None if it is
    not a whole-answer completion."""
    head, _, body = request.partition(HEAD_END)
    line, _, _ = head.partition(b"\r\n")
    if line.split(b" ")[1] not in ASSEMBLED:
        return None
    try:
        fields = json.loads(body)
    except ValueError:
        return None  # the engine says what is wrong with it
    if not isinstance(fields, dict) or fields.get("stream"):
        return None
    fields |= {"stream": True, "stream_options": {"include_usage": True}}
    return _request(line, json.dumps(fields).encode())


async def _streamed_answer(upstream: trio.socket.SocketType) -> tuple[bytes, bytes]:
    """Read the answer to a completion asked for as a stream, to its end: (its status line,
    its body). A chunked stream of events becomes the one answer they make; an answer that
    is not a stream (an error) keeps its body as it came."""
    head, body = await _head(upstream, b"")
    status = head.partition(b"\r\n")[0]
    length = _content_length(head)
    if length is not None:
        while len(body) < length:
            body += await _receive(upstream)
        return status, body
    while not body.endswith(CHUNKED_END):
        body += await _receive(upstream)
    events = bytearray()
    while True:
        size, _, body = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        events += body[:n]
        body = body[n + 2 :]
    return status, _assembled(bytes(events))


def _assembled(events: bytes) -> bytes:
    """The one whole chat or text completion that a stream's events make."""
    answer: dict[str, Any] = {}
    texts: dict[int, str] = {}
    for line in events.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        for choice in event.pop("choices", None) or ():
            index = choice["index"]
            piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            texts[index] = texts.get(index, "") + piece
            if choice.get("finish_reason"):
                answer.setdefault("finish", {})[index] = choice["finish_reason"]
        answer |= event
    finish = answer.pop("finish", {})
    chat = answer.get("object") == "chat.completion.chunk"
    answer["object"] = "chat.completion" if chat else "text_completion"
    answer["choices"] = [
        {"index": i, "finish_reason": finish.get(i)}
        | ({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        for i, text in sorted(texts.items())
    ]
    return json.dumps(answer).encode()


async def _assembled_answer(upstream: trio.socket.SocketType) -> bytes:
    """:func:`_streamed_answer` as one HTTP answer (head and body) for the client."""
    status, body = await _streamed_answer(upstream)
    return b"%s\r\nContent-Type: application/json\r\nContent-Length: %d%s%s" % (
        status,
        len(body),
        HEAD_END,
        body,
    )


async def _serve_client(
    client: trio.socket.SocketType, upstream_port: int, *, streamed: bool
) -> None:
    buffer = b""
    with client:
        try:
            while True:
                head, buffer = await _head(client, buffer)
                length = _content_length(head) or 0
                while len(buffer) < length:
                    buffer += await _receive(client)
                request, buffer = head + buffer[:length], buffer[length:]
                as_stream = _as_stream(request) if streamed else None
                with trio.socket.socket() as upstream:
                    upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    await upstream.connect(("127.0.0.1", upstream_port))
                    if as_stream is None:
                        await _send(upstream, request)
                        await _relay_answer(upstream, client)
                        continue
                    await _send(upstream, as_stream)
                    answer = await _assembled_answer(upstream)
                await _send(client, answer)
        except (_Closed, OSError):
            return


async def _dechunked(upstream: trio.socket.SocketType, buffer: bytes) -> AsyncIterator[bytes]:
    """The data of a chunked body, chunk by chunk as it comes, ``buffer`` read already."""
    while True:
        while b"\r\n" not in buffer:
            buffer += await _receive(upstream)
        size, _, buffer = buffer.partition(b"\r\n")
        n = int(size.split(b";")[0], 16)
        while len(buffer) < n + 2:
            buffer += await _receive(upstream)
        if n == 0:
            return
        yield buffer[:n]
        buffer = buffer[n + 2 :]


async def _asgi(upstream_port: int, scope: Any, receive: Any, send: Any) -> None:
    """The ``--hypercorn`` and ``--front`` floors: ``--streamed``'s forwarding as an ASGI
    app."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    target = scope["raw_path"] + (b"?" + scope["query_string"] if scope["query_string"] else b"")
    request = _request(b"%s %s HTTP/1.1" % (scope["method"].encode(), target), body)
    as_stream = _as_stream(request)
    with trio.socket.socket() as upstream:
        upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await upstream.connect(("127.0.0.1", upstream_port))
        await _send(upstream, as_stream or request)
        if as_stream is not None:
            status, answer = await _streamed_answer(upstream)
            headers = [(b"content-type", b"application/json")]
            headers.append((b"content-length", b"%d" % len(answer)))
            await send(
                {
                    "type": "http.response.start",
                    "status": int(status.split()[1]),
                    "headers": headers,
                }
            )
            await send({"type": "http.response.body", "body": answer, "more_body": False})
            return
        head, rest = await _head(upstream, b"")
        headers = [(b"content-type", _header(head, b"content-type") or b"application/json")]
        code = int(head.split(b" ", 2)[1])
        await send({"type": "http.response.start", "status": code, "headers": headers})
        length = _content_length(head)
        if length is None:
            async for data in _dechunked(upstream, rest):
                await send({"type": "http.response.body", "body": data, "more_body": True})
        else:
            while len(rest) < length:
                rest += await _receive(upstream)
            await send({"type": "http.response.body", "body": rest, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def serve_hypercorn(port: int, upstream_port: int, *, front: bool = False) -> None:
    """Serve :func:`_asgi` until cancelled: with ``hypercorn.trio.serve`` and hypercorn's
    defaults (``--hypercorn``), or with ``front`` as the host serves its app, with
    :func:`gezel_trio.front_guard.serve_front` and the settings a default configuration
    gives it (``--front``)."""
    app = partial(_asgi, upstream_port)
    if not front:
        config = HypercornConfig()
        config.bind = [f"127.0.0.1:{port}"]
        config.accesslog = None
        await serve_asgi(app, config)
        return
    host = config_from_mapping({"server": {"host": "127.0.0.1", "port": port}})
    guard = FrontGuard(
        write_timeout=host.server.stream_stall_timeout, drain_timeout=drain_timeout(host)
    )
    await serve_front(app, hypercorn_config(host), guard)


async def serve(port: int, upstream_port: int, *, streamed: bool = False) -> None:
    """Serve until cancelled."""
    listener = trio.socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    await listener.bind(("127.0.0.1", port))
    listener.listen(128)
    async with trio.open_nursery() as nursery:
        while True:
            client, _ = await listener.accept()
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nursery.start_soon(partial(_serve_client, client, upstream_port, streamed=streamed))


async def _main(argv: list[str]) -> None:
    port, upstream_port = int(argv[1]), int(argv[2])
    if "--hypercorn" in argv[3:] or "--front" in argv[3:]:
        await serve_hypercorn(port, upstream_port, front="--front" in argv[3:])
    else:
        await serve(port, upstream_port, streamed="--streamed" in argv[3:])


if __name__ == "__main__":
    trio.run(_main, sys.argv)
