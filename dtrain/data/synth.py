"""`synthesize`: a deterministic synthetic surface-defect data set on disk.

Layout: OUT/{train,val,test}/<class>/<class>_NNNNN.png and OUT/manifest.json. Every
image has its own random stream, seeded by (seed, split, class, number), so a data set
is byte-identical for the same arguments whatever the number of worker processes, and
images are rendered in any order. PNGs are written with a fixed compression level and
no metadata, so equal pixels give equal bytes.

Difficulty (0..1) moves the severity distribution of defects towards faint and small
ones. At the default 0.5 every severity is >= 0.45 (mean ~0.73); measured at 64 px over
40 images per class, the faintest defect still changes its image by 18 (scratch) to 27
(dent) grey levels at its strongest pixel, the median by 41-62 (compare
`render_image(...)` with `render_image(..., with_defect=False)`).

Two profiles (PROFILES): `quickstart`, the above (64 px colour tiles, 45 % OK, equal
defect classes), and `plant` (dtrain/data/synth_plant.py: 256-512 px grey and colour
parts, ~85 % OK, rare classes, small faint defects, several defects on one part).
"""

from __future__ import annotations

import io
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from dtrain.data import synth_plant as plant
from dtrain.data.synth_defects import CLASSES, DEFECTS, severity
from dtrain.data.synth_surface import Look, new_canvas, render
from dtrain.errors import DtrainError

GENERATOR_VERSION = 3
SPLITS = ("train", "val", "test")
# Images per process task, and the set size from which worker processes pay off.
_CHUNK = 64
# `--masks`: each defective picture's mask beside it, named as the data layer pairs them.
MASK_SUFFIX = "_mask"
_PARALLEL_FROM = 400

Progress = Callable[[int], None]


def render_image(
    seed: int, split: int, cls: int, number: int, size: int, difficulty: float, with_defect: bool = True
) -> np.ndarray:
    """One image, uint8 [size, size, 3]; a pure function of its arguments.

    Texture, look, defect and sensor noise draw from separate streams, so the same
    image without its defect (`with_defect=False`) differs only where the defect is.
    """
    streams = np.random.SeedSequence([seed, split, cls, number]).spawn(4)
    tex, look_rng, defect_rng, noise_rng = (np.random.default_rng(s) for s in streams)
    factor = 2 if size <= 256 else 1  # supersample small images: thin lines stay smooth
    canvas, _ = new_canvas(tex, size * factor)
    look = Look.draw(look_rng)
    name = CLASSES[cls]
    if name != "ok" and with_defect:
        DEFECTS[name](defect_rng, canvas, severity(defect_rng, difficulty))
    return render(noise_rng, canvas, look, factor)


def even_weights(ok_fraction: float) -> list[float]:
    """`ok_fraction` OK, the rest spread evenly over the defect classes."""
    return [ok_fraction] + [(1 - ok_fraction) / len(DEFECTS)] * len(DEFECTS)


@dataclass(frozen=True)
class Profile:
    """What a profile renders, how its classes are weighted, and its defaults."""

    render: Callable[..., np.ndarray]  # (seed, split, cls, number, size, difficulty) -> uint8 image
    weights: Callable[[float], list[float]]  # ok_fraction -> share of every class
    images: int
    size: int
    difficulty: float
    ok_fraction: float
    facts: dict  # what the manifest says about the profile, beyond the arguments
    # Write each defective picture's mask by default. The plant profile stands for the sets
    # plants and public benchmarks ship for inspection (magnetic tile, KolektorSDD2, MVTec-AD,
    # Severstal), which come with a mask per defective photo; the quickstart's tiles stand
    # for a set labelled by folder only.
    masks: bool = False


PROFILES = {
    "quickstart": Profile(render_image, even_weights, 3000, 64, 0.5, 0.45, {}),
    "plant": Profile(
        plant.render_plant_image, plant.class_weights, plant.IMAGES, plant.SIZE, plant.DIFFICULTY, plant.OK_FRACTION,
        {"sides": "each image [size/2, size] px", "grey_share": plant.MONO_SHARE, "defect_shares": plant.DEFECT_SHARES,
         "multi_defect_share": plant.MULTI_SHARE, "defect_window": list(plant.WINDOW), "label_rule": plant.LABEL_RULE},
        masks=True,
    ),
}


def plan_counts(
    images: int, split_fractions: tuple[float, float, float], ok_fraction: float, weights: Callable[[float], list[float]] = even_weights
) -> dict[str, dict[str, int]]:
    """Images per split and class: splits by fraction, then in each split the classes by
    `weights(ok_fraction)` (largest remainders)."""
    split_sizes = _apportion(images, list(split_fractions))
    weights = weights(ok_fraction)
    return {
        split: dict(zip(CLASSES, _apportion(n, weights))) for split, n in zip(SPLITS, split_sizes)
    }


