"""Process identity that survives pid reuse: a pid plus the time its process started.

psutil reads the start time (``/proc/<pid>/stat`` and the boot time on Linux, the
platform's own call elsewhere); a reused pid belongs to a process started at another
time, so a recorded identity never matches it.
"""

from __future__ import annotations

import psutil

__all__ = ["process_alive", "process_start_token"]


def process_start_token(pid: int) -> str | None:
    """An identity for the process now running as ``pid`` (its start time), or None when
    there is no such process or it cannot be read."""
    try:
        return f"{psutil.Process(pid).create_time():.3f}"
    except (psutil.Error, ValueError):
        return None


def process_alive(pid: int, start_token: str | None) -> bool:
    """Whether the process recorded as (pid, start token) still runs: it exists, is not
    a zombie, and (with a token) started when the token says, so a reused pid is dead."""
    if pid <= 0:
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        if start_token is None:
            return True
        return f"{proc.create_time():.3f}" == start_token
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # exists, owned by another user; its start time is not ours to read
    except psutil.Error:
        return False
