"""`dtrain inspect`: files, directories and globs -> one verdict row per image.

The pipeline overlaps: worker threads read, decode and resize whole batches (each
into one preallocated uint8 array) while the calling thread runs the network on the
batch before; at most `workers + 1` batches are in flight, so memory stays bounded
however many images there are. Rows come out in input order. Threads, not processes:
Pillow releases the GIL while it decodes and resizes, and a process pool cost ~20 %
more CPU per quickstart image (every batch pickled back to the parent; BENCHMARKS.md,
"dtrain inspect end to end"), CPU the network needs: inference is most of the work.

An unreadable image (animated, too large, damaged: dtrain.data.decode's refusals)
becomes a row with an error, never an exception. Rows are written and flushed batch by
batch to OUT.partial, which is renamed over OUT at the end: a run that dies keeps the
previous results whole and the rows it had judged in the .partial file.

Where the time goes is measured per stage (`Stages`): thread-seconds of reading and
decoding, resizing, inference and writing, and how long inference waited for images.
"""

from __future__ import annotations

import csv
import glob
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

import numpy as np

from dtrain.data.masks import hidden_or_debris, masks_among, walk
from dtrain.errors import DtrainError
from dtrain.serve.images import DEFAULT_MAX_PIXELS, IMAGE_SUFFIXES, ImageRejected, decode_checked, read_image_file, resize

COLUMNS = ("path", "verdict", "class", "p_defect", "error")


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
class Stages:
    """Seconds per pipeline stage, summed over the threads that ran it. `decode`
    includes reading the file; `wait` is inference waiting for decoded images (the
    decoders are the bottleneck when it is large)."""

    decode: float = 0.0
    resize: float = 0.0
    inference: float = 0.0
    write: float = 0.0
    wait: float = 0.0

    def shares(self) -> dict[str, float]:
        """Each working stage's share of all working time (wait excluded)."""
        work = {k: v for k, v in asdict(self).items() if k != "wait"}
        total = sum(work.values()) or 1.0
        return {k: v / total for k, v in work.items()}

    def describe(self) -> str:
        parts = [f"{k} {getattr(self, k):.2f} s ({share:.0%})" for k, share in self.shares().items()]
        return ", ".join(parts) + f"; inference waited {self.wait:.2f} s for images"


@dataclass
class Summary:
    ok: int = 0
    defect: int = 0
    errors: int = 0
    seconds: float = 0.0
    error_paths: list[str] = field(default_factory=list)
    stages: Stages = field(default_factory=Stages)

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

    def as_json(self) -> dict[str, object]:
        return {
            "images": self.images, "ok": self.ok, "defect": self.defect, "errors": self.errors,
            "seconds": self.seconds, "images_per_s": self.images_per_s, "error_paths": self.error_paths,
            "stages_s": asdict(self.stages), "stage_shares": self.stages.shares(),
        }


def collect_inputs(inputs: Iterable[str], skipped: dict[str, str] | None = None) -> list[Path]:
    """Image files named directly, found under directories (recursively) or by globs.
    Under a directory, ground-truth masks paired with a photo beside them are not parts to
    judge: they are left out, and added to `skipped` (path -> why) when it is given."""
    found: list[Path] = []
    skipped = {} if skipped is None else skipped
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found += _images_under(path, skipped)
        elif path.is_file():
            found.append(path)  # named explicitly: kept even with an odd suffix
        elif glob.has_magic(item):
            for match in sorted(glob.glob(item, recursive=True)):
                m = Path(match)
                found += _images_under(m, skipped) if m.is_dir() else [m] if m.suffix.lower() in IMAGE_SUFFIXES else []
        else:
            raise DtrainError(f"no such file or directory: {item}", "pass image files, directories or quoted globs like 'parts/*.png'")
    if not found:
        raise DtrainError(f"no images found in {', '.join(inputs)}", f"image files end in {', '.join(sorted(IMAGE_SUFFIXES))}")
    return found


def _images_under(folder: Path, skipped: dict[str, str]) -> list[Path]:
    """Image files under `folder`, except hidden ones and archive debris: `.ipynb_checkpoints/`
    holds copies that would be judged twice, and a zip made on a Mac adds `__MACOSX/` and
    `._name.jpg` resource forks that carry an image's suffix but no image. Masks beside
    their photos (dtrain.data.masks.masks_among) go to `skipped`."""
    found = []
    for here, _, names in walk(folder):  # linked folders followed, as training reads them
        files = [p for p in (Path(here, n) for n in names if not hidden_or_debris(n)
                             and Path(n).suffix.lower() in IMAGE_SUFFIXES) if p.is_file()]
        masks = masks_among(files)
        skipped.update(masks)
        found += [p for p in files if str(p) not in masks]
    return sorted(found)


