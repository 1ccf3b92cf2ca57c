"""The training job's typed configuration (YAML + `--set` overrides via dtrain.configio)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, model_validator

from dtrain.configio import StrictModel
from dtrain.data.config import DataConfig
from dtrain.models.config import ModelConfig

Precision = Literal["auto", "fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)  # for command-line checks before a config exists


class OptimConfig(StrictModel):
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(2e-3, gt=0)
    weight_decay: float = Field(0.05, ge=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    warmup_steps: int = Field(50, ge=0)
    # Cosine decay to lr * min_lr_ratio at the last step.
    min_lr_ratio: float = Field(0.01, ge=0, le=1)


class TrainConfig(StrictModel):
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    epochs: int = Field(10, ge=1)
    # Per rank; the global batch is batch_size * world_size * grad_accum.
    batch_size: int = Field(32, ge=1)
    grad_accum: int = Field(1, ge=1)
    # auto: bf16 autocast where the CPU has native bf16 (AMX / AVX512-BF16) or on GPU
    # (bf16 if supported, else fp16 with a grad scaler); fp32 otherwise.
    precision: Precision = "auto"
    channels_last: bool = True
    seed: int = 0
    deterministic: bool = False
    output_dir: str = "runs/train"
    checkpoint_every: int = Field(1, ge=1)  # epochs
    # Also write last.pt every K optimizer steps inside an epoch (with the step reached
    # in it), so a killed run loses at most K steps; None = only at epoch ends.
    checkpoint_every_steps: int | None = Field(None, ge=1)
    # How many ckpt-epochNNNN.pt files to keep (the oldest go first); last.pt is extra.
    keep_checkpoints: int = Field(3, ge=1)
    log_every: int = Field(10, ge=1)  # steps
    val_every_epoch: bool = True  # loss/accuracy on data.val_split after every epoch
    # Also keep the epoch with the lowest validation loss as checkpoints/best.pt (needs
    # val_every_epoch): a long budget then cannot end on a worse epoch than it passed.
    keep_best: bool = False
    # Cross-entropy weights per class from the training counts: "sqrt_inverse" weighs
    # class c by sqrt(n_largest / n_c), so a class of 30 images is not drowned by one of
    # 3000, without letting its few images dominate as full inverse frequency would.
    loss_class_weights: Literal["none", "sqrt_inverse"] = "none"
    # Validate, keep and publish an exponential moving average of the weights with this
    # decay (ramped in over the first steps, dtrain/train/ema.py); None = the last step's.
    ema_decay: float | None = Field(None, gt=0, lt=1)
    # Train on blends of two images with the blend of their labels, the blend's weight drawn
    # from Beta(alpha, alpha) per batch (dtrain/train/mixup.py: for defect types, not OK vs defect).
    mixup_alpha: float | None = Field(None, gt=0)
    # Weight of a per-pixel loss on the training photos' defect masks, drawn by a small head
    # on the network's third stage beside the class loss (dtrain/models/mask_head.py); the
    # masks are found beside the photos (dtrain/data/mask_targets.py). None = image labels
    # only. Training only: the evaluated and exported network is the classifier alone.
    mask_loss: float | None = Field(None, gt=0)
    max_steps: int | None = Field(None, ge=1)  # stop early (tests, benchmarks)
    # Wall seconds the training loop may take (epochs with their validation and checkpoints;
    # not process start-up). At every epoch end the trainer fits the epochs still to run into
    # what is left, at the pace measured so far, never above `max_epochs`, and refits the
    # learning-rate decay to end on the last one (train/deadline.py). None: exactly `epochs`.
    time_budget_s: float | None = Field(None, gt=0)
    # With time_budget_s: the most epochs a run that proves faster than planned may raise
    # itself to (the recipe sets it where its timed probe cut `epochs` short of what the data
    # wants: a probe that over-costed would otherwise leave the budget unspent). None: `epochs`.
    max_epochs: int | None = Field(None, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # torch intra-op threads per rank; None = this node's cores / its number of ranks
    # (more threads than cores makes every rank's OpenMP spin against the others).
    threads: int | None = Field(None, ge=1)
    # torch.compile the model (first steps pay the compile time).
    compile: bool = False

    @model_validator(mode="after")
    def _views_need_augmentation(self) -> TrainConfig:
        # A network never shown a flipped or turned part has no reason to score it alike:
        # averaging over such views would mix in guesses, not an ensemble.
        if self.model.views > 1 and not self.data.augment:
            raise ValueError(f"model.views {self.model.views} needs data.augment: true (the training augmentation draws "
                             "the flips and quarter turns the views average over); set model.views: 1 otherwise")
        if self.max_epochs is not None and self.max_epochs < self.epochs:
            raise ValueError(f"max_epochs {self.max_epochs} is under epochs {self.epochs}: it is the most a time budget "
                             "may raise them to; leave it out (null) to keep epochs as the most")
        if self.data.transplant and self.mask_loss is None:
            raise ValueError(f"data.transplant {self.data.transplant:g} lifts defects off the training photos by their "
                             "masks, which are read only with mask_loss: set mask_loss (e.g. 1.0), or data.transplant: 0")
        if self.model.score_with_mask and self.mask_loss is None:
            raise ValueError("model.score_with_mask pools the mask head's vote into P(defect), and a head is trained "
                             "only with mask_loss: set mask_loss (e.g. 1.0), or model.score_with_mask: false")
        h, w = self.data.input_hw
        if self.model.views > 4 and h != w:
            raise ValueError(f"model.views {self.model.views} needs a square input, but it is {h} x {w} px "
                             "(data.image_width): a quarter turn would change its shape; set model.views: 4 (flips and "
                             "the half turn) or fewer")
        return self
