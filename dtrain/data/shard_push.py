"""`dtrain data push`: pack a data set into WebDataset shards on a store, resumably.

Shards are planned from the source listing alone (file sizes, in listing order), and
written byte-identically on every run, so a re-run after an interruption recomputes each
shard's sha256 locally and uploads only the shards whose `.sha256` marker is missing or
different on the store. The marker is written after its shard; the manifest after
everything: a store never claims a shard or a data set it does not fully hold.

Every object is named by its content (shard_format), so re-pushing a changed data set
writes its new shards and indexes beside the current version's, which stays whole and
readable until the new manifest replaces the old one in one write.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dtrain.data.config import DataConfig
from dtrain.data.shard_format import (
    MANIFEST,
    TAR_OVERHEAD,
    WIDS_LIST,
    FileInfo,
    Manifest,
    ShardInfo,
    ShardWriter,
    SplitInfo,
    encode_index,
    garbage,
    sha256_hex,
    shard_name,
    sidecar_name,
    wids_shardlist,
)
from dtrain.data.storage import DataStore
from dtrain.errors import DtrainError

# Fault injection for the resume test: SIGKILL this process after N shard uploads.
KILL_AFTER_ENV = "DTRAIN_FAULT_PUSH_KILL_AFTER"

Progress = Callable[[int, int], None]  # (bytes done, bytes total)
# Shards are built in TMPDIR/dtrain-push-<pid>-*/ (removed on any exit the process sees;
# a push that was SIGKILLed leaves one, which the next push removes).
STAGING_PREFIX = "dtrain-push-"


@dataclass
class PushReport:
    address: str
    splits: dict[str, int] = field(default_factory=dict)
    shards_total: int = 0
    shards_uploaded: list[str] = field(default_factory=list)
    shards_skipped: list[str] = field(default_factory=list)
    bytes_uploaded: int = 0
    seconds: float = 0.0
    superseded: int = 0  # objects of earlier versions left on the store (`dtrain data gc`)

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_uploaded / self.seconds if self.seconds > 0 else 0.0


def parse_size(text: str) -> int:
    """'256MB' / '1.5GiB' / '4096' -> bytes (decimal and binary units)."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
    raw = text.strip().lower().replace(" ", "")
    num = raw.rstrip("kmgib")
    unit = raw[len(num):]
    try:
        value = float(num) * units[unit]
    except (KeyError, ValueError):
        raise DtrainError(f"bad size {text!r}", "write it like 256MB, 1GiB or 65536") from None
    if value < 1:
        raise DtrainError(f"bad size {text!r}: must be at least one byte")
    return int(value)


def plan_shards(sizes: list[int], shard_size: int) -> list[tuple[int, int]]:
    """Consecutive [start, end) id ranges whose tar size stays under shard_size
    (a single image larger than that gets a shard of its own)."""
    ranges, start, acc = [], 0, 0
    for i, size in enumerate(sizes):
        cost = size + 2 * TAR_OVERHEAD
        if i > start and acc + cost > shard_size:
            ranges.append((start, i))
            start, acc = i, 0
        acc += cost
    if start < len(sizes):
        ranges.append((start, len(sizes)))
    return ranges


def _ext(path: str) -> str:
    return Path(path).suffix.lower().lstrip(".") or "bin"


