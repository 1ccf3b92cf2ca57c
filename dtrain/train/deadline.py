"""A time budget for the training loop (TrainConfig.time_budget_s): how many epochs fit.

A plan made before the run (recipe/budget.py) times the network alone; the run also pays
its data pipeline, the ranks' all-reduce, validation passes and checkpoints, which on a
slow CPU added 40 % (BENCHMARKS.md, session 14). So the run checks itself: at every epoch
end it takes the pace of the epochs it has run and keeps as many more as fit in the time
left, never more than configured. The learning-rate schedule is refit to end on the last
of them (train/schedule.py): a cut run still anneals rather than stopping mid-decay.
"""

from __future__ import annotations


def epochs_within(budget_s: float, elapsed_s: float, epoch_s: float, done: int, most: int) -> int:
    """Epochs in all for a run that has trained `done` epochs in `elapsed_s` seconds, the last
    one (training, validation, checkpoint) at `epoch_s` seconds: as many more as fit in what is
    left of `budget_s`, at most `most` in all, never fewer than `done` (0 more: stop now)."""
    left = budget_s - elapsed_s
    more = int(left // epoch_s) if epoch_s > 0 else most - done
    return max(done, min(most, done + max(more, 0)))


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def refit_message(old: int, new: int, done: int, epoch_s: float, elapsed_s: float, budget_s: float) -> str:
    """The log line for a changed plan (old -> new epochs in all, `done` trained so far)."""
    pace = f"{epoch_s:.0f} s per epoch (training, validation, checkpoint)"
    if new == done:
        return (f"time budget: stopping after epoch {done} of {old}: at {pace}, the next would end at "
                f"{minutes(elapsed_s + epoch_s)}, past the {minutes(budget_s)} training budget; the learning rate "
                "stops before the end of its decay")
    if new < old:
        end = elapsed_s + (old - done) * epoch_s
        return (f"time budget: {new} epochs instead of {old}: at {pace}, {old} would end at {minutes(end)} of the "
                f"{minutes(budget_s)} training budget; the learning-rate decay now ends at epoch {new}")
    return (f"time budget: {new} epochs (was {old}): at {pace} they fit in the {minutes(budget_s)} training budget "
            f"({minutes(elapsed_s)} spent); the learning-rate decay now ends at epoch {new}")
