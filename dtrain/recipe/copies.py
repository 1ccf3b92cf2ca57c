"""Byte-identical images in two splits, or under two classes: found before training and
said in words.

A test image that is also a training image (a photo exported twice, a copy made to
balance the classes before the split) flatters every test figure the report gives; the
same file under two classes is a label conflict no network can fit. Both occur in
published sets and in a plant's own folders.

Cost: one stat per file. Only files that share their size with another are read, first
their leading HEAD_BYTES (distinct photos differ within the first rows of pixels), then
in full where those agree too. A set of distinct compressed photos reads nothing; one of
equal-size uncompressed pictures (BMP, raw TIFF) reads HEAD_BYTES of each.
"""

from __future__ import annotations

import hashlib
import os
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

HEAD_BYTES = 16 * 1024
CHUNK = 1 << 20


@dataclass(frozen=True)
class File:
    path: str
    split: str
    label: str


def identical(files: Iterable[File]) -> list[list[File]]:
    """Groups of two or more byte-identical files, each group in the order given."""
    by_size: dict[int, list[File]] = defaultdict(list)
    for f in files:
        by_size[os.stat(f.path).st_size].append(f)
    groups: list[list[File]] = []
    for same_size in by_size.values():
        for same_head in _split_by(same_size, lambda p: _digest(p, HEAD_BYTES)):
            groups.extend(_split_by(same_head, lambda p: _digest(p, None)))
    return groups


def _split_by(files: list[File], key: Callable[[str], bytes]) -> list[list[File]]:
    """`files` grouped by key(path), only groups of two or more (a single file has no copy)."""
    if len(files) < 2:
        return []
    out: dict[bytes, list[File]] = defaultdict(list)
    for f in files:
        out[key(f.path)].append(f)
    return [g for g in out.values() if len(g) > 1]


def _digest(path: str, limit: int | None) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as fh:
        if limit is not None:
            h.update(fh.read(limit))
        else:
            while block := fh.read(CHUNK):
                h.update(block)
    return h.digest()


def describe(groups: list[list[File]]) -> list[str]:
    """Notes for the recipe's printout and the report: copies across splits, copies under
    two classes; nothing for copies within one split and class (harmless, only weight)."""
    across = [g for g in groups if len({f.split for f in g}) > 1]
    conflicts = [g for g in groups if len({f.label for f in g}) > 1]
    out = []
    if across:
        g = across[0]
        out.append(
            f"{len(across)} image{'s are' if len(across) > 1 else ' is'} in two splits byte for byte (e.g. "
            f"{' = '.join(f'{f.split}: {f.path}' for f in g[:2])}): the test and validation figures count them as "
            "new parts and are flattered; delete the copies to measure the model on parts it has not seen"
        )
    if conflicts:
        g = conflicts[0]
        out.append(
            f"{len(conflicts)} image{'s are' if len(conflicts) > 1 else ' is'} filed under two classes byte for byte "
            f"(e.g. {' and '.join(f'{f.label}: {f.path}' for f in g[:2])}): a label conflict no model can learn; "
            "keep each part under the one class it belongs to"
        )
    return out
