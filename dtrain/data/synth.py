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
"""

from __future__ import annotations

import io
import json
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from dtrain.data.synth_defects import DEFECTS
from dtrain.data.synth_surface import Look, new_canvas, render
from dtrain.errors import DtrainError

GENERATOR_VERSION = 3
CLASSES = ["ok", *DEFECTS]  # "ok" first: the negative class
SPLITS = ("train", "val", "test")
# Images per process task, and the set size from which worker processes pay off.
_CHUNK = 64
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


def severity(rng: np.random.Generator, difficulty: float) -> float:
    """Severity in [floor, 1]; higher difficulty = lower floor and more mass near it."""
    floor = 0.7 - 0.5 * difficulty
    return float(floor + (1 - floor) * rng.random() ** (0.5 + difficulty))


def plan_counts(images: int, split_fractions: tuple[float, float, float], ok_fraction: float) -> dict[str, dict[str, int]]:
    """Images per split and class: splits by fraction, then in each split `ok_fraction`
    ok and the rest spread evenly over the defect classes (largest remainders)."""
    split_sizes = _apportion(images, list(split_fractions))
    defect_share = (1 - ok_fraction) / len(DEFECTS)
    weights = [ok_fraction] + [defect_share] * len(DEFECTS)
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


def _render_chunk(out_dir: str, jobs: list[tuple[int, int, int]], seed: int, size: int, difficulty: float) -> int:
    for split, cls, number in jobs:
        path = Path(out_dir) / SPLITS[split] / CLASSES[cls] / f"{CLASSES[cls]}_{number:05d}.png"
        path.write_bytes(_png_bytes(render_image(seed, split, cls, number, size, difficulty)))
    return len(jobs)


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
    images: int = 3000,
    size: int = 64,
    seed: int = 0,
    progress: Progress | None = None,
    *,
    difficulty: float = 0.5,
    ok_fraction: float = 0.45,
    split_fractions: tuple[float, float, float] = (0.6, 0.2, 0.2),
    workers: int | None = None,
    force: bool = False,
) -> dict:
    """Write the data set and return its manifest. `progress(k)` is called with the
    number of images just finished."""
    if images < len(SPLITS) * len(CLASSES):
        raise DtrainError(f"--images {images} is too few", f"use at least {len(SPLITS) * len(CLASSES)} (one per split and class)")
    if not 16 <= size <= 2048:
        raise DtrainError(f"--size {size} is out of range", "choose 16..2048 pixels")
    if not 0 <= difficulty <= 1:
        raise DtrainError(f"difficulty {difficulty} is out of range", "choose a value in 0..1")
    if not 0 < ok_fraction < 1:
        raise DtrainError(f"ok fraction {ok_fraction} is out of range", "choose a value between 0 and 1")
    out = Path(out_dir)
    counts = plan_counts(images, split_fractions, ok_fraction)
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
            futures = [pool.submit(_render_chunk, str(out), c, seed, size, difficulty) for c in chunks]
            for fut in as_completed(futures):
                done = fut.result()
                if progress:
                    progress(done)
    else:
        for c in chunks:
            done = _render_chunk(str(out), c, seed, size, difficulty)
            if progress:
                progress(done)
    manifest = {
        "generator": "dtrain.data.synth",
        "generator_version": GENERATOR_VERSION,
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
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def sample_grid(path: str | Path, seed: int = 0, size: int = 96, per_class: int = 6, difficulty: float = 0.5) -> Path:
    """A PNG with one row per class (label on the left) for the README."""
    from PIL import Image, ImageDraw

    label_w, pad = 70, 2
    grid = Image.new("RGB", (label_w + per_class * (size + pad), len(CLASSES) * (size + pad)), "white")
    draw = ImageDraw.Draw(grid)
    for ci, name in enumerate(CLASSES):
        y = ci * (size + pad)
        draw.text((6, y + size // 2 - 6), name, fill="black")
        for k in range(per_class):
            img = render_image(seed, 0, ci, k, size, difficulty)
            grid.paste(Image.fromarray(img), (label_w + k * (size + pad), y))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path, format="PNG", compress_level=9)
    return path