def _apportion(total: int, weights: list[float]) -> list[int]:
    raw = [total * w / sum(weights) for w in weights]
    counts = [int(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (counts[i] - raw[i], i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _png_bytes(img: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG", compress_level=6, optimize=False)
    return buf.getvalue()


def _render_chunk(
    out_dir: str, jobs: list[tuple[int, int, int]], seed: int, size: int, difficulty: float, profile: str = "quickstart",
    masks: bool = False,
) -> int:
    render_one = PROFILES[profile].render
    for split, cls, number in jobs:
        path = Path(out_dir) / SPLITS[split] / CLASSES[cls] / f"{CLASSES[cls]}_{number:05d}.png"
        img = render_one(seed, split, cls, number, size, difficulty)
        path.write_bytes(_png_bytes(img))
        if masks and CLASSES[cls] != "ok":
            clean = render_one(seed, split, cls, number, size, difficulty, with_defect=False)
            path.with_name(f"{path.stem}{MASK_SUFFIX}.png").write_bytes(_png_bytes(defect_mask(img, clean)))
    return len(jobs)


def defect_mask(img: np.ndarray, clean: np.ndarray) -> np.ndarray:
    """uint8 [H, W], 255 where the defects changed the picture by a grey level or more: the
    same part rendered without them (same texture, light and sensor noise streams) is the
    reference, so the mask is exactly what was drawn, faint edges included."""
    diff = np.abs(img.astype(np.int16) - clean.astype(np.int16))
    changed = diff.max(axis=-1) if diff.ndim == 3 else diff
    return np.where(changed >= 1, 255, 0).astype(np.uint8)


def _prepare(out: Path, force: bool) -> None:
    existing = [out / name for name in (*SPLITS, "manifest.json") if (out / name).exists()]
    if existing and not force:
        raise DtrainError(
            f"{out} already holds a data set ({existing[0].name} exists)",
            "pass --force to replace it, or choose another directory",
        )
    for path in existing:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    for split in SPLITS:
        for name in CLASSES:
            (out / split / name).mkdir(parents=True, exist_ok=True)


def synthesize(
    out_dir: str | Path,
    images: int | None = None,
    size: int | None = None,
    seed: int = 0,
    progress: Progress | None = None,
    *,
    profile: str = "quickstart",
    difficulty: float | None = None,
    ok_fraction: float | None = None,
    split_fractions: tuple[float, float, float] = (0.6, 0.2, 0.2),
    workers: int | None = None,
    force: bool = False,
    masks: bool | None = None,
) -> dict:
    """Write the data set and return its manifest. `progress(k)` is called with the
    number of images just finished. Arguments left None take the profile's defaults
    (PROFILES); `size` is the plant profile's largest side."""
    if profile not in PROFILES:
        raise DtrainError(f"unknown synth profile {profile!r}", f"choose one of: {', '.join(PROFILES)}")
    spec = PROFILES[profile]
    images = spec.images if images is None else images
    size = spec.size if size is None else size
    difficulty = spec.difficulty if difficulty is None else difficulty
    ok_fraction = spec.ok_fraction if ok_fraction is None else ok_fraction
    masks = spec.masks if masks is None else masks
    if images < len(SPLITS) * len(CLASSES):
        raise DtrainError(f"--images {images} is too few", f"use at least {len(SPLITS) * len(CLASSES)} (one per split and class)")
    if not 16 <= size <= 2048:
        raise DtrainError(f"--size {size} is out of range", "choose 16..2048 pixels")
    if not 0 <= difficulty <= 1:
        raise DtrainError(f"difficulty {difficulty} is out of range", "choose a value in 0..1")
    if not 0 < ok_fraction < 1:
        raise DtrainError(f"ok fraction {ok_fraction} is out of range", "choose a value between 0 and 1")
    out = Path(out_dir)
    counts = plan_counts(images, split_fractions, ok_fraction, spec.weights)
    _prepare(out, force)
    jobs = [
        (si, ci, k)
        for si, split in enumerate(SPLITS)
        for ci, name in enumerate(CLASSES)
        for k in range(counts[split][name])
    ]
    chunks = [jobs[i : i + _CHUNK] for i in range(0, len(jobs), _CHUNK)]
    workers = workers if workers is not None else (os.cpu_count() or 1)
    if workers > 1 and len(jobs) >= _PARALLEL_FROM:
        # spawn: the caller may hold torch threads, which fork does not copy safely.
        with ProcessPoolExecutor(min(workers, len(chunks)), mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(_render_chunk, str(out), c, seed, size, difficulty, profile, masks) for c in chunks]
            for fut in as_completed(futures):
                done = fut.result()
                if progress:
                    progress(done)
    else:
        for c in chunks:
            done = _render_chunk(str(out), c, seed, size, difficulty, profile, masks)
            if progress:
                progress(done)
    manifest = {
        "generator": "dtrain.data.synth",
        "generator_version": GENERATOR_VERSION,
        "profile": profile,
        **spec.facts,
        "seed": seed,
        "images": images,
        "size": size,
        "difficulty": difficulty,
        "ok_fraction": ok_fraction,
        "split_fractions": list(split_fractions),
        "classes": CLASSES,
        "negative_class": "ok",
        "counts": counts,
    }
    if masks:
        manifest["masks"] = f"each defective picture's <name>{MASK_SUFFIX}.png: the pixels its defects changed"
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def sample_grid(
    path: str | Path, seed: int = 0, size: int = 96, per_class: int = 6, difficulty: float = 0.5, profile: str = "quickstart"
) -> Path:
    """A PNG with one row per class (label on the left) for the README: images rendered
    at the profile's size (or `size` if larger), shown as `size` px thumbnails."""
    from PIL import Image, ImageDraw

    spec = PROFILES[profile]

    label_w, pad = 70, 2
    grid = Image.new("RGB", (label_w + per_class * (size + pad), len(CLASSES) * (size + pad)), "white")
    draw = ImageDraw.Draw(grid)
    for ci, name in enumerate(CLASSES):
        y = ci * (size + pad)
        draw.text((6, y + size // 2 - 6), name, fill="black")
        for k in range(per_class):
            thumb = Image.fromarray(spec.render(seed, 0, ci, k, max(size, spec.size), difficulty)).convert("RGB")
            if thumb.size != (size, size):
                thumb = thumb.resize((size, size), Image.Resampling.LANCZOS)
            grid.paste(thumb, (label_w + k * (size + pad), y))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path, format="PNG", compress_level=9)
    return path
