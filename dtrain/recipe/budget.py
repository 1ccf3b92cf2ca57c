"""A wall-clock budget -> input side and images seen, from a timed probe of this machine.

The recipe's other decisions say what the data wants (half the native side, ~90 000
images seen); this one says what the machine affords in `--budget-minutes`. A short
probe times a few training steps of the chosen architecture at the chosen side, one
thread per DDP rank side by side, each with its share of the cores, with the run's
precision. The probe leaves out the data pipeline, the all-reduce and validation: each
run also gets its share as TrainConfig.time_budget_s and fits its epochs to its own pace. A convolutional network's cost per image grows with its pixels, so
the cost at another side is the probe's times (side / probe side)^2.

Rule: the training share of the budget is split evenly over the runs (k fold models +
the final one, or the one run); the input side is the largest multiple of 32, at most
the data's choice and at least a quarter of the native side (below that a defect a few
pixels wide at native resolution is gone; and at least 128 px with a strided stem,
decide.stem), at which each run still sees
BUDGET_IMAGES images, or the epoch cap's passes over a set too small for that (images_needed:
270 images want 27 000 seen at MAX_EPOCHS, 81 000 with transplants, decide.epoch_cap; and
spending the rest of the budget on pixels is what a small set of faint defects can still use). When not even that floor affords them, the floor side is kept
and the images seen are cut to what fits, with a warning: a weaker model in time
rather than a good one too late.

k-fold (recipe/folds.py) multiplies the runs by k + 1, all of one recipe; a threshold
resting on more defects is worth little on a model that saw too few images or saw the
defects too small, so k-fold is kept only while every run still sees KFOLD_MIN_SHARE of
BUDGET_IMAGES at the side one run would get: k is lowered (down to folds.MIN_FOLDS)
until that holds, else the threshold is chosen on the validation split and the budget
that k-fold would need is printed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from dtrain.errors import DtrainError
from dtrain.recipe.decide import BUDGET_IMAGES, MAX_EPOCHS, MIN_SIDE, SIDE_STEP, Decision, stem
from dtrain.recipe.folds import MIN_FOLDS

# Of the budget, what training gets: the rest pays each run's start-up (processes,
# imports, decoding the cache), predicting held-out folds and the test split, the report.
TRAIN_SHARE = 0.75
# Per launched run, on top: process start, imports and DDP rendezvous (~25 s on the loaded
# 2-core machine), and each rank's decode-once cache (~2 400 PNGs of 256-512 px: ~30 s).
RUN_OVERHEAD_S = 60.0
# A run with less than this to train learns nothing worth scoring: the budget is refused.
MIN_TRAIN_S = 10.0
PROBE_WARMUP, PROBE_STEPS = 3, 4  # the first steps pay oneDNN's kernel selection: not timed
# Probe step size: PROBE_BATCH pictures up to PROBE_PIXELS_SIDE px, no more pixels above (probe_batch).
PROBE_BATCH, PROBE_PIXELS_SIDE, PROBE_MIN_BATCH = 16, 320, 4
# k-fold only while every one of the k + 1 runs sees at least this share of BUDGET_IMAGES.
KFOLD_MIN_SHARE = 0.5
# The probe's timing varies between runs (30.4 and 30.7 ms per image at 192 px, the same
# set, minutes apart, idle): a budget printed for the user to rerun with has this slack.
PROBE_SLACK = 0.1


@dataclass(frozen=True)
class Fit:
    side: Decision  # data.image_size
    images_seen: int  # per run
    reason: str  # the budget's arithmetic, printed with the epochs decision
    warning: str | None  # when the budget forced fewer images than `needed`
    seconds: float  # per run: its training loop's share of the budget (TrainConfig.time_budget_s)


def _floor_side(wanted: int) -> int:
    """The smallest input side the budget may shrink to: a quarter of the native side (below it a
    defect a few pixels wide at native resolution is gone), and never so small that the blocks see
    under MIN_SIDE. `wanted`: the data's input side, half the native side with a full-resolution
    stem and the native side with a strided one; decide.stem says which."""
    stride = stem(wanted).value
    quarter = wanted / (2 * stride)
    return min(max(MIN_SIDE * stride, math.ceil(quarter / SIDE_STEP) * SIDE_STEP), wanted)


def _per_run(budget_s: float, runs: int) -> float:
    return max(budget_s * TRAIN_SHARE / runs - RUN_OVERHEAD_S, 0.0)


def _minutes_for(per_run_s: float, runs: int) -> int:
    """The whole minutes whose _per_run is at least `per_run_s` (its inverse, rounded up), and
    at least MIN_TRAIN_S: a budget this names is never one require_training_time refuses."""
    return math.ceil((max(per_run_s, MIN_TRAIN_S) + RUN_OVERHEAD_S) * runs / TRAIN_SHARE / 60)


def require_training_time(budget_s: float, runs: int) -> None:
    """Refuse a budget that leaves its runs under MIN_TRAIN_S each to train (DtrainError). A
    1-minute quickstart went on to write a train.yaml with time_budget_s 0, which the trainer
    then refused after the probe and the scan."""
    per_run = _per_run(budget_s, runs)
    if per_run >= MIN_TRAIN_S:
        return
    each = f"each of the {runs} runs" if runs > 1 else "the run"
    raise DtrainError(
        f"a {budget_s / 60:g} min budget leaves {each} {per_run:.0f} s to train: a run first spends "
        f"~{RUN_OVERHEAD_S:.0f} s starting (processes, imports, decoding the images), and "
        f"{1 - TRAIN_SHARE:.0%} of the budget is kept for scoring and the report",
        f"give --budget-minutes {_minutes_for(MIN_TRAIN_S, runs)} or more" + (" (or fewer --folds)" if runs > 1 else ""),
    )


def _plan(budget_s: float, runs: int, per_run: float, cost: float, side: int) -> str:
    return (f"{budget_s / 60:.0f} min budget, {TRAIN_SHARE:.0%} for training over {runs} run(s): {per_run:.0f} s each; "
            f"{cost * 1000:.1f} ms per image at {side} px")


def images_needed(n_train: int, cap: int = MAX_EPOCHS) -> int:
    """Images one run sees when time is no object: BUDGET_IMAGES, or `cap` passes (decide.epoch_cap)
    over a set too small for that (decide.epochs). A side is afforded when the budget buys this many."""
    return min(BUDGET_IMAGES, n_train * cap)


def fit_budget(
    wanted: Decision, runs: int, budget_s: float, seconds_per_image: Callable[[int], float],
    needed: int = BUDGET_IMAGES,
) -> Fit:
    """`wanted`: the data's input side decision; `seconds_per_image(side)`: training cost per image seen;
    `needed`: images_needed for the run's training set."""
    require_training_time(budget_s, runs)
    per_run = _per_run(budget_s, runs)
    floor = _floor_side(wanted.value)
    sides = [wanted.value] + list(range((wanted.value - 1) // SIDE_STEP * SIDE_STEP, floor - 1, -SIDE_STEP))
    afford = {s: int(per_run / seconds_per_image(s)) for s in sides}
    for s in sides:
        if afford[s] >= needed:
            why = wanted.reason if s == wanted.value else (
                f"{wanted.value} px ({wanted.reason}) would see only {afford[wanted.value]} images per run in the budget; "
                f"{s} px is the largest side that affords {needed}")
            # The images seen stay the recipe's budget: decide.epochs caps a small set's passes itself.
            return Fit(Decision("data.image_size", s, why), BUDGET_IMAGES,
                       _plan(budget_s, runs, per_run, seconds_per_image(s), s), None, per_run)
    images = max(afford[floor], 1)
    warning = (f"the {budget_s / 60:.0f} min budget affords only {images} images seen per run at {floor} px (the "
               f"smallest side that keeps small defects visible), under the {needed} a from-scratch model wants: "
               "expect a weaker model; give it more time (--budget-minutes) or more cores or a GPU")
    why = (f"{wanted.value} px ({wanted.reason}) does not fit the budget; {floor} px is the floor (a quarter of the "
           "native side: below it a defect a few pixels wide at native resolution vanishes)")
    if floor == wanted.value:
        why = wanted.reason
    return Fit(Decision("data.image_size", floor, why), images,
               _plan(budget_s, runs, per_run, seconds_per_image(floor), floor), warning, per_run)


def fit_folds(
    wanted: Decision, k: int, budget_s: float, seconds_per_image: Callable[[int], float], needed: int = BUDGET_IMAGES,
) -> tuple[int, Fit, str]:
    """(k actually run, the budget's fit for its runs, what the budget did to k, in words).

    The fold runs keep the side one run would get: a better-founded threshold cannot
    rescue a model that saw the defects too small, or saw too few images."""
    single = fit_budget(wanted, 1, budget_s, seconds_per_image, needed)
    if k == 0:
        return 0, single, ""
    kept = _folds_kept(single, k, budget_s, seconds_per_image, needed)
    if kept is not None:
        return kept
    side = single.side.value
    auto = minutes_for_folds(wanted, seconds_per_image, needed)
    hint = f"--budget-minutes {auto} would afford {MIN_FOLDS} folds here"
    then = fit_budget(wanted, 1, auto * 60, seconds_per_image, needed).side.value
    if then > side:  # a larger budget first raises one run's side, and the folds must afford it: say so
        hint += f", at {then} px, the side one run gets by then"
        alt = minutes_for_side(wanted, side, MIN_FOLDS + 1, seconds_per_image, needed)
        if alt < auto:
            hint += f"; --folds {MIN_FOLDS} --budget-minutes {alt} runs them at {side} px, each seeing {needed} images"
    return 0, single, (
        f"; but {MIN_FOLDS + 1} runs at {side} px (the side one run affords) would see fewer than "
        f"{int(needed * KFOLD_MIN_SHARE)} images each, and a better-founded threshold cannot rescue a model that "
        f"saw too little: no k-fold, the threshold is chosen on the validation split ({hint})")


def _folds_kept(
    single: Fit, k: int, budget_s: float, seconds_per_image: Callable[[int], float], needed: int,
) -> tuple[int, Fit, str] | None:
    """The most folds, k down to MIN_FOLDS, whose runs each see KFOLD_MIN_SHARE of `needed` images at one
    run's side; None: none do."""
    side = single.side.value
    cost = seconds_per_image(side)
    enough = int(needed * KFOLD_MIN_SHARE)
    for j in range(k, MIN_FOLDS - 1, -1):
        per_run = _per_run(budget_s, j + 1)
        images = min(single.images_seen, int(per_run / cost))
        if images >= enough:
            lowered = "" if j == k else (f"; lowered from {k} to {j} folds so that each of the {j + 1} runs sees "
                                         f"{enough}+ images at {side} px in the budget")
            fit = Fit(single.side, images, _plan(budget_s, j + 1, per_run, cost, side), single.warning, per_run)
            return j, fit, lowered
    return None


def minutes_for_folds(wanted: Decision, seconds_per_image: Callable[[int], float], needed: int = BUDGET_IMAGES) -> int:
    """The smallest whole-minute budget at which fit_folds keeps MIN_FOLDS folds, even if the
    next run's probe measures up to PROBE_SLACK slower.

    Not simply MIN_FOLDS + 1 runs at today's side: a larger budget first raises the side one
    run gets (up to the data's choice), and the folds then have to afford that side. So
    each side's need is tried, smallest first, until the budget it names really keeps them."""
    enough = int(needed * KFOLD_MIN_SHARE)
    sides = sorted({wanted.value, *range(_floor_side(wanted.value), wanted.value, SIDE_STEP)})
    factors = [1 + PROBE_SLACK * i / 4 for i in range(5)]  # the probe's cost, as measured up to PROBE_SLACK slower

    def keeps(minutes: int) -> bool:
        def kept(f: float) -> bool:
            cost = lambda side: f * seconds_per_image(side)  # noqa: E731
            fit = fit_budget(wanted, 1, minutes * 60, cost, needed)
            return _folds_kept(fit, MIN_FOLDS, minutes * 60, cost, needed) is not None
        return all(kept(f) for f in factors)

    for side in sides:
        minutes = _minutes_for(enough * seconds_per_image(side) * factors[-1], MIN_FOLDS + 1)
        if keeps(minutes):
            return minutes
    while not keeps(minutes):  # at the data's own side the need above holds but for rounding
        minutes += 1
    return minutes


def minutes_for_side(
    wanted: Decision, side: int, runs: int, seconds_per_image: Callable[[int], float], needed: int = BUDGET_IMAGES,
) -> int:
    """The smallest whole-minute budget at which fit_budget gives each of `runs` runs `side` px or more
    (what `--folds K` asks of it), even if the next run's probe measures up to PROBE_SLACK slower.

    minutes_for_folds names the budget at which the recipe takes k-fold itself, and by then one
    run's side has grown to the data's own; a user who would rather have the folds at today's
    side needs far less, and is told both."""
    cost = lambda s: (1 + PROBE_SLACK) * seconds_per_image(s)  # noqa: E731 (slower costs only raise the need)
    minutes = _minutes_for(needed * cost(side), runs)

    def enough(m: int) -> bool:  # at the floor fit_budget keeps the side but cuts the images, with a warning
        fit = fit_budget(wanted, runs, m * 60, cost, needed)
        return fit.side.value >= side and fit.warning is None

    while not enough(minutes):  # rounding at the edge
        minutes += 1
    return minutes


def probe_batch(side: int, width: int | None = None) -> int:
    """Images per probe step: PROBE_BATCH up to PROBE_PIXELS_SIDE px, then fewer, so a step holds
    no more pixels than PROBE_BATCH pictures of that side (at least PROBE_MIN_BATCH).

    The probe runs at the data's own side (up to 640 px), usually larger than the side the
    budget then trains at, so its activations were the whole quickstart's peak: measured at
    640 px on 2 ranks (Zen 3, BENCHMARKS.md session 21), batch 16 took 4.5 GB and 50 s, batch 4
    2.0 GB and 13 s, for a cost per image 6 % lower (352 px, 16 -> 8: 5 % lower); the run
    checks its own pace against the plan in any case (TrainConfig.time_budget_s)."""
    return max(PROBE_MIN_BATCH, min(PROBE_BATCH, PROBE_BATCH * PROBE_PIXELS_SIDE ** 2 // (side * (width or side))))


def probe(model_cfg: dict, side: int, n_classes: int, precision: str = "auto", ranks: int = 1,
          batch: int | None = None, width: int | None = None, mask_head: bool = False) -> float:
    """Seconds per training image (forward, backward, AdamW step) at `side` px (`side` x `width`
    for a rectangular input) for `ranks` DDP ranks side by side on this machine's CPU cores (or
    its GPU), each with its share of the cores. `mask_head`: the run trains with mask_loss, so
    the head and its loss are timed too (without them a masked plant run planned 50 epochs at
    352 px and fitted 33 at its epoch ends, BENCHMARKS.md session 26).

    On a CPU the ranks are timed together, one thread each running its own model with its
    share of the cores: two ranks on two cores ran up to 1.5x slower each than one alone
    (BENCHMARKS.md, session 15), so timing one and
    dividing by the ranks under-costed the run. One process with all the cores would instead
    time OpenMP's thread barriers, 2-3x slower than the real run under load. A GPU rank has
    its own device: one is timed."""
    import threading

    import torch

    batch = batch or probe_batch(side, width)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        return _timed_steps(model_cfg, side, n_classes, precision, batch, dev, torch.get_num_threads(), width=width,
                            mask_head=mask_head)
    from dtrain.train.dist import cpu_count

    share = max(1, cpu_count() // ranks)
    start = threading.Barrier(ranks)
    costs: list[float] = []
    errors: list[BaseException] = []

    def rank() -> None:
        try:
            costs.append(_timed_steps(model_cfg, side, n_classes, precision, batch, dev, share, start, width, mask_head))
        except BaseException as exc:  # re-raised in the caller's thread
            start.abort()
            errors.append(exc)

    threads = [threading.Thread(target=rank, name=f"probe-rank-{r}") for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    # The ranks step in lockstep under DDP: the slowest one sets the pace of all.
    return max(costs) / ranks


def probe_scoring(model_cfg: dict, side: int, n_classes: int, width: int | None = None) -> float:
    """Seconds per image and view that scoring takes after training (validation, test, out-of-fold
    images) at `side` px: as dtrain.evaluation.predict runs it, in this process on all its
    threads, in fp32 (evaluation uses no autocast), gradient-free, channels-last, in batches
    of probe_batch pictures (16 up to 320 px, as evaluation's passes; fewer above).

    Timed rather than taken as a third of a training image's cost: on a CPU with bf16 units
    training runs bf16 and scoring fp32. At 320 px (Xeon with AMX, session 31) the training
    probe read 14.1 ms per image and this one 8.9 ms per view (evaluation: 10.4 ms, decoding
    included), not the 4.7 ms a third says: the recipe printed ~43 s for the plant set's
    scoring, which took 100-125 s."""
    import torch

    from dtrain.models import ModelConfig, build_model

    batch = probe_batch(side, width)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(ModelConfig(**{**model_cfg, "views": 1}), n_classes).eval()
    model = model.to(dev).to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, side, width or side, device=dev).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        return _seconds_per_image(lambda: model(x), batch, dev)


def _seconds_per_image(step: Callable[[], object], batch: int, dev, start=None) -> float:
    """Seconds per image of `step` (one batch of `batch` pictures) over PROBE_STEPS calls after
    PROBE_WARMUP untimed ones; `start`: a barrier passed before the timed calls."""
    import torch

    for i in range(PROBE_WARMUP + PROBE_STEPS):
        if i == PROBE_WARMUP:
            if start is not None:
                start.wait()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (PROBE_STEPS * batch)


def _timed_steps(model_cfg: dict, side: int, n_classes: int, precision: str, batch: int, dev,
                 threads: int, start=None, width: int | None = None, mask_head: bool = False) -> float:
    """One rank's seconds per image over PROBE_STEPS steps after PROBE_WARMUP, on `threads` cores;
    `start`: a barrier all ranks pass before their timed steps."""
    import torch
    import torch.nn.functional as F

    from dtrain.models import ModelConfig, build_model
    from dtrain.models.build import NORMS
    from dtrain.models.mask_head import with_mask_head
    from dtrain.train import precision as P

    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # OpenMP's thread count is per calling thread
    try:
        mcfg = ModelConfig(**model_cfg)
        model = build_model(mcfg, n_classes)
        if mask_head:  # the trainer's own wrapper: x -> (class logits, mask logits)
            model = with_mask_head(model, NORMS[mcfg.norm])
        model = model.to(dev).to(memory_format=torch.channels_last)
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(batch, 3, side, width or side, device=dev).contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, n_classes, (batch,), device=dev)
        policy = P.resolve(precision, dev)

        def step() -> None:
            with policy.autocast(dev):
                out = model(x)
                if mask_head:  # an all-clear target: the cost does not depend on the marks
                    logits, marks = out
                    loss = F.cross_entropy(logits, y) + F.binary_cross_entropy_with_logits(
                        marks.float(), torch.zeros_like(marks, dtype=torch.float32))
                else:
                    loss = F.cross_entropy(out, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return _seconds_per_image(step, batch, dev, start)
    finally:
        torch.set_num_threads(before)


def scaled(measured: float, at: int, width: Callable[[int], int] | None = None) -> Callable[[int], float]:
    """Cost per image at any side from one measurement at side `at`, by the input's pixels: side
    squared, or side x width(side) for a rectangle (decide.width_for), probed at at x width(at)."""
    cols = width or (lambda side: side)
    return lambda side: measured * side * cols(side) / (at * cols(at))
