"""The DDP training loop: `run(cfg, resume=False)`.

One entry point for a plain process (a world of one, no process group), `torchrun` and
`dtrain train --nproc N`. Rank 0 logs and writes checkpoints (at epoch ends, and every
`checkpoint_every_steps` steps if set); every rank reports its steps to the monitor
(`report_step`), which is a no-op unless an agent is configured.
"""

from __future__ import annotations

import contextlib
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dtrain.data.masks import mark_output
from dtrain.data.transforms import MEAN, STD, normalize_batch
from dtrain.errors import ConfigError
from dtrain.models import build_model
from dtrain.models.build import NORMS
from dtrain.models.mask_head import with_mask_head
from dtrain.monitor.rank.client import report_step
from dtrain.train import checkpoint as ckpt
from dtrain.train import deadline, dist, mixup, precision
from dtrain.train.ema import WeightAverage
from dtrain.train.facts import describe, run_facts
from dtrain.train.config import TrainConfig
from dtrain.train.loaders import Loaders, build_loaders
from dtrain.train.logs import NullLog, RunLog
from dtrain.train.mask_loss import mask_loss, split_mask
from dtrain.train.schedule import build_optimizer, build_scheduler

@dataclass
class TrainResult:
    world_size: int
    epochs_done: int
    steps: int
    checkpoint: Path | None
    # Last logged values: train_loss, val_loss, val_accuracy, images_per_s, ...
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class State:
    """Everything a checkpoint restores, plus the handles the loop steps."""

    raw: nn.Module  # the unwrapped model: what checkpoints hold
    model: nn.Module  # what the loop calls (DDP and/or compiled)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    epoch: int = 0  # completed epochs
    step: int = 0  # optimizer steps so far
    step_in_epoch: int = 0  # optimizer steps into the current, unfinished epoch
    best_val_loss: float = float("inf")  # for keep_best
    # The averaged weights (cfg.ema_decay): what is validated and what checkpoints publish.
    ema: WeightAverage | None = None
    # cfg.mask_loss: the mask head, trained beside `raw` and saved apart from it.
    head: nn.Module | None = None

    def published(self) -> nn.Module:
        """The weights evaluation, export and keep_best see."""
        return self.ema.module if self.ema is not None else self.raw


def run(cfg: TrainConfig, resume: bool = False, *, stream: TextIO | None = None) -> TrainResult:
    ctx = dist.setup(cfg.device)
    try:
        return _Trainer(cfg, ctx, stream or sys.stderr).fit(resume)
    finally:
        dist.teardown()


