"""Untrusted image bytes -> the network's uint8 input, by the training data's decoder.

dtrain.data.decode checks the pixel count and the decode memory from the header, and
refuses animated and unsupported files, before decoding; here its refusals become the
HTTP status they deserve (413 too large, 422 unreadable).

No torch here: the runtime decodes with Pillow (decode_pil) and resizes with Pillow's
antialiased bilinear filter, the one torchvision's `resize(antialias=True)` for uint8
(dtrain.data.transforms.resize_uint8, used in training and evaluation) was written to
reproduce; tests/test_runtime_preprocess.py holds the two to within one grey level and
the verdicts to identical. Both release the GIL, so decoding threads run in parallel.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from dtrain.data.config import Size, as_hw
from dtrain.data.decode import DEFAULT_MAX_DECODE_BYTES, DEFAULT_MAX_PIXELS, FULL_BITS, ImageRefused, decode_pil, read_file
from dtrain.data.masks import IMAGE_EXTENSIONS

# Pillow stores a large image in 16 MB blocks by default. glibc serves blocks that size
# from per-thread heaps once its mmap threshold has grown (up to 32 MB), and keeps them
# after they are freed: 16 threads decoding 6000 px uploads in turn grew the service to
# 2.8 GB where the decode budget allowed 320 MB. Blocks above 32 MB are always mmap'd and
# go back to the kernel on free; a small image still allocates only what it needs.
_BLOCK_BYTES = 64 * 2**20


def _use_large_blocks() -> None:
    from PIL import Image

    if Image.core.get_block_size() < _BLOCK_BYTES:
        Image.core.set_block_size(_BLOCK_BYTES)


_use_large_blocks()

IMAGE_SUFFIXES = IMAGE_EXTENSIONS  # what training reads is what inspection reads


class ImageRejected(Exception):
    """An image the service refuses; `status` is the HTTP code (413 too large, 422 unreadable)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Abandoned(Exception):
    """The request an image belongs to was answered (a 504) or its client left: the image
    is not decoded."""


class DecodeBudget:
    """Decoded bytes in flight across threads: a decode waits until its bytes (from the
    header) fit, so many small images decode in parallel and a few large ones take turns.
    A decode needs about 1.5x its bytes at its peak (a 16-bit image and its 8-bit copy),
    so the process holds at most ~1.5 x `max_bytes` of pixels beyond its baseline."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free = max_bytes
        self._changed = threading.Condition()

    @contextmanager
    def hold(self, nbytes: int, abandoned: threading.Event | None = None) -> Iterator[None]:
        """Raises Abandoned, instead of waiting on, once `abandon(abandoned)` was called."""
        nbytes = min(nbytes, self.max_bytes)  # one image above the whole budget runs alone
        gone = abandoned.is_set if abandoned is not None else lambda: False
        with self._changed:
            self._changed.wait_for(lambda: self._free >= nbytes or gone())
            if gone():
                raise Abandoned
            self._free -= nbytes
        try:
            yield
        finally:
            with self._changed:
                self._free += nbytes
                self._changed.notify_all()

    def abandon(self, abandoned: threading.Event) -> None:
        """Set `abandoned`, and wake its decodes waiting for their turn so that they give it up."""
        with self._changed:
            abandoned.set()
            self._changed.notify_all()


def prepare_bytes(data: bytes, size: Size, max_pixels: int = DEFAULT_MAX_PIXELS,
                  max_decode_bytes: int = DEFAULT_MAX_DECODE_BYTES, budget: DecodeBudget | None = None,
                  sample_bits: int = FULL_BITS, abandoned: threading.Event | None = None) -> np.ndarray:
    """Encoded image -> uint8 [3, H, W] (`size`: a side or (H, W)); raises ImageRejected.
    `sample_bits`: the model card's (Preprocessing.sample_bits). `abandoned`: see DecodeBudget.hold."""
    return decode_checked(data, max_pixels, max_decode_bytes, budget, then=lambda img: resize(img, size),
                          sample_bits=sample_bits, abandoned=abandoned)


def decode_checked(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS, max_decode_bytes: int = DEFAULT_MAX_DECODE_BYTES,
                   budget: DecodeBudget | None = None, then=lambda img: img, sample_bits: int = FULL_BITS,
                   abandoned: threading.Event | None = None):
    """Encoded image -> 8-bit RGB Pillow image (or `then` of it, still inside the
    budget); raises ImageRejected."""
    kw = {"admit": lambda nbytes: budget.hold(nbytes, abandoned)} if budget is not None else {}
    with _rejected():
        return decode_pil(data, max_pixels=max_pixels, max_decode_bytes=max_decode_bytes, then=then,
                          sample_bits=sample_bits, **kw)


def read_image_file(path: str | Path, max_decode_bytes: int = DEFAULT_MAX_DECODE_BYTES) -> bytes:
    """A file's bytes, refused (ImageRejected 413) without reading them when the file is
    larger than any image within the decode limit can be; OSError when it cannot be read."""
    with _rejected():
        return read_file(path, max_decode_bytes)


@contextmanager
def _rejected() -> Iterator[None]:
    """The decoder's refusals as the HTTP status they deserve."""
    try:
        yield
    except ImageRefused as exc:
        raise ImageRejected(413 if exc.too_large else 422, exc.message) from None


def resize(img, size: Size) -> np.ndarray:
    """RGB Pillow image -> uint8 [3, H, W] for `size` (H, W) or a square side (a view of an
    HWC array: np.stack copies it once). Into a wide input an upright picture is turned a
    quarter counter-clockwise first, as in training (dtrain.data.transforms.resize_uint8)."""
    from PIL import Image

    h, w = as_hw(size)
    if w > h and img.height > img.width:
        img = img.transpose(Image.Transpose.ROTATE_90)
    if img.size != (w, h):
        img = img.resize((w, h), Image.Resampling.BILINEAR)
    return np.asarray(img).transpose(2, 0, 1)


def prepare_file(path: str | Path, size: Size, max_pixels: int = DEFAULT_MAX_PIXELS,
                 max_decode_bytes: int = DEFAULT_MAX_DECODE_BYTES, sample_bits: int = FULL_BITS) -> np.ndarray:
    return prepare_bytes(read_image_file(path, max_decode_bytes), size, max_pixels, max_decode_bytes, sample_bits=sample_bits)
