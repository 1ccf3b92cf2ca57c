"""The recipe's decisions: data statistics -> TrainConfig fields, each with its reason.

Pure functions of `DataStats`. Every default below carries a reason meant to hold for
surface images in general, not for one data set; `plan` returns them in the order they
are printed, and `as_config` turns them into the nested dict `train.yaml` holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dtrain.data.layouts import BOX_RULES, MASK_RULES, NEGATIVE_SYNONYMS, NO_TYPE, UNLISTED, UNREADABLE_MASK
from dtrain.recipe import copies
from dtrain.recipe.stats import DataStats

# Input side bounds. Below 64 px a ResNet's last stage sees 2x2 maps or less; above 320 px
# compute (which grows with the side squared) passes hours per 10 000 images on a CPU,
# and large pictures want tiles at native resolution rather than one shrunken view.
MIN_SIDE, MAX_SIDE = 64, 320
# Sides are multiples of 32: every ResNet stage halves the map, five halvings stay exact.
SIDE_STEP = 32
# From this side on (what the blocks want, half the native side: pictures of 193 px or more)
# the network's first convolution strides by 2 and the input is taken at up to twice the
# blocks' side, the pictures' own pixels: the downscale is learned from them rather than
# averaged (dtrain/models/small.py). Smaller pictures hold too few pixels to double the
# blocks' side without upsampling, and a stride would leave their blocks under it.
STRIDED_STEM_FROM = 2 * MIN_SIDE
# Images seen in training. A from-scratch CNN converges after a number of weight
# updates, not of epochs. Bold defects (the quickstart) need ~470 steps of 64 images;
# small faint defects on parts of every finish (the plant profile) were still learning at
# 900 steps of 32 (validation AUROC 0.96 / 0.98 / 0.98 and loss 0.39 / 0.24 / 0.18 after
# 300 / 600 / 900 steps). The budget buys these before a larger side (recipe/budget.py):
# on the plant profile 192 px did worse than 160 px at the same images seen, and in the
# same time 128 px with 90 000 seen beat 160 px with 61 200 on AUROC and on the best
# no-miss threshold (BENCHMARKS.md, sessions 11-13). Small sets get more epochs (the
# augmentation's symmetries, shifts and brightness/contrast keep repeats different).
BUDGET_IMAGES = 90_000
# At least 5 passes, so that every image of a rare class is seen several times; at most
# 100, past which a small set is memorised rather than learned.
MIN_EPOCHS, MAX_EPOCHS = 5, 100
# With transplants (data.transplant) half the draws are composites no pass has shown before,
# so the reason for the cap weakens: it is raised to this. Measured on the types-only plant
# copy (270 training images), seeds 0-2 (BENCHMARKS.md, session 30): test accuracy higher in
# all three (+1, +4, +4 of 90 parts), the kept epoch's validation loss lower in all three.
MAX_EPOCHS_TRANSPLANTED = 300
# Largest/smallest training class beyond which the loss is reweighted: a 3:1 imbalance
# already moves an argmax towards the large class (and the rare defects are the ones
# that matter at a plant).
IMBALANCE = 3.0
# A class with fewer training images than this is named in a note: its figures are noisy.
RARE = 20
# decode-once cache budget per training process (data.cache_decoded).
CACHE_BYTES = 1 << 30
BATCH_SIZE = 32  # per rank, as the quickstart: keeps one CPU thread per rank busy
# Training images are shifted by up to this share of their side (data.shift): a small
# defect moves by many of its own widths, and at most the picture's outer eighth leaves
# it on one side.
SHIFT = 0.125
# Pictures longer than this (long side / short side) are wide: when most of the sampled ones
# are, the input is a rectangle of their median proportions (data.image_width). Below it a
# square costs a long side at most a third of its pixels, and a set of near-squares shot at
# slightly different crops keeps one shape for all of them.
WIDE = 1.5
# Views per image at inference (dtrain/models/views.py): all 8 of the augmentation's
# symmetries while scoring what the recipe predicts (validation, test, out-of-fold) stays
# within this share of the budget, else 4, 2 or 1, at the cost budget.probe_scoring times.
# Where a caller gives only a training cost, a view is taken at a third of it: a forward pass
# at the training's precision (the backward pass is about twice the forward).
VIEWS_SHARE, FORWARD_COST = 0.1, 1 / 3


@dataclass(frozen=True)
class Decision:
    field: str  # dotted TrainConfig path, e.g. "data.image_size"
    value: Any
    reason: str


# Beta(alpha, alpha) of mixup's shares (train/mixup.py): small, so most blends are mostly
# one image with a trace of another (0.2 is in the range the mixup paper used on ImageNet);
# measured on defect types at this value only (BENCHMARKS.md, sessions 21-22).
MIXUP_ALPHA = 0.2


def input_side(stats: DataStats) -> Decision:
    """The side the data wants at the network's input. The blocks want half the native side;
    where that is STRIDED_STEM_FROM or more, the stem strides (stem) and halves its input for
    them, so the input is taken at twice that, native pixels, never upsampled."""
    native = stats.median_side
    half = math.ceil(native / 2 / SIDE_STEP) * SIDE_STEP
    blocks = min(native, max(MIN_SIDE, min(MAX_SIDE, half)))
    why = (
        f"median shorter side {native} px; half of it (rounded up to {SIDE_STEP}) keeps a defect a few pixels "
        f"wide at native resolution at least half as wide, within {MIN_SIDE}..{MAX_SIDE} px, never upsampled"
    )
    if blocks < half:
        why += f" (capped at {MAX_SIDE}: larger pictures would want tiles at native resolution)"
    side = blocks
    if blocks >= STRIDED_STEM_FROM:
        # Before: the input was the blocks' side, and the stride halved it again: 200 px
        # pictures reached the blocks at 64 px where 190 px ones (no stride) reached them at 96.
        side = min(native // SIDE_STEP * SIDE_STEP, 2 * blocks)
        why += (f"; that is what the blocks see: the stem's stride (below) halves its input, so the input is taken "
                f"at {side} px, the pictures' own pixels")
    if aspect(stats) is not None:
        why += " (the shorter side of a rectangle, data.image_width below)"
    return Decision("data.image_size", side, why)


def aspect(stats: DataStats) -> float | None:
    """The median proportions (long / short side) of the sampled pictures when most are over
    WIDE; None: they are squares or near enough."""
    ratios = sorted(stats.aspect_ratios)
    if not ratios or sum(r > WIDE for r in ratios) * 2 <= len(ratios):
        return None
    return ratios[len(ratios) // 2]


def width_for(ratio: float | None, side: int) -> int | None:
    """data.image_width for an input `side` px high at proportions `ratio`: a multiple of
    SIDE_STEP (like the side, for exact halvings); None: a square."""
    if ratio is None:
        return None
    return max(side + SIDE_STEP, round(side * ratio / SIDE_STEP) * SIDE_STEP)


def input_width(stats: DataStats, side: int) -> Decision:
    ratio = aspect(stats)
    if ratio is None:
        wide = sum(r > WIDE for r in stats.aspect_ratios)
        return Decision("data.image_width", None, "the pictures are squares or near enough "
                        f"({wide} of {len(stats.aspect_ratios)} sampled are over {WIDE}:1): a square input")
    width = width_for(ratio, side)
    return Decision(
        "data.image_width", width,
        f"most sampled pictures are over {WIDE}:1 (median {ratio:.2f}:1): the input is {side} x {width} px, their "
        f"proportions, the long side across (an upright picture is turned a quarter); squashed into a square they would "
        f"lose {1 - 1 / ratio:.0%} of their pixels along the long side, and a thin defect across it would fade (strips "
        "of 4 synthetic parts, 12 epochs each: test AUROC 0.775 squashed, 0.979 as rectangles, at 4x the cost per image)",
    )


def architecture(side: int, strided: bool = False) -> Decision:
    if strided:  # the blocks see a map of half the side: ResNet-18's resolution, not twice it
        keeps = (f" with a 3x3 stride-2 stem (below): its blocks see the maps of a picture of {side // 2} px "
                 "(a quarter of ResNet-18's multiply-adds at this side)")
    else:
        keeps = " keeps twice ResNet-18's resolution at every stage (a 3x3 full-resolution stem) for the same multiply-adds"
    return Decision(
        "model.arch", "small_resnet",
        f"at {side} px: the small-crop ResNet{keeps}, with a quarter of the parameters (less to overfit "
        "on rare classes, less for DDP to all-reduce)",
    )


def stem(wanted: int) -> Decision:
    """`wanted`: the data's own input side (input_side), not the budget's: every side the
    budget tries is costed, probed and trained with one stem."""
    if wanted >= STRIDED_STEM_FROM:
        return Decision(
            "model.stem_stride", 2,
            f"the data wants {wanted} px, pictures its blocks see downscaled: the first convolution strides by 2, so "
            "the network takes twice the blocks' side for about the compute of a full-resolution stem at half of it, "
            "and learns the downscale from native pixels (a resize averages a line a pixel or two wide into its "
            "surroundings)",
        )
    return Decision("model.stem_stride", 1, f"{wanted} px: a full-resolution first convolution (a stride would leave "
                                            f"the blocks under {MIN_SIDE} px)")


def input_norm() -> Decision:
    return Decision(
        "model.input_norm", "per_image",
        "each picture is standardised by its own level and contrast inside the network: parts come under drifting "
        "light in finishes of every shade, and a defect is a departure from the part's own surface (without it a "
        "from-scratch network spends its budget learning the finishes first)",
    )


def pooling() -> Decision:
    return Decision(
        "model.pool", "avgmax",
        "the last feature map is pooled by its mean and its maximum: a defect is local, and the mean dilutes it "
        "by the share of the picture it covers where the maximum keeps it",
    )


def network(side: int, wanted: int) -> list[Decision]:
    """The model.* decisions: what the plan writes and what the budget's probe times.
    `side`: the input side; `wanted`: the data's own (input_side), which picks the stem."""
    first = stem(wanted)
    return [architecture(side, first.value == 2), first, input_norm(), pooling()]


