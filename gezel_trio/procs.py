"""Process identity that survives pid reuse: a pid plus its start time on this boot."""

from __future__ import annotations

import os
from pathlib import Path


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "?"


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, starttime) from /proc/<pid>/stat, or None without /proc."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ")".
    rest = raw[raw.rfind(")") + 2 :].split()
    if len(rest) < 20:
        return None
    return rest[0], rest[19]


def process_start_token(pid: int) -> str | None:
    """An identity for the process now running as ``pid``: boot id + start time."""
    stat = _proc_stat(pid)
    if stat is None:
        return None
    return f"{_boot_id()}:{stat[1]}"


def process_alive(pid: int, start_token: str | None) -> bool:
    """Whether the process recorded as (pid, start token) still runs.

    Dead when ``os.kill(pid, 0)`` finds no process, when it is a zombie, or
    when the pid now belongs to a process started at another time (pid reuse).
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    except OSError:
        return False
    stat = _proc_stat(pid)
    if stat is None:
        return True  # no /proc: os.kill is all we have
    state, starttime = stat
    if state in ("Z", "X", "x"):
        return False
    return not (start_token is not None and start_token != f"{_boot_id()}:{starttime}")
