"""Image bytes as the image dialects receive them: base64 or data URLs, decoded and
checked, their size read from the header, a grey PNG mask inverted. Plain functions,
no I/O.

sd-server decodes every image field itself (stb_image: PNG, JPEG, BMP, GIF, ...); the
host reads only what a translation needs: an image's width and height, where a dialect
takes the output size from the input image and sd-server's native API does not.
"""

from __future__ import annotations

import base64
import binascii
import struct
import zlib
from typing import Final

from ..errors import FieldError

__all__ = ["b64", "decode_b64_image", "image_size", "invert_png_mask", "strip_data_url"]


def strip_data_url(value: str) -> str:
    """The base64 part of a data URL (``data:image/png;base64,...``), or ``value``."""
    if value.startswith("data:"):
        _, _, rest = value.partition(",")
        return rest
    return value


def decode_b64_image(value: object, param: str) -> bytes:
    """The bytes of a base64 image (raw or a data URL); a 400 naming ``param`` when it
    is not a non-empty base64 string."""
    if not isinstance(value, str) or not value:
        raise FieldError(param, "expected a base64-encoded image (or a data URL)")
    data = "".join(strip_data_url(value).split())
    try:
        raw = base64.b64decode(data + "=" * (-len(data) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise FieldError(param, "expected a base64-encoded image (or a data URL)") from None
    if not raw:
        raise FieldError(param, "the image is empty")
    return raw


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


_PNG: Final = b"\x89PNG\r\n\x1a\n"
_SOF_MARKERS: Final = frozenset({*range(0xC0, 0xC4), *range(0xC5, 0xC8), *range(0xC9, 0xCC)}) | {
    0xCD,
    0xCE,
    0xCF,
}


def image_size(raw: bytes) -> tuple[int, int] | None:
    """``(width, height)`` from the header of a PNG, JPEG, GIF, BMP or WebP image; None
    when the format is not one of these or the header is cut short."""
    try:
        if raw.startswith(_PNG) and raw[12:16] == b"IHDR":
            w, h = struct.unpack(">II", raw[16:24])
            return w, h
        if raw[:6] in (b"GIF87a", b"GIF89a"):
            w, h = struct.unpack("<HH", raw[6:10])
            return w, h
        if raw[:2] == b"BM":
            w, h = struct.unpack("<ii", raw[18:26])
            return abs(w), abs(h)
        if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
            return _webp_size(raw)
        if raw[:2] == b"\xff\xd8":
            return _jpeg_size(raw)
    except struct.error:
        return None
    return None


def _webp_size(raw: bytes) -> tuple[int, int] | None:
    chunk = raw[12:16]
    if chunk == b"VP8X":
        w = int.from_bytes(raw[24:27], "little") + 1
        h = int.from_bytes(raw[27:30], "little") + 1
        return w, h
    if chunk == b"VP8L":
        bits = int.from_bytes(raw[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8 ":
        w, h = struct.unpack("<HH", raw[26:30])
        return w & 0x3FFF, h & 0x3FFF
    return None


def _jpeg_size(raw: bytes) -> tuple[int, int] | None:
    i = 2
    while i + 4 <= len(raw):
        if raw[i] != 0xFF:
            return None
        marker = raw[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            i += 2
            continue
        (length,) = struct.unpack(">H", raw[i + 2 : i + 4])
        if marker in _SOF_MARKERS:
            h, w = struct.unpack(">HH", raw[i + 5 : i + 9])
            return w, h
        i += 2 + length
    return None


# --------------------------------------------------------------------------- PNG masks

_CHANNELS: Final = {0: 1, 2: 3, 4: 2, 6: 4}  # colour type -> samples per pixel (8-bit)


def invert_png_mask(raw: bytes, param: str) -> bytes:
    """A mask inverted as SD-WebUI's ``inpainting_mask_invert`` asks (255 - luminance),
    as an 8-bit grey PNG. sd-server reads a mask as one channel of luminance (stb's
    0.299/0.587/0.114 weights), so the result means to it what the inverse of the
    original means. Takes non-interlaced 8-bit grey, grey+alpha, RGB and RGBA PNGs;
    other masks are a 400 naming ``param``."""
    try:
        width, height, rows = _png_rows(raw)
    except (ValueError, zlib.error, struct.error) as exc:
        raise FieldError(
            param,
            f"inpainting_mask_invert needs the mask as a PNG (8-bit, not interlaced): {exc}",
        ) from None
    out = bytearray()
    for row, channels in rows:
        out.append(0)  # filter: none
        if channels in (1, 2):
            out.extend(255 - row[x * channels] for x in range(width))
        else:
            out.extend(
                255
                - (
                    (
                        row[x * channels] * 77
                        + row[x * channels + 1] * 150
                        + row[x * channels + 2] * 29
                    )
                    >> 8
                )
                for x in range(width)
            )
    return _png(width, height, bytes(out))


def _png_rows(raw: bytes) -> tuple[int, int, list[tuple[bytes, int]]]:
    if not raw.startswith(_PNG):
        raise ValueError("not a PNG")
    pos = len(_PNG)
    idat = bytearray()
    header: tuple[int, ...] | None = None
    while pos + 8 <= len(raw):
        (length,) = struct.unpack(">I", raw[pos : pos + 4])
        kind = raw[pos + 4 : pos + 8]
        data = raw[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", data)
        elif kind == b"IDAT":
            idat += data
        elif kind == b"IEND":
            break
    if header is None:
        raise ValueError("no IHDR chunk")
    width, height, depth, colour, _, _, interlace = header
    channels = _CHANNELS.get(colour)
    if depth != 8 or channels is None or interlace:
        raise ValueError(f"bit depth {depth}, colour type {colour}, interlace {interlace}")
    data = zlib.decompress(bytes(idat))
    stride = width * channels
    if len(data) < height * (stride + 1):
        raise ValueError("the image data is cut short")
    rows: list[tuple[bytes, int]] = []
    prev = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        line = bytearray(data[start + 1 : start + 1 + stride])
        _unfilter(data[start], line, prev, channels)
        rows.append((bytes(line), channels))
        prev = line
    return width, height, rows


def _unfilter(kind: int, line: bytearray, prev: bytearray, bpp: int) -> None:
    if kind == 0:
        return
    for i in range(len(line)):
        left = line[i - bpp] if i >= bpp else 0
        up = prev[i]
        if kind == 1:
            line[i] = (line[i] + left) & 0xFF
        elif kind == 2:
            line[i] = (line[i] + up) & 0xFF
        elif kind == 3:
            line[i] = (line[i] + ((left + up) >> 1)) & 0xFF
        elif kind == 4:
            corner = prev[i - bpp] if i >= bpp else 0
            p = left + up - corner
            pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
            pred = left if pa <= pb and pa <= pc else up if pb <= pc else corner
            line[i] = (line[i] + pred) & 0xFF
        else:
            raise ValueError(f"unknown filter type {kind}")


def _png(width: int, height: int, filtered_grey: bytes) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        _PNG
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(filtered_grey))
        + chunk(b"IEND", b"")
    )
