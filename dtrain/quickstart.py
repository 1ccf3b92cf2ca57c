"""`dtrain quickstart`: the whole inspection recipe on this machine, with tuned defaults.

synthesise a defect data set (if absent) -> train with DDP on every local device (the
launcher `dtrain train --nproc` uses) -> evaluate against the target miss rate ->
`WORKDIR/report.json` + `WORKDIR/report.html`.

With `data` (`dtrain quickstart --data ROOT`) the user's own images replace the
synthetic set, and the recipe (dtrain/recipe/) decides input size, architecture,
loss weights, training budget and validation from them; each decision and its reason
is printed, written to train.yaml as an ordinary TrainConfig field, and listed in the report.
Two decisions are not TrainConfig fields, since they are about runs rather than one run:
the wall-clock budget (recipe/budget.py: a timed probe sets the input side and images
seen so that the whole run fits `--budget-minutes`) and k-fold training for the threshold
when the validation split holds too few defects (recipe/folds.py, recipe/oof.py).

The recipe below is tuned so that on a 2-core CPU (world size 2, gloo) the whole run
fits well under 10 minutes and reaches a test miss rate <= 0.5 % and accuracy >= 97 %
(numbers in BENCHMARKS.md). Every knob is an ordinary TrainConfig field, so the
written `WORKDIR/train.yaml` reproduces the training with `dtrain train`.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TextIO

import yaml

from dtrain.data.masks import mark_output
from dtrain.errors import DtrainError

# The tuned recipe (see the module docstring).
# 12 000 images (6000 to train on), 6 epochs: about the images seen of 7000 x 8 epochs, but
# each defect met fewer times and more defects met. At 7000 images every seed x precision
# left 5-10 % false alarms or 0.6-0.9 % test misses: a few defects of a kind the network had
# seen too few of scored P(defect) ~0.01 (BENCHMARKS.md, "Quickstart", session 6).
IMAGES = 12000
IMAGE_SIZE = 64
SEED = 0
# The synthesiser's knob: 0 = bold defects only, 1 = many faint and small ones.
DIFFICULTY = 0.0
# train / val / test. A large validation split is what lets the threshold be tight:
# bound95 needs >= 598 defective validation images for zero misses to prove 0.5 %,
# ~950 to tolerate one miss; each missed hard image otherwise drags the threshold
# (and the false-alarm rate) down. Validation images cost only inference.
SPLIT_FRACTIONS = (0.5, 0.25, 0.25)
EPOCHS = 6
TARGET_MISS_RATE = 0.005
# The threshold keeps the validation miss rate's 95 % upper bound (not just the rate)
# within target: a threshold tuned to exactly the target on validation misses it on
# the test split about half the time.
CALIBRATION = "bound95"
TRAIN = {
    # The small-crop ResNet (dtrain/models/small.py): at 64 px it trains 1.46x faster
    # than ResNet-18 and, seeing the defects at twice the resolution, reaches ~98 %
    # test accuracy where ResNet-18 stalled at ~95 % (BENCHMARKS.md, "Quickstart").
    # avg+max pooling (dtrain/models/heads.py), as the recipe on the user's images picks: a
    # thin scratch covers a few of the last map's 64 positions, and the mean dilutes it.
    # 8 views (dtrain/models/views.py): each image scored on its 8 symmetries, the ones the
    # augmentation trains for, probabilities averaged. The threshold sits in P(defect)'s
    # tail, where one view is noisy: seed 0 bf16 and seed 2 fp32 went from 96.8 % accuracy
    # at the threshold to 98.5 % and 97.3 % (BENCHMARKS.md, "Quickstart", session 12). It
    # costs 8x the inference: ~45 s more of the quickstart's evaluation.
    "model": {"arch": "small_resnet", "pool": "avgmax", "views": 8},
    # Per rank (global 64 on 2 ranks): batch 32 keeps one CPU thread per rank busy;
    # batch 16 ran at half the images per CPU-second.
    "batch_size": 32,
    "optim": {"name": "adamw", "lr": 2e-3, "weight_decay": 0.05, "warmup_steps": 30},
    "channels_last": True,
    # The per-epoch validation pass costs ~15 % of the CPU budget; evaluation
    # predicts the validation split once at the end anyway.
    "val_every_epoch": False,
    "log_every": 10,
    "checkpoint_every": 1,
}


@dataclass
class QuickstartOptions:
    workdir: Path = Path("runs/quickstart")
    images: int | None = None
    epochs: int | None = None
    nproc: int | None = None
    image_size: int = IMAGE_SIZE
    seed: int = SEED  # the synthetic set's and the training's
    precision: str = "auto"  # TrainConfig.precision (train.config.PRECISIONS); auto: bf16 where the CPU/GPU has it
    difficulty: float = DIFFICULTY
    target_miss_rate: float = TARGET_MISS_RATE
    calibration: str = CALIBRATION
    data: Path | None = None  # the user's own images: the recipe decides (see recipe_config)
    # With --data: the whole run's wall-clock budget (issue 11: 30 min on the 2-core machine).
    budget_minutes: float = 30.0
    folds: int | None = None  # with --data: k of k-fold for the threshold (0: none); None: the recipe decides
    fresh: bool = False  # start over even where WORKDIR holds an unfinished run (quickstart_resume.py)


def train_config(opts: QuickstartOptions, data_dir: Path, output_dir: Path) -> dict[str, Any]:
    """The TrainConfig (as a plain dict, what train.yaml holds) of the recipe."""
    return {
        **TRAIN,
        "data": {"root": str(data_dir), "image_size": opts.image_size, "cache_decoded": True},
        "epochs": opts.epochs or EPOCHS,
        "seed": opts.seed,
        "precision": opts.precision,
        "output_dir": str(output_dir),
    }


@dataclass
class Recipe:
    """What the recipe decided for the user's images (see recipe_config)."""

    cfg: dict[str, Any]  # the final run's TrainConfig, as train.yaml holds it
    decisions: list[dict]  # field, value, reason: printed, and listed in the report
    notes: list[str]  # what no decision can fix (few images of a class...)
    data: Any  # the DataConfig of the user's images (its layout detected)
    folds: int  # k of k-fold training for the threshold; 0: the threshold comes from validation
    images_seen: int  # what the budget affords one run (recipe/budget.py)
    fixed_epochs: int | None = None  # --epochs: every run's, whatever its size
    epoch_cap: int | None = None  # decide.epoch_cap; None (a quickstart.json from before it): MAX_EPOCHS

    def epochs_for(self, n: int) -> int:
        """A run's epochs for its `n` training images."""
        from dtrain.recipe.decide import MAX_EPOCHS, epochs

        return self.fixed_epochs or epochs(n, self.images_seen, cap=self.epoch_cap or MAX_EPOCHS).value

    def as_json(self) -> dict[str, Any]:
        """What quickstart.json keeps, so a continued run need not decide (and time the machine) again."""
        return {"cfg": self.cfg, "decisions": self.decisions, "notes": self.notes, "data": self.data.model_dump(),
                "folds": self.folds, "images_seen": self.images_seen, "fixed_epochs": self.fixed_epochs,
                "epoch_cap": self.epoch_cap}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Recipe:
        from dtrain.data.config import DataConfig

        return cls(raw["cfg"], raw["decisions"], raw["notes"], DataConfig.model_validate(raw["data"]), int(raw["folds"]),
                   int(raw["images_seen"]), raw.get("fixed_epochs"), raw.get("epoch_cap"))


