"""The one image decoder: encoded bytes -> uint8 [3, H, W] RGB, for training, evaluation,
`dtrain inspect` and the service alike, with its cost checked before decoding.

Pillow's `Image.open` reads only the header, which gives the size, whether there is more
than one frame and the channels; the bit depth comes from the header too (PNG's IHDR, TIFF's
BitsPerSample). What a decode would cost in memory, pixels x bytes per pixel, is
refused above a limit before a single row is inflated: a 280 kB 6000 x 6000 16-bit RGBA
PNG would need 288 MB for its pixels alone.

A photo is decoded upright: the EXIF orientation a phone or a camera on its side writes
(tag 0x0112) is applied, as every viewer, OpenCV's imread and the labelling tools (LabelMe,
CVAT, a browser) apply it, so a box drawn on what the labeller saw lands on the same
pixels here. The tag is read by Pillow with the header (pure Python: a malformed EXIF block
is ignored, not a crash) and applied to the decoded pixels by a flip or turn.

What is accepted: one still image of any size within the limits (a JPEG's first picture
where a phone stored a second one after it), grey, grey + alpha,
palette, RGB, RGBA, CMYK, at 8 or 16 bits per sample (alpha is dropped). 16-bit samples
become 8 bits by a shift of `sample_bits - 8` (DataConfig.sample_bits): the high byte by
default, the low 12 bits' top 8 for a 12-bit camera's values stored as they come, which
the high byte would leave with 16 grey levels. What is refused, with a reason: animated or multi-page files (which
frame would be the part?), 32-bit integer or float samples, and anything unreadable.

Two outputs, one set of checks: `decode` gives a torch tensor for training and
evaluation (torchvision's native decoders where it has them), `decode_pil` an 8-bit RGB
Pillow image for the torch-free inspection runtime (dtrain.serve.images). This module
imports neither torch nor torchvision at module level, so the runtime never loads them.
"""

from __future__ import annotations

import io
import os
import sys
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image as PILImage

T = TypeVar("T")
D = TypeVar("D")
# torchvision 0.29 marks its image codecs deprecated in favour of torchcodec (not a
# dependency here); the codecs still work, and the warning would fire in every
# DataLoader worker and bury real ones.
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision", category=DeprecationWarning)

# 40 MP: larger than any line-scan photo we expect, far below what would exhaust memory.
DEFAULT_MAX_PIXELS = 40_000_000
# 40 MP at 4 bytes per pixel (8-bit RGBA); a 16-bit RGB image may have 26 MP.
DEFAULT_MAX_DECODE_BYTES = 160_000_000
# Bits a 16-bit sample really uses (DataConfig.sample_bits): all 16 unless told otherwise.
FULL_BITS = 16

# EXIF orientations that swap a photo's width and height (a transpose or a quarter turn).
QUARTER_TURNS = frozenset({5, 6, 7, 8})

# torchvision decodes these natively (fast, and with little memory beyond its output);
# the rest go through Pillow.
_TORCHVISION_FORMATS = frozenset({"PNG", "JPEG", "MPO", "WEBP", "GIF"})
# A phone's JPEG may carry a second picture after the photo (a depth map, a preview: the MP
# Format, which Pillow calls MPO). Viewers, OpenCV and torchvision show the first picture,
# and so does this decoder (torchvision's and Pillow's JPEG readers stop after it).
_FIRST_PICTURE_FORMATS = frozenset({"MPO"})
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_BYTES_PER_SAMPLE_BY_MODE = {"I;16": 2, "I;16L": 2, "I;16B": 2, "I;16N": 2, "I": 4, "F": 4}


