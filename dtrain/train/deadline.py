"""A time budget for the training loop (TrainConfig.time_budget_s): how many epochs fit.

A plan made before the run (recipe/budget.py) times the network alone for a few steps; the
run also pays its data pipeline, the ranks' all-reduce, validation passes and checkpoints,
and a shared machine's speed moves by 15-30 % between minutes: a plant run on a slow CPU
ran 40 % over its plan (BENCHMARKS.md, session 14). So the run checks itself: at every epoch
end it takes the pace of the epochs it has run and keeps as many more as fit in the time
left, never more than configured (TrainConfig.max_epochs, else epochs): a probe that
over-costed is made up for as one that under-costed is. The learning-rate schedule is
refit to end on the last of them (train/schedule.py): a cut run still anneals rather than
stopping mid-decay.
"""

from __future__ import annotations


# A plan is raised only if the extra epochs fit with this share of an epoch to spare: at the
# budget's edge every epoch's noise (+-5 % on a shared VM) would otherwise flip it up and
# down, and each flip moves the learning-rate decay.
RAISE_SPARE = 0.5
# A changed plan is logged when it stops the run or has moved by this share (or 2 epochs, the
# larger) since the plan last logged: the plan is refit at every epoch end, and on short
# epochs the noise moved it by one or two each time, a line per epoch saying little.
SAY_SHARE = 0.1
# The pace: the mean of the last few epochs, leaving out the first once others exist (it
# pays kernel selection and first-touch page faults).
PACE_EPOCHS = 3


def pace(epoch_seconds: list[float]) -> float:
    """Seconds per epoch to plan with, from this process's epochs so far (oldest first)."""
    later = epoch_seconds[1:] or epoch_seconds
    recent = later[-PACE_EPOCHS:]
    return sum(recent) / len(recent)


def epochs_within(budget_s: float, elapsed_s: float, epoch_s: float, done: int, most: int,
                  planned: int | None = None) -> int:
    """Epochs in all for a run that has trained `done` epochs in `elapsed_s` seconds at `epoch_s`
    seconds per epoch (training, validation, checkpoint): as many more as fit in what is left of
    `budget_s`, at most `most` in all, never fewer than `done` (0 more: stop now). Above the
    current plan (`planned`) only with RAISE_SPARE of an epoch to spare."""
    if epoch_s <= 0:
        return most
    left = budget_s - elapsed_s
    fit = done + max(int(left // epoch_s), 0)
    if planned is not None and fit > planned:
        fit = max(planned, done + max(int((left - RAISE_SPARE * epoch_s) // epoch_s), 0))
    return max(done, min(most, fit))


def worth_saying(said: int, new: int, done: int) -> bool:
    """Whether a plan of `new` epochs in all is logged, `said` being the plan last logged (or the
    one the run started with) and `done` the epochs trained: always when it stops the run."""
    return new == done or abs(new - said) >= max(2, SAY_SHARE * said)


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def refit_message(old: int, new: int, done: int, epoch_s: float, elapsed_s: float, budget_s: float) -> str:
    """The log line for a changed plan (old -> new epochs in all, `done` trained so far)."""
    per = f"{epoch_s:.0f}" if epoch_s >= 10 else f"{epoch_s:.2g}"  # never "0 s" for a short epoch
    pace = f"{per} s per epoch (training, validation, checkpoint; the last few epochs' mean)"
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
