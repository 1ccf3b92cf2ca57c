"""A time budget for the training loop (TrainConfig.time_budget_s, dtrain/train/deadline.py)."""

from __future__ import annotations

import io
import json

import pytest
import torch

from dtrain.train import checkpoint as ckpt
from dtrain.train.config import TrainConfig
from dtrain.train.deadline import epochs_within, pace, refit_message, worth_saying
from dtrain.train.schedule import build_optimizer, build_scheduler
from dtrain.train.trainer import run


def test_epochs_within_keeps_as_many_as_fit_never_more_than_configured():
    # 100 s spent over 2 epochs at 50 s each; 300 s budget: 4 more fit.
    assert epochs_within(300, elapsed_s=100, epoch_s=50, done=2, most=10) == 6
    assert epochs_within(300, elapsed_s=100, epoch_s=49, done=2, most=5) == 5  # configured is the cap
    assert epochs_within(300, elapsed_s=100, epoch_s=201, done=2, most=10) == 2  # not one more: stop
    assert epochs_within(300, elapsed_s=400, epoch_s=50, done=2, most=10) == 2  # overdrawn: stop
    assert epochs_within(300, elapsed_s=100, epoch_s=0.0, done=2, most=10) == 10


def test_a_plan_is_raised_only_with_half_an_epoch_to_spare():
    # 4 more epochs of 50 s fit in 210 s, but with 10 s to spare: a cut plan of 5 stays 5...
    assert epochs_within(310, elapsed_s=100, epoch_s=50, done=2, most=10, planned=5) == 5
    # ...and is raised once the fourth fits with 25 s (half an epoch) to spare.
    assert epochs_within(325, elapsed_s=100, epoch_s=50, done=2, most=10, planned=5) == 6
    # Lowering needs no spare: a plan that no longer fits is cut at once.
    assert epochs_within(290, elapsed_s=100, epoch_s=50, done=2, most=10, planned=6) == 5


def test_a_changed_plan_is_logged_when_it_stops_the_run_or_moved_by_a_tenth():
    assert worth_saying(said=100, new=45, done=1)  # the first big cut
    assert not worth_saying(said=74, new=79, done=3)  # an epoch's noise: 5 of 74
    assert worth_saying(said=74, new=82, done=9)  # 8 of 74 since the plan last logged
    assert not worth_saying(said=10, new=11, done=4) and worth_saying(said=10, new=12, done=4)  # at least 2
    assert worth_saying(said=50, new=7, done=7) and worth_saying(said=8, new=7, done=7)  # a stop, always
    # a short epoch's pace is not printed as "0 s"
    assert "at 0.41 s per epoch" in refit_message(old=40, new=60, done=3, epoch_s=0.41, elapsed_s=2, budget_s=30)


def test_the_pace_leaves_out_the_first_epoch_and_follows_the_last_few():
    assert pace([130.0]) == 130.0  # the first epoch alone is all there is
    assert pace([130.0, 100.0, 110.0]) == 105.0  # kernel selection and page faults left out
    assert pace([130.0, 90.0, 100.0, 110.0, 120.0]) == 110.0  # the last PACE_EPOCHS = 3


def test_a_lowered_total_ends_the_decay_on_the_new_last_step():
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model, "adamw", 1.0, 0.0, 0.9)
    sched = build_scheduler(opt, total_steps=100, warmup_steps=0, min_ratio=0.1)
    for _ in range(20):
        opt.step()
        sched.step()
    sched.lr_lambdas[0].total_steps = 40  # the budget now affords 40 steps, not 100
    lrs = []
    for _ in range(20):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == sorted(lrs, reverse=True)
    assert lrs[-1] == pytest.approx(0.1)  # step 40 of 40: the floor


@pytest.fixture
def keep_threads():
    # run() sets torch's intra-op threads for its process; this test process is shared.
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _cfg(synth_data, out, **kw) -> TrainConfig:
    return TrainConfig.model_validate({
        "data": {"root": str(synth_data), "image_size": 32, "num_workers": 0},
        "model": {"arch": "small_resnet"}, "epochs": 3, "batch_size": 16, "precision": "fp32",
        "optim": {"warmup_steps": 2}, "device": "cpu", "threads": 1, "deterministic": True, "log_every": 1,
        "output_dir": str(out), **kw,
    })


def test_a_spent_budget_stops_after_an_epoch_and_a_resume_keeps_to_it(synth_data, tmp_path, keep_threads):
    out, log = tmp_path / "run", io.StringIO()
    # No epoch runs in a millisecond: after the first, none more fits.
    result = run(_cfg(synth_data, out, time_budget_s=0.001), stream=log)
    assert result.epochs_done == 1
    assert "time budget: stopping after epoch 1 of 3" in log.getvalue()
    blob = ckpt.load(ckpt.find_resume(out))
    assert blob["epoch"] == 1 and blob["epochs_planned"] == 1 and blob["train_seconds"] > 0
    # Resumed under the same budget: it is spent, so nothing more trains.
    again = run(_cfg(synth_data, out, time_budget_s=0.001), resume=True, stream=io.StringIO())
    assert again.epochs_done == 1 and again.steps == result.steps
    # Without a budget the config's epochs hold again, and its schedule: all 3 epochs, decay to the floor.
    full = run(_cfg(synth_data, out), resume=True, stream=io.StringIO())
    assert full.epochs_done == 3 and full.steps == 3 * result.steps
    peak = TrainConfig().optim.lr
    lrs = [row["lr"] for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
           if row["kind"] == "train" and row["step"] > result.steps + 1]  # the first used the saved lr
    # The decay spans the 3 epochs (not the 1 the budgeted run had fit it to) and ends at the floor.
    assert max(lrs) > 0.5 * peak
    assert blob_lr(out) == pytest.approx(peak * TrainConfig().optim.min_lr_ratio)


def blob_lr(out) -> float:
    return ckpt.load(ckpt.find_resume(out))["scheduler"]["_last_lr"][0]


def test_an_ample_budget_changes_nothing(synth_data, tmp_path, keep_threads):
    plain = run(_cfg(synth_data, tmp_path / "plain", epochs=2), stream=io.StringIO())
    log = io.StringIO()
    budgeted = run(_cfg(synth_data, tmp_path / "budget", epochs=2, time_budget_s=1e6), stream=log)
    assert "time budget:" not in log.getvalue().replace("a time budget of", "")
    assert budgeted.epochs_done == plain.epochs_done == 2
    a, b = (ckpt.load(ckpt.find_resume(tmp_path / d))["model"] for d in ("plain", "budget"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_faster_than_planned_raises_its_epochs_up_to_max_epochs(synth_data, tmp_path, keep_threads):
    """TrainConfig.max_epochs: a plan cut by an over-costing probe is raised at the epoch ends
    when the run proves faster, up to max_epochs and no further, the decay refit to end there."""
    log = io.StringIO()
    result = run(_cfg(synth_data, tmp_path / "run", epochs=1, max_epochs=3, time_budget_s=1e6), stream=log)
    assert result.epochs_done == 3
    assert "time budget: 3 epochs (was 1)" in log.getvalue()
    assert blob_lr(tmp_path / "run") == pytest.approx(TrainConfig().optim.lr * TrainConfig().optim.min_lr_ratio)
    with pytest.raises(ValueError, match="max_epochs 2 is under epochs 3"):
        _cfg(synth_data, tmp_path / "x", epochs=3, max_epochs=2)
