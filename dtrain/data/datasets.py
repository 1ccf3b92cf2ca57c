"""Map-style datasets of inspection images: `open_split` and `collate_skip_bad`.

`ds[i]` is `(uint8 [3, S, S], label)` ([4, S, S] with the photo's defect mask as channel 3
when the split is opened with masks: dtrain/data/mask_targets.py), or `None` when the file
cannot be read or decoded: one bad file among millions must not end a week-long run. Bad files are
collected in `ds.bad_files` from every DataLoader worker process (workers append to a
small log file named at construction, since a worker's own copy of the dataset dies
with it), and `collate_skip_bad` drops the Nones from the batch.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import uuid
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.utils.data import Dataset, default_collate

from dtrain.data import mask_targets
from dtrain.data.config import DataConfig, Size, as_hw
from dtrain.data.decode import FULL_BITS
from dtrain.data.layouts import scan
from dtrain.data.transforms import read_image, read_image_oriented, resize_uint8, train_augmentation
from dtrain.data.transplant import Transplants
from dtrain.errors import ConfigError
from dtrain.printable import printable

log = logging.getLogger("dtrain.data")

# What a damaged, truncated, missing or unsupported file raises while being decoded
# (Pillow raises SyntaxError for some broken headers).
_READ_ERRORS = (RuntimeError, OSError, ValueError, SyntaxError)

Sample = tuple[torch.Tensor, int]


class InspectionDataset(Dataset):
    def __init__(
        self,
        paths: Sequence[str],
        targets: Sequence[int],
        classes: Sequence[str],
        negative_index: int | None,  # None: no defect-free class (a classification task)
        image_size: Size,  # a square's side or (rows, columns): DataConfig.input_hw
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        cache_decoded: bool = False,
        sample_bits: int = FULL_BITS,  # DataConfig.sample_bits
        masks: Sequence[str | None] | None = None,  # per photo its mask file (mask_targets.mask_files)
        transplant: float = 0.0,  # DataConfig.transplant: needs masks
        transplant_min_strength: float = 1.0,  # DataConfig.transplant_min_strength
    ) -> None:
        self.paths = list(paths)
        self.targets = list(targets)
        self.classes = list(classes)
        self.negative_index = negative_index
        self.negative_class = None if negative_index is None else self.classes[negative_index]
        self.image_size = image_size
        self.sample_bits = sample_bits
        self.transform = transform
        self.masks = None if masks is None else list(masks)
        self._bad_masks: set[str] = set()  # warned once per process
        self._bad_local: dict[str, str] = {}
        # Named now, created by the first worker that finds a bad file.
        self._bad_log = os.path.join(tempfile.gettempdir(), f"dtrain-bad-{os.getpid()}-{uuid.uuid4().hex}.log")
        weakref.finalize(self, _remove_quietly, self._bad_log, os.getpid())
        self._cache: torch.Tensor | None = None
        self._cache_ok: torch.Tensor | None = None
        if cache_decoded:
            self._fill_cache()
        self.transplants: Transplants | None = None
        if transplant:
            if self.masks is None:
                raise ConfigError("data.transplant lays defects lifted off masked photos onto other parts",
                                  "it needs the photos' masks (mask_loss); set data.transplant: 0")
            donors = [j for j, (t, m) in enumerate(zip(self.targets, self.masks)) if t != negative_index and m is not None]
            self.transplants = Transplants(transplant, donors, self.targets, self._load, negative_index,
                                           transplant_min_strength)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Sample | None:
        img = self._load(index)
        if img is None:
            return None
        target = self.targets[index]
        if self.transplants is not None:
            img, target = self.transplants(img, index)
        if self.transform is not None:
            img = self.transform(img)
        return img, target

    def _load(self, index: int) -> torch.Tensor | None:
        if self._cache is not None:
            return self._cache[index] if self._cache_ok[index] else None
        path = self.paths[index]
        try:
            return self._pixels(index)
        except _READ_ERRORS as exc:
            self._record_bad(path, exc)
            return None

    def _pixels(self, index: int) -> torch.Tensor:
        if self.masks is None:
            return resize_uint8(read_image(self.paths[index], self.sample_bits), self.image_size)
        native, orientation = read_image_oriented(self.paths[index], self.sample_bits)
        image = resize_uint8(native, self.image_size)
        return mask_targets.with_mask(image, self._mask(index, tuple(native.shape[-2:]), orientation))

    def _mask(self, index: int, native: tuple[int, int], orientation: int = 1) -> torch.Tensor:
        """`native`: the photo's own (height, width) as decoded (upright), which a box file's
        boxes are shares of; `orientation`: the EXIF orientation the decode applied."""
        path = self.masks[index]
        if path is None:
            clear = self.targets[index] == self.negative_index
            return mask_targets.constant_mask(self.image_size, 0 if clear else mask_targets.UNKNOWN)
        try:
            mask = mask_targets.read_mask(path, self.image_size, native, orientation)
        except _READ_ERRORS as exc:  # the photo still trains on its label; its mask is left out
            if path not in self._bad_masks:
                self._bad_masks.add(path)
                log.warning("mask %s cannot be read (%s): its photo trains without it", path, exc)
            return mask_targets.constant_mask(self.image_size, mask_targets.UNKNOWN)
        if not mask.any() and self.targets[index] != self.negative_index:
            # A defective photo's empty mask says nothing of where its defect is (a set may ship
            # blank masks for the photos nobody annotated): not "nothing here".
            return mask_targets.constant_mask(self.image_size, mask_targets.UNKNOWN)
        return mask

    def _record_bad(self, path: str, exc: BaseException) -> None:
        reason = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]
        if path in self._bad_local:
            return
        self._bad_local[path] = reason
        log.warning("skipping unreadable image %s (%s)", printable(path), reason)
        # One short O_APPEND write: a JSON line, since a file name may hold a tab, a newline or
        # (unpacked from a Windows zip) bytes that are not UTF-8, which Python keeps as surrogates
        # and a UTF-8 text write refuses; json escapes all three.
        with open(self._bad_log, "a", encoding="ascii") as fh:
            fh.write(json.dumps([path, reason]) + "\n")

    @property
    def bad_reasons(self) -> dict[str, str]:
        """Every unreadable file seen so far, by any process, with why it failed."""
        found: dict[str, str] = {}
        try:
            with open(self._bad_log, encoding="utf-8") as fh:
                for line in fh:
                    try:
                        path, reason = json.loads(line)
                    except ValueError:  # a line torn by a killed worker
                        continue
                    found.setdefault(path, reason)
        except FileNotFoundError:
            pass
        for path, reason in self._bad_local.items():
            found.setdefault(path, reason)
        return found

    @property
    def bad_files(self) -> list[str]:
        return list(self.bad_reasons)

    def _fill_cache(self) -> None:
        n, s = len(self.paths), self.image_size
        cache = torch.empty((n, 3 if self.masks is None else 4, *as_hw(s)), dtype=torch.uint8)
        ok = torch.zeros(n, dtype=torch.bool)

        def one(i: int) -> None:
            try:
                cache[i] = self._pixels(i)
                ok[i] = True
            except _READ_ERRORS as exc:
                self._record_bad(self.paths[i], exc)

        # The decoders release the GIL, so threads use every core without pickling.
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            list(pool.map(one, range(n)))
        self._cache, self._cache_ok = cache, ok


def _remove_quietly(path: str, owner_pid: int) -> None:
    if os.getpid() != owner_pid:  # a forked worker's copy must not delete the shared log
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def open_split(cfg: DataConfig, split: str, *, train: bool, masks: bool = False) -> Dataset:
    """The dataset of one split; `train=True` adds augmentation (if `cfg.augment`);
    `masks=True` adds each photo's defect mask as channel 3 (TrainConfig.mask_loss)."""
    if cfg.layout == "shards" or "://" in cfg.root:
        if masks:
            raise ConfigError("mask_loss reads masks beside the photos; shards carry the photos only",
                              "train from the image folders, or set mask_loss: null")
        from dtrain.data.shards import open_shard_split

        return open_shard_split(cfg, split, train=train)
    listing = scan(cfg, split)
    return InspectionDataset(
        listing.paths,
        listing.targets,
        listing.classes,
        listing.negative_index,
        cfg.input_hw,
        transform=train_augmentation(cfg.shift) if (train and cfg.augment) else None,
        cache_decoded=cfg.cache_decoded,
        sample_bits=cfg.sample_bits,
        masks=mask_targets.mask_files(listing.paths) if masks else None,
        transplant=cfg.transplant if train and masks else 0.0,
        transplant_min_strength=cfg.transplant_min_strength,
    )


def collate_skip_bad(batch: Sequence[Sample | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack the readable samples -> (uint8 [B, 3, S, S], int64 [B]); B may be smaller
    than the batch asked for, and 0 (shape [0, 3, 0, 0]) when every sample was bad."""
    good = [item for item in batch if item is not None]
    if not good:
        return torch.empty((0, 3, 0, 0), dtype=torch.uint8), torch.empty(0, dtype=torch.int64)
    # default_collate stacks into shared memory inside a worker (no extra copy).
    images, labels = default_collate(good)
    return images, labels