@dataclass
class _Prepared:
    images: np.ndarray  # uint8 [n_good, 3, S, S]
    good: list[int]  # index in the chunk of each image in `images`
    errors: dict[int, str]  # index in the chunk -> why it was not judged
    decode_s: float
    resize_s: float


def _prepare(paths: list[Path], size: tuple[int, int], max_pixels: int, clock: Callable[[], float],
             sample_bits: int, stop: threading.Event) -> _Prepared:
    """One batch, decoded and resized; cut short (what it holds then is never read) once
    `stop` is set: the run was interrupted or failed."""
    images = np.empty((len(paths), 3, *size), dtype=np.uint8)
    good: list[int] = []
    errors: dict[int, str] = {}
    decode_s = resize_s = 0.0
    for i, path in enumerate(paths):
        if stop.is_set():
            break
        t0 = clock()
        try:
            img = decode_checked(read_image_file(path), max_pixels, sample_bits=sample_bits)
        except ImageRejected as exc:
            errors[i] = exc.message
            continue
        except OSError as exc:  # missing, unreadable, a directory...
            errors[i] = f"cannot read the file: {exc.strerror or exc}"
            continue
        finally:
            t1 = clock()
            decode_s += t1 - t0
        images[len(good)] = resize(img, size)
        good.append(i)
        resize_s += clock() - t1
    return _Prepared(images[: len(good)], good, errors, decode_s, resize_s)


def inspect_paths(
    predictor,
    paths: list[Path],
    *,
    batch: int = 32,
    workers: int = 4,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    progress: Callable[[int], None] | None = None,
    stages: Stages | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[Row]:
    """Verdict rows in input order; `progress(n)` after each batch of n images (its rows
    all yielded); time per stage added to `stages`."""
    stages = stages if stages is not None else Stages()
    size = predictor.input_hw
    chunks = iter([paths[i : i + batch] for i in range(0, len(paths), batch)])
    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dtrain-decode")
    try:
        # One batch per worker being prepared and one ready: inference never waits while
        # the decoders keep up, and no more than workers + 1 batches sit in memory.
        pending: deque[tuple[list[Path], Future[_Prepared]]] = deque()

        def submit_next() -> None:
            chunk = next(chunks, None)
            if chunk is not None:
                pending.append((chunk, pool.submit(_prepare, chunk, size, max_pixels, clock, predictor.sample_bits, stop)))

        for _ in range(workers + 1):
            submit_next()
        while pending:
            chunk, future = pending.popleft()
            t0 = clock()
            prepared = future.result()
            t1 = clock()
            submit_next()
            verdicts = predictor.predict(prepared.images) if prepared.good else []
            stages.wait += t1 - t0
            stages.inference += clock() - t1
            stages.decode += prepared.decode_s
            stages.resize += prepared.resize_s
            by_index = dict(zip(prepared.good, verdicts, strict=True))
            for i, path in enumerate(chunk):
                v = by_index.get(i)
                if v is None:
                    yield Row(str(path), error=prepared.errors[i])
                elif v.error:
                    yield Row(str(path), error=v.error)
                else:
                    yield Row(str(path), v.verdict, v.cls, v.p_defect)
            if progress is not None:
                progress(len(chunk))
    finally:
        # After a Ctrl-C, an error or a caller that stopped reading, the queued batches are
        # dropped and the running ones end at their next image. Leaving the pool's `with`
        # waited for every batch in flight: 15 s after a Ctrl-C on 40 large PNGs.
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)


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


def partial_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


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
    """Inspect `paths`, streaming every row to `out` (CSV/JSONL by its suffix) when given."""
    partial = None
    if out is not None:
        check_output(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = partial_path(out)
    summary = Summary()
    start = clock()
    # A photo's name is written as its own bytes, whatever they are (a camera share's Latin-1
    # names): the CSV then names the file exactly as it is on disk, where a strict write
    # stopped the inspection at the first such name. JSONL escapes them itself.
    f = open(partial, "w", newline="", encoding="utf-8", errors="surrogateescape") if partial is not None else None
    writer = WRITERS[out.suffix.lower()](f) if out is not None and f is not None else None

    def batch_done(n: int) -> None:
        if f is not None:
            t0 = clock()
            f.flush()  # a crash loses no judged row
            summary.stages.write += clock() - t0
        if progress is not None:
            progress(n)

    rows = inspect_paths(predictor, paths, batch=batch, workers=workers, progress=batch_done,
                         stages=summary.stages, clock=clock)
    try:
        for row in rows:
            summary.add(row)
            if writer is not None:
                t0 = clock()
                writer.write(row)
                summary.stages.write += clock() - t0
    except BaseException as exc:
        rows.close()  # a Ctrl-C here, between two rows, stops the decoders now, not when collected
        if f is not None:
            f.close()
            exc.add_note(f"dtrain inspect: the {summary.images} rows judged before this are in {partial}")
        raise
    if f is not None:
        f.close()
        os.replace(partial, out)
    summary.seconds = clock() - start
    return summary
