"""The llama-server process itself: starting it, ending it, reading its exit code.

What a process is to the supervisor (:class:`ProcessHandle`, which a fake implements
in tests), how a real one starts (:func:`spawn_process`) and how one ends
(:func:`end_process`: SIGTERM, then SIGKILL after a grace period). The lifecycle
around them (states, restarts, the memory reservation) is
:mod:`gezel_trio.engine.supervisor`'s.
"""

from __future__ import annotations

import contextlib
import math
import signal
import subprocess
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol

import trio

__all__ = ["Launcher", "ProcessHandle", "describe_exit_code", "end_process", "spawn_process"]


class ProcessHandle(Protocol):
    """The part of :class:`trio.Process` the supervisor uses (a fake implements it in tests)."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    @property
    def stdout(self) -> trio.abc.ReceiveStream | None: ...
    async def wait(self) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


Launcher = Callable[[Sequence[str], Mapping[str, str]], Awaitable[ProcessHandle]]


async def spawn_process(argv: Sequence[str], env: Mapping[str, str]) -> ProcessHandle:
    """Start a real process with stdout and stderr merged into one pipe.

    The child gets its own session so a terminal's Ctrl-C reaches only the
    host, which then stops its engines in order. Raises ``OSError`` when it
    cannot start.
    """
    proc: ProcessHandle = await trio.lowlevel.open_process(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(env),
        start_new_session=True,
    )
    return proc


async def end_process(
    proc: ProcessHandle, *, graceful: bool, grace: float, note: Callable[[str], None]
) -> None:
    """SIGTERM ``proc`` and SIGKILL it if it has not exited ``grace`` seconds later
    (``graceful=False``: SIGKILL at once), then wait for its exit. ``note`` gets a
    line for the engine's log when SIGKILL follows a SIGTERM. A process that has
    exited already is left alone.

    Cancellation abandons the wait (the signal is sent): callers shield it.
    """
    if proc.returncode is not None:
        return
    with contextlib.suppress(OSError):
        if graceful:
            proc.send_signal(signal.SIGTERM)
        else:
            proc.kill()
    with trio.move_on_after(grace if graceful else math.inf):
        await proc.wait()
    if proc.returncode is None:
        note(f"[gezel] no exit {grace:g}s after SIGTERM: sending SIGKILL")
        with contextlib.suppress(OSError):
            proc.kill()
        await proc.wait()


def describe_exit_code(code: int | None) -> str:
    """``-15, SIGTERM`` for a signal, the number for an exit code, ``unknown`` for none."""
    if code is None:
        return "unknown"
    if code < 0:
        try:
            return f"{code}, {signal.Signals(-code).name}"
        except ValueError:
            return str(code)
    return str(code)
