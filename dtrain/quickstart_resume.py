"""What `dtrain quickstart` keeps in WORKDIR/quickstart.json, so that an interrupted run continues.

A quickstart on the user's images is a 30-minute job: a Ctrl-C, a closed laptop lid or a
crash at minute 25 used to cost the whole half hour, since each run wiped its training
folder. Now the run writes down, before training, what it was asked (the options), what
the recipe decided (so a continued run does not time the machine again and land on
another input side), which images it read (a fingerprint of their names, sizes and
modification times) and how far it got (the stage). Run the same command again and it
continues: finished fold runs are not repeated, an unfinished one resumes from its last
checkpoint (the trainer's exact resume: same data order, same learning-rate curve, the
time budget spanning both runs), and so does the final run. Other options, or images
that changed, are refused rather than mixed into the old run; `--fresh` starts over.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dtrain.errors import DtrainError

STATE_FILE = "quickstart.json"
VERSION = 1
# How far a run got; "done" once its report is written.
STAGES = ("recipe", "folds", "train", "eval", "done")
# The options that make a run what it is; a continued run must be asked for the same.
COMPARED = ("data", "images", "epochs", "image_size", "seed", "precision", "difficulty", "target_miss_rate",
            "calibration", "budget_minutes", "folds", "nproc")


@dataclass
class RunState:
    options: dict[str, Any]  # COMPARED of the QuickstartOptions, as JSON
    fingerprint: str  # of the images the run reads ("" for the synthetic set, which the options pin)
    stage: str = "recipe"
    recipe: dict[str, Any] | None = None  # with --data: what the recipe decided (quickstart.Recipe, as JSON)
    folds_done: list[int] = field(default_factory=list)
    # Wall seconds of the earlier, stopped invocations (not the pauses between), and how
    # many there were: the report's times then cover the whole run.
    spent_s: float = 0.0
    stops: int = 0
    version: int = VERSION


def options_of(opts: Any) -> dict[str, Any]:
    out = {}
    for name in COMPARED:
        value = getattr(opts, name)
        out[name] = str(Path(value).resolve()) if name == "data" and value is not None else value
    return out


def load(workdir: Path) -> RunState | None:
    """The state of the run in `workdir`; None when there is none (or one this version cannot read)."""
    path = Path(workdir) / STATE_FILE
    try:
        raw = json.loads(path.read_text())
        if raw.get("version") != VERSION:
            return None
        return RunState(**raw)
    except (OSError, ValueError, TypeError):  # absent, torn or foreign: nothing to continue
        return None


def unreadable(workdir: Path) -> bool:
    """A state file is there that `load` cannot use (another dtrain version's) and it does
    not say its run finished: it may stand for an unfinished run this version cannot continue."""
    path = Path(workdir) / STATE_FILE
    if not path.is_file() or load(workdir) is not None:
        return False
    try:
        return json.loads(path.read_text()).get("stage") != "done"
    except (OSError, ValueError, AttributeError):
        return True


def save(workdir: Path, state: RunState) -> None:
    """Written whole to a temporary file, then renamed: a kill mid-write leaves the old state."""
    path = Path(workdir) / STATE_FILE
    tmp = path.with_name(f".{STATE_FILE}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(asdict(state), indent=1, default=str))
    os.replace(tmp, path)


def fingerprint(data: Any) -> str:
    """sha256 over (path, size, mtime) of every image of the run's splits (`data`: a DataConfig):
    a stat per file, no reads."""
    from dtrain.data.layouts import SplitMissing, scan

    h = hashlib.sha256()
    for split in (data.train_split, data.val_split, data.test_split):
        if not split:
            continue
        try:
            listing = scan(data, split)
        # A split the data does not have: nothing to compare. Any other error (a label table
        # broken since the run stopped) is the user's to see, not "the images have changed".
        except SplitMissing:
            h.update(f"{split}: absent\n".encode())
            continue
        for path, target in zip(listing.paths, listing.targets):
            # os.fsencode: the name's own bytes, also for one that is not UTF-8 (a Windows zip's),
            # which Python keeps as surrogates and str.encode() refuses.
            try:
                st = os.stat(path)
                h.update(f"{split}\0".encode() + os.fsencode(path) + f"\0{target}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
            except OSError:
                h.update(f"{split}\0".encode() + os.fsencode(path) + b"\0gone\n")
    return h.hexdigest()


def continue_or_refuse(saved: RunState | None, options: dict[str, Any], fresh: bool, workdir: Path) -> RunState | None:
    """The state to continue from, or None for a fresh run. An unfinished run with other
    options is refused (DtrainError), never silently replaced: it may hold 25 minutes of training."""
    if fresh:
        return None
    if saved is None and unreadable(workdir):
        raise DtrainError(
            f"{workdir} holds a quickstart run this dtrain version cannot continue ({STATE_FILE} of another version)",
            "add --fresh to replace it, or choose another --workdir",
        )
    if saved is None or saved.stage == "done":
        return None
    changed = [f"{_flag(k)} {_shown(saved.options.get(k))} (now {_shown(v)})"
               for k, v in options.items() if saved.options.get(k) != v]
    if changed:
        raise DtrainError(
            f"{workdir} holds an unfinished quickstart run ({describe(saved)}) made with other options: {'; '.join(changed)}",
            "run the command with its options again to continue it, add --fresh to replace it, or choose another --workdir",
        )
    return saved


def discard(workdir: Path) -> None:
    """--fresh: the unfinished run's record goes at once, so a new run that fails before it
    saves its own is not reported as that old run kept (and a plain rerun would not
    continue the old one after a --fresh that failed)."""
    try:
        (Path(workdir) / STATE_FILE).unlink()
    except FileNotFoundError:
        pass


def record_stop(workdir: Path, seconds: float) -> RunState | None:
    """Add a stopped invocation's wall time to the saved state; None if there is none to add to."""
    state = load(workdir)
    if state is None or state.stage in ("recipe", "done"):
        return None
    state.spent_s += seconds
    state.stops += 1
    save(workdir, state)
    return state


def check_images(saved: RunState, now: str, workdir: Path) -> None:
    if saved.fingerprint != now:
        raise DtrainError(
            f"the images have changed since the unfinished run in {workdir} started (files added, removed or rewritten)",
            "add --fresh to train again on the images as they are now, or choose another --workdir",
        )


def describe(state: RunState) -> str:
    where = {"recipe": "before training", "folds": "in the fold runs", "train": "in training",
             "eval": "in evaluation"}.get(state.stage, state.stage)
    done = f", {len(state.folds_done)} fold run(s) finished" if state.folds_done else ""
    return f"stopped {where}{done}"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _shown(value: Any) -> str:
    return "(not given)" if value is None else str(value)
