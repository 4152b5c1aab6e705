"""sd-server's sampling progress, read from its output: plain parsing, no I/O.

sd-server prints ``\\r|=====>    | 2/4 - 1.23s/it`` on its stdout while it samples
(``print_progress_line`` in its ``src/util.cpp``), each update overwriting the last with
a carriage return and no newline until the last step. Its job API carries no progress,
so this is where a render's progress comes from. Loading tensors draws the same bar with
a speed in MB/s or GB/s: that is not a render's progress.
"""

from __future__ import annotations

import re

from .job import ImageProgress

__all__ = ["last_progress"]

# a sampling step's speed is in s/it or it/s; the same bar with MB/s or GB/s is the
# engine loading tensors (at start, and for a model part loaded on first use)
_PROGRESS = re.compile(rb"\|[^|\r\n]*\|\s*(\d+)/(\d+)\s+-\s+[\d.]+(?:s/it|it/s)")


def last_progress(chunk: bytes) -> ImageProgress | None:
    """The last progress update in ``chunk`` of the engine's output (None: none)."""
    found = None
    for found in _PROGRESS.finditer(chunk):  # noqa: B007 - the last one is wanted
        pass
    if found is None:
        return None
    return ImageProgress(step=int(found.group(1)), steps=int(found.group(2)))
