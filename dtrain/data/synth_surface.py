"""Metal surfaces for the synthetic inspection set, and how a camera sees them.

A `Canvas` holds three fields a defect can change: `height` (relief, in render
pixels; what the light turns into shading), `albedo` (brightness of the material) and
`color` (per-channel multiplier: only stains use it). `render` lights the canvas from
one side, adds a lighting gradient and hot spot, blurs slightly (optics), downsamples
(anti-aliasing), adds sensor noise and quantises to uint8.

Textures come from shaped white noise in the Fourier domain: one FFT gives brushed
streaks (all energy perpendicular to the brush direction), cast blotches and grain
(1/f^beta noise), or the noisy concentric grooves of a turned part.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import scipy.fft
from scipy.ndimage import gaussian_filter

Rng = np.random.Generator


@dataclass
class Canvas:
    n: int  # render resolution (pixels per side)
    xx: np.ndarray  # pixel coordinates, float32 [n, n]
    yy: np.ndarray
    height: np.ndarray
    albedo: np.ndarray
    color: np.ndarray  # [n, n, 3]


def spectral_noise(rng: Rng, n: int, amplitude: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
    """White noise shaped by `amplitude(fx, fy)` (cycles/pixel), zero mean, unit std."""
    white = rng.standard_normal((n, n), dtype=np.float32)
    fy = np.fft.fftfreq(n).astype(np.float32)[:, None]
    fx = np.fft.rfftfreq(n).astype(np.float32)[None, :]
    out = scipy.fft.irfft2(scipy.fft.rfft2(white) * amplitude(fx, fy), s=(n, n)).astype(np.float32, copy=False)
    out -= out.mean()
    out /= out.std() + 1e-8
    return out


def fractal(rng: Rng, n: int, beta: float) -> np.ndarray:
    """1/f^beta noise: beta ~1 fine grain, ~3 soft blotches."""
    floor = 1.0 / n
    return spectral_noise(rng, n, lambda fx, fy: (fx * fx + fy * fy + floor * floor) ** (-beta / 4))


def brushed(rng: Rng, c: Canvas) -> None:
    theta = rng.uniform(0, np.pi)
    cos, sin = math.cos(theta), math.sin(theta)
    sharp = rng.uniform(0.002, 0.006)

    def streaks(fx: np.ndarray, fy: np.ndarray) -> np.ndarray:
        along = fx * cos + fy * sin
        across = np.abs(-fx * sin + fy * cos) + 1.0 / c.n
        return np.exp(-((along / sharp) ** 2)) * across**-0.6

    s = spectral_noise(rng, c.n, streaks)
    c.height += rng.uniform(0.3, 0.7) * s
    c.albedo *= 1 + rng.uniform(0.03, 0.08) * s + 0.03 * fractal(rng, c.n, 3.0)


def cast(rng: Rng, c: Canvas) -> None:
    grain = fractal(rng, c.n, rng.uniform(0.6, 1.2))
    blotch = fractal(rng, c.n, rng.uniform(2.8, 3.6))
    c.height += rng.uniform(0.4, 0.8) * grain + 0.6 * blotch
    c.albedo *= 1 + rng.uniform(0.04, 0.09) * blotch + rng.uniform(0.02, 0.05) * grain


def machined(rng: Rng, c: Canvas) -> None:
    # A turned face: the spindle axis lies outside the picture, so grooves are arcs.
    angle = rng.uniform(0, 2 * np.pi)
    dist = c.n * rng.uniform(0.7, 2.5)
    cx, cy = c.n / 2 + dist * math.cos(angle), c.n / 2 + dist * math.sin(angle)
    r = np.hypot(c.xx - cx, c.yy - cy)
    period = c.n * rng.uniform(0.03, 0.07)
    wobble = 0.6 * fractal(rng, c.n, 3.0)
    phase = 2 * np.pi * r / period + wobble
    grooves = np.sin(phase) + 0.35 * np.sin(2 * phase + rng.uniform(0, 2 * np.pi))
    c.height += rng.uniform(0.25, 0.5) * grooves + 0.2 * fractal(rng, c.n, 1.0)
    c.albedo *= 1 + rng.uniform(0.03, 0.06) * grooves + 0.04 * fractal(rng, c.n, 3.0)


SURFACES: dict[str, Callable[[Rng, Canvas], None]] = {"brushed": brushed, "cast": cast, "machined": machined}


def blank_canvas(n: int) -> Canvas:
    """A flat, even, colourless n x n canvas: what a defect changes nothing of."""
    yy, xx = np.mgrid[0:n, 0:n].astype(np.float32)
    return Canvas(
        n=n,
        xx=xx,
        yy=yy,
        height=np.zeros((n, n), np.float32),
        albedo=np.ones((n, n), np.float32),
        color=np.ones((n, n, 3), np.float32),
    )


def new_canvas(rng: Rng, n: int) -> tuple[Canvas, str]:
    canvas = blank_canvas(n)
    kind = sorted(SURFACES)[int(rng.integers(len(SURFACES)))]
    SURFACES[kind](rng, canvas)
    return canvas, kind


@dataclass(frozen=True)
class Look:
    """Per-image camera and lighting set-up, drawn before the defect so that every
    class sees the same distribution of looks."""

    base: float
    tint: tuple[float, float, float]
    light_angle: float
    shade: float
    gradient: float
    gradient_angle: float
    hotspot: float
    hotspot_xy: tuple[float, float]
    blur: float  # output pixels
    noise: float

    @classmethod
    def draw(cls, rng: Rng) -> Look:
        return cls(
            base=float(rng.uniform(0.35, 0.62)),
            tint=tuple(float(t) for t in 1 + rng.normal(0, 0.008, 3)),
            light_angle=float(rng.uniform(0, 2 * np.pi)),
            shade=float(rng.uniform(0.05, 0.09)),
            gradient=float(rng.uniform(0.0, 0.35)),
            gradient_angle=float(rng.uniform(0, 2 * np.pi)),
            hotspot=float(rng.uniform(0.0, 0.25)),
            hotspot_xy=(float(rng.uniform(0, 1)), float(rng.uniform(0, 1))),
            blur=float(rng.uniform(0.3, 0.7)),
            noise=float(rng.uniform(0.006, 0.02)),
        )


def render(rng: Rng, c: Canvas, look: Look, factor: int) -> np.ndarray:
    """Canvas -> uint8 [n/factor, n/factor, 3]."""
    gy, gx = np.gradient(c.height)
    shading = look.shade * (gx * math.cos(look.light_angle) + gy * math.sin(look.light_angle))
    u, v = c.xx / c.n - 0.5, c.yy / c.n - 0.5
    ramp = u * math.cos(look.gradient_angle) + v * math.sin(look.gradient_angle)
    hx, hy = look.hotspot_xy
    spot = np.exp(-((u + 0.5 - hx) ** 2 + (v + 0.5 - hy) ** 2) / 0.08)
    illum = 1 + look.gradient * ramp + look.hotspot * spot
    lum = look.base * c.albedo * illum + shading
    rgb = lum[..., None] * c.color * np.asarray(look.tint, np.float32)
    m = c.n // factor
    if factor == 2:  # 2x2 box average; much faster than reshape(...).mean()
        rgb = 0.25 * (rgb[0::2, 0::2] + rgb[1::2, 0::2] + rgb[0::2, 1::2] + rgb[1::2, 1::2])
    elif factor > 2:
        rgb = rgb.reshape(m, factor, m, factor, 3).mean(axis=(1, 3))
    # Optics blur after the box average: on 1/factor^2 of the pixels, same look.
    rgb = gaussian_filter(rgb, sigma=(look.blur, look.blur, 0), mode="reflect")
    rgb += look.noise * rng.standard_normal(rgb.shape, dtype=np.float32)
    return np.clip(np.rint(rgb * 255), 0, 255).astype(np.uint8)
