"""The on-storage layout of a pushed data set (see DESIGN.md, "Storage").

    DEST/dtrain-shards.json                 manifest: classes, splits, every object + sha256 (written last)
    DEST/<split>/shard-000000-<sha>.tar     WebDataset shards: <key>.<ext> (original bytes) + <key>.cls
    DEST/<split>/shard-000000-<sha>.tar.sha256   push-resume marker, written after its shard
    DEST/<split>/index-<sha>.npy            int64 [N, 4]: shard, byte offset, byte size, label
    DEST/<split>/paths-<sha>.json           the source path of each sample (relative to SRC)
    DEST/<split>/shards.wds.json            wids-style shard list of the current version

Sample ids are global within a split and follow the source listing order, so sample i of
the shards is sample i of the local folder: the same sampler gives the same order.

Versions: every shard and index object is named by its content (<sha>: the first 16 hex
digits of its sha256), so a push never overwrites an object of another version; it
writes the new version's objects beside the old ones and then replaces the manifest in
one atomic write, the commit point. Until then readers, `verify` and fingerprints see
the old version, whole; a push that died midway leaves the manifest as it was (none for
a first push: readers refuse the address until a re-run completes it). Objects no
manifest names any more are removed by `dtrain data gc` (`garbage`).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from typing import BinaryIO

import numpy as np
from pydantic import Field

from dtrain.configio import StrictModel

MANIFEST = "dtrain-shards.json"
FORMAT = "dtrain-shards"
VERSION = 1
# Per-member overhead in a tar: a 512-byte header plus padding to 512 bytes.
TAR_OVERHEAD = 1024


class ShardInfo(StrictModel):
    name: str  # relative to DEST
    count: int
    bytes: int
    sha256: str


class FileInfo(StrictModel):
    name: str
    bytes: int
    sha256: str


class SplitInfo(StrictModel):
    count: int
    class_counts: dict[str, int]
    shards: list[ShardInfo]
    index: FileInfo
    paths: FileInfo


class Manifest(StrictModel):
    format: str = FORMAT
    version: int = VERSION
    container: str = "webdataset-tar"
    classes: list[str]
    negative_index: int | None  # None: no defect-free class (dtrain.data.layouts)
    splits: dict[str, SplitInfo] = Field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return (json.dumps(self.model_dump(), indent=1, sort_keys=True) + "\n").encode()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


NAME_DIGITS = 16  # of the sha256 in a content-named object: enough to never collide
WIDS_LIST = "shards.wds.json"
# Objects a push writes below a split; anything else under DEST is never touched by gc.
_OURS = re.compile(r"^[^/]+/(shard-\d{6}(-[0-9a-f]+)?\.tar(\.sha256)?|index(-[0-9a-f]+)?\.npy|paths(-[0-9a-f]+)?\.json)"
                   r"(\.tmp-\d+)?$")


def shard_name(split: str, number: int, sha256: str) -> str:
    return f"{split}/shard-{number:06d}-{sha256[:NAME_DIGITS]}.tar"


def sidecar_name(split: str, stem: str, ext: str, data: bytes) -> str:
    """`<split>/<stem>-<sha>.<ext>`: named by content, like the shards."""
    return f"{split}/{stem}-{sha256_hex(data)[:NAME_DIGITS]}.{ext}"


def garbage(names: dict[str, int], manifest: Manifest) -> list[str]:
    """The objects among `names` (a listing of DEST) that a push wrote and `manifest` no
    longer needs: other versions' shards, markers and indexes, and temporary files."""
    keep = set()
    for split in manifest.splits.values():
        keep.update(s.name for s in split.shards)
        keep.update(s.name + ".sha256" for s in split.shards)
        keep.update((split.index.name, split.paths.name))
    return sorted(n for n in names if n not in keep and _OURS.match(n))


def sample_key(sample_id: int) -> str:
    return f"{sample_id:09d}"


def encode_index(rows: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(rows, dtype=np.int64), allow_pickle=False)
    return buf.getvalue()


def decode_index(data: bytes) -> np.ndarray:
    rows = np.load(io.BytesIO(data), allow_pickle=False)
    if rows.ndim != 2 or rows.shape[1] != 4:
        raise ValueError(f"index has shape {rows.shape}, expected [N, 4]")
    return rows


def wids_shardlist(split: str, shards: list[ShardInfo]) -> bytes:
    """A wids-compatible descriptor (shard urls relative to this file)."""
    doc = {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "name": split,
        "shardlist": [{"url": s.name.split("/", 1)[1], "nsamples": s.count} for s in shards],
    }
    return (json.dumps(doc, indent=1) + "\n").encode()


class ShardWriter:
    """Writes one deterministic tar (fixed mtime/owner, so a re-run is byte-identical)
    and records where each image's bytes start inside it."""

    def __init__(self, fileobj: BinaryIO) -> None:
        self._tar = tarfile.open(fileobj=fileobj, mode="w", format=tarfile.USTAR_FORMAT)
        self.rows: list[tuple[int, int]] = []  # (offset of image bytes, size)

    def add(self, sample_id: int, ext: str, data: bytes, label: int) -> None:
        key = sample_key(sample_id)
        # USTAR with short names: exactly one 512-byte header before the data.
        self.rows.append((self._tar.offset + 512, len(data)))
        self._member(f"{key}.{ext[:16]}", data)
        self._member(f"{key}.cls", str(label).encode())

    def _member(self, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), 0, 0o644
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        self._tar.addfile(info, io.BytesIO(data))

    def close(self) -> None:
        self._tar.close()
