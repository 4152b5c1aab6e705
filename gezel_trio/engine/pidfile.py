"""Engine pid files: reap an engine orphaned by a host that died without stopping it.

Engines run in their own session (so a terminal's Ctrl-C reaches only the
host, which stops them in order). If the host itself is killed (SIGKILL, OOM,
a power cut of the process), nothing stops them. Each running engine therefore
has a small JSON file in the state dir naming it and its host, both with
start-time tokens (:mod:`gezel_trio.engine.procs`); the next host to open that state
dir kills an engine whose host is gone. A reused pid never matches a token, so
an unrelated process is never killed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from pathlib import Path

from .procs import process_alive, process_start_token

log = logging.getLogger("gezel_trio.engine")


def write_pidfile(path: Path, engine_pid: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    me = os.getpid()
    record = {
        "engine_pid": engine_pid,
        "engine_start": process_start_token(engine_pid),
        "host_pid": me,
        "host_start": process_start_token(me),
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)


def remove_pidfile(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def reap_orphan(path: Path) -> int | None:
    """Kill the engine recorded in ``path`` if its host is gone; returns the pid killed.

    Blocking (reads /proc): call it from a thread or before the event loop.
    """
    try:
        record = json.loads(path.read_text())
        engine_pid = int(record["engine_pid"])
        host_pid = int(record["host_pid"])
    except (OSError, ValueError, KeyError, TypeError):
        remove_pidfile(path)
        return None
    if process_alive(host_pid, record.get("host_start")):
        return None  # another live host owns it: not ours to touch
    killed = None
    if process_alive(engine_pid, record.get("engine_start")):
        with contextlib.suppress(OSError):
            os.kill(engine_pid, signal.SIGKILL)
            killed = engine_pid
            log.warning(
                "killed an engine orphaned by a host that died",
                extra={"fields": {"pid": engine_pid, "dead_host_pid": host_pid}},
            )
    remove_pidfile(path)
    return killed
