"""Defects drawn onto a `Canvas`: one function per class, registered by name.

Each takes a severity `v` in (0, 1]: low severity means a faint or small defect (low
contrast, short, narrow). Sizes are fractions of the picture, so a data set rendered
at another resolution looks the same. Everything is vectorised over the pixel grid;
lines are exact distances to a polyline, a few dozen segments each.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from scipy.special import expit

from dtrain.data.synth_surface import Canvas, Rng, fractal


def polyline_distance(c: Canvas, pts: np.ndarray, reach: float) -> np.ndarray:
    """Distance of every pixel to the polyline `pts`, computed only within `reach` of
    its bounding box (inf elsewhere): lines are thin, the picture is not."""
    d = np.full((c.n, c.n), np.inf, np.float32)
    x0, y0 = np.floor(pts.min(axis=0) - reach).astype(int).clip(0, c.n)
    x1, y1 = np.ceil(pts.max(axis=0) + reach + 1).astype(int).clip(0, c.n)
    if x0 >= x1 or y0 >= y1:
        return d
    xx, yy = c.xx[y0:y1, x0:x1], c.yy[y0:y1, x0:x1]
    d2 = np.full(xx.shape, np.inf, np.float32)
    for (ax, ay), (bx, by) in zip(pts[:-1], pts[1:]):
        dx, dy = bx - ax, by - ay
        t = np.clip(((xx - ax) * dx + (yy - ay) * dy) / (dx * dx + dy * dy + 1e-9), 0, 1)
        np.minimum(d2, (xx - ax - t * dx) ** 2 + (yy - ay - t * dy) ** 2, out=d2)
    d[y0:y1, x0:x1] = np.sqrt(d2)
    return d


def _walk(
    rng: Rng, start: np.ndarray, heading: float, length: float, steps: int, turn: float, drift: float, zigzag: float = 0.0
) -> np.ndarray:
    """A path of `steps` segments: a constant turn rate, a heading that drifts (random
    walk, `drift` rad per step) and a zigzag that does not accumulate (`zigzag` rad)."""
    headings = heading + turn * np.arange(steps) + np.cumsum(rng.normal(0, drift, steps)) + rng.normal(0, zigzag, steps)
    step = length / steps
    moves = np.stack([np.cos(headings), np.sin(headings)], axis=1) * step
    return np.vstack([start, start + np.cumsum(moves, axis=0)]).astype(np.float32)


def _inside(rng: Rng, n: int, margin: float = 0.12) -> np.ndarray:
    return rng.uniform(margin * n, (1 - margin) * n, 2).astype(np.float32)


def scratch(rng: Rng, c: Canvas, v: float) -> None:
    length = c.n * rng.uniform(0.25, 0.75) * (0.55 + 0.45 * v)
    pts = _walk(rng, _inside(rng, c.n, 0.2), rng.uniform(0, 2 * np.pi), length, 24, rng.normal(0, 0.02), 0.01)
    width = c.n * rng.uniform(0.01, 0.018) * (0.7 + 0.4 * v)
    line = np.exp(-((polyline_distance(c, pts, 4 * width) / width) ** 2))
    # A scratch is a groove whose walls catch the light: mostly bright, rarely dark.
    sign = 1.0 if rng.random() < 0.85 else -0.7
    c.albedo *= 1 + sign * v * rng.uniform(0.4, 0.7) * line
    c.height -= v * width * 1.5 * line


def crack(rng: Rng, c: Canvas, v: float) -> None:
    length = c.n * rng.uniform(0.28, 0.55) * (0.7 + 0.3 * v)
    start = _inside(rng, c.n, 0.2)
    heading = rng.uniform(0, 2 * np.pi)
    paths = [_walk(rng, start, heading, length, 30, 0.0, 0.08, 0.6)]
    if rng.random() < 0.5:  # a side branch, splitting off at a sharp angle
        k = int(rng.integers(8, 22))
        fork = heading + float(rng.choice([-1.0, 1.0])) * rng.uniform(0.4, 1.2)
        paths.append(_walk(rng, paths[0][k], fork, length * 0.45, 14, 0.0, 0.08, 0.6))
    width = c.n * rng.uniform(0.006, 0.01) * (0.7 + 0.4 * v)
    for pts in paths:
        line = np.exp(-((polyline_distance(c, pts, 4 * width) / width) ** 2))
        c.albedo *= 1 - min(0.9, v * rng.uniform(0.6, 0.95)) * line
        c.height -= v * width * line


def dent(rng: Rng, c: Canvas, v: float) -> None:
    cx, cy = _inside(rng, c.n, 0.18)
    r = c.n * rng.uniform(0.06, 0.13) * (0.6 + 0.4 * v)
    angle, aspect = rng.uniform(0, np.pi), rng.uniform(0.7, 1.3)
    du, dv = c.xx - cx, c.yy - cy
    cos, sin = math.cos(angle), math.sin(angle)
    a = (du * cos + dv * sin) / (r * aspect)
    b = (-du * sin + dv * cos) / r
    bump = np.exp(-0.5 * (a * a + b * b))
    # Shading goes with slope ~ depth / r: depth scales with r to keep it visible.
    c.height -= v * r * rng.uniform(4.5, 6.5) * bump
    c.albedo *= 1 - v * 0.08 * bump


def pit(rng: Rng, c: Canvas, v: float) -> None:
    centre = _inside(rng, c.n, 0.15)
    count = int(rng.integers(1, 5))
    for _ in range(count):
        x, y = (float(t) for t in centre + rng.normal(0, c.n * 0.05, 2))
        r = c.n * rng.uniform(0.016, 0.03) * (0.6 + 0.4 * v)
        d = np.hypot(c.xx - x, c.yy - y)
        core = expit((r - d) / (0.25 * r + 0.3))
        c.albedo *= 1 - v * rng.uniform(0.5, 0.8) * core
        c.height -= v * r * 1.5 * core


def stain(rng: Rng, c: Canvas, v: float) -> None:
    cx, cy = _inside(rng, c.n, 0.15)
    radius = c.n * rng.uniform(0.1, 0.24) * (0.6 + 0.4 * v)
    d = np.hypot(c.xx - cx, c.yy - cy) / radius
    field = 1 - d + 0.35 * fractal(rng, c.n, 3.2)
    mask = expit(field / 0.08)
    tint, darken, ring = STAINS[int(rng.integers(len(STAINS)))]
    if ring:  # a dried liquid leaves most of its residue at the rim
        mask = np.clip(mask * (1 - mask) * 4, 0, 1) * 0.8 + mask * 0.2
    strength = v * rng.uniform(0.7, 1.0)
    c.color *= 1 - (strength * mask)[..., None] * (1 - np.asarray(tint, np.float32))
    c.albedo *= 1 - strength * darken * mask


# (per-channel tint, darkening, tide-mark ring): rust, oil, dried coolant.
STAINS = (
    ((1.0, 0.78, 0.55), 0.2, False),
    ((0.92, 0.92, 0.97), 0.45, False),
    ((1.0, 0.88, 0.6), 0.2, True),
)

DEFECTS: dict[str, Callable[[Rng, Canvas, float], None]] = {
    "scratch": scratch,
    "dent": dent,
    "stain": stain,
    "crack": crack,
    "pit": pit,
}
CLASSES = ["ok", *DEFECTS]  # "ok" first: the negative class


def severity(rng: Rng, difficulty: float) -> float:
    """Severity in [floor, 1]; higher difficulty = lower floor and more mass near it."""
    floor = 0.7 - 0.5 * difficulty
    return float(floor + (1 - floor) * rng.random() ** (0.5 + difficulty))
