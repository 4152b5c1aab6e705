"""Which flags an engine accepts, as its own parser knows them: read from its ``--help``.

llama-server prints every option it parses as one ``--help`` entry that starts at the
first column: its names, comma-separated (``-c,    --ctx-size N``, ``--mmap, --no-mmap``),
then, after one space, the value it takes (``N``, ``FNAME``, ``[on|off|auto]``), then the
description after a padding of at least three spaces or on the next lines. Its parser
accepts exactly those names (a ``--`` name also with ``_`` for ``-``), each followed by
its value as the next argument: ``--ctx-size=4096`` is an invalid argument to it.

:func:`engine_flags` runs the binary with ``--help`` once per binary (path, mtime and
size) and keeps what it read; :meth:`EngineFlags.problems` checks a list of flags the
way the engine's parser will. Nothing here starts an engine.
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EngineFlags", "engine_flags", "parse_help"]

_NAME = r"-{1,2}[A-Za-z0-9][A-Za-z0-9_.-]*"
_ENTRY = re.compile(rf"^(?P<names>{_NAME}(?:,\s*{_NAME})*)(?P<rest>.*)$")
_FLAG_LIKE = re.compile(r"^-{1,2}[A-Za-z]")


@dataclass(frozen=True, slots=True)
class EngineFlags:
    """The options of one engine binary: each name, and whether it takes a value."""

    binary: str
    takes_value: Mapping[str, bool]

    def __repr__(self) -> str:
        return f"<EngineFlags {self.binary}: {len(self.takes_value)} names>"

    def problems(self, args: Sequence[str]) -> list[str]:
        """What the engine's parser would refuse in ``args``, one unlabelled line each:
        a flag it does not know (with the nearest names it does), ``--flag=value``, and
        a flag that needs a value at the end of the list. A value is never read as a
        flag (``-ngl -1`` is fine)."""
        out: list[str] = []
        i = 0
        while i < len(args):
            arg = args[i]
            i += 1
            if not _FLAG_LIKE.match(arg):
                continue
            name = arg.replace("_", "-") if arg.startswith("--") else arg
            if name in self.takes_value:
                if self.takes_value[name]:
                    if i >= len(args):
                        out.append(f"{arg} needs a value after it")
                    i += 1
                continue
            head, eq, _ = name.partition("=")
            if eq and head in self.takes_value:
                out.append(
                    f"{arg}: {Path(self.binary).name} does not read name=value; give the "
                    f'value as the next argument ("{head}", "{arg.partition("=")[2]}")'
                )
                continue
            near = difflib.get_close_matches(name, list(self.takes_value), n=2, cutoff=0.75)
            hint = f" (did you mean {' or '.join(near)}?)" if near else ""
            out.append(f"{arg}: {Path(self.binary).name} has no such flag{hint}")
        return out


def parse_help(text: str, *, binary: str = "llama-server") -> EngineFlags:
    """The option names in a llama-server ``--help`` text (see the module)."""
    takes: dict[str, bool] = {}
    for line in text.splitlines():
        m = _ENTRY.match(line)
        if m is None:
            continue
        rest = m["rest"]
        value = rest.startswith(" ") and not rest.startswith("  ") and bool(rest.strip())
        for name in re.split(r",\s*", m["names"]):
            takes[name] = value
    return EngineFlags(binary=binary, takes_value=takes)


_cache: dict[tuple[str, int, int], EngineFlags] = {}
_cache_lock = threading.Lock()


def engine_flags(
    binary: Path, *, env: Mapping[str, str] | None = None, timeout: float = 30.0
) -> EngineFlags:
    """The flags ``binary`` accepts, from its ``--help`` (run once per path, mtime and
    size; later calls answer from memory). Raises :class:`OSError` when it cannot be
    run, and :class:`ValueError` when its help names no flag (not a llama-server, or
    one that failed to start). Blocking: call in a thread."""
    st = binary.stat()
    key = (str(binary), st.st_mtime_ns, st.st_size)
    with _cache_lock:
        found = _cache.get(key)
    if found is not None:
        return found
    try:
        proc = subprocess.run(
            [str(binary), "--help"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            env=dict(os.environ if env is None else env),
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise OSError(f"{binary} --help did not finish within {timeout:g}s") from exc
    flags = parse_help(proc.stdout + "\n" + proc.stderr, binary=str(binary))
    if len(flags.takes_value) < 10:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
        raise ValueError(
            f"{binary} --help (exit code {proc.returncode}) lists no options: {tail[0][:200]}"
        )
    with _cache_lock:
        _cache[key] = flags
    return flags
