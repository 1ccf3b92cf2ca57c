"""Training from pushed shards: a map-style dataset with a global sample index.

`open_shard_split(cfg, split, train=...)` returns a dataset that behaves exactly like the
local-folder one (`dtrain.data.datasets.open_split`): same length, same sample ids in the
same order, same decode / resize / augmentation, `None` for unreadable images. So the
trainer's sampler (DistributedSampler over the global ids: every sample once per epoch
across nodes x ranks, shuffled by seed and epoch, padded by repeating the first ids of
the permutation to a multiple of the world size; loader workers take whole batches) and
its mid-epoch skip apply unchanged, and a run from `s3://...` reproduces a run from the
local folder.

Fetching is shard-aware: the DataLoader hands a worker a whole batch (`__getitems__`),
the worker groups the batch by shard and reads cached or local shards with pread. For
the rest it merges each shard's byte ranges that lie within MERGE_GAP of each other into
one, and asks the store for all of them at once (concurrent range GETs on S3); when the
merged ranges would cover most of a shard it reads the whole shard in one GET and hands
it to the cache. Remote shards are also pulled whole into a bounded node-local cache in
the background, so later epochs and the node's other ranks read local disk.

Debugging aid: with DTRAIN_DATA_TRACE=DIR each batch fetched appends one line of sample
ids to DIR/<split>-rank<RANK>-worker<W>.txt (tests use it to prove exactly-once delivery).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.utils.data import Dataset

from dtrain.data.config import DataConfig, Size
from dtrain.data.decode import FULL_BITS
from dtrain.data.shard_cache import ShardCache
from dtrain.data.shard_format import Manifest, decode_index, sha256_hex
from dtrain.data.shard_verify import load_manifest, read_manifest_bytes
from dtrain.data.storage import DataStore, open_store
from dtrain.errors import DtrainError
from dtrain.printable import printable

log = logging.getLogger("dtrain.data")
TRACE_ENV = "DTRAIN_DATA_TRACE"
# What a damaged image raises while being decoded (as in dtrain.data.datasets).
_READ_ERRORS = (RuntimeError, OSError, ValueError, SyntaxError)

Sample = tuple[torch.Tensor, int]

# Ranges of one shard closer than this are read with one GET: on an object store a
# request costs about what transferring a megabyte or more does (latency, request
# signing, per-request CPU on both ends, and a price per request).
MERGE_GAP = 1 << 20
# A batch whose merged ranges would cover this share of a shard reads all of it: about
# the same bytes, one request, and the copy fills the node-local cache for free.
WHOLE_SHARD_SHARE = 0.5


def coalesce(ranges: Sequence[tuple[int, int, int]], gap: int) -> list[tuple[int, int, list[int]]]:
    """(start, end, tag) byte ranges -> spans (start, end, tags) covering them, merging
    ranges that overlap or lie less than `gap` bytes apart."""
    spans: list[tuple[int, int, list[int]]] = []
    for start, end, tag in sorted(ranges):
        if spans and start - spans[-1][1] <= gap:
            last = spans[-1]
            spans[-1] = (last[0], max(last[1], end), last[2] + [tag])
        else:
            spans.append((start, end, [tag]))
    return spans


class ShardDataset(Dataset):
    def __init__(
        self,
        store: DataStore,
        manifest: Manifest,
        split: str,
        rows,  # numpy int64 [N, 4]: shard, offset, size, label
        paths: list[str],
        image_size: Size,  # a square's side or (rows, columns): DataConfig.input_hw
        transform: Callable[[torch.Tensor], torch.Tensor] | None,
        cache: ShardCache | None,
        sample_bits: int = FULL_BITS,  # DataConfig.sample_bits
    ) -> None:
        info = manifest.splits[split]
        self.store = store
        self.split = split
        self.shards = [s.name for s in info.shards]
        self.shard_bytes = [s.bytes for s in info.shards]
        self.rows = rows
        self.paths = paths
        self.targets = [int(x) for x in rows[:, 3]]
        self.classes = list(manifest.classes)
        self.negative_index = manifest.negative_index
        self.negative_class = None if self.negative_index is None else self.classes[self.negative_index]
        self.image_size = image_size
        self.sample_bits = sample_bits
        self.transform = transform
        self.cache = cache
        self._bad: dict[str, str] = {}
        self._trace_dir = os.environ.get(TRACE_ENV) or None
        self._batch: dict[int, bytes | None] = {}

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Sample | None:
        blob = self._batch.get(index) if self._batch else None
        if blob is None:
            blob = self.fetch([index])[0]
        return self._prepare(index, blob)

    def __getitems__(self, indices: Sequence[int]) -> list[Sample | None]:
        with self.batch_io(indices):
            return [self[int(i)] for i in indices]

    @contextlib.contextmanager
    def batch_io(self, indices: Sequence[int]) -> Iterator[None]:
        """Fetch the bytes of a whole batch in one round; `ds[i]` inside uses them.

        A wrapping dataset (the trainer's per-sample seeding) calls this around its
        per-item loop, so I/O is batched while decode and augmentation stay per sample.
        """
        indices = [int(i) for i in indices]
        if self._trace_dir:
            self._trace(indices)
        self._batch = dict(zip(indices, self.fetch(indices)))
        try:
            yield
        finally:
            self._batch = {}

    # -- bytes ------------------------------------------------------------------------
    def fetch(self, indices: Sequence[int]) -> list[bytes | None]:
        """The encoded bytes of each sample, reading each shard as cheaply as it allows."""
        out: list[bytes | None] = [None] * len(indices)
        by_shard: dict[int, list[int]] = defaultdict(list)
        for pos, i in enumerate(indices):
            by_shard[int(self.rows[i, 0])].append(pos)
        spans: list[tuple[int, int, int, list[int]]] = []  # (shard, start, end, positions)
        whole: set[int] = set()  # shards read whole, for the cache
        for shard, positions in by_shard.items():
            name = self.shards[shard]
            local = (self.cache.get(name) if self.cache else None) or self.store.local_path(name)
            if local is None:
                merged, is_whole = self._remote_spans(shard, [(*self._extent(indices[p]), p) for p in positions])
                spans += [(shard, b, e, tags) for b, e, tags in merged]
                if is_whole:
                    whole.add(shard)
                continue
            try:
                with open(local, "rb") as fh:
                    for pos in positions:
                        offset, end = self._extent(indices[pos])
                        out[pos] = os.pread(fh.fileno(), end - offset, offset)
            except OSError as exc:
                for pos in positions:
                    self._record_bad(indices[pos], exc)
        if spans:
            blobs = self.store.read_ranges(
                [self.shards[shard] for shard, *_ in spans], [b for _, b, _, _ in spans], [e for _, _, e, _ in spans]
            )
            for (shard, start, _, positions), blob in zip(spans, blobs):
                if shard in whole:
                    self.cache.offer(self.shards[shard], blob)
                for pos in positions:
                    offset, end = self._extent(indices[pos])
                    out[pos] = blob[offset - start:end - start]
        return out

    def _remote_spans(self, shard: int, ranges: list[tuple[int, int, int]]) -> tuple[list[tuple[int, int, list[int]]], bool]:
        """The GETs for a batch's (start, end, position) ranges in one remote shard:
        merged ranges, or the whole shard (True) when they would cover most of it and
        the cache can keep it; otherwise the cache fetches the shard in the background."""
        merged = coalesce(ranges, MERGE_GAP)
        size = self.shard_bytes[shard]
        if self.cache is None:
            return merged, False
        if self.cache.fits(size) and sum(e - b for b, e, _ in merged) >= WHOLE_SHARD_SHARE * size:
            return [(0, size, [tag for _, _, tags in merged for tag in tags])], True
        self.cache.want(self.shards[shard], size)
        return merged, False

    def _extent(self, index: int) -> tuple[int, int]:
        """[start, end) of sample `index` in its shard."""
        _, offset, size, _ = self.rows[index]
        return int(offset), int(offset + size)

    # -- decode + augment -------------------------------------------------------------
    def _prepare(self, index: int, blob: bytes | None) -> Sample | None:
        from dtrain.data.transforms import decode_bytes, resize_uint8

        if blob is None:
            return None
        try:
            # the local-folder dataset's decoder, with its checks, for every format
            img = resize_uint8(decode_bytes(blob, self.sample_bits), self.image_size)
        except _READ_ERRORS as exc:
            self._record_bad(index, exc)
            return None
        if self.transform is not None:
            img = self.transform(img)
        return img, self.targets[index]

    def _record_bad(self, index: int, exc: BaseException) -> None:
        path = self.paths[index]
        if path not in self._bad:
            self._bad[path] = f"{type(exc).__name__}: {exc}"[:300]
            log.warning("skipping unreadable image %s (%s)", printable(path), self._bad[path])

    @property
    def bad_files(self) -> list[str]:
        return list(self._bad)

    def _trace(self, indices: list[int]) -> None:
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        rank = os.environ.get("RANK", "0")
        path = os.path.join(self._trace_dir, f"{self.split}-rank{rank}-worker{worker}.txt")
        os.makedirs(self._trace_dir, exist_ok=True)
        with open(path, "a", encoding="utf-8") as fh:  # one short O_APPEND write per batch
            fh.write(" ".join(map(str, indices)) + "\n")


def open_shard_split(cfg: DataConfig, split: str, *, train: bool) -> ShardDataset:
    """The dataset of one split of the data set pushed to `cfg.root`."""
    from dtrain.data.transforms import train_augmentation

    store = open_store(cfg.root, cfg.storage_options)
    raw = read_manifest_bytes(store)
    manifest = load_manifest(store, raw)
    if split not in manifest.splits:
        raise DtrainError(
            f"{store.display} has no split '{split}'",
            f"pushed splits: {', '.join(manifest.splits) or '(none)'}",
        )
    info = manifest.splits[split]
    index_bytes = store.read_bytes(info.index.name)
    paths_bytes = store.read_bytes(info.paths.name)
    for fi, data in ((info.index, index_bytes), (info.paths, paths_bytes)):
        if sha256_hex(data) != fi.sha256:
            raise DtrainError(f"{store.display}/{fi.name} does not match its checksum",
                              f"run `dtrain data verify {store.display}` and push again")
    rows = decode_index(index_bytes)
    paths = json.loads(paths_bytes)
    cache = None
    if not store.is_local:
        root = cfg.cache_dir or os.path.join(tempfile.gettempdir(), "dtrain-shard-cache")
        # Keyed by the manifest digest: a re-pushed data set never mixes with old shards.
        directory = os.path.join(root, sha256_hex(raw)[:16])
        cache = ShardCache(directory, int(cfg.cache_limit_gb * 1e9), store, {s.name: s.sha256 for s in info.shards})
    return ShardDataset(
        store,
        manifest,
        split,
        rows,
        paths,
        cfg.input_hw,
        transform=train_augmentation(cfg.shift) if (train and cfg.augment) else None,
        cache=cache,
        sample_bits=cfg.sample_bits,
    )
