"""Small PNG images for the image tests, written by hand (the package needs no imaging
library): an RGB picture with every row filter PNG has, and a size reader."""

from __future__ import annotations

import struct
import zlib

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (which must come first)."""
    assert data[:8] == PNG_SIGNATURE, f"not a PNG: {data[:16]!r}"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13, f"first chunk is {kind!r}, not IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _chunk(kind: bytes, data: bytes) -> bytes:
    body = kind + data
    return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else b if pb <= pc else c


def _filtered(kind: int, line: bytes, prev: bytes, bpp: int) -> bytes:
    out = bytearray()
    for i, x in enumerate(line):
        a = line[i - bpp] if i >= bpp else 0
        b = prev[i]
        c = prev[i - bpp] if i >= bpp else 0
        pred = (0, a, b, (a + b) >> 1, _paeth(a, b, c))[kind]
        out.append((x - pred) & 0xFF)
    return bytes(out)


def make_png(width: int, height: int, pixel: object = None, *, colour: int = 2) -> bytes:
    """A ``width`` x ``height`` 8-bit PNG (colour type 2 RGB, 0 grey, 6 RGBA); ``pixel(x,
    y)`` gives each pixel's samples (a gradient by default). Row ``y`` uses filter
    ``y % 5``, so a decoder meets all five."""
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[colour]

    def default(x: int, y: int) -> tuple[int, ...]:
        return tuple((x * 7 + y * 13 + c * 50) % 256 for c in range(channels))

    at = pixel if callable(pixel) else default
    raw = bytearray()
    prev = bytes(width * channels)
    for y in range(height):
        line = bytes(v for x in range(width) for v in at(x, y))
        kind = y % 5
        raw.append(kind)
        raw += _filtered(kind, line, prev, channels)
        prev = line
    ihdr = struct.pack(">IIBBBBB", width, height, 8, colour, 0, 0, 0)
    return (
        PNG_SIGNATURE
        + _chunk(b"IHDR", ihdr)
        + _chunk(b"IDAT", zlib.compress(bytes(raw)))
        + _chunk(b"IEND", b"")
    )


def grey_pixels(data: bytes) -> list[list[int]]:
    """The rows of an unfiltered (filter 0) 8-bit grey PNG, as the host writes masks."""
    from gezel_trio.api.image_data import _png_rows

    width, _, rows = _png_rows(data)
    return [[row[x] for x in range(width)] for row, _ in rows]


def decoded_size(data: bytes) -> tuple[int, int]:
    """Width and height of a PNG decoded whole (inflated, every row unfiltered): a PNG
    that only has a plausible header fails here."""
    from gezel_trio.api.image_data import _png_rows

    width, height, rows = _png_rows(data)
    assert len(rows) == height, (len(rows), height)
    assert all(len(row) == width * channels for row, channels in rows)
    assert (width, height) == png_size(data)
    return width, height
