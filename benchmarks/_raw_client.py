"""A client on a bare socket, for what an HTTP library will not do: leave mid-request.

The abandoned-request figures and tests send a request by hand, read as much of the
answer as they want, and then leave the way a killed client does (a TCP reset, not a
polite close), so that the host sees its client gone at that very point.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import trio

__all__ = ["post_json", "reset"]


async def post_json(
    url: str, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> trio.SocketStream:
    """Open a connection to ``url`` (``http://host:port``), send ``body`` as a JSON POST
    to ``path``, and return the stream unread. Cancellation closes nothing: the caller
    owns the stream from the moment it is connected (on error it is left to the GC)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    payload = json.dumps(body).encode()
    await stream.send_all(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return stream


async def reset(stream: trio.SocketStream) -> None:
    """Leave the way a killed client does: a reset (``SO_LINGER`` 0), not a polite close."""
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00" * 2)
    await stream.aclose()
