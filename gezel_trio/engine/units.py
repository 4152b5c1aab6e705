"""The one byte formatter, for logs, error messages and the CLI's tables."""

from __future__ import annotations

from typing import Literal

__all__ = ["ByteStyle", "format_bytes"]

ByteStyle = Literal["exact", "plan", "short"]
"""How :func:`format_bytes` writes a size:

- ``exact`` (the ledger's messages): ``6.00 GiB (6442450944 bytes)``, KiB to GiB with
  two decimals and the exact count, ``512 bytes`` below a KiB: readable, and exact for
  a test or a log search;
- ``plan`` (the planner's reasons): ``6.00 GiB``, ``1.5 MiB``, ``512 B``;
- ``short`` (the CLI's tables): ``6.0 GiB``, ``1.5 KiB``, ``512 B``, up to TiB.
"""

_KIB, _MIB, _GIB, _TIB = 1024, 1024**2, 1024**3, 1024**4
# Per style: (unit, its size, decimals) from the largest, and the word for plain bytes.
_UNITS: dict[ByteStyle, tuple[tuple[tuple[str, int, int], ...], str]] = {
    "exact": ((("GiB", _GIB, 2), ("MiB", _MIB, 2), ("KiB", _KIB, 2)), "bytes"),
    "plan": ((("GiB", _GIB, 2), ("MiB", _MIB, 1)), "B"),
    "short": ((("TiB", _TIB, 1), ("GiB", _GIB, 1), ("MiB", _MIB, 1), ("KiB", _KIB, 1)), "B"),
}


def format_bytes(n: float, style: ByteStyle = "exact") -> str:
    """``n`` bytes in the largest unit it fills, written in ``style`` (:data:`ByteStyle`)."""
    units, plain = _UNITS[style]
    for unit, size, decimals in units:
        if abs(n) >= size:
            text = f"{n / size:.{decimals}f} {unit}"
            return f"{text} ({n} bytes)" if style == "exact" else text
    return f"{n:.0f} {plain}" if isinstance(n, float) else f"{n} {plain}"
