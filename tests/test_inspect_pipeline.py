"""`dtrain inspect`'s overlapped pipeline: rows in input order whatever the batch and
thread counts, a bad image is a row with its reason, and the summary says where the
time went."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.image_fixtures import animated_gif


@pytest.fixture(scope="module")
def mixed(synth_data, tmp_path_factory):
    """Good images with unreadable ones between them; the unreadable names."""
    folder = tmp_path_factory.mktemp("mixed")
    good = sorted((synth_data / "test").rglob("*.png"))[:21]
    paths = []
    for i, p in enumerate(good):
        paths.append(p)
        if i % 6 == 2:
            bad = folder / f"bad{i}.png"
            bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10 if i % 12 == 2 else animated_gif())
            paths.append(bad)
    return paths, {p.name for p in paths if p.name.startswith("bad")}


@pytest.mark.parametrize(("batch", "workers"), [(1, 1), (4, 3), (8, 2), (64, 2)])
def test_rows_come_in_input_order_with_bad_images_as_rows(exported_model, mixed, batch, workers):
    from dtrain.serve.images import prepare_file
    from dtrain.serve.inspect_batch import Stages, inspect_paths
    from dtrain.serve.predictor import Predictor

    paths, bad = mixed
    predictor = Predictor(exported_model)
    stages = Stages()
    rows = list(inspect_paths(predictor, paths, batch=batch, workers=workers, stages=stages))
    assert [r.path for r in rows] == [str(p) for p in paths]
    for path, row in zip(paths, rows, strict=True):
        if path.name in bad:
            assert row.error and not row.verdict, row
        else:  # the same verdict as the image judged on its own
            alone = predictor.predict(prepare_file(path, predictor.image_size)[None])[0]
            assert (row.verdict, row.cls) == (alone.verdict, alone.cls)
            assert row.p_defect == pytest.approx(alone.p_defect, abs=1e-6)
    assert stages.decode > 0 and stages.inference > 0


def test_cli_summary_has_the_stage_breakdown(exported_model, mixed, tmp_path, dtrain_cmd):
    paths, bad = mixed
    out = tmp_path / "r.csv"
    proc = subprocess.run(dtrain_cmd + ["inspect", str(exported_model), *map(str, paths), "--out", str(out), "--batch", "8", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["images"] == len(paths) and summary["errors"] == len(bad)
    assert set(summary["stages_s"]) == {"decode", "resize", "inference", "write", "wait"}
    assert summary["stages_s"]["inference"] > 0 and summary["stages_s"]["write"] > 0
    assert sum(summary["stage_shares"].values()) == pytest.approx(1.0)
    assert "time per stage" in proc.stderr and "inference" in proc.stderr
    assert len(out.read_text().splitlines()) == 1 + len(paths)
    assert not (tmp_path / "r.csv.partial").exists()


def test_a_folder_is_read_without_hidden_copies_and_archive_debris(tmp_path):
    from dtrain.serve.inspect_batch import collect_inputs

    for rel in ("a.png", "line2/b.jpg", ".ipynb_checkpoints/a-checkpoint.png", "__MACOSX/._a.png", "._b.jpg",
                "notes.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"not decoded here")

    assert [p.relative_to(tmp_path).as_posix() for p in collect_inputs([str(tmp_path)])] == ["a.png", "line2/b.jpg"]


def test_dtrain_output_folders_among_the_photos_are_not_judged(tmp_path):
    """A run's plots (runs/quickstart/eval/*.png) beside the photos are no parts; a marked
    folder named on the command line is read as asked."""
    from dtrain.data.masks import mark_output
    from dtrain.serve.inspect_batch import collect_inputs

    for rel in ("a.png", "runs/quickstart/eval/score_histogram.png", "runs/quickstart/train/x.png"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"not decoded here")
    for d in ("runs/quickstart", "runs/quickstart/eval", "runs/quickstart/train"):
        mark_output(tmp_path / d)
    assert [p.relative_to(tmp_path).as_posix() for p in collect_inputs([str(tmp_path)])] == ["a.png"]
    named = tmp_path / "runs" / "quickstart" / "eval"
    assert [p.name for p in collect_inputs([str(named)])] == ["score_histogram.png"]


def test_linked_folders_are_followed_and_a_loop_read_once(tmp_path):
    from dtrain.serve.inspect_batch import collect_inputs

    for rel in ("store/dent/a.png", "store/pit/b.png"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"not decoded here")
    subset = tmp_path / "subset"
    subset.mkdir()
    for cls in ("dent", "pit"):  # a subset made of linked class folders, as training reads them
        (subset / cls).symlink_to(tmp_path / "store" / cls, target_is_directory=True)
    (tmp_path / "store" / "dent" / "up").symlink_to(subset, target_is_directory=True)  # a loop

    assert [p.relative_to(subset).as_posix() for p in collect_inputs([str(subset)])] == ["dent/a.png", "pit/b.png"]


def test_masks_beside_the_photos_are_not_judged_as_parts(tmp_path):
    import numpy as np
    from PIL import Image

    from dtrain.serve.inspect_batch import collect_inputs

    rng = np.random.default_rng(0)
    for name in ("p1.png", "line2/p2.jpg", "line2/p3.png"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (24, 24), dtype=np.uint8)).save(tmp_path / name)
    mask = np.zeros((24, 24), np.uint8)
    mask[3:9, 4:12] = 255
    Image.fromarray(mask).save(tmp_path / "p1_mask.png")  # a suffix names its photo
    Image.fromarray(mask).save(tmp_path / "line2/p2.png")  # the same stem, two values: a mask of p2.jpg
    skipped: dict[str, str] = {}
    found = collect_inputs([str(tmp_path)], skipped)
    assert [p.relative_to(tmp_path).as_posix() for p in found] == ["line2/p2.jpg", "line2/p3.png", "p1.png"]
    assert sorted(Path(p).name for p in skipped) == ["p1_mask.png", "p2.png"]
    assert "a mask of p1.png" in skipped[str(tmp_path / "p1_mask.png")]


def test_any_file_name_reaches_the_csv_and_jsonl_as_it_is_on_disk(exported_model, synth_data, tmp_path, dtrain_cmd):
    """Photo names a line PC meets: bytes that are not UTF-8 (a camera's Latin-1 share), a
    comma, a quote, a tab, a newline. The CSV holds each name's own bytes (a reader opening
    it with errors="surrogateescape", as Python does file names, gets the path back); the
    JSONL escapes them. Before, the first such name stopped the inspection (UnicodeEncodeError)."""
    import csv
    import os
    import shutil

    folder = tmp_path / "photos"
    folder.mkdir()
    source = sorted((synth_data / "test").rglob("*.png"))[:5]
    names = [b"d\xe9faut.png", b"a,b.png", b'say "ok".png', b"tab\there.png", b"new\nline.png"]
    for src, name in zip(source, names, strict=True):
        shutil.copy(src, os.fsencode(folder) + b"/" + name)
    wanted = sorted(os.fsdecode(os.fsencode(folder) + b"/" + n) for n in names)
    for suffix in (".csv", ".jsonl"):
        out = tmp_path / f"r{suffix}"
        proc = subprocess.run(dtrain_cmd + ["inspect", str(exported_model), str(folder), "--out", str(out)],
                              capture_output=True, timeout=120)
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")
        with open(out, encoding="utf-8", errors="surrogateescape", newline="") as f:
            rows = list(csv.DictReader(f)) if suffix == ".csv" else [json.loads(line) for line in f]
        assert sorted(r["path"] for r in rows) == wanted
        assert all(r["verdict"] in ("ok", "defect") for r in rows)


class _Interrupted:
    """A predictor on which Ctrl-C lands while it runs."""

    input_hw, sample_bits = (8, 8), 16

    def predict(self, images):
        raise KeyboardInterrupt


def test_an_interrupted_run_leaves_the_queued_images_unread(tmp_path, monkeypatch):
    """Leaving the decoding pool waited for every batch in flight after a Ctrl-C (15 s on 40
    large PNGs). Now the queued batch is dropped and the running one ends at its next image."""
    import threading

    from PIL import Image

    from dtrain.serve import inspect_batch

    image = tmp_path / "part.png"
    Image.new("RGB", (8, 8)).save(image)
    read, release = [], threading.Event()
    real = inspect_batch.read_image_file

    def reading(path):
        if len(read) == 4:  # the second batch's first image: held until the interrupt is through
            release.wait(10)
        read.append(path)
        return real(path)

    monkeypatch.setattr(inspect_batch, "read_image_file", reading)
    with pytest.raises(KeyboardInterrupt):
        list(inspect_batch.inspect_paths(_Interrupted(), [image] * 12, batch=4, workers=1))
    release.set()
    for thread in threading.enumerate():
        if thread.name.startswith("dtrain-decode"):
            thread.join(30)
    assert len(read) <= 5  # the first batch, and the image the second was reading; not the third batch