def push(
    src: DataConfig,
    store: DataStore,
    shard_size: int,
    progress: Progress | None = None,
    splits: list[str] | None = None,
    recheck: bool = False,
) -> PushReport:
    from dtrain.data.layouts import SplitMissing, scan

    t0 = time.perf_counter()
    store.check_reachable()
    wanted = splits or list(dict.fromkeys([src.train_split, src.val_split, src.test_split]))
    listings = {}
    for split in wanted:
        try:
            listings[split] = scan(src, split)
        except SplitMissing:
            if splits:  # asked for by name: its absence is the user's error to see
                raise
        # Any other error (a class name that is not text, a broken label table) stops the
        # push: skipping that split would push a data set without it, and say nothing.
    if not listings:
        raise DtrainError(f"no split of {', '.join(wanted)} found under {src.root}",
                          "point SRC at a data set folder (e.g. one made by `dtrain data synth`)")
    first = next(iter(listings.values()))
    manifest = Manifest(classes=first.classes, negative_index=first.negative_index)
    report = PushReport(address=store.display)
    plans = {}
    for split, listing in listings.items():
        sizes = [os.path.getsize(p) for p in listing.paths]
        plans[split] = (plan_shards(sizes, shard_size), sizes)
    total = sum(sum(sizes) for _, sizes in plans.values())
    done = 0
    kill_after = int(os.environ.get(KILL_AFTER_ENV, "0") or 0)
    _remove_stale_staging()
    with tempfile.TemporaryDirectory(prefix=f"{STAGING_PREFIX}{os.getpid()}-") as staging, \
            ThreadPoolExecutor(1) as uploader:
        pending: Future | None = None
        for split, listing in listings.items():
            ranges, sizes = plans[split]
            rows = np.zeros((len(listing.paths), 4), dtype=np.int64)
            present = store.list_sizes(split)  # one listing instead of a request per shard
            shards: list[ShardInfo] = []
            for number, (lo, hi) in enumerate(ranges):
                local = os.path.join(staging, f"{split}-{number}.tar")
                if pending is not None:  # at most one upload in flight while we build
                    pending.result()
                with open(local, "wb") as fh:
                    writer = ShardWriter(fh)
                    for i in range(lo, hi):
                        writer.add(i, _ext(listing.paths[i]), Path(listing.paths[i]).read_bytes(), listing.targets[i])
                    writer.close()
                for j, (offset, size) in enumerate(writer.rows):
                    rows[lo + j] = (number, offset, size, listing.targets[lo + j])
                digest = _file_sha256(local)
                name = shard_name(split, number, digest)
                info = ShardInfo(name=name, count=hi - lo, bytes=os.path.getsize(local), sha256=digest)
                shards.append(info)
                shard_bytes = sum(sizes[lo:hi])
                if _already_there(store, info, present, recheck):
                    report.shards_skipped.append(name)
                    os.unlink(local)
                    done += shard_bytes
                    if progress:
                        progress(done, total)
                    continue

                def upload(local=local, info=info, shard_bytes=shard_bytes) -> None:
                    nonlocal done
                    store.put_file(local, info.name)
                    store.write_bytes(info.name + ".sha256", info.sha256.encode())
                    os.unlink(local)
                    report.shards_uploaded.append(info.name)
                    report.bytes_uploaded += info.bytes
                    done += shard_bytes
                    if progress:
                        progress(done, total)
                    if kill_after and len(report.shards_uploaded) >= kill_after:
                        os.kill(os.getpid(), signal.SIGKILL)

                pending = uploader.submit(upload)
            if pending is not None:
                pending.result()
                pending = None
            manifest.splits[split] = _write_split_files(store, split, listing, src.root, rows, shards)
            report.splits[split] = len(listing.paths)
            report.shards_total += len(shards)
    store.write_bytes(MANIFEST, manifest.to_bytes())  # the commit point: this version is now the data set
    for split, info in manifest.splits.items():
        store.write_bytes(f"{split}/{WIDS_LIST}", wids_shardlist(split, info.shards))
    report.superseded = len(garbage(store.list_sizes(""), manifest))
    report.seconds = time.perf_counter() - t0
    return report


def _write_split_files(store: DataStore, split: str, listing, root: str, rows: np.ndarray, shards: list[ShardInfo]) -> SplitInfo:
    index = encode_index(rows)
    rel = [os.path.relpath(p, root) for p in listing.paths]
    paths = json.dumps(rel).encode()
    index_name, paths_name = sidecar_name(split, "index", "npy", index), sidecar_name(split, "paths", "json", paths)
    store.write_bytes(index_name, index)
    store.write_bytes(paths_name, paths)
    counts = {c: 0 for c in listing.classes}
    for t in listing.targets:
        counts[listing.classes[t]] += 1
    return SplitInfo(
        count=len(listing.paths),
        class_counts=counts,
        shards=shards,
        index=FileInfo(name=index_name, bytes=len(index), sha256=sha256_hex(index)),
        paths=FileInfo(name=paths_name, bytes=len(paths), sha256=sha256_hex(paths)),
    )


def _already_there(store: DataStore, info: ShardInfo, present: dict[str, int], recheck: bool) -> bool:
    """Size + marker is enough after an interruption; `recheck` re-reads the object
    itself (to replace shards that `verify` found corrupted)."""
    if present.get(info.name) != info.bytes or info.name + ".sha256" not in present:
        return False
    try:
        if store.read_bytes(info.name + ".sha256").decode().strip() != info.sha256:
            return False
    except DtrainError:
        return False
    if recheck:
        h = hashlib.sha256()
        for chunk in store.iter_chunks(info.name):
            h.update(chunk)
        return h.hexdigest() == info.sha256
    return True


def _remove_stale_staging() -> None:
    import psutil

    for entry in Path(tempfile.gettempdir()).glob(f"{STAGING_PREFIX}*-*"):
        pid = entry.name[len(STAGING_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()