def recipe_config(
    opts: QuickstartOptions, data_dir: Path, output_dir: Path, stream: TextIO,
    seconds_per_image: Callable[[int], float] | None = None, seconds_per_view: Callable[[int], float] | None = None,
) -> Recipe:
    """The recipe for the user's images. `seconds_per_image(side)`: the training cost per image
    seen at an input of that side (a rectangle's shorter one, data.image_width); default: a
    timed probe of this machine at the data's input (recipe/budget.py). `seconds_per_view(side)`:
    the scoring cost per image and view; default: timed with it, or a third of a given training
    cost."""
    from dtrain.data.config import DataConfig
    from dtrain.recipe import budget
    from dtrain.recipe.decide import (
        FORWARD_COST, Decision, as_config, aspect, epoch_cap, inference_views, input_side, lend_test_images, max_epochs,
        network, notes, plan, time_budget, width_for,
    )
    from dtrain.recipe.folds import plan_folds
    from dtrain.recipe.stats import describe_layout, detect_layout, gather
    from dtrain.train.launch import default_nproc

    layout = detect_layout(data_dir)
    data = DataConfig(root=str(data_dir), **layout)
    stats = gather(data)
    lent = lend_test_images(layout, stats)
    if lent is not None:  # MVTec-AD trains on good parts only: read it again with test images lent to train
        layout = {**layout, "mvtec_train_fraction": lent.value}
        data = DataConfig(root=str(data_dir), **layout)
        stats = gather(data)
    print(f"recipe: {stats.n_train} training images in {len(stats.classes)} classes ({describe_layout(layout)})",
          file=stream)
    labelled = {c: stats.train_counts.get(c, 0) + stats.val_counts.get(c, 0) for c in stats.classes}
    val_defective = sum(v for c, v in stats.val_counts.items() if c != stats.negative_class)
    folds = plan_folds(val_defective, labelled, stats.negative_class, opts.target_miss_rate)
    wanted = input_side(stats)
    ratio = aspect(stats)
    # Before the probe: a budget too short to train in is refused without timing anything.
    budget.require_training_time(opts.budget_minutes * 60, opts.folds + 1 if opts.folds else 1)
    if seconds_per_image is None:
        # A rectangle is probed as it trains; the budget then weighs every side at its rectangle's pixels.
        cols = None if ratio is None else (lambda side: width_for(ratio, side))
        shape = f"{wanted.value} px" if cols is None else f"{wanted.value} x {cols(wanted.value)} px"
        print(f"recipe: timing a few training steps at {shape} for the budget", file=stream)
        model_cfg = as_config(network(wanted.value, wanted.value))["model"]
        measured = budget.probe(model_cfg, wanted.value, len(stats.classes), opts.precision,
                                ranks=opts.nproc or default_nproc(), width=cols and cols(wanted.value),
                                mask_head=bool(stats.masked_defects))
        seconds_per_image = budget.scaled(measured, wanted.value, cols)
        if seconds_per_view is None:
            view = budget.probe_scoring(model_cfg, wanted.value, len(stats.classes), width=cols and cols(wanted.value))
            seconds_per_view = budget.scaled(view, wanted.value, cols)
    if seconds_per_view is None:  # a caller's own training cost: a forward pass at its precision
        given = seconds_per_image
        seconds_per_view = lambda side: FORWARD_COST * given(side)  # noqa: E731
    # A small set is capped at epoch_cap passes: the budget then buys pixels, not repeats. Sized
    # on the training split: under k-fold the final run's train + val is larger, never smaller.
    cap = epoch_cap(stats)
    needed = budget.images_needed(stats.n_train, cap)
    if opts.folds is None:
        k, fit, why_k = budget.fit_folds(wanted, folds.k, opts.budget_minutes * 60, seconds_per_image, needed)
    else:  # the command line wins, said so
        k, why_k = opts.folds, f"; --folds {opts.folds} overrides the recipe's {folds.k}"
        fit = budget.fit_budget(wanted, k + 1 if k else 1, opts.budget_minutes * 60, seconds_per_image, needed)
    n_final = stats.n_train + stats.n_val if k else stats.n_train
    # A fold model learns from (k - 1) / k of train + val: possibly fewer images than train alone.
    n_smallest = min(stats.n_train, n_final * (k - 1) // k) if k else stats.n_train
    decisions = ([lent] if lent else []) + plan(stats, fit.side, fit.images_seen, fit.reason, n_final, kfold=bool(k),
                                                ranks=opts.nproc or default_nproc(), n_smallest=n_smallest)
    # Scored after training: the test split (taken as large as validation), and validation or,
    # under k-fold, every labelled image out of fold.
    n_scored = stats.n_val + (stats.n_train + stats.n_val if k else stats.n_val)
    decisions.append(inference_views(n_scored, seconds_per_view(fit.side.value), opts.budget_minutes * 60,
                                     square=ratio is None))
    if opts.epochs:  # the command line wins; said so, like every other decision
        decisions = [d for d in decisions if d.field != "epochs"] + [Decision("epochs", opts.epochs, "--epochs")]
    else:  # asked-for epochs are not cut by the clock
        decisions.append(time_budget(fit.seconds, bool(k)))
        planned = next(d.value for d in decisions if d.field == "epochs")
        if (most := max_epochs(n_final, planned, bool(k), cap)) is not None:
            decisions.append(most)
    decisions.append(Decision("threshold k-fold", k, folds.reason + why_k))  # a decision about runs: not in train.yaml
    for d in decisions:
        print(f"recipe: {d.field} = {d.value}  ({d.reason})", file=stream)
    remarks = notes(stats) + ([fit.warning] if fit.warning else [])
    for note in remarks:
        print(f"recipe: note: {note}", file=stream)
    cfg = _merged(TRAIN, as_config(decisions[:-1]))
    cfg["data"].update(root=str(data_dir), **layout)
    cfg.update(seed=opts.seed, precision=opts.precision, output_dir=str(output_dir))
    listed = [{"field": d.field, "value": d.value, "reason": d.reason} for d in decisions]
    return Recipe(cfg, listed, remarks, data, k, fit.images_seen, opts.epochs, cap)


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def ensure_data(data_dir: Path, opts: QuickstartOptions, images: int, stream: TextIO) -> dict[str, Any]:
    """Synthesise the data set unless one made with the same settings is already there."""
    from dtrain.data.synth import synthesize
    from dtrain.progress import progress_bars

    from dtrain.data.synth import GENERATOR_VERSION

    # generator_version: a set drawn by an older synthesiser is stale even when the
    # other settings match (its defects look different).
    wanted = {
        "images": images, "size": opts.image_size, "seed": opts.seed, "difficulty": opts.difficulty,
        "split_fractions": list(SPLIT_FRACTIONS), "generator_version": GENERATOR_VERSION,
    }
    manifest_path = data_dir / "manifest.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if all(manifest.get(k) == v for k, v in wanted.items()):
            print(f"data: reusing {data_dir} ({images} images, {opts.image_size} px)", file=stream)
            return manifest
        print(f"data: {data_dir} was made with other settings; synthesising it again", file=stream)
    print(f"data: synthesising {images} images of {opts.image_size} px into {data_dir}", file=stream)
    with progress_bars(stream) as bars:
        return synthesize(data_dir, images=images, size=opts.image_size, seed=opts.seed, progress=bars("synthesise", images),
                          difficulty=opts.difficulty, split_fractions=SPLIT_FRACTIONS, force=True)


def run_quickstart(opts: QuickstartOptions, stream: TextIO = sys.stdout) -> dict[str, Any]:
    """Run the recipe; returns the report dict also written to WORKDIR/report.json. An
    unfinished run in WORKDIR with the same options is continued (quickstart_resume.py)."""
    from dtrain import quickstart_resume as resume

    t0 = time.perf_counter()
    workdir = Path(opts.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    mark_output(workdir)  # before the scan: a workdir inside the data root is no class of photos
    options = resume.options_of(opts)
    state = resume.continue_or_refuse(resume.load(workdir), options, opts.fresh, workdir)
    if opts.fresh:
        resume.discard(workdir)
    saved = Recipe.from_json(state.recipe) if state is not None and state.recipe is not None else None
    if saved is not None:  # the user's images: the same ones, or refused
        resume.check_images(state, resume.fingerprint(saved.data), workdir)
    if state is not None:
        print(f"resume: continuing the unfinished run in {workdir} ({resume.describe(state)}); --fresh starts over",
              file=stream)
    try:
        return _run(opts, workdir, options, state, saved, t0, stream)
    except (KeyboardInterrupt, DtrainError):
        if resume.record_stop(workdir, time.perf_counter() - t0) is not None:
            print(f"quickstart: the run so far is kept in {workdir}: run the same command again to continue it "
                  "(--fresh starts over)", file=stream)
        raise


def _run(opts: QuickstartOptions, workdir: Path, options: dict[str, Any], state: Any, saved: Recipe | None,
         t0: float, stream: TextIO) -> dict[str, Any]:
    """`state`/`saved`: the unfinished run continued and its recipe (None: a fresh run)."""
    from dtrain import quickstart_resume as resume
    from dtrain.evaluation.evaluate import evaluate
    from dtrain.evaluation.html_report import write_report
    from dtrain.train.launch import default_nproc

    images = opts.images or IMAGES
    data_dir, train_dir, eval_dir = workdir / "data", workdir / "train", workdir / "eval"
    recipe: Recipe | None = None
    nproc = opts.nproc or default_nproc()
    oof = None
    if opts.data is None:
        ensure_data(data_dir, opts, images, stream)
        cfg_dict = train_config(opts, data_dir, train_dir)  # the options pin the synthetic set: no fingerprint
    else:
        data_dir = Path(opts.data)
        if saved is not None:  # its images checked by run_quickstart
            recipe = saved
            print(f"recipe: as decided by the unfinished run ({len(recipe.decisions)} decisions in {workdir / 'train.yaml'})",
                  file=stream)
        else:
            recipe = recipe_config(opts, data_dir, train_dir, stream)
        cfg_dict = recipe.cfg
    if state is None:
        state = resume.RunState(options, resume.fingerprint(recipe.data) if recipe is not None else "",
                                recipe=recipe.as_json() if recipe is not None else None)
    t_data = time.perf_counter() - t0

    def advance(stage: str) -> None:
        # Never back: a continued run passing its finished folds again is still past them.
        state.stage = max(state.stage, stage, key=resume.STAGES.index)
        resume.save(workdir, state)

    # A fold or final run already under way continues from its checkpoint; the rest start afresh.
    reached = state.stage
    t1 = time.perf_counter()
    if recipe is not None and recipe.folds:
        from dtrain.recipe.oof import run_folds

        advance("folds")

        def fold_done(i: int) -> None:
            state.folds_done = sorted({*state.folds_done, i})
            resume.save(workdir, state)

        continuing = reached != "recipe"
        oof, cfg_dict = run_folds(cfg_dict, recipe.data, recipe.folds, recipe.epochs_for, workdir,
                                  lambda path: _train(path, nproc, stream, resume=continuing), stream,
                                  done=set(state.folds_done) if continuing else None, on_done=fold_done)
    cfg_path = workdir / "train.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg_dict, sort_keys=False))
    advance("train")
    checkpoint = _train(cfg_path, nproc, stream, resume=reached in ("train", "eval"))
    train_time = time.perf_counter() - t1
    advance("eval")
    best = checkpoint.with_name("best.pt")  # written with keep_best: the lowest validation loss
    evaluated = best if best.is_file() else checkpoint

    from dtrain.progress import progress_bars

    with progress_bars(stream) as bars:
        progress = lambda split, total: bars(f"predict {split}", total)  # noqa: E731
        if oof is None:
            print("eval: predicting the validation and test splits", file=stream)
            result = evaluate(evaluated, data_dir, opts.target_miss_rate, calibration=opts.calibration, out_dir=eval_dir,
                              progress=progress)
        else:
            from dtrain.evaluation.evaluate import save_scores

            print(f"eval: the threshold from {len(oof)} out-of-fold scores; predicting the test split", file=stream)
            result = evaluate(evaluated, recipe.data, opts.target_miss_rate, calibration=opts.calibration, out_dir=eval_dir,
                              progress=progress, threshold_scores=oof,
                              threshold_source=f"out-of-fold scores of {recipe.folds} fold models over train + val")
            save_scores(eval_dir / "oof_scores.npz", oof)
    report = {**result, **_training_figures(checkpoint, Path(cfg_dict["output_dir"]), train_time)}
    if state.stops:
        report["warnings"] = [*report["warnings"], f"this run was stopped {state.stops} time(s) and continued: the whole "
                              f"quickstart's time counts every part ({state.spent_s:.0f} s before the last), not the "
                              "pauses; the training time is the last part's"]
    report.update(
        data_time_s=t_data,
        total_time_s=state.spent_s + time.perf_counter() - t0,
        config=cfg_dict,
        workdir=str(workdir),
        evaluated_checkpoint=evaluated.name,
    )
    if recipe is not None:
        report["recipe"] = recipe.decisions
        report["warnings"] = [*report["warnings"], *recipe.notes]
        report["budget_minutes"] = opts.budget_minutes
    write_report(workdir, report, eval_dir, train_dir / "metrics.jsonl", title="dtrain quickstart: surface-defect inspection")
    advance("done")
    return report


def _train(cfg_path: Path, nproc: int, stream: TextIO, resume: bool = False) -> Path:
    """One local DDP run of a config; returns its last checkpoint. `resume`: continue from
    the run's last checkpoint where it has one (an unfinished quickstart's)."""
    from dtrain.train.checkpoint import find_resume
    from dtrain.train.launch import launch_local, say_job

    output_dir = Path(yaml.safe_load(cfg_path.read_text())["output_dir"])
    resume = resume and find_resume(output_dir) is not None
    if not resume:  # a fresh run: an old last.pt must not be mistaken for this run's result
        shutil.rmtree(output_dir, ignore_errors=True)
    print(f"train: {nproc} DDP processes, config {cfg_path}" + (", continuing from its last checkpoint" if resume else ""),
          file=stream)
    if launch_local(str(cfg_path), [], resume, nproc, on_job=say_job(True)):
        raise KeyboardInterrupt  # its job was stopped (Ctrl-C or `dtrain stop`): the quickstart ends there
    checkpoint = output_dir / "checkpoints" / "last.pt"
    if not checkpoint.is_file():
        raise DtrainError(f"training finished without a checkpoint at {checkpoint}", f"see the log above and {output_dir}")
    return checkpoint


def _training_figures(checkpoint: Path, train_dir: Path, train_time: float) -> dict[str, Any]:
    """World size from the checkpoint, throughput from the trainer's metrics log."""
    from dtrain.evaluation.html_report import read_jsonl
    from dtrain.train.checkpoint import load

    blob = load(checkpoint)
    rows = read_jsonl(train_dir / "metrics.jsonl")
    rates = [r["images_per_s"] for r in rows if r.get("kind") == "train" and "images_per_s" in r]
    val = [r for r in rows if r.get("kind") == "val"]
    return {
        "world_size": int(blob["world_size"]),
        "epochs": int(blob["epoch"]),
        "steps": int(blob["step"]),
        "train_time_s": train_time,
        # The median logged window: steady-state speed, without start-up and validation.
        "train_images_per_s": statistics.median(rates) if rates else 0.0,
        "final_val_accuracy": val[-1].get("accuracy") if val else None,
    }
