"""The shard dataset in one process: identical samples to the local folder (through the
trainer's per-sample seeding), batched fetches from S3, the bounded node-local cache,
unreadable images, and store addresses."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader

from dtrain.data.config import DataConfig
from dtrain.data.datasets import collate_skip_bad, open_split
from dtrain.data.shard_push import parse_size, push
from dtrain.data.storage import open_store, redact
from dtrain.errors import DtrainError
from dtrain.train.loaders import SeededSamples


@pytest.fixture(scope="module")
def s3_shards(synth_data, s3_server):
    """The train split of synth_data pushed to a fresh bucket; yields the address."""
    import os

    saved = {k: os.environ.get(k) for k in s3_server.env()}
    os.environ.update(s3_server.env())
    bucket = s3_server.new_bucket()
    dest = f"s3://{bucket}/defects"
    push(DataConfig(root=str(synth_data)), open_store(dest), parse_size("64kB"), splits=["train"])
    yield dest
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.mark.slow
def test_s3_shards_give_the_local_samples_bit_for_bit(synth_data, s3_shards, tmp_path):
    local = open_split(DataConfig(root=str(synth_data), image_size=32), "train", train=True)
    remote = open_split(DataConfig(root=s3_shards, image_size=32, cache_dir=str(tmp_path)), "train", train=True)
    assert (len(remote), remote.classes, remote.negative_index) == (len(local), local.classes, local.negative_index)
    assert remote.targets == local.targets
    assert [p.replace("\\", "/") for p in remote.paths] == [
        str(__import__("pathlib").Path(p).relative_to(synth_data)) for p in local.paths
    ]
    a, b = SeededSamples(local, seed=5), SeededSamples(remote, seed=5)
    keys = [(1, i) for i in range(len(local))]
    for start in range(0, len(keys), 32):  # batched I/O, as a DataLoader worker calls it
        batch = keys[start:start + 32]
        for (img_a, y_a), (img_b, y_b) in zip(a.__getitems__(batch), b.__getitems__(batch)):
            assert torch.equal(img_a, img_b) and y_a == y_b
    # single items too, and augmentation really is on (another epoch, other pixels)
    assert torch.equal(a[(1, 3)][0], b[(1, 3)][0]) and not torch.equal(b[(1, 3)][0], b[(2, 3)][0])


@pytest.mark.slow
def test_remote_shards_fill_a_bounded_local_cache(s3_shards, tmp_path):
    ds = open_split(DataConfig(root=s3_shards, image_size=32, cache_dir=str(tmp_path)), "train", train=False)
    total = sum(ds.shard_bytes)
    with ds.batch_io(range(len(ds))):  # touches every shard once
        pass
    deadline = time.monotonic() + 60
    while ds.cache.usage() < total and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ds.cache.usage() == total
    assert all(ds.cache.get(name) for name in ds.shards)
    first = ds[0]
    assert first is not None and first[0].shape == (3, 32, 32)

    # A limit of ~3 shards: the cache never grows past it, reads still succeed.
    limit_gb = 3.2 * max(ds.shard_bytes) / 1e9
    small = open_split(DataConfig(root=s3_shards, image_size=32, cache_dir=str(tmp_path / "small"),
                                  cache_limit_gb=limit_gb), "train", train=False)
    for start in range(0, len(small), 40):
        batch = small.__getitems__(list(range(start, min(start + 40, len(small)))))
        assert all(item is not None for item in batch)
        time.sleep(0.3)
    time.sleep(2)
    assert 0 < small.cache.usage() <= limit_gb * 1e9


def test_coalesce_merges_ranges_closer_than_the_gap():
    from dtrain.data.shards import coalesce

    ranges = [(500, 600, 2), (0, 100, 0), (150, 200, 1), (2000, 2100, 3), (550, 580, 4)]
    assert coalesce(ranges, gap=50) == [(0, 200, [0, 1]), (500, 600, [2, 4]), (2000, 2100, [3])]
    assert coalesce(ranges, gap=0) == [(0, 100, [0]), (150, 200, [1]), (500, 600, [2, 4]), (2000, 2100, [3])]
    assert coalesce(ranges, gap=10_000) == [(0, 2100, [0, 1, 2, 4, 3])]


def _count_gets(ds, monkeypatch) -> list[list[tuple[str, int, int]]]:
    calls: list[list[tuple[str, int, int]]] = []
    real = ds.store.read_ranges

    def counting(names, starts, ends):
        calls.append(list(zip(names, starts, ends)))
        return real(names, starts, ends)

    monkeypatch.setattr(ds.store, "read_ranges", counting)
    return calls


@pytest.mark.slow
def test_a_batch_reads_merged_ranges_or_whole_shards(s3_shards, tmp_path, monkeypatch):
    import dtrain.data.shards as shards

    # Cache on: a batch with every sample of shard 0 reads it in one GET and caches that copy.
    ds = open_split(DataConfig(root=s3_shards, image_size=32, cache_dir=str(tmp_path / "c")), "train", train=False)
    calls = _count_gets(ds, monkeypatch)
    in_first = [i for i in range(len(ds)) if ds.rows[i, 0] == 0]
    items = ds.__getitems__(in_first[::-1])
    assert calls == [[(ds.shards[0], 0, ds.shard_bytes[0])]]
    assert [it[1] for it in items] == [ds.targets[i] for i in in_first[::-1]]
    deadline = time.monotonic() + 30
    while not ds.cache.get(ds.shards[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ds.cache.get(ds.shards[0])
    assert ds.__getitems__(in_first[:3]) and len(calls) == 1  # now from the cache

    # Shards too big to cache: a batch's ranges per shard are merged, never widened.
    plain = SeededSamples(open_split(DataConfig(root=s3_shards, image_size=32), "train", train=False), seed=0)
    nocache = open_split(DataConfig(root=s3_shards, image_size=32, cache_dir=str(tmp_path / "n"), cache_limit_gb=1e-9),
                         "train", train=False)
    calls = _count_gets(nocache, monkeypatch)
    pick = [in_first[0], in_first[1], in_first[-1], len(ds) - 1]  # 3 in shard 0, 1 in the last
    got = nocache.__getitems__(pick)
    assert [len(c) for c in calls] == [2]  # one merged range per shard
    assert all(torch.equal(g[0], plain[(0, i)][0]) for g, i in zip(got, pick))
    monkeypatch.setattr(shards, "MERGE_GAP", 0)  # tar headers and .cls members lie between samples
    nocache.__getitems__(pick)
    assert len(calls[-1]) == 4
    assert not list((tmp_path / "n").rglob("*.tar"))


@pytest.mark.slow
def test_loader_workers_read_s3_shards_with_the_parents_service_models(s3_shards, tmp_path):
    ds = open_split(DataConfig(root=s3_shards, image_size=32, cache_dir=str(tmp_path)), "train", train=False)
    parent = ds.store.fs
    ds.store._pid = -1  # what a forked worker sees: the parent's client, another pid
    child = ds.store.fs
    assert child is not parent and child.session is not parent.session
    assert child.session.get_component("data_loader") is parent.session.get_component("data_loader")
    assert child.cat_file(ds.store.path(ds.shards[0]), start=0, end=10)  # and it works
    loader = DataLoader(ds, batch_size=40, num_workers=2, collate_fn=collate_skip_bad)  # real forks
    assert sum(len(labels) for _, labels in loader) == len(ds)


def test_unreadable_image_in_a_shard_is_skipped(tmp_path):
    from PIL import Image

    src = tmp_path / "src"
    for cls in ("ok", "scratch"):
        (src / "train" / cls).mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (20, 20), (i * 40, 80, 120)).save(src / "train" / cls / f"{cls}_{i}.png")
    (src / "train" / "scratch" / "scratch_9.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    push(DataConfig(root=str(src)), open_store(str(tmp_path / "dest")), parse_size("1MB"))
    ds = open_split(DataConfig(root=str(tmp_path / "dest"), layout="shards", image_size=16), "train", train=False)
    loader = DataLoader(ds, batch_size=4, num_workers=1, collate_fn=collate_skip_bad)
    images = sum(x.shape[0] for x, _ in loader)
    assert images == len(ds) - 1 == 8
    assert any(ds[i] is None for i in range(len(ds)))
    assert ds.bad_files == ["train/scratch/scratch_9.png"]


def test_bmp_and_16_bit_tiff_in_shards_decode_as_in_the_folder(tmp_path):
    """Every format goes through the one checked decoder, sample_bits included (BMP and TIFF
    used to go to Pillow unchecked: a 16-bit grey TIFF clipped at 255 there)."""
    import numpy as np
    from PIL import Image

    src = tmp_path / "src"
    rng = np.random.default_rng(1)
    for cls in ("ok", "scratch"):
        (src / "train" / cls).mkdir(parents=True)
        Image.fromarray(rng.integers(0, 4096, (16, 16), dtype=np.uint16)).save(src / "train" / cls / f"{cls}_0.tif", "TIFF")
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(src / "train" / cls / f"{cls}_1.bmp", "BMP")
    push(DataConfig(root=str(src)), open_store(str(tmp_path / "dest")), parse_size("1MB"))
    for bits in (16, 12):
        folder = open_split(DataConfig(root=str(src), image_size=16, sample_bits=bits), "train", train=False)
        shards = open_split(DataConfig(root=str(tmp_path / "dest"), layout="shards", image_size=16, sample_bits=bits),
                            "train", train=False)
        by_path = {p.split("/")[-1]: folder[i][0] for i, p in enumerate(folder.paths)}
        assert len(shards) == len(by_path) == 4
        for i in range(len(shards)):
            assert shards[i][0].equal(by_path[shards.paths[i].split("/")[-1]]), (bits, shards.paths[i])
    assert max(int(shards[i][0].max()) for i in range(4)) > 200  # at 12 bits the TIFFs fill the range


@pytest.mark.slow
def test_addresses_and_their_errors(s3_shards, tmp_path):
    with pytest.raises(DtrainError, match="no split 'nope'"):
        open_split(DataConfig(root=s3_shards), "nope", train=False)
    with pytest.raises(DtrainError, match="no pushed data set"):
        open_split(DataConfig(root=str(tmp_path), layout="shards"), "train", train=False)
    assert redact("s3://AKIA:secret@bucket/p") == "s3://bucket/p"
    store = open_store(str(tmp_path / "a" / "b"))
    store.write_bytes("x/y.bin", b"12345")
    assert store.read_ranges(["x/y.bin"], [1], [4]) == [b"234"] and store.list_sizes("x") == {"x/y.bin": 5}
    assert not list((tmp_path / "a" / "b" / "x").glob("*.tmp-*"))
