"""The torch-free runtime prepares images as training and evaluation do: Pillow's decode
and antialiased bilinear resize (dtrain.serve.images) against torchvision's
(dtrain.data.transforms.preprocess_image), pixel by pixel and through the network."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from tests.image_fixtures import encoded, png16


def _part(height: int, width: int, seed: int) -> np.ndarray:
    """A smooth picture with noise, like a photographed surface (a flat one would hide resize differences)."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (height // 4 + 1, width // 4 + 1, 3), dtype=np.uint8))
    smooth = np.asarray(coarse.resize((width, height), Image.Resampling.BICUBIC)).astype(int)
    return np.clip(smooth + rng.integers(-20, 21, smooth.shape), 0, 255).astype(np.uint8)


def _both(data: bytes, size: int | tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    from dtrain.data.transforms import preprocess_image
    from dtrain.serve.images import prepare_bytes

    return prepare_bytes(data, size).astype(int), preprocess_image(data, size).numpy().astype(int)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
@pytest.mark.parametrize(("shape", "size", "tolerance"), [
    ((64, 64), 64, 0),  # no resize: the same decoded bytes
    ((97, 131), 64, 1),  # shrink, odd sizes
    ((300, 500), 224, 1),  # shrink, aspect ratio squashed
    ((64, 64), 224, 2),  # enlarge (ResNet-18 at 224 on 64 px tiles)
    ((120, 300), (64, 160), 1),  # a rectangle into a rectangle (DataConfig.image_width)
    ((300, 120), (64, 160), 1),  # an upright picture: turned a quarter, then shrunk
    ((96, 96), (32, 96), 1),  # a square stretched into a rectangle
])
def test_numpy_preprocessing_matches_torchvision(fmt, shape, size, tolerance):
    seed = size if isinstance(size, int) else sum(size)
    runtime, torch_path = _both(encoded(Image.fromarray(_part(*shape, seed=seed)), fmt, quality=90), size)
    hw = (size, size) if isinstance(size, int) else size
    assert runtime.shape == torch_path.shape == (3, *hw)
    diff = np.abs(runtime - torch_path)
    assert diff.max() <= tolerance
    assert diff.mean() < 0.1


@pytest.mark.parametrize(("name", "data"), [
    ("16-bit rgb png", png16(8, 8, 3)),
    ("16-bit grey png", png16(8, 8, 1)),
    ("16-bit rgba png", png16(8, 8, 4)),
    ("grey+alpha png", encoded(Image.new("LA", (8, 8), (77, 5)), "PNG")),
    ("palette png", encoded(Image.new("RGB", (8, 8), (10, 120, 250)).quantize(4), "PNG")),
    ("cmyk jpeg", encoded(Image.new("CMYK", (8, 8), (0, 50, 100, 0)), "JPEG", quality=100)),
    ("still gif", encoded(Image.new("RGB", (8, 8), (0, 0, 255)).convert("P"), "GIF")),
])
def test_pillow_and_torchvision_decode_every_mode_alike(name, data):
    runtime, torch_path = _both(data, 8)
    assert np.abs(runtime - torch_path).max() <= 1, name


def test_verdicts_of_the_runtime_path_equal_the_torch_path(exported_model, synth_data):
    """Through the exported network, at the model's size and after a resize from odd sizes."""
    import torch

    from dtrain.data.transforms import preprocess_image
    from dtrain.serve.images import prepare_bytes
    from dtrain.serve.predictor import Predictor, judge

    predictor = Predictor(exported_model)
    size, card = predictor.image_size, predictor.card
    paths = sorted((synth_data / "test").rglob("*.png"))
    blobs = [p.read_bytes() for p in paths]
    for i, p in enumerate(paths[::3]):  # the same parts at odd sizes: both paths resize them back
        buf = io.BytesIO()
        Image.open(p).resize((size + 13 + i % 7, size + 29), Image.Resampling.BICUBIC).save(buf, format="PNG")
        blobs.append(buf.getvalue())
    runtime = np.stack([prepare_bytes(b, size) for b in blobs])
    torch_path = torch.stack([preprocess_image(b, size) for b in blobs]).numpy()
    a, b = predictor.logits(runtime), predictor.logits(torch_path)
    assert np.abs(a - b).max() < 0.05

    def verdicts(logits):
        return [v.verdict for v in judge(logits, card.classes, card.negative_index, card.threshold)]

    assert verdicts(a) == verdicts(b)


@pytest.mark.parametrize("mode", ["grey png", "grey tiff", "rgb png"])
def test_a_12_bit_model_is_fed_alike_by_both_paths(mode):
    """Preprocessing.sample_bits (the model card's) reaches the runtime's Pillow decode as
    DataConfig.sample_bits reaches training's: a 12-bit picture, resized, matches."""
    from dtrain.data.transforms import preprocess_image
    from dtrain.serve.images import prepare_bytes

    rgb = _part(97, 131, seed=12).astype(np.uint16) * 16 + 7  # 12-bit values, 0..4087
    if mode == "rgb png":
        from tests.image_fixtures import png16_of

        data = png16_of(rgb)
    else:
        data = encoded(Image.fromarray(np.ascontiguousarray(rgb[..., 0])), mode.split()[1].upper())
    runtime = prepare_bytes(data, 64, sample_bits=12).astype(int)
    torch_path = preprocess_image(data, 64, sample_bits=12).numpy().astype(int)
    assert np.abs(runtime - torch_path).max() <= 1
    assert runtime.max() > 200  # the 12 bits fill the 8-bit range (the high byte would stay under 16)
