"""Reading a pushed data set's manifest, verifying it, and its fingerprint.

`data_fingerprint(address)` is the preflight hook: the sha256 of the manifest, which
names every shard's and index's sha256, so equal fingerprints on two nodes mean both
see the same data set (and a node that cannot read the address fails with its reason).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from dtrain.data.shard_format import MANIFEST, Manifest, garbage, sha256_hex
from dtrain.data.storage import DataStore, open_store
from dtrain.errors import DtrainError


def read_manifest_bytes(store: DataStore) -> bytes:
    if store.size(MANIFEST) is None:
        store.check_reachable()
        raise DtrainError(
            f"{store.display}: no pushed data set here ({MANIFEST} is missing)",
            "create it with `dtrain data push SRC ADDRESS` (a push that was interrupted: run it again)",
        )
    return store.read_bytes(MANIFEST)


def load_manifest(store: DataStore, raw: bytes | None = None) -> Manifest:
    data = raw if raw is not None else read_manifest_bytes(store)
    try:
        return Manifest.model_validate_json(data)
    except ValidationError as exc:
        raise DtrainError(f"{store.display}/{MANIFEST} is damaged: {exc.errors()[0]['msg']}",
                          "push the data set again") from None


def data_fingerprint(address: str, storage_options: dict[str, Any] | None = None) -> str:
    """The index checksum of a pushed data set; the same on every node that reads it."""
    return sha256_hex(read_manifest_bytes(open_store(address, storage_options)))


@dataclass
class VerifyReport:
    address: str
    checked: int = 0
    bytes: int = 0
    problems: list[tuple[str, str]] = field(default_factory=list)  # (object name, what is wrong)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(store: DataStore, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Re-read every shard and index file and compare size and sha256 with the manifest."""
    manifest = load_manifest(store)
    items = []
    for split in manifest.splits.values():
        items += [(s.name, s.bytes, s.sha256) for s in split.shards]
        items += [(f.name, f.bytes, f.sha256) for f in (split.index, split.paths)]
    total = sum(size for _, size, _ in items)
    report = VerifyReport(address=store.display)
    done = 0
    for name, size, digest in items:
        actual = store.size(name)
        if actual is None:
            report.problems.append((name, "missing"))
        elif actual != size:
            report.problems.append((name, f"size {actual} bytes, expected {size}"))
        else:
            h = hashlib.sha256()
            for chunk in store.iter_chunks(name):
                h.update(chunk)
            if h.hexdigest() != digest:
                report.problems.append((name, "sha256 mismatch (corrupted)"))
        report.checked += 1
        done += size
        report.bytes = done
        if progress:
            progress(done, total)
    return report


def collect_garbage(store: DataStore, *, dry_run: bool = False) -> list[str]:
    """Remove (or with `dry_run` only list) the objects of superseded versions and of
    interrupted pushes. Only while no push to this address runs (its new objects are not
    in the manifest yet) and no job still reads an earlier version."""
    names = garbage(store.list_sizes(""), load_manifest(store))
    if not dry_run:
        store.delete(names)
    return names


def info(store: DataStore) -> dict[str, Any]:
    """Counts per split and class, shard counts and sizes, the fingerprint."""
    raw = read_manifest_bytes(store)
    manifest = load_manifest(store, raw)
    return {
        "address": store.display,
        "fingerprint": sha256_hex(raw),
        "container": manifest.container,
        "classes": manifest.classes,
        "negative_class": None if manifest.negative_index is None else manifest.classes[manifest.negative_index],
        "splits": {
            name: {
                "count": s.count,
                "shards": len(s.shards),
                "bytes": sum(x.bytes for x in s.shards),
                "class_counts": s.class_counts,
            }
            for name, s in manifest.splits.items()
        },
    }
