"""The floor: the least a Python proxy on trio can do, to put the host's added latency
beside what any Python proxy adds on the same machine.

    python -m benchmarks.floor_proxy PORT UPSTREAM_PORT

Listens on 127.0.0.1:PORT and forwards every request to the llama-server on
127.0.0.1:UPSTREAM_PORT, as the host and llama-server's router do: one new upstream
connection per request. It parses only what framing needs (the request's
``Content-Length``, the answer's ``Content-Length`` or chunked end) on bare trio sockets,
copies the answer's head and body through unchanged (a ``Connection: close`` too: the
client then reconnects, as llama-server's own clients do after its errors), and keeps the
client's connection alive otherwise. No routing, scheduling, validation, model names, logs, metrics, deadlines or error
handling: it is not a product, only a measure. ``proxy_overhead`` runs it as its
``floor`` path.
"""

from __future__ import annotations

import socket
import sys

import trio

HEAD_END = b"\r\n\r\n"
CHUNKED_END = b"0\r\n\r\n"


class _Closed(Exception):
    """The peer closed its connection."""


async def _receive(sock: trio.socket.SocketType) -> bytes:
    data = await sock.recv(65536)
    if not data:
        raise _Closed
    return data


async def _head(sock: trio.socket.SocketType, buffer: bytes) -> tuple[bytes, bytes]:
    """(head up to and with its blank line, what followed it)."""
    while HEAD_END not in buffer:
        buffer += await _receive(sock)
    head, _, rest = buffer.partition(HEAD_END)
    return head + HEAD_END, rest


def _content_length(head: bytes) -> int | None:
    at = head.lower().find(b"\r\ncontent-length:")
    return None if at < 0 else int(head[at + 17 :].split(b"\r\n", 1)[0])


async def _forward_answer(upstream: trio.socket.SocketType, client: trio.socket.SocketType) -> None:
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


async def _send(sock: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[await sock.send(view) :]


async def _serve_client(client: trio.socket.SocketType, upstream_port: int) -> None:
    buffer = b""
    with client:
        try:
            while True:
                head, buffer = await _head(client, buffer)
                length = _content_length(head) or 0
                while len(buffer) < length:
                    buffer += await _receive(client)
                request, buffer = head + buffer[:length], buffer[length:]
                with trio.socket.socket() as upstream:
                    upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    await upstream.connect(("127.0.0.1", upstream_port))
                    await _send(upstream, request)
                    await _forward_answer(upstream, client)
        except (_Closed, OSError):
            return


async def serve(port: int, upstream_port: int) -> None:
    """Serve until cancelled."""
    listener = trio.socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    await listener.bind(("127.0.0.1", port))
    listener.listen(128)
    async with trio.open_nursery() as nursery:
        while True:
            client, _ = await listener.accept()
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nursery.start_soon(_serve_client, client, upstream_port)


if __name__ == "__main__":
    trio.run(serve, int(sys.argv[1]), int(sys.argv[2]))
