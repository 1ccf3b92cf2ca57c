"""Which backend a model directory runs on, per machine kind.

The export measures every candidate on the validation split and records, under the
exporting machine's kind (machine.py), a table (agreement with the checkpoint, miss
rate, images/s) and the chosen backend: the fastest whose verdicts agree with the
checkpoint's on >= 99.5 % of the validation images and whose miss rate is no worse (a
quantised one must also show that on enough images: export._unfaithful).

The fastest backend on one machine is not the fastest on another (int8 wants VNNI,
bf16 wants AVX512-BF16/AMX or a GPU), and int8 arithmetic itself differs between
instruction sets. So a directory loaded on a machine kind it has no record for checks
again, once: each backend that qualified at export and can run here is run on a small
stored sample of validation inputs (`recheck_sample.npz`: uint8 images and the
checkpoint's logits, so no torch and no data set are needed), and qualifies here if it
agrees with the checkpoint on that sample at least as well as it did at export; the
fastest of those is chosen and recorded in model.json (atomically; a read-only
directory keeps working with the choice unrecorded).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from dtrain.configio import StrictModel

if TYPE_CHECKING:
    from dtrain.serve.model_dir import ModelCard

PREFER_MIN_AGREEMENT = 0.995
SAMPLE = "recheck_sample.npz"
SAMPLE_IMAGES = 64
RECHECK_SECONDS = 0.3  # timing per backend on first load: ranks them, no more


class BackendRow(StrictModel):
    """One candidate backend as measured on one machine."""

    backend: str
    verdict_agreement: float | None = None  # with the checkpoint: validation split at export, sample on re-check
    sample_agreement: float | None = None  # on the stored sample (the re-check compares with it)
    miss_rate: float | None = None  # validation split (export only)
    threshold: float | None = None  # the P(defect) it decides at (model.json threshold_for)
    images_per_s: float | None = None
    eligible: bool = False  # may be chosen: agrees with the checkpoint, misses no more
    note: str = ""  # why it was not measured or not shipped


class MachineChoice(StrictModel):
    backend: str
    source: Literal["export", "first load"]
    batch: int
    rows: list[BackendRow]


def pick(rows: list[BackendRow]) -> str:
    """The fastest eligible backend; without one, the most faithful of those measured."""
    timed = [r for r in rows if r.images_per_s is not None]
    eligible = [r for r in timed if r.eligible]
    if eligible:
        return max(eligible, key=lambda r: r.images_per_s).backend
    return max(timed, key=lambda r: (r.verdict_agreement or 0.0, r.images_per_s)).backend


def verdict_keys(logits: np.ndarray, classes: list[str], negative_index: int | None, threshold: float) -> np.ndarray:
    """What must agree between two backends: the ok/defect verdict, or for a classifier
    (no negative class, every verdict "defect") the class."""
    from dtrain.serve.predictor import judge

    verdicts = judge(logits, classes, negative_index, threshold)
    return np.array([v.cls if negative_index is None else v.verdict for v in verdicts])


def agreement(logits: np.ndarray, ref_logits: np.ndarray, classes: list[str], negative_index: int | None, threshold: float,
              own_threshold: float | None = None) -> float:
    """Share of verdicts the backend (deciding at `own_threshold`, default the same) shares
    with the checkpoint (deciding at `threshold`)."""
    own = threshold if own_threshold is None else own_threshold
    return float(np.mean(verdict_keys(logits, classes, negative_index, own) == verdict_keys(ref_logits, classes, negative_index, threshold)))


def sample_indices(n: int, k: int = SAMPLE_IMAGES) -> np.ndarray:
    """k indices spread evenly over n (the validation split is ordered by class, so
    every class is in the sample)."""
    return np.unique(np.linspace(0, n - 1, num=min(n, k)).round().astype(int))


def write_sample(folder: Path, images: np.ndarray, logits: np.ndarray) -> None:
    np.savez(folder / SAMPLE, images=images, logits=logits.astype(np.float32))


def read_sample(folder: Path) -> tuple[np.ndarray, np.ndarray] | None:
    path = folder / SAMPLE
    if not path.is_file():
        return None  # exported before re-checks existed
    with np.load(path, allow_pickle=False) as data:
        return data["images"], data["logits"]


def batch_of(images: np.ndarray, n: int) -> np.ndarray:
    """Exactly n images, repeating `images` when there are fewer."""
    reps = -(-n // max(len(images), 1))
    return np.ascontiguousarray(np.concatenate([images] * reps)[:n])


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def backend_for(folder: Path, card: ModelCard, kind: str | None = None, *, say: Callable[[str], None] = _stderr) -> str:
    """The backend to run `folder` on, on a machine of `kind` (default: this one),
    re-checking and recording the choice the first time this kind loads it."""
    from dtrain.serve.machine import machine_kind

    kind = kind or machine_kind()
    if kind in card.machine_choices:
        return card.machine_choices[kind].backend
    sample = read_sample(folder)
    if sample is None:
        return card.preferred_backend
    say(f"first load of {folder} on this machine kind ({kind}): re-checking its backends")
    choice = recheck(folder, card, *sample)
    try:
        record(folder, kind, choice)
    except OSError as exc:
        say(f"{folder} is not writable ({exc.strerror or exc}): using {choice.backend} without recording the choice")
    return choice.backend


def recheck(folder: Path, card: ModelCard, images: np.ndarray, ref_logits: np.ndarray) -> MachineChoice:
    from dtrain.serve import backends as B

    exported = next((c for c in card.machine_choices.values() if c.source == "export"), None)
    at_export = {r.backend: r for r in exported.rows} if exported else {}
    rows = []
    for name, network in card.backends.items():
        before = at_export.get(name)
        if before is not None and not before.eligible:
            continue  # disqualified on the validation split: no sample overturns that
        backend = B.get_backend(name)
        reason = backend.unavailable_reason()
        if reason:
            rows.append(BackendRow(backend=name, note=f"cannot run here: {reason}"))
            continue
        run = backend.runner(folder / network, card.views)
        own = card.threshold_for(name)
        agree = agreement(run(images), ref_logits, card.classes, card.negative_index, card.threshold, own)
        needed = before.sample_agreement if before is not None and before.sample_agreement is not None else PREFER_MIN_AGREEMENT
        ips = round(B.measure(run, batch_of(images, card.throughput_batch), min_seconds=RECHECK_SECONDS), 1)
        rows.append(BackendRow(backend=name, verdict_agreement=agree, sample_agreement=agree, images_per_s=ips, threshold=own,
                               eligible=agree >= needed,
                               note="" if agree >= needed else f"agrees on {agree:.1%} of the sample here, {needed:.1%} at export"))
    if not any(r.images_per_s is not None for r in rows):
        return MachineChoice(backend=card.preferred_backend, source="first load", batch=card.throughput_batch, rows=rows)
    return MachineChoice(backend=pick(rows), source="first load", batch=card.throughput_batch, rows=rows)


def record(folder: Path, kind: str, choice: MachineChoice) -> None:
    """Add `choice` for `kind` to folder/model.json, replacing the file atomically (a
    loader reading it meanwhile sees the old card or the new, never half of one)."""
    from dtrain.serve.model_dir import CARD, load_card

    card = load_card(folder, verify=False)  # re-read: another process may have recorded its kind meanwhile
    card = card.model_copy(update={"machine_choices": {**card.machine_choices, kind: choice}})
    fd, tmp = tempfile.mkstemp(prefix=f".{CARD}.", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(card.model_dump_json(indent=2) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, folder / CARD)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
