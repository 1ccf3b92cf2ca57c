"""`dtrain inspect`: files, directories and globs -> one verdict row per image.

Decoding runs in a thread pool (Pillow and torchvision's decoders release the GIL) a
couple of batches ahead of inference, which runs on the calling thread. An unreadable
image (animated, too large, damaged: dtrain.data.decode's refusals) becomes a row with
an error, never an exception. The results file is written beside its final name and
renamed over it at the end, so a run that dies leaves the previous results whole.
"""

from __future__ import annotations

import csv
import glob
import json
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np

from dtrain.errors import DtrainError
from dtrain.serve.images import DEFAULT_MAX_PIXELS, IMAGE_SUFFIXES, ImageRejected, prepare_file

COLUMNS = ("path", "verdict", "class", "p_defect", "error")
PREFETCH_BATCHES = 2


@dataclass
class Row:
    path: str
    verdict: str = ""  # "ok", "defect", or "" with an error
    cls: str = ""
    p_defect: float | None = None
    error: str = ""

    def as_dict(self) -> dict[str, object]:
        return {"path": self.path, "verdict": self.verdict, "class": self.cls, "p_defect": self.p_defect, "error": self.error}


@dataclass
class Summary:
    ok: int = 0
    defect: int = 0
    errors: int = 0
    seconds: float = 0.0
    error_paths: list[str] = field(default_factory=list)

    @property
    def images(self) -> int:
        return self.ok + self.defect + self.errors

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0

    def add(self, row: Row) -> None:
        if row.error:
            self.errors += 1
            self.error_paths.append(row.path)
        elif row.verdict == "defect":
            self.defect += 1
        else:
            self.ok += 1


def collect_inputs(inputs: Iterable[str]) -> list[Path]:
    """Image files named directly, found under directories (recursively) or by globs."""
    found: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found += _images_under(path)
        elif path.is_file():
            found.append(path)  # named explicitly: kept even with an odd suffix
        elif glob.has_magic(item):
            for match in sorted(glob.glob(item, recursive=True)):
                m = Path(match)
                found += _images_under(m) if m.is_dir() else [m] if m.suffix.lower() in IMAGE_SUFFIXES else []
        else:
            raise DtrainError(f"no such file or directory: {item}", "pass image files, directories or quoted globs like 'parts/*.png'")
    if not found:
        raise DtrainError(f"no images found in {', '.join(inputs)}", f"image files end in {', '.join(sorted(IMAGE_SUFFIXES))}")
    return found


def _images_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def inspect_paths(
    predictor,
    paths: list[Path],
    *,
    batch: int = 32,
    workers: int = 4,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    progress: Callable[[int], None] | None = None,
) -> Iterator[Row]:
    """Verdict rows in input order; `progress(n)` after each batch of n images."""
    size = predictor.image_size
    chunks = [paths[i : i + batch] for i in range(0, len(paths), batch)]

    def decode(path: Path) -> np.ndarray | str:
        try:
            return prepare_file(path, size, max_pixels)
        except ImageRejected as exc:
            return exc.message
        except OSError as exc:  # missing, unreadable, a directory...
            return f"cannot read the file: {exc.strerror or exc}"

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dtrain-decode") as pool:
        pending: deque[list[Future]] = deque()
        for chunk in chunks[:PREFETCH_BATCHES]:
            pending.append([pool.submit(decode, p) for p in chunk])
        next_chunk = len(pending)
        for chunk in chunks:
            futures = pending.popleft()
            if next_chunk < len(chunks):
                pending.append([pool.submit(decode, p) for p in chunks[next_chunk]])
                next_chunk += 1
            decoded = [f.result() for f in futures]
            good = [i for i, d in enumerate(decoded) if not isinstance(d, str)]
            verdicts = predictor.predict(np.stack([decoded[i] for i in good])) if good else []
            by_index = dict(zip(good, verdicts, strict=True))
            for i, path in enumerate(chunk):
                v = by_index.get(i)
                if v is None:
                    yield Row(str(path), error=str(decoded[i]))
                else:
                    yield Row(str(path), v.verdict, v.cls, v.p_defect)
            if progress is not None:
                progress(len(chunk))


class _CsvWriter:
    def __init__(self, f: IO[str]) -> None:
        self._w = csv.DictWriter(f, fieldnames=COLUMNS)
        self._w.writeheader()

    def write(self, row: Row) -> None:
        d = row.as_dict()
        d["p_defect"] = "" if row.p_defect is None else f"{row.p_defect:.6g}"
        self._w.writerow(d)


class _JsonlWriter:
    def __init__(self, f: IO[str]) -> None:
        self._f = f

    def write(self, row: Row) -> None:
        d = row.as_dict()
        d["error"] = row.error or None
        self._f.write(json.dumps(d) + "\n")


WRITERS = {".csv": _CsvWriter, ".jsonl": _JsonlWriter}


def check_output(path: Path) -> None:
    if path.suffix.lower() not in WRITERS:
        raise DtrainError(f"cannot tell the output format of {path}", f"name it with one of {', '.join(WRITERS)}")


def run_inspection(
    predictor,
    paths: list[Path],
    out: Path | None,
    *,
    batch: int = 32,
    workers: int = 4,
    progress: Callable[[int], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Summary:
    """Inspect `paths`, writing every row to `out` (CSV/JSONL by its suffix) when given."""
    tmp = None
    if out is not None:
        check_output(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    summary = Summary()
    start = clock()
    f = open(tmp, "w", newline="") if tmp is not None else None
    try:
        writer = WRITERS[out.suffix.lower()](f) if out is not None and f is not None else None
        for row in inspect_paths(predictor, paths, batch=batch, workers=workers, progress=progress):
            summary.add(row)
            if writer is not None:
                writer.write(row)
        if f is not None:
            f.close()
            os.replace(tmp, out)
    finally:
        if f is not None:
            f.close()
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    summary.seconds = clock() - start
    return summary
