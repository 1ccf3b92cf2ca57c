"""Untrusted image bytes -> the network's uint8 input, with limits checked before decoding.

Pillow reads only the header in `Image.open`, so the pixel count of a 20000 x 20000
"decompression bomb" is known (and refused) before a single row is inflated. Formats
torchvision decodes natively go through the same decoder as the training data
(dtrain.data.transforms), so a served image gives exactly the evaluated scores.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

# 40 MP: larger than any line-scan photo we expect, far below what would exhaust memory.
DEFAULT_MAX_PIXELS = 40_000_000
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp", ".gif"})
_TORCHVISION_FORMATS = frozenset({"PNG", "JPEG", "WEBP", "GIF"})


class ImageRejected(Exception):
    """An image the service refuses; `status` is the HTTP code (413 too large, 422 unreadable)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def prepare_bytes(data: bytes, size: int, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Encoded image -> uint8 [3, size, size]; raises ImageRejected."""
    from PIL import Image, UnidentifiedImageError

    from dtrain.data.transforms import preprocess_image

    try:
        img = Image.open(io.BytesIO(data))  # header only
    except Image.DecompressionBombError as exc:
        raise ImageRejected(413, f"image refused before decoding: {exc}") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise ImageRejected(422, "not an image file (unknown or corrupt format)") from None
    width, height = img.size
    if width * height > max_pixels:
        raise ImageRejected(
            413, f"image is {width}x{height} = {width * height} pixels, above the limit of {max_pixels}; refused before decoding"
        )
    try:
        if img.format in _TORCHVISION_FORMATS:
            tensor = preprocess_image(data, size)
        else:
            tensor = preprocess_image(img, size)
    except Image.DecompressionBombError as exc:
        raise ImageRejected(413, f"image refused: {exc}") from None
    except (OSError, ValueError, SyntaxError, RuntimeError):
        # Truncated or damaged data surfaces only while decoding; the decoders' own
        # messages name C++ source lines, which help nobody here.
        raise ImageRejected(422, f"cannot decode the {img.format or 'image'} data: the file is corrupt or truncated") from None
    return tensor.numpy()


def prepare_file(path: str | Path, size: int, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    return prepare_bytes(Path(path).read_bytes(), size, max_pixels)