def configure_runtime(cfg: TrainConfig, ctx: dist.DistContext) -> None:
    torch.set_num_threads(cfg.threads or max(1, dist.cpu_count() // ctx.local_world_size))
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    else:
        torch.backends.cudnn.benchmark = True
    # The same seed on every rank gives every rank the same initial weights; DDP would
    # broadcast rank 0's anyway, but this keeps a world of one identical to a world of N.
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed + ctx.rank)
    np.random.seed((cfg.seed + ctx.rank) % 2**32)


class _Trainer:
    def __init__(self, cfg: TrainConfig, ctx: dist.DistContext, stream: TextIO) -> None:
        self.cfg, self.ctx = cfg, ctx
        configure_runtime(cfg, ctx)
        self.precision = precision.resolve(cfg.precision, ctx.device)
        # Plain values, saved in every checkpoint: what an evaluation report states ran.
        self.facts = run_facts(ctx.device, self.precision.name, ctx.world_size, cfg.seed)
        self.data: Loaders = build_loaders(cfg.data, ctx, batch_size=cfg.batch_size, seed=cfg.seed,
                                           masks=cfg.mask_loss is not None)
        self.steps_per_epoch = len(self.data.train) // cfg.grad_accum
        if self.steps_per_epoch == 0:
            per_rank = len(self.data.sampler)
            raise ConfigError(
                f"no full step per epoch: {per_rank} training images per rank, batch_size {cfg.batch_size} x grad_accum {cfg.grad_accum}",
                "lower batch_size or grad_accum, or use more images",
            )
        # The epochs this run trains: cfg.epochs, unless a time budget cuts them (refit).
        self.epochs = cfg.epochs
        self.said_epochs = cfg.epochs  # the plan last logged (deadline.worth_saying)
        self.total_steps = self.steps_per_epoch * cfg.epochs
        # Training seconds of the runs this one resumes (their checkpoints' train_seconds).
        self.seconds_before = 0.0
        self.epoch_seconds: list[float] = []  # this process's epochs, for the time budget's pace
        self.t_loop = time.perf_counter()
        self.loss_weight = loss_weights(cfg.loss_class_weights, self.data.train_set, len(self.data.classes), ctx.device)
        self.stream = stream
        self.log: NullLog = NullLog()
        self.last_metrics: dict[str, float] = {}

    # ---- setup -------------------------------------------------------------------------

    def build_state(self) -> State:
        cfg, ctx = self.cfg, self.ctx
        raw = build_model(cfg.model, len(self.data.classes)).to(ctx.device)
        if cfg.channels_last:
            raw = raw.to(memory_format=torch.channels_last)
        trained: nn.Module = raw  # what the optimiser steps and the loop calls (raw, or raw + the mask head)
        head = None
        if cfg.mask_loss is not None:
            trained = with_mask_head(raw, NORMS[cfg.model.norm]).to(ctx.device)
            if cfg.channels_last:
                trained = trained.to(memory_format=torch.channels_last)
            head = trained.head
        # Per-rank randomness (dropout, if a model has it) must differ between ranks.
        torch.manual_seed(cfg.seed * 1000 + ctx.rank)
        optimizer = build_optimizer(trained, cfg.optim.name, cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.momentum)
        scheduler = build_scheduler(optimizer, self.total_steps, cfg.optim.warmup_steps, cfg.optim.min_lr_ratio)
        model: nn.Module = trained
        if ctx.distributed:
            model = DDP(trained, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        if cfg.compile:
            model = torch.compile(model)
        ema = WeightAverage(raw, cfg.ema_decay) if cfg.ema_decay is not None else None
        return State(raw, model, optimizer, scheduler, self.precision.grad_scaler(ctx.device), ema=ema, head=head)

    def restore(self, state: State) -> str:
        """Load last.pt into `state`; returns what happened, for the log."""
        if self.ctx.is_main:  # what a killed writer left
            ckpt.remove_stale_temporaries(self.cfg.output_dir)
        path = ckpt.find_resume(self.cfg.output_dir)
        if path is None:
            return f"resume: no checkpoint in {ckpt.checkpoint_dir(self.cfg.output_dir)}; starting fresh"
        blob = ckpt.load(path)
        # With an average, "model" holds it and "live_model" the weights being trained.
        state.raw.load_state_dict(blob.get("live_model", blob["model"]))
        if state.ema is not None:  # a checkpoint without an average starts one at its weights
            state.ema.load(blob["model"], int(blob.get("ema_updates", 0)))
        if state.head is not None and "mask_head" in blob:  # without it, the head starts afresh
            state.head.load_state_dict(blob["mask_head"])
        state.optimizer.load_state_dict(blob["optimizer"])
        state.scheduler.load_state_dict(blob["scheduler"])
        # The saved state carries the saved run's total; this run's config says how long it is.
        state.scheduler.lr_lambdas[0].total_steps = self.total_steps
        state.scaler.load_state_dict(blob["scaler"])
        state.epoch, state.step, state.step_in_epoch = blob["epoch"], blob["step"], blob["step_in_epoch"]
        state.best_val_loss = float(blob.get("best_val_loss", float("inf")))
        if self.cfg.time_budget_s is not None:  # the budget spans the resumed runs
            self.seconds_before = float(blob.get("train_seconds", 0.0))
            self.set_epochs(state, min(self.most_epochs, int(blob.get("epochs_planned", self.cfg.epochs))))
            self.said_epochs = self.epochs  # the start line says this plan
        if blob["world_size"] == self.ctx.world_size:
            ckpt.set_rng_state(blob["rng"][self.ctx.rank])
        elif state.step_in_epoch:
            # Another world size splits the epoch differently: restart the epoch.
            state.step -= state.step_in_epoch
            state.step_in_epoch = 0
        return f"resumed from {path}: epoch {state.epoch}, step {state.step}"

    # ---- the loop ----------------------------------------------------------------------

    def fit(self, resume: bool) -> TrainResult:
        cfg, ctx = self.cfg, self.ctx
        state = self.build_state()
        if ctx.is_main:
            Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
            mark_output(Path(cfg.output_dir))
            (Path(cfg.output_dir) / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
            (Path(cfg.output_dir) / "run.yaml").write_text(yaml.safe_dump(self.facts, sort_keys=False))
        resumed = self.restore(state) if resume else None
        if ctx.is_main:
            self.log = RunLog(cfg.output_dir, self.stream, resume_step=state.step if resume else None)
            if resumed:
                self.log.message(resumed)
            self.log.message(
                f"training {cfg.model.arch} on {len(self.data.classes)} classes: world {ctx.world_size} on {ctx.device.type}, "
                f"precision {self.precision.name}, {self.steps_per_epoch} steps/epoch x {self.epochs} epochs"
                + (f", a time budget of {deadline.minutes(cfg.time_budget_s)}" if cfg.time_budget_s else "")
                + (f", mask loss {cfg.mask_loss:g} on {self.masked_photos()} photos' masks" if state.head is not None else "")
            )
            self.log.message(f"run: {describe(self.facts)}")
            if self.data.negative_index is None:
                self.log.message(_no_negative_class_note(cfg.data.negative_class, self.data.classes))
            elif (found := self.data.classes[self.data.negative_index]) != cfg.data.negative_class:
                self.log.message(f"negative class: {found} (data.negative_class {cfg.data.negative_class!r}: {found} is "
                                 "the class named like defect-free parts; set data.negative_class if it is not)")
        last_path: Path | None = None
        try:
            self.log.start(self.total_steps, state.step, f"epoch {state.epoch + 1}/{self.epochs}")
            self.t_loop = mark = time.perf_counter()
            mark_step = state.step
            while state.epoch < self.epochs and not self.reached_max(state):
                self.train_epoch(state)
                if state.step_in_epoch < self.steps_per_epoch:  # stopped by max_steps
                    last_path = self.save(state, epoch_end=False)
                    break
                state.epoch, state.step_in_epoch = state.epoch + 1, 0
                val_loss = self.evaluate(state)
                if cfg.time_budget_s is not None:
                    self.refit(state, time.perf_counter() - mark, state.step - mark_step)
                    mark, mark_step = time.perf_counter(), state.step
                # val_loss is all-reduced: every rank takes the same branch (save is collective).
                best = cfg.keep_best and val_loss is not None and val_loss < state.best_val_loss
                if best:
                    state.best_val_loss = val_loss
                if best or state.epoch % cfg.checkpoint_every == 0 or state.epoch == self.epochs or self.reached_max(state):
                    last_path = self.save(state, epoch_end=True)
                    if best and ctx.is_main:
                        ckpt.publish_last(last_path, ckpt.BEST)
        finally:
            self.log.close()
        return TrainResult(ctx.world_size, state.epoch, state.step, last_path or ckpt.find_resume(cfg.output_dir), self.last_metrics)

    def refit(self, state: State, since_s: float, steps: int) -> None:
        """At an epoch end: the epochs that fit the time budget (train/deadline.py).

        `since_s`: seconds since the last epoch end (or the loop's start), `steps`: the steps
        run in them: a resumed run's first epoch may be a part of one, so the pace is per step.
        The ranks average their clocks: every rank must decide alike (the loop is collective)."""
        self.epoch_seconds.append(since_s * self.steps_per_epoch / max(steps, 1))
        elapsed_s, epoch_s = dist.all_reduce_mean([self.train_seconds(), deadline.pace(self.epoch_seconds)], self.ctx)
        old = self.epochs
        new = deadline.epochs_within(self.cfg.time_budget_s, elapsed_s, epoch_s, state.epoch, self.most_epochs, old)
        if new != old:
            if deadline.worth_saying(self.said_epochs, new, state.epoch):
                self.log.message(deadline.refit_message(self.said_epochs, new, state.epoch, epoch_s, elapsed_s,
                                                        self.cfg.time_budget_s))
                self.said_epochs = new
            self.set_epochs(state, new)

    @property
    def most_epochs(self) -> int:
        """What the time budget may raise the epochs to (TrainConfig.max_epochs)."""
        return self.cfg.max_epochs or self.cfg.epochs

    def set_epochs(self, state: State, epochs: int) -> None:
        self.epochs = epochs
        self.total_steps = self.steps_per_epoch * epochs
        state.scheduler.lr_lambdas[0].total_steps = self.total_steps
        self.log.retotal(self.total_steps)

    def train_seconds(self) -> float:
        return self.seconds_before + time.perf_counter() - self.t_loop

    def reached_max(self, state: State) -> bool:
        return self.cfg.max_steps is not None and state.step >= self.cfg.max_steps

    def train_epoch(self, state: State) -> None:
        cfg, ctx, dev = self.cfg, self.ctx, self.ctx.device
        accum = cfg.grad_accum
        self.data.sampler.set_epoch(state.epoch, skip=state.step_in_epoch * accum * cfg.batch_size)
        state.model.train()
        window = _Window()
        micro, step_samples, data_wait = 0, 0, 0.0
        t_prev = t_step = time.perf_counter()
        for images, labels in self.data.train:
            t_got = time.perf_counter()
            data_wait += t_got - t_prev
            empty = labels.numel() == 0  # every image of the batch was unreadable
            masks = None
            if not empty:
                images = images.to(dev, non_blocking=True)
                if state.head is not None:
                    images, masks = split_mask(images)
                images = normalize_batch(images, cfg.channels_last)
                labels = labels.to(dev, non_blocking=True)
            micro += 1
            final_micro = micro % accum == 0
            # Non-final micro-steps skip DDP's gradient all-reduce; the last one syncs the sum.
            no_sync = state.raw is not state.model and not final_micro
            with state.model.no_sync() if no_sync and hasattr(state.model, "no_sync") else contextlib.nullcontext():
                if empty:
                    loss = self.null_loss(state)
                else:
                    with self.precision.autocast(dev):  # autocast runs cross_entropy in fp32
                        lam, perm = None, None
                        if cfg.mixup_alpha is not None:
                            lam, perm = mixup.draw(cfg.mixup_alpha, labels.shape[0], cfg.seed, ctx.rank, state.step,
                                                   (micro - 1) % accum)
                            perm = perm.to(dev, non_blocking=True)  # once, for the blend and the losses
                            images = mixup.mix(images, lam, perm)
                        out = state.model(images)
                        logits, mask_logits = out if masks is not None else (out, None)
                        if perm is None:
                            loss = F.cross_entropy(logits, labels, weight=self.loss_weight)
                        else:
                            loss = mixup.loss(logits, labels, lam, perm, self.loss_weight)
                        if mask_logits is not None:
                            loss = loss + cfg.mask_loss * mask_loss(mask_logits, masks, lam, perm)
                state.scaler.scale(loss / accum).backward()
            window.add(loss.detach(), labels.shape[0])
            step_samples += labels.shape[0]
            t_prev = time.perf_counter()
            if not final_micro:
                continue
            lr = state.optimizer.param_groups[0]["lr"]
            state.scaler.step(state.optimizer)
            state.scaler.update()
            state.optimizer.zero_grad(set_to_none=True)
            state.scheduler.step()
            if state.ema is not None:
                state.ema.update()
            state.step += 1
            state.step_in_epoch += 1
            t_prev = now = time.perf_counter()
            # A tensor: report_step converts it (a device sync) only when it sends, not per step.
            report_step(
                step=state.step, epoch=state.epoch, loss=loss.detach(), lr=lr,
                step_time_s=now - t_step, data_wait_s=data_wait, samples=step_samples,
            )
            window.steps += 1
            if state.step % cfg.log_every == 0 or state.step_in_epoch == self.steps_per_epoch:
                self.flush_window(state, window, lr)
            self.log.advance(1, f"epoch {state.epoch + 1}/{self.epochs} loss {self.last_metrics.get('train_loss', float('nan')):.4f}")
            t_step, step_samples, data_wait = now, 0, 0.0
            if self.mid_epoch_checkpoint_due(state):
                self.save(state, epoch_end=False)
                t_prev = t_step = time.perf_counter()  # the save is neither step nor data time
            if state.step_in_epoch >= self.steps_per_epoch or self.reached_max(state):
                break
        if window.steps:
            self.flush_window(state, window, state.optimizer.param_groups[0]["lr"])

    def null_loss(self, state: State) -> torch.Tensor:
        """A zero loss through the whole model, for a batch with no readable image.

        Skipping the batch on this rank alone would put the ranks' gradient all-reduces
        out of step (a hang under DDP), so the rank takes part with a zero gradient: the
        step's averaged gradient is the other ranks' share. The stand-in (one blank
        image) runs in eval mode so that BatchNorm neither fails on it nor learns it.
        """
        (h, w), dev = self.cfg.data.input_hw, self.ctx.device
        blank = normalize_batch(torch.zeros((1, 3, h, w), dtype=torch.uint8, device=dev), self.cfg.channels_last)
        state.model.eval()
        try:
            with self.precision.autocast(dev):
                out = state.model(blank)
        finally:
            state.model.train()
        outs = out if isinstance(out, tuple) else (out,)  # with the mask head: both outputs reach the loss
        return sum(o.float().sum() for o in outs) * 0.0

    def masked_photos(self) -> int:
        masks = getattr(self.data.train_set, "masks", None) or []
        return sum(m is not None for m in masks)

    def mid_epoch_checkpoint_due(self, state: State) -> bool:
        every = self.cfg.checkpoint_every_steps
        # Epoch ends and max_steps stops have their own checkpoint (fit).
        return (
            every is not None and state.step % every == 0
            and state.step_in_epoch < self.steps_per_epoch and not self.reached_max(state)
        )

    def flush_window(self, state: State, window: "_Window", lr: float) -> None:
        loss_sum, images = dist.all_reduce_sum([float(window.loss_sum), window.images], self.ctx)
        elapsed = time.perf_counter() - window.t0
        values = {"loss": loss_sum / max(images, 1), "lr": lr, "images_per_s": images / max(elapsed, 1e-9)}
        self.last_metrics.update(train_loss=values["loss"], images_per_s=values["images_per_s"])
        self.log.train(state.step, state.epoch, values)
        window.reset()

    @torch.no_grad()
    def evaluate(self, state: State) -> float | None:
        """Validation loss and accuracy, logged; returns the loss (None without validation)."""
        if self.data.val is None or not self.cfg.val_every_epoch:
            return None
        model, dev = state.published(), self.ctx.device
        model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        correct = torch.zeros((), dtype=torch.int64, device=dev)
        count = 0
        for images, labels in self.data.val:
            if labels.numel() == 0:  # no readable image; no collective here, so just skip
                continue
            images = normalize_batch(images.to(dev, non_blocking=True), self.cfg.channels_last)
            labels = labels.to(dev, non_blocking=True)
            with self.precision.autocast(dev):
                logits = model(images)
            loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum")
            correct += (logits.argmax(1) == labels).sum()
            count += labels.shape[0]
        loss_total, correct_total, n = dist.all_reduce_sum([float(loss_sum), float(correct), count], self.ctx)
        values = {"loss": loss_total / max(n, 1), "accuracy": correct_total / max(n, 1), "images": n}
        self.last_metrics.update(val_loss=values["loss"], val_accuracy=values["accuracy"])
        self.log.eval(state.step, state.epoch, values)
        self.log.message(
            f"epoch {state.epoch}/{self.epochs}: train loss {self.last_metrics.get('train_loss', float('nan')):.4f}, "
            f"val loss {values['loss']:.4f}, val accuracy {values['accuracy']:.4f} ({int(n)} images)"
        )
        return values["loss"] if n else None

    def save(self, state: State, *, epoch_end: bool) -> Path:
        rngs = dist.gather_objects(ckpt.rng_state(), self.ctx)
        path = ckpt.checkpoint_dir(self.cfg.output_dir) / ckpt.LAST
        if self.ctx.is_main:
            payload = {
                "model": _cpu_weights(state.published()),
                "optimizer": state.optimizer.state_dict(),
                "scheduler": state.scheduler.state_dict(),
                "scaler": state.scaler.state_dict(),
                "epoch": state.epoch,
                "step": state.step,
                "step_in_epoch": state.step_in_epoch,
                "rng": rngs,
                "config": self.cfg.model_dump(mode="json"),
                "classes": self.data.classes,
                "negative_class": None if self.data.negative_index is None else self.data.classes[self.data.negative_index],
                "image_size": self.cfg.data.image_size,
                "image_width": self.cfg.data.image_width,  # None: a square
                "mean": list(MEAN),
                "std": list(STD),
                "world_size": self.ctx.world_size,
                "run": self.facts,
                "best_val_loss": state.best_val_loss,
                # For a resumed run under a time budget: the plan and the time already spent.
                "epochs_planned": self.epochs,
                "train_seconds": self.train_seconds(),
            }
            if state.ema is not None:
                payload.update(live_model=_cpu_weights(state.raw), ema_updates=state.ema.updates)
            if state.head is not None:
                payload["mask_head"] = _cpu_weights(state.head)
            path = ckpt.save(payload, self.cfg.output_dir, epoch_end=epoch_end, keep=self.cfg.keep_checkpoints)
        return path


def _cpu_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu() if v.is_floating_point() else v.cpu() for k, v in model.state_dict().items()}


def loss_weights(rule: str, train_set, n_classes: int, device: torch.device) -> torch.Tensor | None:
    """Per-class cross-entropy weights from the training set's counts (TrainConfig.loss_class_weights)."""
    if rule == "none":
        return None
    counts = np.bincount(np.asarray(train_set.targets, dtype=np.int64), minlength=n_classes).astype(np.float64)
    # A class without training images gets weight 1: no image of it ever meets the weight.
    weights = np.where(counts > 0, np.sqrt(counts.max() / np.maximum(counts, 1)), 1.0)
    return torch.tensor(weights, dtype=torch.float32, device=device)


def _no_negative_class_note(configured: str | None, classes: list[str]) -> str:
    why = "data.negative_class is null" if configured is None else (
        f"no class name reads as defect-free: ok, good, normal, *_free, no_defect, ... (data.negative_class {configured!r})"
    )
    return (
        f"{why}: a classification task over {', '.join(classes)}; evaluation reports accuracy, per-class "
        "figures and the confusion matrix, no miss rates (set data.negative_class to the defect-free class if there is one)"
    )


class _Window:
    """Running sums between two log lines; summed as tensors to avoid a sync per step."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.loss_sum: torch.Tensor | float = 0.0
        self.images = 0
        self.steps = 0
        self.t0 = time.perf_counter()

    def add(self, loss: torch.Tensor, n: int) -> None:
        # loss is a batch mean; weight by batch size so the window mean is per image.
        self.loss_sum = self.loss_sum + loss.float() * n
        self.images += n