class ImageRefused(ValueError):
    """An image dtrain will not decode; `too_large` tells a size refusal (HTTP 413) from
    an unreadable or unsupported file (422)."""

    def __init__(self, message: str, *, too_large: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.too_large = too_large


@dataclass(frozen=True)
class Header:
    format: str
    width: int
    height: int
    mode: str  # Pillow's
    animated: bool  # more than one frame or page
    channels: int
    bytes_per_sample: int
    orientation: int = 1  # EXIF's 1-8; 1: as stored

    @property
    def pixels(self) -> int:
        return self.width * self.height

    @property
    def upright_hw(self) -> tuple[int, int]:
        """(height, width) once decoded, its orientation applied: a quarter turn swaps them."""
        return (self.width, self.height) if self.orientation in QUARTER_TURNS else (self.height, self.width)

    @property
    def decode_bytes(self) -> int:
        """Memory of the decoded pixels: at the file's depth, and at least RGB (the output)."""
        return self.pixels * max(self.channels, 3) * self.bytes_per_sample


def max_file_bytes(max_decode_bytes: int = DEFAULT_MAX_DECODE_BYTES) -> int:
    """The largest file an image within `max_decode_bytes` can need: its pixels stored as they
    are, and as much again for metadata and bad compression (a noisy JPEG at quality 100 is
    1.4x its pixels)."""
    return 2 * max_decode_bytes


def read_file(path: str | os.PathLike[str], max_decode_bytes: int = DEFAULT_MAX_DECODE_BYTES) -> bytes:
    """A file's bytes for the decoder, refused unread (ImageRefused, too_large) when it is
    larger than max_file_bytes: read whole before its header was looked at, a 2 GiB TIFF
    stack cost 2.3 GB of memory per decoding thread. OSError when it cannot be read."""
    limit = max_file_bytes(max_decode_bytes)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise ImageRefused(f"the file is {size / 1e6:.0f} MB, more than an image within the decode limit of "
                               f"{max_decode_bytes / 1e6:.0f} MB can need ({limit / 1e6:.0f} MB); not read: "
                               "several images in one file, or a damaged one? Store one image per file", too_large=True)
        return f.read()


def read_header(data: bytes) -> Header:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:  # header only
            # Whether a second frame exists, not how many: n_frames walks every page of a
            # TIFF, each step costing as much as all before it (40 000 pages of 1 x 1 pixel,
            # 4 MB: 12 s of CPU before the refusal).
            animated = bool(getattr(img, "is_animated", False)) and img.format not in _FIRST_PICTURE_FORMATS
            return Header(img.format or "image", img.width, img.height, img.mode, animated, len(img.getbands()),
                          _bytes_per_sample(img, data), _orientation(img))
    except Image.DecompressionBombError as exc:
        raise ImageRefused(f"image refused before decoding: {exc}", too_large=True) from None
    except MemoryError:  # this machine's trouble, not the file's
        raise
    except Exception:  # noqa: BLE001 - untrusted bytes: any failure to read them is the file's
        # Pillow's readers raise whatever their parsing runs into on a damaged header, not
        # only OSError/ValueError: TypeError (a TIFF whose next page lies past the end),
        # KeyError (an IM file's unknown mode), NotImplementedError (DDS pixel flags), ...
        raise ImageRefused("not an image file (unknown or corrupt format)") from None


# EXIF orientation -> Pillow's transpose that makes the photo upright (as ImageOps.exif_transpose).
_UPRIGHT = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE", 6: "ROTATE_270",
            7: "TRANSVERSE", 8: "ROTATE_90"}


def _orientation(img) -> int:
    """The EXIF orientation read with the header: TIFF's tag, or an EXIF block Pillow has
    already read at open (JPEG's APP1, PNG's eXIf before the pixels). Pillow's PNG reader
    would decode the whole image to look for a later block: not here, before the size check."""
    try:
        if img.format == "TIFF":
            value = img.tag_v2.get(0x0112, 1)
        elif "exif" in img.info:
            with warnings.catch_warnings():  # Pillow warns of a damaged block in every worker, per photo
                warnings.simplefilter("ignore")
                value = img.getexif().get(0x0112, 1)
        else:
            return 1
    except Exception:  # noqa: BLE001 - a damaged EXIF block says nothing about the pixels: as stored
        return 1
    return value if isinstance(value, int) and value in _UPRIGHT else 1


def upright(img: torch.Tensor, orientation: int) -> torch.Tensor:
    """uint8 [C, H, W] as stored -> as its EXIF `orientation` says it is seen."""
    if orientation not in _UPRIGHT:
        return img
    hw = (-2, -1)
    turned = img.transpose(-2, -1) if orientation in (5, 7) else img  # about the main diagonal first
    turn = {3: 2, 6: -1, 7: 2, 8: 1}.get(orientation, 0)  # quarter turns, counter-clockwise
    if turn:
        turned = turned.rot90(turn, hw)
    if orientation == 2:
        turned = turned.flip(-1)
    elif orientation == 4:
        turned = turned.flip(-2)
    return turned.contiguous()


