"""The model directory: network files plus `model.json`, everything a plant needs to run
the inspection model, and nothing it has to guess.

`model.json` holds the preprocessing (size, colour order, normalisation, which the
networks already apply), the classes and the negative class, the decision threshold
with the target miss rate it was chosen for and how the export verified it, the
measured throughput of each backend and the preferred one, and the sha256 of every
other file (a card that leaves a network file out is refused: nothing runs unchecked).
A directory is published by renaming a complete temporary sibling, so a reader sees
either the whole model or none; it is published readable by all (0755 / 0644), as a
model directory is copied to and served from other accounts and machines.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from pydantic import Field, ValidationError, ValidationInfo, field_validator

from dtrain.configio import StrictModel
from dtrain.data.config import input_hw
from dtrain.errors import DtrainError
from dtrain.models.config import SCORE_CLASSIFIER
from dtrain.serve.choice import MachineChoice

CARD = "model.json"
FORMAT_VERSION = 1


class Preprocessing(StrictModel):
    image_size: int
    # Columns, where the input is a rectangle (DataConfig.image_width); null (and cards
    # from before it): a square of image_size.
    image_width: int | None = Field(None, ge=1)
    colour: str = "RGB"
    # The networks take uint8 [B, 3, H, W] and normalise inside; mean/std (0..1 units)
    # are recorded for anyone who feeds the weights some other way.
    input: str = ("uint8 [B, 3, H, W] (H = image_size, W = image_width or H), RGB, 0..255, squashed (not cropped) to "
                  "H x W, antialiased; into a wide input (W > H) an upright picture is first turned a quarter counter-clockwise")
    mean: list[float]
    std: list[float]
    # DataConfig.sample_bits of the training data: 16-bit samples are shifted down by
    # sample_bits - 8 before anything else, as in training (cards without it: 16, the high byte).
    sample_bits: int = Field(16, ge=8, le=16)

    @property
    def input_hw(self) -> tuple[int, int]:
        return input_hw(self.image_size, self.image_width)


class Verification(StrictModel):
    """How one exported network compares with the checkpoint on the validation split."""

    split: str
    n_images: int
    n_defective: int
    verdict_agreement: float
    max_abs_p_defect_diff: float
    miss_rate: float
    false_alarm_rate: float
    threshold: float | None = None  # the one the backend decided at (None: written before backends had their own)


class ModelCard(StrictModel):
    format_version: int = FORMAT_VERSION
    dtrain_version: str
    arch: str
    checkpoint: str
    preprocessing: Preprocessing
    # Each part is scored on this many of its symmetries inside the network (model.views,
    # dtrain/models/views.py): the throughput figures are parts per second, views included.
    views: int = Field(1, ge=1)
    classes: list[str]
    negative_class: str | None  # None: a classifier (no defect-free class); verdicts are "defect" + class
    # What P(defect) is (dtrain.models.config.SCORE_*): the classifier's, or pooled with its mask head.
    score: str = SCORE_CLASSIFIER
    threshold: float = Field(ge=0.0, le=1.0)
    target_miss_rate: float
    threshold_rule: str = "rate"  # model directories written before the field existed used "rate"; "given": --threshold
    # Where the threshold came from, in words: chosen by the export on a split, or taken
    # from a report (a k-fold quickstart's out-of-fold scores) or from --threshold.
    threshold_source: str = "chosen by the export on the validation split"
    reference_val_miss_rate: float
    # backend name -> network file it runs; only backends whose file is here.
    backends: dict[str, str]
    preferred_backend: str
    throughput_images_per_s: dict[str, float]
    throughput_batch: int
    verification: dict[str, Verification]  # keyed by backend name
    notes: list[str] = []  # what a reader must know about the verification (e.g. it ran on training images)
    files: dict[str, str] = {}  # file name -> sha256, every file except model.json
    # machine kind (serve/machine.py) -> the backend chosen there and the table it was chosen by (serve/choice.py)
    machine_choices: dict[str, MachineChoice] = {}

    @field_validator("backends", "files")
    @classmethod
    def _names_inside(cls, names: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        # The files are the directory's own: a path ("../x.onnx", "/opt/x.pt2") would have the
        # service verify and load a network from wherever the card points.
        for name in (names.values() if info.field_name == "backends" else names):
            if name in ("", ".", "..") or "/" in name or "\\" in name:
                raise ValueError(f"a model directory names its files by name alone, not {name!r}")
        return names

    def threshold_for(self, backend: str) -> float:
        """The P(defect) threshold `backend` decides at: its verification's (a quantised
        backend's own, export.py OWN_THRESHOLD), else the checkpoint's (older directories)."""
        check = self.verification.get(backend)
        return self.threshold if check is None or check.threshold is None else check.threshold

    @property
    def negative_index(self) -> int | None:
        return None if self.negative_class is None else self.classes.index(self.negative_class)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_card(folder: Path, card: ModelCard) -> None:
    """Fill in the checksums of the files in `folder` and write model.json."""
    files = {p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != CARD}
    card = card.model_copy(update={"files": files})
    (folder / CARD).write_text(card.model_dump_json(indent=2) + "\n", encoding="utf-8")  # JSON is UTF-8, not the locale's


def staging_dir(out: Path) -> Path:
    """A fresh temporary directory next to `out` (same filesystem, so the rename is atomic)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))


def check_replaceable(out: Path) -> None:
    """`out` is free, an empty directory or a model directory (which publish replaces)."""
    if out.exists() and not (out / CARD).is_file() and not (out.is_dir() and not any(out.iterdir())):
        raise DtrainError(f"{out} exists and is not a model directory", "choose another --out, or remove it")


def publish(staged: Path, out: Path) -> None:
    """Move a complete `staged` directory to `out`, replacing an older model there."""
    staged.chmod(0o755)  # mkdtemp made it 0700
    for path in staged.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    check_replaceable(out)
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / "model")
        os.replace(staged, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staged, out)


def load_card(folder: str | Path, *, verify: bool = True) -> ModelCard:
    """Read model.json; with `verify`, refuse a directory whose files do not match it."""
    folder = Path(folder)
    path = folder / CARD
    if not path.is_file():
        raise DtrainError(f"{folder} is not a model directory (no {CARD})", "create one with `dtrain export CHECKPOINT --out DIR`")
    try:
        card = ModelCard.model_validate_json(path.read_bytes())  # as UTF-8 JSON; bytes that are not: a ValidationError
    except ValidationError as exc:
        raise DtrainError(f"{path} is damaged or from another version: {exc.errors()[0]['msg']}", "export the model again") from None
    if verify:
        unlisted = sorted(set(card.backends.values()) - set(card.files))
        if unlisted:
            raise DtrainError(f"{path} lists no checksum for {', '.join(unlisted)}, so the network cannot be verified",
                              "export the model again (dtrain export writes the checksum of every file)")
        for name, want in card.files.items():
            file = folder / name
            if not file.is_file():
                raise DtrainError(f"{file} is missing", "copy the whole model directory, or export again")
            if sha256_file(file) != want:
                raise DtrainError(f"{file} does not match its checksum in {CARD}: the file was changed or damaged",
                                  "copy the model directory again from the export, or export again")
    return card
