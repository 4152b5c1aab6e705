"""A bounded ring buffer of an engine's output lines."""

from __future__ import annotations

import collections
import time

import trio


class LogRing:
    """Keeps the last ``maxlen`` lines; older lines are dropped and counted."""

    def __init__(self, maxlen: int = 400) -> None:
        self._lines: collections.deque[tuple[float, str]] = collections.deque(maxlen=maxlen)
        self.dropped = 0
        self.total = 0

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

    async def pump(
        self, stream: trio.abc.ReceiveStream, *, max_line: int = 4096, gather_s: float = 0.0
    ) -> None:
        """Read ``stream`` to EOF, appending decoded lines. Returns on EOF or stream error.

        ``gather_s``: after each read, wait that long before the next, so that the lines
        a writer writes one by one (llama-server: several per request) come in one read
        instead of a wakeup each; the pipe holds them meanwhile. Cancellation stops it."""
        buf = b""
        try:
            while True:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                if gather_s > 0:
                    await trio.sleep(gather_s)
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for raw in lines:
                    self.append(raw[:max_line].decode("utf-8", "replace").rstrip("\r"))
                if len(buf) > max_line:
                    self.append(buf[:max_line].decode("utf-8", "replace"))
                    buf = b""
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        if buf:
            self.append(buf.decode("utf-8", "replace"))
