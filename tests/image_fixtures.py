"""Image files the decoder must cope with, built in memory (owner: serve).

`png16` writes a one-colour 16-bit PNG row by row (Pillow cannot write 16-bit RGB), so
a 6000 x 6000 file costs a fraction of a second and about 300 kB, never its raw pixels.
"""

from __future__ import annotations

import io
import struct
import zlib


def png16(width: int, height: int, channels: int, value: int = 0x9A10) -> bytes:
    """A 16-bit PNG: 1 grey, 2 grey + alpha, 3 RGB, 4 RGBA; every sample is `value`."""
    colour_type = {1: 0, 2: 4, 3: 2, 4: 6}[channels]

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    row = b"\x00" + struct.pack(">H", value) * (width * channels)
    z = zlib.compressobj(9)
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 16, colour_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def png16_of(values) -> bytes:
    """A 16-bit PNG of a uint16 array: [H, W] grey or [H, W, 3] RGB (big-endian rows, filter 0)."""
    import numpy as np

    values = np.asarray(values, dtype=">u2")
    height, width = values.shape[:2]
    colour_type = 2 if values.ndim == 3 else 0

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    raw = b"".join(b"\x00" + values[y].tobytes() for y in range(height))
    ihdr = struct.pack(">IIBBBBB", width, height, 16, colour_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def tiff16_rgb(values) -> bytes:
    """An uncompressed 16-bit RGB TIFF of a uint16 [H, W, 3] array (Pillow writes none)."""
    import numpy as np

    values = np.asarray(values, dtype="<u2")
    height, width, _ = values.shape
    data = values.tobytes()
    count = 10
    bits_at = 8 + 2 + count * 12 + 4
    data_at = bits_at + 6

    def entry(tag: int, kind: int, value: int) -> bytes:  # kind 3: SHORT, 4: LONG; one value each
        return struct.pack("<HHIHH", tag, 3, 1, value, 0) if kind == 3 else struct.pack("<HHII", tag, 4, 1, value)

    entries = [entry(256, 4, width), entry(257, 4, height), struct.pack("<HHII", 258, 3, 3, bits_at), entry(259, 3, 1),
               entry(262, 3, 2), entry(273, 4, data_at), entry(277, 3, 3), entry(278, 4, height), entry(279, 4, len(data)),
               entry(284, 3, 1)]
    ifd = struct.pack("<H", count) + b"".join(entries) + struct.pack("<I", 0)
    return b"II*\x00" + struct.pack("<I", 8) + ifd + struct.pack("<HHH", 16, 16, 16) + data


def animated_gif(frames: int = 5, side: int = 64) -> bytes:
    """The file of issue 10: a 5-frame 64 x 64 GIF saved with Pillow's save_all."""
    from PIL import Image

    images = [Image.new("RGB", (side, side), (40 * i, 90, 200 - 30 * i)) for i in range(frames)]
    out = io.BytesIO()
    images[0].save(out, format="GIF", save_all=True, append_images=images[1:], duration=100, loop=0)
    return out.getvalue()


def encoded(image, fmt: str, **kwargs) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **kwargs)
    return out.getvalue()


def damaged_files() -> dict[str, bytes]:
    """Files whose header made Pillow raise something other than OSError/ValueError (a
    reviewer's fuzzing finds, rebuilt): name -> bytes. The TIFF failed only when its pages
    were counted; it is refused as multi-page since (its first page says a next one exists)."""
    from PIL import Image

    tiff = bytearray(encoded(Image.new("RGB", (4, 4), (10, 120, 250)), "TIFF"))
    ifd = struct.unpack_from("<I", tiff, 4)[0]
    entries = struct.unpack_from("<H", tiff, ifd)[0]
    struct.pack_into("<I", tiff, ifd + 2 + 12 * entries, len(tiff) + 1000)  # next page past the end: TypeError
    im_header = b"Image type: R1EGB image\r\nImage size (x*y): 20*24\r\nFile size (no of images): 1\r\n\x1a"
    dds = bytearray(encoded(Image.new("RGBA", (4, 4)), "DDS"))
    struct.pack_into("<I", dds, 80, 0xFF00)  # the pixel format's flags: NotImplementedError
    return {
        "next_page_past_end.tif": bytes(tiff),
        "unknown_mode.im": im_header.ljust(512, b"\0") + bytes(20 * 24 * 3),  # KeyError
        "unknown_flags.dds": bytes(dds),
    }


def tiff_pages(pages: int, *, last_broken: bool = False) -> bytes:
    """A TIFF of `pages` chained 1 x 1 grey pages (~110 bytes each). `last_broken`: the
    last page has no width, which Pillow fails on (TypeError) if it ever reads that page."""
    def ifd(next_at: int, data_at: int, width: bool) -> bytes:
        tags = [(256, 3, 1, 1)] if width else []
        tags += [(257, 3, 1, 1), (258, 3, 1, 8), (259, 3, 1, 1), (262, 3, 1, 1), (273, 4, 1, data_at), (278, 3, 1, 1),
                 (279, 4, 1, 1)]
        body = struct.pack("<H", len(tags)) + b"".join(struct.pack("<HHII", *t) for t in tags)
        return (body + struct.pack("<I", next_at)).ljust(2 + 12 * 8 + 4, b"\0")

    size = 2 + 12 * 8 + 4
    data_at = 8 + pages * size
    out = b"II*\x00" + struct.pack("<I", 8)
    for i in range(pages):
        out += ifd(8 + (i + 1) * size if i < pages - 1 else 0, data_at, width=not (last_broken and i == pages - 1))
    return out + b"\x80"
