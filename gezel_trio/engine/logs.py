"""A bounded ring buffer of an engine's output lines."""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable

import trio


class LogRing:
    """Keeps the last ``maxlen`` lines; older lines are dropped and counted."""

    def __init__(self, maxlen: int = 400) -> None:
        self._lines: collections.deque[tuple[float, str]] = collections.deque(maxlen=maxlen)
        self.dropped = 0
        self.total = 0
        self._gather: trio.CancelScope | None = None  # the pump's wait, while it gathers
        self._caught_up: trio.Event | None = None  # for readers hurrying that wait
        self.observer: Callable[[bytes], None] | None = None
        """Given every chunk the pump reads, as read (``\r``-separated updates too, which
        make no line until the next ``\n``): the image engine's progress is read so."""

    def __repr__(self) -> str:
        return f"<LogRing {len(self._lines)}/{self._lines.maxlen} lines, {self.dropped} dropped>"

    def append(self, line: str) -> None:
        if len(self._lines) == self._lines.maxlen:
            self.dropped += 1
        self.total += 1
        self._lines.append((time.time(), line))

    def since(self, seq: int) -> tuple[list[str], int]:
        """The lines appended after the first ``seq`` ever appended (those still kept),
        and the sequence number to ask from next time (``total``)."""
        kept = len(self._lines)
        first = self.total - kept  # the sequence number of the oldest line kept
        skip = max(0, seq - first)
        return [line for _, line in list(self._lines)[skip:]], self.total

    def tail(self, n: int = 50) -> list[str]:
        if n <= 0:
            return []
        return [line for _, line in list(self._lines)[-n:]]

    def summary(self, n: int = 8) -> str:
        """The last ``n`` non-empty lines joined, for error messages."""
        lines = [ln.strip() for ln in self.tail(max(n * 4, n)) if ln.strip()]
        return " | ".join(lines[-n:])

    async def caught_up(self) -> None:
        """Return once what the pump has read is in the ring, and what the engine wrote
        before the call with it: a pump gathering (see :meth:`pump`) stops waiting, reads
        what the pipe holds, and appends it. At once when the pump is not gathering.
        Cancellation: the caller stops waiting."""
        gather = self._gather
        if gather is None:
            return
        if self._caught_up is None:
            self._caught_up = trio.Event()
        caught_up = self._caught_up
        gather.cancel()
        await caught_up.wait()

    async def pump(
        self, stream: trio.abc.ReceiveStream, *, max_line: int = 4096, gather_s: float = 0.0
    ) -> None:
        """Read ``stream`` to EOF, appending decoded lines. Returns on EOF or stream error.

        ``gather_s``: after each read, wait that long, then take what the stream holds by
        then too, so that the lines a writer writes one by one (llama-server: several per
        request) cost one wakeup instead of one each. A reader that needs the latest lines
        cuts the wait short (:meth:`caught_up`). Cancellation stops it."""
        buf = b""
        try:
            while True:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                if gather_s > 0:
                    with trio.CancelScope(deadline=trio.current_time() + gather_s) as gather:
                        self._gather = gather
                        await trio.sleep_forever()
                    self._gather = None
                    chunk += _ready_bytes(stream)
                if self.observer is not None:
                    self.observer(bytes(chunk))
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for raw in lines:
                    self.append(raw[:max_line].decode("utf-8", "replace").rstrip("\r"))
                if len(buf) > max_line:
                    self.append(buf[:max_line].decode("utf-8", "replace"))
                    buf = b""
                self._release_readers()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self._gather = None
            self._release_readers()
        if buf:
            self.append(buf.decode("utf-8", "replace"))

    def _release_readers(self) -> None:
        if self._caught_up is not None:
            self._caught_up.set()
            self._caught_up = None


def _ready_bytes(stream: trio.abc.ReceiveStream) -> bytes:
    """What ``stream`` holds now, read without waiting, when it is a pipe (trio's
    ``FdStream``, whose descriptor is non-blocking); b"" for any other stream."""
    fileno = getattr(stream, "fileno", None)
    if fileno is None:
        return b""
    out = []
    while True:
        try:
            data = os.read(fileno(), 65536)
        except OSError:  # BlockingIOError: nothing more now
            break
        if not data:  # the end: the next receive_some says so too
            break
        out.append(data)
    return b"".join(out)