def _bytes_per_sample(img, data: bytes) -> int:
    if data.startswith(_PNG_SIGNATURE) and len(data) > 24:
        return 2 if data[24] == 16 else 1  # IHDR's bit depth: Pillow reports 16-bit RGB as "RGB"
    if img.format == "TIFF":
        bits = img.tag_v2.get(258, 8)  # BitsPerSample
        return max(-(-int(b) // 8) for b in (bits if isinstance(bits, tuple) else (bits,)))
    return _BYTES_PER_SAMPLE_BY_MODE.get(img.mode, 1)


def check(header: Header, max_pixels: int, max_decode_bytes: int) -> None:
    """Refuse, from the header alone, what the decoder will not or should not decode."""
    size = f"{header.width}x{header.height}"
    if header.pixels > max_pixels:
        raise ImageRefused(f"image is {size} = {header.pixels} pixels, above the limit of {max_pixels}; "
                           "refused before decoding", too_large=True)
    if header.decode_bytes > max_decode_bytes:
        raise ImageRefused(
            f"image is {size} with {header.channels} channel(s) at {8 * header.bytes_per_sample} bits: decoding needs "
            f"{header.decode_bytes / 1e6:.0f} MB, above the limit of {max_decode_bytes / 1e6:.0f} MB; refused before decoding",
            too_large=True,
        )
    if header.animated:
        raise ImageRefused(f"{header.format} of several frames or pages (animated or multi-page): "
                           "send one still image of the part")
    if header.mode in ("I", "F"):
        raise ImageRefused(f"{header.format} with 32-bit {'float' if header.mode == 'F' else 'integer'} samples "
                           "is not supported: save it with 8 or 16 bits per sample")


Admit = Callable[[int], AbstractContextManager]


def decode(
    data: bytes,
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_decode_bytes: int = DEFAULT_MAX_DECODE_BYTES,
    admit: Admit = lambda _nbytes: nullcontext(),
    sample_bits: int = FULL_BITS,
) -> torch.Tensor:
    """Encoded image -> uint8 [3, H, W] RGB; raises ImageRefused (nothing else) for any
    file it will not or cannot decode. The decode itself runs inside `admit(decode_bytes)`
    (the service's memory budget shared by concurrent decodes). `sample_bits`: see the module."""
    return _tensor(data, max_pixels, max_decode_bytes, admit, sample_bits)[1]


def decode_oriented(data: bytes, *, sample_bits: int = FULL_BITS) -> tuple[torch.Tensor, int]:
    """`decode` at the default limits, and the EXIF orientation it applied (1: none), which a
    label drawn on the stored pixels needs to be turned with them (dtrain.data.shapes)."""
    header, img = _tensor(data, DEFAULT_MAX_PIXELS, DEFAULT_MAX_DECODE_BYTES, lambda _nbytes: nullcontext(), sample_bits)
    return img, header.orientation


def _tensor(data: bytes, max_pixels: int, max_decode_bytes: int, admit: Admit, sample_bits: int) -> tuple[Header, torch.Tensor]:
    header, img = _checked_decode(data, max_pixels, max_decode_bytes, admit,
                                  lambda d, h: _decode_tensor(d, h, sample_bits))
    if img.ndim != 3 or img.shape[0] != 3:  # the header check makes this unreachable; the batch stack relies on it
        raise ImageRefused(f"the {header.format} decoded to shape {tuple(img.shape)}, not one RGB image")
    return header, img


def decode_pil(
    data: bytes,
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_decode_bytes: int = DEFAULT_MAX_DECODE_BYTES,
    admit: Admit = lambda _nbytes: nullcontext(),
    then: Callable[[PILImage], T] = lambda img: img,
    sample_bits: int = FULL_BITS,
) -> T:
    """The same checks and refusals as `decode`, by Pillow alone: an 8-bit RGB image,
    or what `then` makes of it. `then` runs inside `admit`, so the full-size image is
    gone before the budget is given back (a resize after the budget let 16 concurrent
    6000 px uploads hold 2.8 GB where the budget said 250 MB)."""
    return _checked_decode(data, max_pixels, max_decode_bytes, admit, lambda d, h: _pil_rgb(d, h, sample_bits), then)[1]


def _checked_decode(data: bytes, max_pixels: int, max_decode_bytes: int, admit: Admit,
                    how: Callable[[bytes, Header], D], then: Callable[[D], T] = lambda img: img) -> tuple[Header, T]:
    """`how` decodes (its failures are the file's: refused); `then` is the caller's own work
    on the result, inside `admit` too, where an exception is a bug and stays one."""
    header = read_header(data)
    check(header, max_pixels, max_decode_bytes)
    with admit(header.decode_bytes):
        return header, then(_decoded(data, header, how))


def _decoded(data: bytes, header: Header, how: Callable[[bytes, Header], D]) -> D:
    from PIL import Image

    try:
        return how(data, header)
    except ImageRefused:  # a refusal with its own reason (a 16-bit colour PNG, no torchvision): kept
        raise
    except Image.DecompressionBombError as exc:
        raise ImageRefused(f"image refused: {exc}", too_large=True) from None
    except MemoryError:  # this machine's trouble, not the file's
        raise
    except Exception:  # noqa: BLE001 - as in read_header: a damaged file fails however its reader fails
        # Truncated or damaged data surfaces only while decoding; the decoders' own
        # messages name C++ source lines, which help nobody here.
        raise ImageRefused(f"cannot decode the {header.format} data: the file is corrupt or truncated") from None


def _decode_tensor(data: bytes, header: Header, sample_bits: int = FULL_BITS) -> torch.Tensor:
    if header.format in _TORCHVISION_FORMATS:
        return upright(_decode_torchvision(data, sample_bits), header.orientation)
    import numpy as np
    import torch

    # np.array: a writable copy (_pil_rgb has turned it upright)
    return torch.from_numpy(np.array(_pil_rgb(data, header, sample_bits))).permute(2, 0, 1).contiguous()


def _decode_torchvision(data: bytes, sample_bits: int = FULL_BITS) -> torch.Tensor:
    import torch
    from torchvision.io import ImageReadMode, decode_image

    img = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    if img.dtype != torch.uint16:
        return img
    if sample_bits >= FULL_BITS:
        return _high_byte(img)
    # torch has no shift on uint16: through int32, 4x the image's size for the moment (the
    # decode budget counts 2 bytes a sample; a 12-bit camera's frames are a few MP)
    return (img.to(torch.int32) >> (sample_bits - 8)).clamp_(max=255).to(torch.uint8)


def _high_byte(img: torch.Tensor) -> torch.Tensor:
    """uint16 [3, H, W] -> uint8 by keeping each sample's high byte, read in place from
    the decoder's HWC buffer: no int32 copy at 4x the image's size."""
    import torch

    hwc = img.permute(1, 2, 0).contiguous()  # torchvision's output is an HWC buffer already: no copy
    high = 1 if sys.byteorder == "little" else 0
    return hwc.view(torch.uint8)[..., high::2].permute(2, 0, 1).contiguous()


def _pil_rgb(data: bytes, header: Header, sample_bits: int = FULL_BITS) -> PILImage:
    from PIL import Image

    rgb = _pil_stored(data, header, sample_bits)
    if header.orientation in _UPRIGHT:
        return rgb.transpose(getattr(Image.Transpose, _UPRIGHT[header.orientation]))
    return rgb


def _pil_stored(data: bytes, header: Header, sample_bits: int) -> PILImage:
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        if img.mode.startswith("I;16"):  # Pillow's convert("RGB") would clip these at 255
            shifted = np.asarray(img, dtype=np.uint16) >> (sample_bits - 8)
            return Image.fromarray(np.minimum(shifted, 255).astype(np.uint8)).convert("RGB")
        if sample_bits < FULL_BITS and header.bytes_per_sample == 2 and header.format == "PNG":
            return _to_pil(_colour_png16(data, sample_bits))
        return img.convert("RGB")


def _colour_png16(data: bytes, sample_bits: int):
    """16-bit colour PNG at `sample_bits`: Pillow reads only its high byte, so torchvision
    decodes it, as in training. torch is imported on this rare path only; an inspection
    PC without it is told so rather than given the high byte the network never saw."""
    try:
        return _decode_torchvision(data, sample_bits)
    except ImportError:
        raise ImageRefused(f"a 16-bit colour PNG for a model of {sample_bits}-bit samples needs torchvision to decode: "
                           "install torch and torchvision, or send 16-bit grey or 8-bit images") from None


def _to_pil(chw) -> PILImage:
    from PIL import Image

    return Image.fromarray(chw.permute(1, 2, 0).contiguous().numpy(), "RGB")
