"""The `plant` profile of `dtrain data synth`: a harder set, closer to a line's photos.

The quickstart profile is 64 px, colour, 45 % OK, classes of equal size and bold
defects that fill a good part of the picture. A plant's images differ in each of
these, and a recipe tuned on the quickstart alone would not notice:

- Size: every part has its own side, drawn in [size/2, size] (default 256-512 px), as
  crops of parts of several sizes are; the recipe must pick an input size.
- Camera: MONO_SHARE of the parts come from a monochrome camera (8-bit grey PNG), the
  others in colour, with a finish of their own (FINISHES); grey and colour are drawn
  independently of the class, so neither says anything about defects.
- OK-heavy (~85 % by default) and unbalanced defect classes (DEFECT_SHARES): with the
  default 3000 images the two rarest classes have 20-40 training images each.
- Small and faint: each defect is drawn inside a window of WINDOW of the picture's
  side (so a pit is a few pixels across at 512 px), at a random place, faded out at
  the window's border; the default difficulty puts more defects near faint.
- Several defects on one part: MULTI_SHARE of defective parts carry a second defect
  of another class, always at a lower severity than the first. Label rule: a part is
  labelled with its most severe defect (the first one drawn).

Same determinism as the quickstart profile: every image has its own streams, seeded
by (seed, split, class, number) and a key of this profile.
"""

from __future__ import annotations

import numpy as np

from dtrain.data.synth_defects import CLASSES, DEFECTS, severity
from dtrain.data.synth_surface import Canvas, Look, Rng, blank_canvas, new_canvas, render

PROFILE_KEY = 1  # in every image's seed, so no image shares a stream with the quickstart's
SIZE = 512
DIFFICULTY = 0.7
OK_FRACTION = 0.85
IMAGES = 3000
# Of the defective parts, per class (DEFECTS order is irrelevant: looked up by name).
DEFECT_SHARES = {"scratch": 0.30, "stain": 0.25, "dent": 0.20, "pit": 0.13, "crack": 0.12}
MONO_SHARE = 0.5
MULTI_SHARE = 0.25
# A defect's window, as a fraction of the picture's side.
WINDOW = (0.3, 0.55)
# Colour parts' finishes (per-channel reflectance): bare steel, brass, blue and black
# anodising, bronze. A stain is still a local change of colour on any of them.
FINISHES = ((1.0, 1.0, 1.0), (1.0, 0.86, 0.58), (0.72, 0.82, 1.0), (0.55, 0.55, 0.58), (0.95, 0.76, 0.62))
LABEL_RULE = "the most severe defect names the part; a second defect (on MULTI_SHARE of them) is always fainter"


def class_weights(ok_fraction: float) -> list[float]:
    """Share of every class of CLASSES in each split."""
    return [ok_fraction] + [(1 - ok_fraction) * DEFECT_SHARES[name] for name in CLASSES[1:]]


def part_side(rng: Rng, size: int) -> int:
    return int(rng.integers(max(16, size // 2), size + 1))


def render_plant_image(
    seed: int, split: int, cls: int, number: int, size: int, difficulty: float, with_defect: bool = True
) -> np.ndarray:
    """One image, uint8 [side, side] (grey) or [side, side, 3]; a pure function of its arguments."""
    streams = np.random.SeedSequence([seed, split, cls, number, PROFILE_KEY]).spawn(5)
    tex, look_rng, defect_rng, noise_rng, part_rng = (np.random.default_rng(s) for s in streams)
    side = part_side(part_rng, size)
    mono = bool(part_rng.random() < MONO_SHARE)
    finish = FINISHES[int(part_rng.integers(len(FINISHES)))]
    factor = 2 if side <= 256 else 1  # as the quickstart profile: thin lines stay smooth
    canvas, _ = new_canvas(tex, side * factor)
    if not mono:
        canvas.color *= np.asarray(finish, np.float32) * (1 + part_rng.normal(0, 0.03, 3)).astype(np.float32)
    look = Look.draw(look_rng)
    name = CLASSES[cls]
    if name != "ok" and with_defect:
        for defect, v in defects_on_part(defect_rng, name, difficulty):
            stamp(defect_rng, canvas, defect, v)
    rgb = render(noise_rng, canvas, look, factor)
    if mono:  # ITU-R 601 luma, what a monochrome sensor behind no filter roughly sees
        return np.clip(np.rint(rgb.astype(np.float32) @ np.float32([0.299, 0.587, 0.114])), 0, 255).astype(np.uint8)
    return rgb


def defects_on_part(rng: Rng, label: str, difficulty: float) -> list[tuple[str, float]]:
    """(defect, severity) drawn on one part labelled `label`: the label's own defect first;
    on MULTI_SHARE of parts a second one of another class, always fainter (LABEL_RULE)."""
    v = severity(rng, difficulty)
    found = [(label, v)]
    if rng.random() < MULTI_SHARE:
        others = [d for d in DEFECTS if d != label]
        found.append((others[int(rng.integers(len(others)))], v * float(rng.uniform(0.4, 0.85))))
    return found


def stamp(rng: Rng, c: Canvas, defect: str, v: float) -> None:
    """Draw `defect` at severity `v` in a random window of `c`, faded out at the window's border."""
    m = max(8, int(c.n * rng.uniform(*WINDOW)))
    x0, y0 = (int(t) for t in rng.integers(0, c.n - m + 1, 2))
    patch = blank_canvas(m)
    DEFECTS[defect](rng, patch, v)
    fade = _fade(m)
    win = (slice(y0, y0 + m), slice(x0, x0 + m))
    c.height[win] += patch.height * fade
    c.albedo[win] *= 1 + (patch.albedo - 1) * fade
    c.color[win] *= 1 + (patch.color - 1) * fade[..., None]


def _fade(m: int, edge: float = 0.12) -> np.ndarray:
    """1 inside, a raised cosine to 0 over the outer `edge` of the window: no straight cut."""
    i = np.arange(m, dtype=np.float32)
    t = np.clip(np.minimum(i, m - 1 - i) / max(edge * m, 1.0), 0, 1)
    ramp = 0.5 - 0.5 * np.cos(np.pi * t)
    return np.outer(ramp, ramp).astype(np.float32)