def sampling(stats: DataStats) -> list[Decision]:
    """Rare classes: drawn more often (data.sampling), not weighted in the loss."""
    present = {k: v for k, v in stats.train_counts.items() if v > 0}
    rare, common = min(present, key=present.get), max(present, key=present.get)
    ratio = present[common] / present[rare]
    if ratio >= IMBALANCE:
        why = (f"{rare} has {present[rare]} training images, {common} {present[common]} ({ratio:.0f}:1, over "
               f"{IMBALANCE:.0f}:1): each class is drawn in proportion to the square root of its size, so rare defects "
               "are in nearly every batch without their few images repeating as often as full balancing would")
        return [Decision("data.sampling", "sqrt_inverse", why),
                Decision("loss_class_weights", "none", "rare classes are drawn more often instead (a loss weight on "
                         "an image met once in fifty batches gives a noisy gradient; drawing it more often does not)")]
    why = f"classes within {ratio:.1f}:1 (under {IMBALANCE:.0f}:1): every image once per epoch, no reweighting"
    return [Decision("data.sampling", "uniform", why), Decision("loss_class_weights", "none", why)]


def epoch_cap(stats: DataStats) -> int:
    """The most passes a run makes over its set: MAX_EPOCHS_TRANSPLANTED where the recipe
    transplants defects (each pass then shows new composites), MAX_EPOCHS elsewhere."""
    return MAX_EPOCHS_TRANSPLANTED if transplant(stats).value > 0 else MAX_EPOCHS


