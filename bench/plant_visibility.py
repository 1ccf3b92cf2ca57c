"""How visible each defect of a synthetic plant set is, beside what a trained model scored it.

The plant check's false alarms are set by the few defects a model scores lowest (the
validation threshold sits under the faintest one). This asks whether those are the ones the
picture barely shows. The generator is deterministic, so every defective image can be
rendered again without its defects (same texture, light and sensor noise): the difference
is exactly what was drawn. Its visibility is the strongest band-passed response of that
difference over the band-passed texture's robust spread (1.4826 x MAD), the best of four
scales (Gaussian sigma 1, 2, 4, 8 px at native resolution; the band is sigma..4 sigma).
Grey levels only (ITU-R 601 luma): a stain's change of colour is not counted.

    python bench/plant_visibility.py PLANT_SET [--seed 0] [--run WORKDIR] [--show 8]

PLANT_SET: what `dtrain data synth --profile plant PLANT_SET --seed S` wrote (default size
and difficulty). WORKDIR: a `dtrain quickstart --data PLANT_SET` run; its evaluation's
scores are re-read through its checkpoint (val and test, 8 views) to put P(defect) and
the false alarms a threshold at each defect would cost beside each defect's visibility.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from scipy.ndimage import gaussian_filter
from scipy.stats import spearmanr

from dtrain.data.synth import SPLITS
from dtrain.data.synth_defects import CLASSES
from dtrain.data.synth_plant import DIFFICULTY, SIZE, render_plant_image

SCALES = (1, 2, 4, 8)


def luma(img: np.ndarray) -> np.ndarray:
    a = img.astype(np.float32)
    return a if a.ndim == 2 else a @ np.float32([0.299, 0.587, 0.114])


def visibility(drawn: np.ndarray, clean: np.ndarray) -> tuple[float, int]:
    """(peak band-passed defect / band-passed texture spread, the scale it peaks at)."""
    best, at = 0.0, SCALES[0]
    diff = drawn - clean
    for s in SCALES:
        band = gaussian_filter(clean, s) - gaussian_filter(clean, 4 * s)
        spread = 1.4826 * float(np.median(np.abs(band - np.median(band))))
        signal = gaussian_filter(diff, s)
        peak = float(np.abs(signal - gaussian_filter(signal, 4 * s)).max())
        if peak / max(spread, 1e-3) > best:
            best, at = peak / max(spread, 1e-3), s
    return best, at


def defects(root: Path, seed: int) -> dict[tuple[str, str], tuple[float, int]]:
    """{(split, image stem): visibility} for every defective val and test image."""
    out = {}
    for split in ("val", "test"):
        for ci, name in enumerate(CLASSES):
            if name == "ok":
                continue
            for path in sorted((root / split / name).glob(f"{name}_*.png")):
                if "_mask" in path.stem:
                    continue
                number = int(path.stem.rsplit("_", 1)[1])
                args = (seed, SPLITS.index(split), ci, number, SIZE, DIFFICULTY)
                drawn = luma(render_plant_image(*args))
                out[(split, path.stem)] = visibility(drawn, luma(render_plant_image(*args, with_defect=False)))
    return out


def scores(workdir: Path, root: Path) -> dict[tuple[str, str], tuple[float, float]]:
    """{(split, stem): (P(defect), share of that split's good parts scored at or above it)}."""
    import torch

    from dtrain.data.datasets import open_split
    from dtrain.evaluation.evaluate import _data_config
    from dtrain.evaluation.predict import predict_split
    from dtrain.train.checkpoint import load_for_inference

    model, meta = load_for_inference(str(workdir / "train" / "checkpoints" / "best.pt"), map_location="cpu")
    cfg = _data_config(str(root), meta)
    out = {}
    for split in ("val", "test"):
        ds = open_split(cfg, split, train=False)
        p = predict_split(model, ds, mean=meta["mean"], std=meta["std"], batch_size=64, device=torch.device("cpu"),
                          num_workers=1)
        ok = ds.negative_index
        pdef = 1 - p.probs[:, ok]
        good = np.sort(pdef[p.targets == ok])
        for path, score, target in zip(p.paths, pdef, p.targets):
            if target != ok:
                out[(split, Path(path).stem)] = (float(score), float((good >= score).mean()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run", type=Path, help="a quickstart workdir trained on ROOT")
    ap.add_argument("--show", type=int, default=8)
    ap.add_argument("--json", type=Path, help="write every defect's figures here")
    args = ap.parse_args()
    vis = defects(args.root, args.seed)
    v = np.array([x for x, _ in vis.values()])
    print(f"{len(vis)} val + test defects: visibility median {np.median(v):.2f}, lowest {v.min():.2f}, "
          f"{(v < 3).sum()} under 3")
    rows = [{"split": k[0], "name": k[1], "visibility": x, "scale": s} for k, (x, s) in vis.items()]
    if args.run:
        scored = scores(args.run, args.root)
        for row in rows:
            row["p_defect"], row["false_alarms_here"] = scored[(row["split"], row["name"])]
        rho = spearmanr([r["visibility"] for r in rows], [r["p_defect"] for r in rows])[0]
        print(f"Spearman (visibility, P(defect)): {rho:.2f}")
        print(f"the {args.show} lowest scored: P(defect), false alarms at a threshold there, visibility")
        for r in sorted(rows, key=lambda r: r["p_defect"])[: args.show]:
            print(f"  {r['split']:>4} {r['name']:<14} {r['p_defect']:.3f}  {r['false_alarms_here']:6.1%}  "
                  f"{r['visibility']:5.2f} (sigma {r['scale']})")
    print(f"the {args.show} least visible:")
    for r in sorted(rows, key=lambda r: r["visibility"])[: args.show]:
        extra = f"  P(defect) {r['p_defect']:.3f}" if "p_defect" in r else ""
        print(f"  {r['split']:>4} {r['name']:<14} {r['visibility']:5.2f} (sigma {r['scale']}){extra}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
