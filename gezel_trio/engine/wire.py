"""The bytes of one HTTP/1.1 request to an engine and of its answer, without I/O.

:class:`~.transport.EngineTransport` sends each completion over a connection of its
own and reads one answer from it. This module is that exchange's wire format:
:func:`request_bytes` writes the request, and :class:`AnswerReader` reads the answer's
head and de-frames its body (chunked, ``Content-Length``, or up to the connection's
end) from whatever bytes arrive.

It reads only what an HTTP/1.1 server may send a client that sent one request with
``Connection: close``, and refuses what breaks the protocol (:class:`AnswerError`).
It does less than h11, which it replaced on this path: h11's generality (both roles,
keep-alive, every state transition checked by a state machine) cost more Python
calls than the rest of the upstream half of a 1-token completion
(``python -m benchmarks.transport_cost``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["AnswerError", "AnswerHead", "AnswerReader", "request_bytes"]

MAX_HEAD_BYTES = 64 * 1024
"""An answer's head longer than this is refused (h11's default limit)."""

_MAX_CHUNK_LINE = 1024
"""A chunk-size line (or a trailer line) longer than this is refused."""

_FORBIDDEN_IN_HEADERS = (b"\r", b"\n", b"\0")
_HEX_DIGITS = b"0123456789abcdefABCDEF"


class AnswerError(Exception):
    """The engine's answer breaks HTTP/1.1 (its message says how)."""


@dataclass(frozen=True, slots=True)
class AnswerHead:
    status: int
    reason: bytes
    headers: list[tuple[bytes, bytes]]
    """As sent: names in the engine's case, values without surrounding blanks."""


