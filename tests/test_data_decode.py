"""dtrain.data.decode: every mode, depth and frame count is decoded to uint8 RGB or
refused with a reason, and the memory a decode needs is refused from the header."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from dtrain.data.decode import ImageRefused, decode, read_header
from tests.image_fixtures import animated_gif, damaged_files, encoded, png16, tiff_pages


def _rgb(r: int, g: int, b: int, side: int = 8) -> Image.Image:
    return Image.new("RGB", (side, side), (r, g, b))


@pytest.mark.parametrize(("name", "data", "pixel"), [
    ("rgb png", encoded(_rgb(10, 120, 250), "PNG"), (10, 120, 250)),
    ("rgba png", encoded(Image.new("RGBA", (8, 8), (10, 120, 250, 30)), "PNG"), (10, 120, 250)),
    ("grey png", encoded(Image.new("L", (8, 8), 77), "PNG"), (77, 77, 77)),
    ("grey+alpha png", encoded(Image.new("LA", (8, 8), (77, 5)), "PNG"), (77, 77, 77)),
    ("palette png", encoded(_rgb(10, 120, 250).quantize(4), "PNG"), (10, 120, 250)),
    ("1-bit png", encoded(Image.new("1", (8, 8), 1), "PNG"), (255, 255, 255)),
    ("still gif", encoded(_rgb(0, 0, 255).convert("P"), "GIF"), (0, 0, 255)),
    ("cmyk jpeg", encoded(Image.new("CMYK", (8, 8), (0, 50, 100, 0)), "JPEG", quality=100), (255, 205, 155)),
    ("cmyk tiff", encoded(Image.new("CMYK", (8, 8), (0, 50, 100, 0)), "TIFF"), (255, 205, 155)),
    ("bmp", encoded(_rgb(10, 120, 250), "BMP"), (10, 120, 250)),
    ("16-bit grey png", png16(8, 8, 1), (0x9A, 0x9A, 0x9A)),
    ("16-bit grey+alpha png", png16(8, 8, 2), (0x9A, 0x9A, 0x9A)),
    ("16-bit rgb png", png16(8, 8, 3), (0x9A, 0x9A, 0x9A)),
    ("16-bit rgba png", png16(8, 8, 4), (0x9A, 0x9A, 0x9A)),
    ("16-bit grey tiff", encoded(Image.fromarray(np.full((8, 8), 0x9A10, np.uint16)), "TIFF"), (0x9A, 0x9A, 0x9A)),
])
def test_every_mode_and_depth_decodes_to_uint8_rgb(name, data, pixel):
    img = decode(data)
    assert img.dtype == torch.uint8 and img.shape == (3, 8, 8), name
    got = tuple(int(v) for v in img[:, 4, 4])
    assert all(abs(a - b) <= 2 for a, b in zip(got, pixel, strict=True)), (name, got)


def test_an_animated_gif_is_refused():
    with pytest.raises(ImageRefused, match="GIF of several frames or pages") as info:
        decode(animated_gif())
    assert not info.value.too_large


def test_a_multi_page_tiff_is_refused():
    pages = [_rgb(i, i, i) for i in (0, 100)]
    with pytest.raises(ImageRefused, match="TIFF of several frames or pages"):
        decode(encoded(pages[0], "TIFF", save_all=True, append_images=pages[1:]))


def test_a_many_page_tiff_is_refused_by_its_first_page_without_reading_the_others():
    """Counting the pages walked every one, each step as long as all before it: 40 000 pages
    of 1 x 1 cost 12 s of CPU, a 64 MB upload most of an hour. The last page here is broken,
    so a refusal that read it would say 'not an image file'."""
    with pytest.raises(ImageRefused, match="TIFF of several frames or pages") as info:
        decode(tiff_pages(2000, last_broken=True))
    assert not info.value.too_large
    assert decode(tiff_pages(1)).shape == (3, 1, 1)


def test_float_samples_are_refused_with_what_to_do():
    with pytest.raises(ImageRefused, match="32-bit float .* 8 or 16 bits"):
        decode(encoded(Image.fromarray(np.zeros((8, 8), np.float32)), "TIFF"))


def test_decode_memory_counts_bit_depth_and_channels_from_the_header():
    # 6000 x 6000 = 36 MP passes a 40 MP pixel limit; at 16 bits x 4 channels it would
    # need 288 MB, which the default 160 MB limit refuses without decoding a row.
    data = png16(6000, 6000, 4)
    header = read_header(data)
    assert (header.channels, header.bytes_per_sample, header.decode_bytes) == (4, 2, 288_000_000)
    with pytest.raises(ImageRefused, match="16 bits: decoding needs 288 MB") as info:
        decode(data)
    assert info.value.too_large
    assert read_header(png16(100, 100, 3)).decode_bytes == 100 * 100 * 3 * 2
    assert read_header(encoded(Image.new("L", (100, 100)), "PNG")).decode_bytes == 100 * 100 * 3  # RGB out


@pytest.mark.parametrize("data", [b"hello, not an image", encoded(_rgb(1, 2, 3, 64), "PNG")[:120]])
def test_garbage_and_truncated_files_are_refused_not_raised_raw(data):
    with pytest.raises(ImageRefused) as info:
        decode(data)
    assert not info.value.too_large and ("not an image" in info.value.message or "corrupt" in info.value.message)


@pytest.mark.parametrize("name", sorted(damaged_files()))
def test_a_header_pillow_chokes_on_in_any_way_is_refused_as_unreadable(name):
    """Pillow raised TypeError, KeyError or NotImplementedError on these: a 500 in the service."""
    from dtrain.data.decode import decode_pil

    for decoder in (decode, decode_pil):
        with pytest.raises(ImageRefused, match="not an image file|several frames or pages") as info:
            decoder(damaged_files()[name])
        assert not info.value.too_large


def test_whatever_pillow_raises_while_decoding_is_a_refusal(monkeypatch):
    from PIL import ImageFile

    from dtrain.data.decode import decode_pil

    def broken(_self):
        raise KeyError("a reader's table has no such entry")

    monkeypatch.setattr(ImageFile.ImageFile, "load", broken)
    for decoder in (decode, decode_pil):  # BMP: Pillow decodes it in both
        with pytest.raises(ImageRefused, match="cannot decode the BMP data"):
            decoder(encoded(_rgb(1, 2, 3), "BMP"))


def test_a_damaged_file_in_a_training_folder_is_skipped_and_listed(synth_data, tmp_path):
    import shutil

    from torch.utils.data import DataLoader

    from dtrain.data.config import DataConfig
    from dtrain.data.datasets import collate_skip_bad, open_split

    root = tmp_path / "data"
    shutil.copytree(synth_data / "val", root / "val")
    tiff = root / "val" / "ok" / "zz_damaged.tif"
    tiff.write_bytes(damaged_files()["unknown_mode.im"])
    ds = open_split(DataConfig(root=str(root), image_size=32), "val", train=True)
    loader = DataLoader(ds, batch_size=len(ds), num_workers=0, collate_fn=collate_skip_bad)
    (images, _labels), = list(loader)
    assert images.shape[0] == len(ds) - 1
    assert ds.bad_files == [str(tiff)] and "not an image file" in ds.bad_reasons[str(tiff)]


def test_an_animated_gif_in_a_training_folder_is_skipped_and_listed(synth_data, tmp_path):
    import shutil

    from torch.utils.data import DataLoader

    from dtrain.data.config import DataConfig
    from dtrain.data.datasets import collate_skip_bad, open_split

    root = tmp_path / "data"
    shutil.copytree(synth_data / "val", root / "val")
    gif = root / "val" / "ok" / "zz_anim.gif"
    gif.write_bytes(animated_gif())
    ds = open_split(DataConfig(root=str(root), image_size=32), "val", train=True)
    loader = DataLoader(ds, batch_size=len(ds), num_workers=1, collate_fn=collate_skip_bad)
    (images, labels), = list(loader)
    assert images.shape == (len(ds) - 1, 3, 32, 32) and labels.shape == (len(ds) - 1,)
    assert ds.bad_files == [str(gif)] and "several frames" in ds.bad_reasons[str(gif)]


_12BIT = [
    ("16-bit grey png", lambda v: png16(8, 8, 1, v)),
    ("16-bit rgb png", lambda v: png16(8, 8, 3, v)),
    ("16-bit rgba png", lambda v: png16(8, 8, 4, v)),
    ("16-bit grey tiff", lambda v: encoded(Image.fromarray(np.full((8, 8), v, np.uint16)), "TIFF")),
]


@pytest.mark.parametrize(("name", "make"), _12BIT)
def test_sample_bits_shift_a_12_bit_cameras_values_into_the_8_bit_range(name, make):
    """DataConfig.sample_bits: 0x9A1 (2465 of 4095) becomes 0x9A, where the high byte gives 0x09."""
    from dtrain.data.decode import decode_pil

    assert decode(make(0x9A1))[:, 0, 0].tolist() == [0x09] * 3  # the default: the high byte
    assert decode(make(0x9A1), sample_bits=12)[:, 0, 0].tolist() == [0x9A] * 3, name
    assert decode_pil(make(0x9A1), sample_bits=12).getpixel((0, 0)) == (0x9A, 0x9A, 0x9A), name  # the runtime's Pillow path
    # A value past the stated bits (a hot pixel, a wrong setting) saturates rather than wraps.
    assert decode(make(0x2345), sample_bits=12)[:, 0, 0].tolist() == [255] * 3
    assert decode_pil(make(0x2345), sample_bits=12).getpixel((0, 0)) == (255, 255, 255)


def test_a_16_bit_colour_png_without_torchvision_is_refused_with_its_own_reason(monkeypatch):
    """The refusal used to be rewritten on its way out as 'the file is corrupt or truncated'."""
    from dtrain.data import decode as module

    def no_torchvision(_data, _bits):
        raise ImportError("No module named 'torchvision'")

    monkeypatch.setattr(module, "_decode_torchvision", no_torchvision)
    with pytest.raises(ImageRefused, match="needs torchvision to decode: install torch and torchvision"):
        module.decode_pil(png16(8, 8, 3, 0x9A1), sample_bits=12)


def test_sample_bits_leave_8_bit_images_alone():
    data = encoded(_rgb(200, 100, 7), "PNG")
    assert decode(data, sample_bits=12)[:, 0, 0].tolist() == [200, 100, 7]
    assert decode(data, sample_bits=8).equal(decode(data))


def _oriented(fmt: str, orientation: int, **kw) -> bytes:
    """A 6 x 10 photo (wider than tall, no two pixels alike) stored with an EXIF orientation."""
    pixels = np.arange(6 * 10 * 3, dtype=np.uint8).reshape(6, 10, 3)
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encoded(Image.fromarray(pixels), fmt, exif=exif.tobytes(), **kw)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_a_photo_is_decoded_upright_as_its_exif_orientation_says(orientation):
    """As every viewer, OpenCV and the labelling tools show it (Pillow's exif_transpose is the
    reference); the torch and Pillow paths agree pixel for pixel."""
    import io

    from PIL import ImageOps

    from dtrain.data.decode import decode_pil

    data = _oriented("PNG", orientation)
    with Image.open(io.BytesIO(data)) as img:
        want = np.asarray(ImageOps.exif_transpose(img.convert("RGB")))
    assert read_header(data).orientation == orientation
    assert np.array_equal(decode(data).permute(1, 2, 0).numpy(), want)
    assert np.array_equal(np.asarray(decode_pil(data)), want)
    if orientation in (5, 6, 7, 8):
        assert want.shape[:2] == (10, 6)  # a quarter turn: taller than wide now
    jpeg = decode(_oriented("JPEG", orientation, quality=100))
    assert tuple(jpeg.shape[1:]) == want.shape[:2]


def test_a_phone_jpeg_with_a_second_picture_is_its_first_picture_upright():
    """A phone stores a depth map or a preview after the photo (MP Format: Pillow's "MPO").
    Viewers, OpenCV and torchvision show the first picture; it was refused as animated."""
    import io

    from PIL import ImageOps

    from dtrain.data.decode import decode_pil

    photo = np.zeros((16, 32, 3), np.uint8)  # wider than tall, halves far apart: JPEG keeps them
    photo[:, :16] = (200, 30, 30)
    photo[:, 16:] = (30, 200, 30)
    exif = Image.Exif()
    exif[0x0112] = 6  # the phone was held upright: a quarter turn to view
    data = encoded(Image.fromarray(photo), "MPO", save_all=True, append_images=[Image.new("RGB", (8, 8), (0, 0, 255))],
                   exif=exif.tobytes(), quality=95)
    with Image.open(io.BytesIO(data)) as img:
        assert (img.format, img.n_frames) == ("MPO", 2)  # what a phone writes
        want = np.asarray(ImageOps.exif_transpose(img.convert("RGB"))).astype(int)
    assert want.shape == (32, 16, 3) and read_header(data).orientation == 6
    for got in (decode(data).permute(1, 2, 0).numpy(), np.asarray(decode_pil(data))):
        assert got.shape == want.shape and np.abs(got.astype(int) - want).max() <= 8
        assert got[2, 8].tolist()[0] > 150 and got[29, 8].tolist()[1] > 150  # red on top, green below


def test_a_damaged_or_absent_exif_orientation_leaves_the_pixels_as_stored():
    pixels = np.arange(6 * 10 * 3, dtype=np.uint8).reshape(6, 10, 3)
    for exif in (b"Exif\x00\x00MM\x00*\x00\x00\x00\x08\xff\xff", None):
        data = encoded(Image.fromarray(pixels), "PNG", **({"exif": exif} if exif else {}))
        assert read_header(data).orientation == 1
        assert np.array_equal(decode(data).permute(1, 2, 0).numpy(), pixels)


def test_a_training_file_too_large_for_any_image_is_refused_unread(tmp_path):
    """Training read every file whole before its header was looked at: a 2 GiB TIFF stack in
    a class folder cost 2 GB per DataLoader worker (and was then trained on as its first page)."""
    import os

    from PIL import Image

    from dtrain.data.decode import ImageRefused
    from dtrain.data.transforms import read_image, read_image_oriented

    big = tmp_path / "stack.tif"
    big.write_bytes(encoded(Image.new("RGB", (20, 24)), "TIFF"))  # a readable image, and zeros after it
    os.truncate(big, 320_000_001)  # past twice the default decode limit; a sparse file: no disk used
    for read in (read_image, read_image_oriented):
        with pytest.raises(ImageRefused, match="not read") as err:
            read(big)
        assert err.value.too_large
