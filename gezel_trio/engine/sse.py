"""The one server-sent-events decoder: what llama-server streams, and what the host
streams to its own clients.

An SSE stream is lines (ended by ``\\n`` or ``\\r\\n``), grouped into events
by blank lines; an event's ``data:`` lines carry its payload (llama-server sends one
JSON object per event, or ``[DONE]``). Lines of other fields (``event:``, ``id:``)
and comments (``:``) carry no data. Each decoder here yields the payload of every
``data:`` line, stripped of surrounding white space, in order:

- :class:`SseDecoder` incrementally, over chunks of bytes as they arrive: a payload
  comes out once its event has ended (an event split across reads is held back);
  ``feed`` decodes the JSON, ``payloads`` gives the raw bytes;
- :func:`data_payloads` over one buffer already read (a whole body, or a tail of one);
- :func:`aiter_data` over an async iterator of chunks (an httpx response), payloads
  as they arrive, then those of a last event the stream did not end.

No I/O here, and nothing here waits but :func:`aiter_data`, on its source.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterable, Iterator
from typing import Any

__all__ = ["DONE", "SseDecoder", "aiter_data", "data_payloads"]

DONE = b"[DONE]"
"""The payload that ends an OpenAI-style stream."""


def _data(line: bytes) -> bytes | None:
    """The payload of a ``data:`` line, or None for any other line."""
    if line.endswith(b"\r"):
        line = line[:-1]
    return line[5:].strip() if line.startswith(b"data:") else None


def data_payloads(buffer: bytes) -> Iterator[bytes]:
    """The payload of each ``data:`` line of ``buffer``, its last line included even
    when it is not ended (a buffer cut at either end can start or end mid-line: such a
    piece yields only if it happens to start with ``data:``)."""
    for line in buffer.split(b"\n"):
        data = _data(line)
        if data is not None:
            yield data


class SseDecoder:
    """Bytes in, payloads out, incrementally (see the module docstring).

    ``feed`` yields the decoded JSON of each payload, skipping empty ones and
    :data:`DONE` (an invalid JSON payload raises ``ValueError``); ``payloads``
    yields every payload as it is; ``flush`` ends the stream: the payloads of an
    event it left unfinished.
    """

    __slots__ = ("_buffer", "_pending")

    def __init__(self) -> None:
        self._buffer = b""
        self._pending: list[bytes] = []

    def payloads(self, chunk: bytes) -> Iterator[bytes]:
        self._buffer += chunk
        start = 0
        while True:
            end = self._buffer.find(b"\n", start)
            if end < 0:
                break
            line = self._buffer[start:end]
            start = end + 1
            if not line or line == b"\r":  # a blank line ends the event
                pending, self._pending = self._pending, []
                yield from pending
                continue
            data = _data(line)
            if data is not None:
                self._pending.append(data)
        self._buffer = self._buffer[start:]

    def flush(self) -> Iterator[bytes]:
        """The payloads of an event the stream did not end (and of an unended last
        ``data:`` line); the decoder is empty afterwards."""
        if self._buffer:
            data = _data(self._buffer)
            if data is not None:
                self._pending.append(data)
            self._buffer = b""
        pending, self._pending = self._pending, []
        yield from pending

    def feed(self, chunk: bytes) -> Iterator[Any]:
        for data in self.payloads(chunk):
            if data and data != DONE:
                yield json.loads(data)


async def aiter_data(chunks: AsyncIterable[bytes]) -> AsyncGenerator[bytes, None]:
    """The payload of each ``data:`` line of a stream of chunks (``response.aiter_bytes()``),
    each as soon as its event has ended, then those of an event the stream left
    unended. Cancellation: only the wait for the next chunk is abandoned; closing the
    source is its owner's business."""
    decoder = SseDecoder()
    async for chunk in chunks:
        for data in decoder.payloads(chunk):
            yield data
    for data in decoder.flush():
        yield data