def request_bytes(
    method: str, target: bytes, headers: Sequence[tuple[bytes, bytes]], body: bytes
) -> bytes:
    """The whole request, head and body, as one write. ``headers`` are sent as given
    (a ``Content-Length`` is added when they frame nothing; a body sent with
    ``Transfer-Encoding: chunked`` goes as one chunk). A header that would break the
    head (a CR, LF or NUL in it) raises ``ValueError``."""
    lines = [b"%s %s HTTP/1.1\r\n" % (method.encode("ascii"), target)]
    framed = chunked = False
    for name, value in headers:
        for c in _FORBIDDEN_IN_HEADERS:
            if c in name or c in value:
                raise ValueError(f"the header {name!r} holds a forbidden byte {c!r}")
        lowered = name.lower()
        if lowered == b"content-length":
            framed = True
        elif lowered == b"transfer-encoding":
            framed = chunked = True
        lines.append(b"%s: %s\r\n" % (name, value))
    if not framed:
        lines.append(b"Content-Length: %d\r\n" % len(body))
    lines.append(b"\r\n")
    if chunked:
        lines.append(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n")
    else:
        lines.append(body)
    return b"".join(lines)


# How the body is framed, then where the reader is in a chunked one.
_LENGTH = 0  # Content-Length: ``_left`` bytes to come
_UNTIL_CLOSE = 1  # no framing: the body ends with the connection
_CHUNK_SIZE = 2  # a chunk-size line is next
_CHUNK_DATA = 3  # ``_left`` bytes of the chunk to come
_CHUNK_END = 4  # the CRLF after a chunk's data is next
_TRAILERS = 5  # trailer lines until an empty one


class AnswerReader:
    """Reads one answer: :meth:`feed` it the bytes that arrive; :meth:`head` gives the
    head once it is whole, then :meth:`body` the body's bytes as they come, de-framed,
    until :attr:`done`. An informational (1xx) head is skipped. Not for the answer to
    a ``HEAD`` request (its framing headers describe a body that never comes)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._head: AnswerHead | None = None
        self._framing = _UNTIL_CLOSE
        self._left = 0
        self.done = False
        """The whole body has been read."""

    def __repr__(self) -> str:
        status = None if self._head is None else self._head.status
        return f"<AnswerReader status={status} buffered={len(self._buffer)} done={self.done}>"

    @property
    def ends_with_connection(self) -> bool:
        """The body has no framing: the connection's end is the body's end."""
        return self._head is not None and self._framing == _UNTIL_CLOSE

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def head(self) -> AnswerHead | None:
        """The answer's head, once it has all arrived (None until then); raises
        :class:`AnswerError` for one that is malformed or over :data:`MAX_HEAD_BYTES`."""
        while self._head is None:
            buffer = self._buffer
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > MAX_HEAD_BYTES:
                    raise AnswerError(f"the answer's head is over {MAX_HEAD_BYTES} bytes")
                return None
            head = _parse_head(bytes(buffer[:end]))
            del buffer[: end + 4]
            if not 100 <= head.status < 200:
                self._head = head
                self._frame(head)
        return self._head

    def body(self) -> bytes:
        """The body's bytes that arrived since the last call, de-framed (``b""`` when
        none did); sets :attr:`done` once the body is whole. Raises
        :class:`AnswerError` for a framing that breaks the protocol."""
        buffer = self._buffer
        if self.done or not buffer:
            return b""
        framing = self._framing
        if framing == _UNTIL_CLOSE:
            data = bytes(buffer)
            buffer.clear()
            return data
        if framing == _LENGTH:
            data = bytes(buffer[: self._left])
            del buffer[: self._left]
            self._left -= len(data)
            self.done = self._left == 0
            return data
        return self._chunked()

    def _frame(self, head: AnswerHead) -> None:
        if head.status in (204, 304):
            self._framing, self._left, self.done = _LENGTH, 0, True
            return
        length: bytes | None = None
        for name, value in head.headers:
            lowered = name.lower()
            if lowered == b"transfer-encoding":
                codings = value.lower().split(b",")
                self._framing = _CHUNK_SIZE if codings[-1].strip() == b"chunked" else _UNTIL_CLOSE
                return
            if lowered == b"content-length":
                if length is not None and value != length:
                    raise AnswerError("the answer has two different Content-Length headers")
                length = value
        if length is not None:
            if not length.isdigit():
                raise AnswerError(f"the answer's Content-Length is not a number: {length!r}")
            self._framing, self._left = _LENGTH, int(length)
            self.done = self._left == 0

    def _chunked(self) -> bytes:
        buffer = self._buffer
        out: list[bytes] = []
        while buffer:
            state = self._framing
            if state == _CHUNK_DATA:
                data = bytes(buffer[: self._left])
                del buffer[: self._left]
                out.append(data)
                self._left -= len(data)
                if self._left == 0:
                    self._framing = _CHUNK_END
                continue
            if state == _CHUNK_END:
                if len(buffer) < 2:
                    break
                if buffer[:2] != b"\r\n":
                    raise AnswerError("a chunk's data does not end with CRLF")
                del buffer[:2]
                self._framing = _CHUNK_SIZE
                continue
            end = buffer.find(b"\r\n")
            if end < 0:
                if len(buffer) > _MAX_CHUNK_LINE:
                    raise AnswerError(f"a chunk-size line is over {_MAX_CHUNK_LINE} bytes")
                break
            line = bytes(buffer[:end])
            del buffer[: end + 2]
            if state == _TRAILERS:
                if not line:
                    self.done = True
                    buffer.clear()
                    break
                continue
            size = line.partition(b";")[0].strip(b" \t")
            if not size or size.strip(_HEX_DIGITS):
                raise AnswerError(f"a chunk's size is not hexadecimal: {line!r}")
            self._left = int(size, 16)
            self._framing = _CHUNK_DATA if self._left else _TRAILERS
        return b"".join(out)


def _parse_head(raw: bytes) -> AnswerHead:
    lines = raw.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise AnswerError(f"the answer does not start with an HTTP/1 status line: {lines[0]!r}")
    code = parts[1]
    if len(code) != 3 or not code.isdigit():
        raise AnswerError(f"the answer's status is not three digits: {code!r}")
    headers: list[tuple[bytes, bytes]] = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
            raise AnswerError(f"the answer has a malformed header line: {line!r}")
        headers.append((name, value.strip(b" \t")))
    return AnswerHead(int(code), parts[2] if len(parts) > 2 else b"", headers)
