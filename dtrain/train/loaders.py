"""Datasets, samplers and DataLoaders for one rank: the training input pipeline.

`build_loaders` is the one place they are constructed (the hook for other data
layouts, e.g. shards). Workers hand over uint8 batches; the float conversion and
normalisation run on the training device (`dtrain.data.transforms.normalize_batch`).

Augmentation is a pure function of (seed, epoch, sample index): the sampler yields
`(epoch, index)` pairs and `SeededSamples` seeds torch's RNG from them around each
`__getitem__`. So the images a step sees do not depend on the number of workers, on
persistent workers' RNG history, or on whether the run was resumed — which is what lets
a resumed run reproduce an uninterrupted one exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from dtrain.data.config import DataConfig
from dtrain.train.dist import DistContext, cpu_count

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, epoch, index) over seeds


class SeededSamples(Dataset):
    """Wraps a dataset so that item `(epoch, i)` is drawn with its own RNG seed."""

    def __init__(self, inner: Dataset, seed: int) -> None:
        self.inner = inner
        self.seed = seed

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        seed = ((self.seed * 1_000_003 + epoch) * 1_000_003 + index) * _MIX % (1 << 63)
        # fork_rng: with num_workers=0 this runs in the training process, whose own RNG
        # stream must not be disturbed. Only the CPU generator is seeded (what the CPU-side
        # augmentation draws from): torch.manual_seed would also reseed an initialised GPU's
        # generators, which fork_rng(devices=[]) does not restore, and before that formats a
        # stack trace per call for each lazy accelerator (cuda, xpu, mtia): 0.09 ms a sample,
        # 5 % of a 384 px sample's preparation (measured, session 31).
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            return self.inner[index]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list:
        # Datasets on object stores (dtrain.data.shards) fetch a whole batch in one
        # concurrent round; decode + augmentation stay per sample, seeded as above.
        batch_io = getattr(self.inner, "batch_io", None)
        with batch_io([i for _, i in keys]) if batch_io else contextlib.nullcontext():
            return [self[key] for key in keys]


class ClassWeightedSampler(Sampler):
    """DistributedSampler's interface (set_epoch, rank's share), drawing each epoch's
    `len(dataset)` indices with replacement, class c's images each with weight
    n_c ** -0.5 (DataConfig.sampling). The draw is seeded by (seed, epoch), so every rank
    draws the same list and takes its own stride of it, and a resumed run redraws it."""

    def __init__(self, targets, num_replicas: int, rank: int, seed: int) -> None:
        y = torch.as_tensor(list(targets), dtype=torch.int64)
        self.weights = torch.bincount(y).double()[y].rsqrt()  # each image: 1 / sqrt(its class's size)
        self.num_replicas, self.rank, self.seed = num_replicas, rank, seed
        self.num_samples = -(-len(y) // num_replicas)  # ceil, as DistributedSampler without drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if not len(self.weights):  # torch.multinomial refuses an empty distribution
            return iter(())
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        draw = torch.multinomial(self.weights, self.num_samples * self.num_replicas, replacement=True, generator=g)
        return iter(draw[self.rank::self.num_replicas].tolist())

    def __len__(self) -> int:
        return self.num_samples


class EpochSampler(Sampler):
    """This rank's share of a seeded per-epoch permutation, as `(epoch, index)` pairs.

    `set_epoch(e, skip=k)` starts epoch e after its first k samples (mid-epoch resume).
    """

    def __init__(self, inner: DistributedSampler | ClassWeightedSampler) -> None:
        self.inner = inner
        self.epoch = 0
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.inner.set_epoch(epoch)
        self.epoch, self.skip = epoch, skip

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for pos, index in enumerate(self.inner):
            if pos >= self.skip:
                yield self.epoch, index

    def __len__(self) -> int:
        return max(len(self.inner) - self.skip, 0)


class ShardOf(Sampler):
    """Indices rank::world without padding, so evaluation counts every image once."""

    def __init__(self, n: int, rank: int, world: int) -> None:
        self.indices = range(rank, n, world)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


@dataclass
class Loaders:
    train: DataLoader
    val: DataLoader | None
    sampler: EpochSampler
    classes: list[str]
    negative_index: int | None  # None: no defect-free class (a classification task)
    train_set: Dataset
    val_set: Dataset | None


def workers_per_rank(cfg: DataConfig, ctx: DistContext) -> int:
    """data.num_workers, capped so that all ranks' workers fit on this node's cores."""
    return min(cfg.num_workers, max(1, cpu_count() // ctx.local_world_size))


def loader_kwargs(cfg: DataConfig, ctx: DistContext) -> dict:
    from dtrain.data.datasets import collate_skip_bad

    workers = workers_per_rank(cfg, ctx)
    kw = dict(num_workers=workers, collate_fn=collate_skip_bad, pin_memory=ctx.device.type == "cuda")
    if workers:
        kw.update(persistent_workers=True, prefetch_factor=4)
    return kw


def build_loaders(cfg: DataConfig, ctx: DistContext, *, batch_size: int, seed: int, masks: bool = False) -> Loaders:
    """`masks`: the training photos carry their defect masks as a fourth channel (TrainConfig.mask_loss)."""
    from dtrain.data.datasets import open_split

    train_set = open_split(cfg, cfg.train_split, train=True, masks=masks)
    if cfg.sampling == "sqrt_inverse":
        inner = ClassWeightedSampler(train_set.targets, ctx.world_size, ctx.rank, seed)
    else:
        inner = DistributedSampler(
            train_set, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=seed, drop_last=False
        )
    sampler = EpochSampler(inner)
    kw = loader_kwargs(cfg, ctx)
    # drop_last: a ragged final batch would give one step a different noise scale (and
    # BatchNorm a tiny batch); the permutation changes every epoch, so nothing is lost.
    train = DataLoader(SeededSamples(train_set, seed), batch_size=batch_size, sampler=sampler, drop_last=True, **kw)
    val_set = open_split(cfg, cfg.val_split, train=False) if cfg.val_split else None
    val = None
    if val_set is not None and len(val_set):
        val = DataLoader(val_set, batch_size=batch_size * 2, sampler=ShardOf(len(val_set), ctx.rank, ctx.world_size), **kw)
    return Loaders(train, val, sampler, list(train_set.classes), train_set.negative_index, train_set, val_set)
