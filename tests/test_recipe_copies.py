"""Byte-identical images across splits or classes (owner: recipe): found by content, told
apart from files that only share a size or their first bytes, and said in the recipe's notes."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from dtrain.data.config import DataConfig
from dtrain.recipe.copies import HEAD_BYTES, File, identical
from dtrain.recipe.decide import notes
from dtrain.recipe.stats import gather


def test_only_files_equal_to_the_last_byte_are_copies(tmp_path):
    head = bytes(range(256)) * (HEAD_BYTES // 256)
    blobs = {
        "a": head + b"tail-1", "a_copy": head + b"tail-1",
        "same_head_other_tail": head + b"tail-2",  # equal size and first HEAD_BYTES: read in full
        "same_size": bytes(reversed(head)) + b"tail-1",
        "alone": b"x",
    }
    for name, data in blobs.items():
        (tmp_path / name).write_bytes(data)
    files = [File(str(tmp_path / name), "train", "ok") for name in blobs]

    groups = identical(files)

    assert [[Path(f.path).name for f in g] for g in groups] == [["a", "a_copy"]]


def _photo(path: Path, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (40, 40), dtype=np.uint8)).save(path)


def test_a_test_image_copied_from_train_and_a_file_under_two_classes_are_named(tmp_path):
    root = tmp_path / "data"
    for s, split in enumerate(("train", "val", "test")):
        for c, name in enumerate(("ok", "scratch")):
            for i in range(4):
                _photo(root / split / name / f"{i}.png", seed=100 * s + 10 * c + i)
    shutil.copy(root / "train" / "scratch" / "2.png", root / "test" / "scratch" / "leaked.png")
    shutil.copy(root / "train" / "ok" / "1.png", root / "train" / "scratch" / "which.png")
    shutil.copy(root / "val" / "ok" / "0.png", root / "val" / "ok" / "twice.png")  # same split and class: only weight

    said = notes(gather(DataConfig(root=str(root), image_size=32)))

    across = [n for n in said if "in two splits" in n]
    conflict = [n for n in said if "under two classes" in n]
    assert len(across) == 1 and across[0].startswith("1 image is in two splits byte for byte")
    assert "leaked.png" in across[0] and "train/scratch/2.png" in across[0]
    assert len(conflict) == 1 and "ok: " in conflict[0] and "scratch: " in conflict[0] and "which.png" in conflict[0]
    assert not any("twice.png" in n for n in said)


def test_distinct_photos_give_no_note(tmp_path):
    root = tmp_path / "data"
    for s, split in enumerate(("train", "val", "test")):
        for i in range(3):
            _photo(root / split / "ok" / f"{i}.png", seed=10 * s + i)
            _photo(root / split / "dent" / f"{i}.png", seed=1000 + 10 * s + i)

    said = notes(gather(DataConfig(root=str(root), image_size=32)))

    assert not [n for n in said if "byte for byte" in n]
