"""An interrupted `dtrain quickstart` continues where it stopped (dtrain/quickstart_resume.py).

End to end with real processes: a 2-rank synthetic run and a k-fold run on a tiny plant
set, each stopped by SIGINT to its process group (what Ctrl-C in a terminal sends) once a
checkpoint exists, then run again. Plus the rules themselves, without training."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from dtrain import quickstart_resume as resume
from dtrain.errors import DtrainError


def _stop_when(argv: list[str], path: Path, out: Path, stop=None, timeout: float = 600) -> tuple[int, str]:
    """Run argv in its own process group; as soon as `path` exists, SIGINT the group (what
    Ctrl-C sends) or call `stop(log so far)`. -> (exit code, stdout + stderr)."""
    with open(out, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not path.exists():
            assert proc.poll() is None, f"the run ended before {path} appeared:\n{out.read_text()[-3000:]}"
            assert time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.05)
        if stop is None:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            stop(out.read_text())
        rc = proc.wait(timeout=120)
    return rc, out.read_text()


def _epoch(checkpoint: Path) -> int:
    from dtrain.train.checkpoint import load

    return int(load(checkpoint)["epoch"])


@pytest.mark.slow
def test_interrupted_quickstart_continues_from_its_checkpoint(tmp_path, dtrain_cmd, dtrain_home):
    work = tmp_path / "qs"
    argv = [*dtrain_cmd, "quickstart", "--workdir", str(work), "--images", "600", "--epochs", "6", "--image-size", "32",
            "--nproc", "2", "--seed", "3", "--precision", "fp32"]
    rc, said = _stop_when(argv, work / "train" / "checkpoints" / "ckpt-epoch0001.pt", tmp_path / "first.log")
    assert rc == 130, said[-3000:]
    assert "run the same command again to continue it" in said
    last = work / "train" / "checkpoints" / "last.pt"
    stopped_at = _epoch(last)
    assert 1 <= stopped_at < 6
    stopped = resume.load(work)
    assert stopped.stage == "train" and stopped.stops == 1 and stopped.spent_s > 0

    # Other options are refused, and the checkpoint is left as it was.
    before = last.stat().st_mtime_ns
    other = subprocess.run([*argv[:-4], "--seed", "4", "--precision", "fp32"], capture_output=True, text=True, timeout=120)
    assert other.returncode != 0 and "--seed 3 (now 4)" in other.stderr and "--fresh" in other.stderr, other.stderr[-2000:]
    assert last.stat().st_mtime_ns == before

    again = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resume: continuing the unfinished run" in again.stdout and "continuing from its last checkpoint" in again.stdout
    assert "data: reusing" in again.stdout  # not synthesised again
    assert f"resumed from {last}: epoch {stopped_at}" in again.stdout + again.stderr
    report = json.loads((work / "report.json").read_text())
    assert report["epochs"] == 6 and report["config"]["seed"] == 3
    # The report's whole time counts the stopped part too, and says so.
    assert report["total_time_s"] > stopped.spent_s
    assert any(w.startswith("this run was stopped 1 time(s) and continued") for w in report["warnings"])
    assert _epoch(last) == 6 and resume.load(work).stage == "done"
    # The metrics log holds each step once: the resumed run appended after the stop.
    rows = [json.loads(line) for line in (work / "train" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows if r.get("kind") == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == report["steps"]


@pytest.mark.slow
def test_interrupted_kfold_quickstart_keeps_its_finished_folds(tmp_path, dtrain_cmd, dtrain_home):
    data, work = tmp_path / "plant", tmp_path / "qs"
    synth = subprocess.run([*dtrain_cmd, "data", "synth", str(data), "--profile", "plant", "--images", "130", "--size", "64",
                            "--workers", "1"], capture_output=True, text=True, timeout=300)
    assert synth.returncode == 0, synth.stderr[-2000:]
    argv = [*dtrain_cmd, "quickstart", "--data", str(data), "--workdir", str(work), "--epochs", "3", "--nproc", "1",
            "--budget-minutes", "6000", "--folds", "2"]
    # Stopped in the second fold's training, by `dtrain stop` on that run's job (the other way to
    # stop a run, from another terminal): the first fold is finished.
    def stop_job(log: str) -> None:
        job = re.findall(r"monitoring job (\S+):", log)[-1]  # the fold run under way
        stopped = subprocess.run([*dtrain_cmd, "stop", job], capture_output=True, text=True, timeout=120)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr

    rc, said = _stop_when(argv, work / "folds" / "fold1" / "run" / "checkpoints" / "ckpt-epoch0001.pt", tmp_path / "first.log",
                          stop=stop_job)
    assert rc == 130 and "run the same command again to continue it" in said, said[-3000:]
    state = resume.load(work)
    assert state.stage == "folds" and state.folds_done == [0] and state.recipe is not None
    first_scores = np.load(work / "folds" / "fold0" / "heldout_scores.npz")["probs"]

    again = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    out = again.stdout
    assert "recipe: as decided by the unfinished run" in out and "timing a few training steps" not in out
    assert "folds: fold 1/2: finished by the unfinished run" in out
    assert "fold1" in out and "continuing from its last checkpoint" in out
    report = json.loads((work / "report.json").read_text())
    assert report["threshold_basis"]["source"] == "out-of-fold scores of 2 fold models over train + val"
    assert np.array_equal(np.load(work / "folds" / "fold0" / "heldout_scores.npz")["probs"], first_scores)
    manifest = json.loads((data / "manifest.json").read_text())
    labelled = sum(manifest["counts"][s][c] for s in ("train", "val") for c in manifest["counts"][s])
    assert len(np.load(work / "eval" / "oof_scores.npz")["targets"]) == labelled  # every labelled image scored once
    assert resume.load(work).stage == "done"


# ---- the rules, without training ----------------------------------------------------------------


def _state(**over) -> resume.RunState:
    return resume.RunState(options={"seed": 0, "data": "/d", "folds": None}, fingerprint="f", stage="train", **over)


def test_continue_or_refuse(tmp_path):
    same = {"seed": 0, "data": "/d", "folds": None}
    assert resume.continue_or_refuse(None, same, False, tmp_path) is None  # nothing there
    assert resume.continue_or_refuse(_state(), same, True, tmp_path) is None  # --fresh
    done = _state()
    done.stage = "done"
    assert resume.continue_or_refuse(done, {**same, "seed": 5}, False, tmp_path) is None  # a finished run is replaced
    assert resume.continue_or_refuse(_state(), same, False, tmp_path).stage == "train"
    with pytest.raises(DtrainError) as err:
        resume.continue_or_refuse(_state(), {**same, "seed": 1, "folds": 2}, False, tmp_path)
    assert "--seed 0 (now 1)" in str(err.value) and "--folds (not given) (now 2)" in str(err.value)
    assert "stopped in training" in str(err.value) and "--fresh" in str(err.value)


def test_fresh_forgets_the_old_run_even_when_the_new_one_fails_before_training(tmp_path, dtrain_cmd):
    """Not "the run so far is kept" for a run --fresh replaced, and no old run left to continue."""
    from PIL import Image

    work, data = tmp_path / "qs", tmp_path / "boxed"
    work.mkdir()
    resume.save(work, _state())
    for i in range(4):  # a detection set whose every photo holds a box: the recipe refuses it
        (data / "train" / "images").mkdir(parents=True, exist_ok=True)
        (data / "train" / "labels").mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((16, 16), 40 * i, np.uint8)).save(data / "train" / "images" / f"{i}.png")
        (data / "train" / "labels" / f"{i}.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    proc = subprocess.run([*dtrain_cmd, "quickstart", "--data", str(data), "--workdir", str(work), "--fresh"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no good part to tell a defect from" in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "the run so far is kept" not in proc.stdout + proc.stderr
    assert resume.load(work) is None


def test_a_state_file_of_another_version_is_not_overwritten_silently(tmp_path):
    same = {"seed": 0}
    (tmp_path / resume.STATE_FILE).write_text(json.dumps({"version": 99, "stage": "train"}))
    with pytest.raises(DtrainError, match="cannot continue"):
        resume.continue_or_refuse(resume.load(tmp_path), same, False, tmp_path)
    assert resume.continue_or_refuse(resume.load(tmp_path), same, True, tmp_path) is None  # --fresh
    (tmp_path / resume.STATE_FILE).write_text(json.dumps({"version": 99, "stage": "done"}))  # finished: replaced
    assert resume.continue_or_refuse(resume.load(tmp_path), same, False, tmp_path) is None


def test_state_round_trip_and_torn_file(tmp_path):
    resume.save(tmp_path, _state(folds_done=[0, 2]))
    assert resume.load(tmp_path) == _state(folds_done=[0, 2])
    assert not list(tmp_path.glob(".*tmp*"))
    (tmp_path / resume.STATE_FILE).write_text('{"options": {"se')  # a torn write: nothing to continue
    assert resume.load(tmp_path) is None
    (tmp_path / resume.STATE_FILE).write_text(json.dumps({"version": 99}))
    assert resume.load(tmp_path) is None


def test_fingerprint_follows_the_images(tmp_path, synth_data):
    import shutil

    from dtrain.data.config import DataConfig

    root = tmp_path / "data"
    shutil.copytree(synth_data, root)
    cfg = DataConfig(root=str(root))
    first = resume.fingerprint(cfg)
    assert resume.fingerprint(cfg) == first
    image = next((root / "train" / "ok").iterdir())
    shutil.copy(image, root / "train" / "ok" / "added.png")
    added = resume.fingerprint(cfg)
    assert added != first
    with pytest.raises(DtrainError, match="images have changed"):
        resume.check_images(_state(), added, tmp_path)
    (root / "train" / "ok" / "added.png").unlink()
    assert resume.fingerprint(cfg) == first
    # a name of bytes that are not UTF-8 (a Windows zip's): str.encode() refused it, and
    # `dtrain quickstart --data` stopped before training
    odd = os.fsdecode(os.fsencode(root / "train" / "ok") + b"/d\xe9faut.png")
    shutil.copy(image, odd)
    assert resume.fingerprint(cfg) not in (first, added)
    # An absent split is hashed as absent (a data set without test/ resumes); a data set broken
    # since the run stopped says what is broken, not "the images have changed".
    shutil.rmtree(root / "test")
    assert resume.fingerprint(cfg) != first
    os.rename(os.fsencode(root / "train" / "pit"), os.fsencode(root / "train") + b"/p\xeft")
    with pytest.raises(DtrainError, match="is not UTF-8 text"):
        resume.fingerprint(cfg)


def test_recipe_round_trip():
    from dtrain.data.config import DataConfig
    from dtrain.quickstart import Recipe

    recipe = Recipe({"epochs": 7}, [{"field": "epochs", "value": 7, "reason": "r"}], ["a note"],
                    DataConfig(root="/x", negative_class=None), 4, 90_000)
    back = Recipe.from_json(json.loads(json.dumps(recipe.as_json())))
    assert back.as_json() == recipe.as_json() and back.data.negative_class is None
    assert back.epochs_for(1000) == recipe.epochs_for(1000) > 1
    assert Recipe.from_json({**recipe.as_json(), "fixed_epochs": 2}).epochs_for(1000) == 2
    # The epoch cap travels with the recipe; a quickstart.json from before it had none: MAX_EPOCHS.
    small = Recipe.from_json({**recipe.as_json(), "epoch_cap": 300})
    assert small.epochs_for(270) == 300 and Recipe.from_json(json.loads(json.dumps(small.as_json()))).epochs_for(270) == 300
    old = recipe.as_json()
    old.pop("epoch_cap")
    assert Recipe.from_json(old).epochs_for(270) == 100