def epochs(n: int, images_seen: int = BUDGET_IMAGES, budget: str = "", cap: int = MAX_EPOCHS) -> Decision:
    """Epochs for `n` training images, at most `cap` (epoch_cap); `images_seen` below
    BUDGET_IMAGES is the wall-clock budget's cut (recipe/budget.py), which then wins over MIN_EPOCHS."""
    # epoch_cap's two values: MAX_EPOCHS, or the raised cap of a set with transplants.
    why_cap = ("past that a small set is memorised rather than learned" if cap == MAX_EPOCHS
               else "transplants make each pass new")
    if images_seen >= BUDGET_IMAGES:
        e = min(cap, max(MIN_EPOCHS, math.ceil(images_seen / n)))
        bounds = f"{MIN_EPOCHS}..{cap} epochs" + ("" if cap == MAX_EPOCHS else f": {why_cap}")
    elif images_seen // n > cap:  # the budget is short of BUDGET_IMAGES, the set is smaller still
        e = cap
        bounds = f"at most {cap} epochs: {why_cap}"
    else:
        e = max(1, images_seen // n)
        bounds = "cut to fit the wall-clock budget, at least 1 epoch"
    return Decision(
        "epochs", e,
        f"a budget of {images_seen} images seen over {n} training images ({e * n} seen; {bounds})"
        + (f"; {budget}" if budget else ""),
    )


def max_epochs(n: int, planned: int, kfold: bool, cap: int = MAX_EPOCHS) -> Decision | None:
    """TrainConfig.max_epochs where the budget's plan cut `planned` epochs short of the data's
    wish (epochs at BUDGET_IMAGES, at most `cap`); None where it did not, or under k-fold."""
    wish = epochs(n, cap=cap).value
    if kfold or planned >= wish:
        return None
    return Decision(
        "max_epochs", wish,
        f"the probe's plan cut the epochs to {planned}; a run that proves faster at its epoch ends (the probe's timing "
        f"varies between runs) raises them towards the {wish} the data wants (BUDGET_IMAGES) rather than leave the "
        "budget unspent",
    )


def time_budget(seconds: float, kfold: bool) -> Decision:
    """The run's own check on the plan: the probe times a few steps of the network alone,
    not the data pipeline, all-reduce, validation or checkpoints, and a shared machine's
    speed moves between minutes, so the run measures itself (dtrain/train/deadline.py)."""
    why = ("this run's training share of the wall-clock budget; at every epoch end the trainer times its epochs "
           "(data pipeline, all-reduce and validation included, which the probe leaves out) and, if the epochs "
           "above would not fit, trains fewer with the learning-rate decay refit to end on the last")
    if kfold:
        why += "; every fold run has the same share (a fold cut short trains fewer epochs than the others)"
    return Decision("time_budget_s", round(seconds), why)


KFOLD_VALIDATION = (
    "k-fold: the final model trains on train + val, so nothing is held out to validate on or to pick a best epoch "
    "with; the fold models train the same way (fixed epochs, last epoch kept) so that their out-of-fold scores "
    "stand for the final model's"
)


def validation(stats: DataStats, kfold: bool = False) -> list[Decision]:
    if kfold:
        return [Decision("val_every_epoch", False, KFOLD_VALIDATION), Decision("keep_best", False, KFOLD_VALIDATION)]
    if stats.n_val == 0:
        reason = "no validation images: nothing to validate on each epoch"
        return [Decision("val_every_epoch", False, reason), Decision("keep_best", False, reason)]
    return [
        Decision("val_every_epoch", True, f"{stats.n_val} validation images, one inference pass per epoch"),
        Decision("keep_best", True, "the budget is fixed in advance: the epoch with the lowest validation loss is "
                 "kept as best.pt and evaluated, so a late bad epoch costs nothing"),
    ]


def negative_class(stats: DataStats) -> Decision:
    if stats.negative_class is None:
        return Decision("data.negative_class", None, "no class name reads as defect-free (ok, good, normal, *_free, "
                        "no_defect, ...): a classification task (accuracy and per-class figures, no miss rate)")
    why = "the defect-free class: misses are measured against it"
    if stats.negative_class not in NEGATIVE_SYNONYMS:
        why += " (found by its name; if it is not the defect-free class, set data.negative_class)"
    return Decision("data.negative_class", stats.negative_class, why)


def augmentation(stats: DataStats) -> list[Decision]:
    # A rectangle keeps its shape: flips and the half turn only (data/transforms.py).
    turns = "8 symmetries" if aspect(stats) is None else "4 symmetries: flips and the half turn, which keep a rectangle"
    return [
        Decision(
            "data.augment", True,
            f"{stats.grey_share:.0%} of the sampled images are grey (decoded to three equal channels); the augmentation "
            f"changes orientation ({turns}), brightness and contrast, never hue, so it suits grey and colour alike",
        ),
        Decision(
            "data.shift", SHIFT,
            f"each training image is also moved by up to {SHIFT:.1%} of its side, the border mirrored: a defect may sit "
            "anywhere on a part, and a from-scratch network on a few thousand images otherwise memorises where each one "
            "lies (defect types only, 1099 training images: validation loss 0.47 -> 0.37, test accuracy 88.3 -> 91.3 %)",
        ),
    ]


# Weight of the per-pixel mask loss beside the class loss (TrainConfig.mask_loss): both are
# mean cross-entropies of the same order, so equal weights let neither drown the other.
MASK_LOSS = 1.0


def mask_supervision(stats: DataStats) -> Decision:
    """Pixel labels where the data has them (models/mask_head.py)."""
    defects = sum(n for c, n in stats.train_counts.items() if c != stats.negative_class)
    if not stats.masked_defects:
        return Decision("mask_loss", None, "no defective training photo has a mask beside it: the network learns "
                        "from the image labels alone")
    return Decision(
        "mask_loss", MASK_LOSS,
        f"{stats.masked_defects} of the {defects} defective training photos have a mask{_boxes(stats)}: a small head on "
        "the network's inner features learns to draw it beside the class loss (equal weights), so the pixel labels tell "
        "the network where each defect lies instead of leaving it to find which pixels differ; the classifier "
        "alone decides at inspection (model.score_with_mask: true lets the head's most defective spot vote too)",
    )


def _boxes(stats: DataStats) -> str:
    if not stats.boxed_defects:
        return ""
    share = "all" if stats.boxed_defects == stats.masked_defects else str(stats.boxed_defects)
    return f" ({share} of them boxes from annotation files, filled in)"


# Share of the host draws (the defect-free ones; without a defect-free class, the masked
# defective ones) that receive a defect lifted off a masked defective photo (data.transplant).
# Half: the sampler's draws still show half of the parts as they were photographed, and the
# other half show the few dozen defects of each class on surfaces they were not photographed
# on. Measured at this value only (BENCHMARKS.md): session 27, the plant profile with masks at
# 160 px, 90 000 images seen, seeds 0-2: argmax accuracy higher on both splits of all three
# seeds (+0.8 to +2.3 points), and the false alarms at the 3rd and 5th faintest defect lower on
# all six; at the single faintest, lower on four of six. Session 28, its defect-types-only copy
# end to end: test accuracy 72.2 -> 88.9 %.
TRANSPLANT = 0.5


def transplant(stats: DataStats) -> Decision:
    """Defects moved onto other parts (data/transplant.py), where masks say where they are."""
    if not stats.masked_defects:
        return Decision("data.transplant", 0.0, "no defective training photo has a mask: a defect cannot be lifted "
                        "off its photo")
    if stats.negative_class is None:
        return Decision(
            "data.transplant", TRANSPLANT,
            f"{TRANSPLANT:.0%} of the masked defective training draws have their own defects taken off and one lifted "
            f"off another of the {stats.masked_defects} masked photos laid on (its change to the surface, at a random "
            "turn and place), and take its type: every surface and finish then carries every type, so the network "
            "learns a type by its shape, not by the parts it was photographed on",
        )
    return Decision(
        "data.transplant", TRANSPLANT,
        f"{TRANSPLANT:.0%} of the defect-free training draws receive a defect lifted off one of the "
        f"{stats.masked_defects} masked defective photos (its change to the surface, at a random turn and place) and "
        "take its class: each defect is then seen on hundreds of surfaces instead of one, so the network learns it "
        "apart from the texture it was photographed on",
    )


def mixup(stats: DataStats) -> Decision:
    """Blends of two training images (train/mixup.py), for defect types only."""
    if stats.negative_class is not None:
        return Decision("mixup_alpha", None, "a defect-free class: a scratch blended into a good part is a fainter "
                        "scratch, and a label partly 'ok' would teach the network to pass faint defects: no blends")
    return Decision(
        "mixup_alpha", MIXUP_ALPHA,
        f"defect types only: each batch is also trained on pairwise blends of its images (the larger share from "
        f"Beta({MIXUP_ALPHA}, {MIXUP_ALPHA}) folded to >= 0.5) against the blend of their labels; a from-scratch "
        "network on a few hundred images per class otherwise learns them by heart (defect types only, 1099 training "
        "images, seeds 0-4: best validation loss lower on all five, 0.416 -> 0.385 on average; test accuracy higher on "
        "four, 87.98 -> 89.40 % on average; images right only with blends 72, only without 46, paired p = 0.02)",
    )


def inference_views(n_scored: int, seconds_per_view: float, budget_s: float, square: bool = True) -> Decision:
    """`n_scored`: images the recipe predicts after training; `seconds_per_view`: scoring cost
    per image and view at the chosen side (recipe/budget.py's probe_scoring); `square`: False
    for a rectangular input, which has 4 symmetries (a quarter turn changes its shape)."""
    allowed = VIEWS_SHARE * budget_s
    cost = lambda n: n_scored * n * seconds_per_view  # noqa: E731
    n = next((v for v in (8, 4, 2) if cost(v) <= allowed and (square or v <= 4)), 1)
    if n == 1:
        return Decision("model.views", 1, f"one view per image: scoring {n_scored} images on 2 views would take "
                                          f"~{cost(2):.0f} s, over {VIEWS_SHARE:.0%} of the budget")
    why = (f"each image is scored on {n} of its symmetries (flips{', quarter turns' if n == 8 else ''}), the ones the "
           "augmentation trains the network to treat alike, and the class probabilities averaged: an ensemble the "
           "augmentation already paid for, steadiest where one view is noisy, in the tail of P(defect) where an "
           "inspection threshold sits and between look-alike classes (quickstart: accuracy at the threshold 96.8 -> "
           f"98.5 %); scoring {n_scored} images so takes ~{cost(n):.0f} s, within {VIEWS_SHARE:.0%} of the budget. "
           f"Inspection pays the same {n}x per part")
    return Decision("model.views", n, why)


def cache(n_train: int, side: int, width: int | None = None, masks: bool = False) -> Decision:
    """`masks`: the training photos carry their mask as a fourth channel (mask_loss)."""
    need = n_train * (4 if masks else 3) * side * (width or side)
    fits = need <= CACHE_BYTES
    size = f"{side} x {width} px" if width else f"{side} px"
    return Decision(
        "data.cache_decoded", fits,
        f"the decoded training set is {need / 2**20:.0f} MiB at {size} "
        + ("(within 1 GiB per process): decode once instead of every epoch" if fits else "(over 1 GiB per process): decode per epoch"),
    )


def batch_size(n_train: int, ranks: int) -> Decision:
    """Pictures per step and rank: BATCH_SIZE, or, where a rank's share of the smallest
    training set a run gets holds fewer, the largest power of two it fills (the loader drops a
    ragged last batch, so a batch larger than the share would leave an epoch with no step)."""
    per_rank = max(n_train // max(ranks, 1), 1)
    if per_rank >= BATCH_SIZE:
        return Decision("batch_size", BATCH_SIZE, "per process; keeps one CPU thread per rank busy")
    size = 1 << (per_rank.bit_length() - 1)
    return Decision("batch_size", size, f"per process; {per_rank} training images per rank (of {ranks}) fill no batch "
                                        f"of {BATCH_SIZE}: {size}, so that every epoch has a full step")


def plan(
    stats: DataStats, side: Decision | None = None, images_seen: int = BUDGET_IMAGES, budget: str = "",
    n_train: int | None = None, kfold: bool = False, ranks: int = 1, n_smallest: int | None = None,
) -> list[Decision]:
    """The decisions, in print order. `side`/`images_seen`/`budget`: the wall-clock budget's
    (recipe/budget.py; default: the data's wish); `n_train`: the final run's training images
    (train + val under k-fold); `kfold`: the threshold comes from out-of-fold scores; `ranks`:
    DDP processes per run; `n_smallest`: the fewest training images any run gets (a fold's)."""
    wanted = input_side(stats)
    side = side or wanted
    width = input_width(stats, side.value)
    n = n_train or stats.n_train
    return [
        negative_class(stats), *sample_bits(stats), side, width, *network(side.value, wanted.value),
        cache(n, side.value, width.value, masks=bool(stats.masked_defects)),
        *augmentation(stats), mixup(stats), mask_supervision(stats), transplant(stats), *sampling(stats),
        epochs(n, images_seen, budget, epoch_cap(stats)),
        *validation(stats, kfold),
        batch_size(min(stats.n_train, n_smallest or n, n), ranks),
    ]


# What cameras digitise to: a 16-bit image's largest sample is rounded up to one of these,
# so a dark sample of a 12-bit camera's images (none above 2047) does not make the brighter
# images the recipe did not open clip at 255.
CAMERA_BITS = (8, 10, 12, 14, 16)


# MVTec-AD's own train/ holds good parts only (its protocol is anomaly detection), and a
# classifier learns a defect only from examples of it: this share of every test class (good
# parts too, so the classes keep their proportions) is lent to train, and the rest is cut into
# val and test as before. Half, because the held-out defects are also what the threshold and
# its miss-rate bound rest on, and an MVTec category has only 40-110 of them.
MVTEC_LEND = 0.5


def lend_test_images(layout: dict[str, Any], stats: DataStats) -> Decision | None:
    """data.mvtec_train_fraction when an MVTec-AD layout trains on no defect at all; None otherwise."""
    if layout.get("layout") != "mvtec" or layout.get("mvtec_train_fraction") or stats.negative_class is None:
        return None
    if any(n for c, n in stats.train_counts.items() if c != stats.negative_class):
        return None
    return Decision(
        "data.mvtec_train_fraction", MVTEC_LEND,
        f"train/ holds only {stats.negative_class} parts (MVTec-AD's layout, made for anomaly detection), and a "
        f"classifier learns a defect only from examples of it: {MVTEC_LEND:.0%} of every test class is lent to train, "
        "the rest cut into val and test; the figures are then on that rest, not comparable with published "
        "anomaly-detection results",
    )


def sample_bits(stats: DataStats) -> list[Decision]:
    """`data.sample_bits` where sampled 16-bit images use fewer than 16 bits; nothing otherwise."""
    if not stats.deep_bits or max(stats.deep_bits) > CAMERA_BITS[-2]:
        return []
    top = max(stats.deep_bits)
    bits = next(b for b in CAMERA_BITS if b >= top)
    return [Decision(
        "data.sample_bits", bits,
        f"the {len(stats.deep_bits)} sampled 16-bit images use at most {top} bits (no value reaches {2 ** top}), as a "
        f"{bits}-bit camera's values stored as they come: "
        + (f"shifted down by {bits - 8} bits" if bits > 8 else "taken as they are") + " rather than keeping the high byte, "
        f"which would leave them {2 ** max(bits - 8, 0)} of 256 grey levels and hide faint defects",
    )]


def notes(stats: DataStats) -> list[str]:
    """What the decisions cannot fix, in words for the report."""
    out = []
    rare = {k: v for k, v in stats.train_counts.items() if v < RARE}
    if rare:
        out.append("few training images for " + ", ".join(f"{k} ({v})" for k, v in sorted(rare.items()))
                   + f": under {RARE}, their accuracy figures are noisy and the model may not generalise")
    missing = [k for k in stats.classes if stats.val_counts.get(k, 0) == 0 and stats.n_val]
    if missing:
        out.append(f"no validation images of {', '.join(missing)}")
    if stats.refused:
        path, why = next(iter(stats.refused.items()))
        out.append(f"{len(stats.refused)} of the sampled training images are refused by the decoder and will be skipped "
                   f"in training (e.g. {path}: {why})")
    if stats.labelled_by:
        rules = ", ".join(f"{n} because {rule}" for rule, n in stats.labelled_by.items() if n)
        boxed = sum(stats.labelled_by.get(rule, 0) for rule in BOX_RULES)
        masked = sum(stats.labelled_by.values()) - boxed - stats.labelled_by.get(MASK_RULES[2], 0)
        source = "masks and box files" if boxed and masked else "box files" if boxed else "masks"
        kept = " (the boxes' classes are not kept: defect or ok is what the miss rate needs)" if boxed else ""
        out.append(f"labels read from the {source} (data.layout masklabels): {rules} (marked: defect; empty or none: "
                   f"ok){kept}. If photos without one are not all good parts, sort the photos into class folders "
                   "instead")
    unread = {p: why for p, why in stats.left_out.items() if why.startswith(UNREADABLE_MASK)}
    if unread:
        path, why = next(iter(unread.items()))
        out.append(f"{len(unread)} photos left out of every split: their masks cannot be read (e.g. {path}: {why})")
    unlisted = {p: why for p, why in stats.left_out.items() if why.startswith(UNLISTED)}
    if unlisted:
        path, why = next(iter(unlisted.items()))
        out.append(f"{len(unlisted)} images under the data folder are not in the label table and are left out of every "
                   f"split (e.g. {path}: {why})")
    untyped = {p: why for p, why in stats.left_out.items() if why.startswith(NO_TYPE)}
    if untyped:
        path, why = next(iter(untyped.items()))
        out.append(f"{len(untyped)} photos left out of every split: a classifier of defect types learns nothing from a "
                   f"photo without a box (e.g. {path}: {why})")
    truth = {p: why for p, why in stats.left_out.items() if p not in unread and p not in unlisted and p not in untyped}
    if truth:
        path, why = next(iter(truth.items()))
        masks = sum(not p.endswith(("/", "\\")) for p in truth)  # folders end in a separator
        folders = len(truth) - masks
        what = [f"{n} ground-truth {noun}{'s' if n != 1 else ''}" for n, noun in ((masks, "mask"), (folders, "folder")) if n]
        use = ("; the training photos' masks are their pixel labels (mask_loss)" if stats.masked_defects else "")
        out.append(f"{' and '.join(what)} among the images, left out of every split (e.g. {path}: {why}); a mask is a picture of "
                   f"the answer, not of the part{use}")
    return out + copies.describe(stats.copies)


def as_config(decisions: list[Decision]) -> dict[str, Any]:
    """{"data.image_size": 256, ...} -> {"data": {"image_size": 256}, ...}."""
    out: dict[str, Any] = {}
    for d in decisions:
        *parents, leaf = d.field.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = d.value
    return out
