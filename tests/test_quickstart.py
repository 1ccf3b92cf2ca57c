"""`dtrain quickstart` end to end with tiny settings: real synthesis, real 2-rank DDP
(gloo, through the elastic launcher), real evaluation and report. Checks the report's
shape and the world size, not the accuracy (that is the full recipe's job)."""

from __future__ import annotations

import io
import json
import re
import subprocess

import pytest

pytestmark = pytest.mark.slow  # end to end: ./dev test -m 'not slow' leaves it out

DESIGN_KEYS = {"classes", "accuracy", "miss_rate", "miss_rate_upper95", "false_alarm_rate", "threshold",
               "per_class", "confusion_matrix", "n_images"}


def test_quickstart_tiny(tmp_path, dtrain_cmd, dtrain_home):
    work = tmp_path / "qs"
    argv = [*dtrain_cmd, "quickstart", "--workdir", str(work), "--images", "300", "--epochs", "1", "--image-size", "32", "--nproc", "2",
            "--seed", "3", "--precision", "fp32"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((work / "report.json").read_text())
    assert DESIGN_KEYS | {"world_size", "train_time_s", "train_images_per_s", "config", "warnings"} <= set(report)
    assert report["world_size"] == 2
    assert report["negative_class"] == "ok" and len(report["classes"]) == 6
    assert report["n_images"] == sum(sum(row) for row in report["confusion_matrix"])
    assert report["config"]["epochs"] == 1
    assert report["config"]["model"]["views"] == 8  # scored on the 8 symmetries: evaluation and the export below
    # --seed and --precision reach the data, the training and the report's run facts.
    assert report["config"]["seed"] == 3 and report["config"]["precision"] == "fp32"
    assert (report["run"]["seed"], report["run"]["precision"]) == (3, "fp32")
    assert json.loads((work / "data" / "manifest.json").read_text())["seed"] == 3
    # 300 images leave far fewer than 598 defective test images: the report says so.
    assert any("598" in w for w in report["warnings"])
    page = (work / "report.html").read_text()
    assert "data:image/png;base64," in page and "DDP world size" in page
    assert (work / "train.yaml").is_file() and (work / "eval" / "evaluation.json").is_file()
    assert "report:" in proc.stdout

    # The local run was watched like a cluster job: both ranks' steps are stored, and
    # `dtrain report` reads them back.
    job = re.search(r"monitoring job (\S+):", proc.stderr)
    assert job, proc.stderr[-2000:]
    rep = subprocess.run([*dtrain_cmd, "report", job.group(1), "--out", str(tmp_path / "jobreport")],
                         capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr[-2000:]
    summary = json.loads((tmp_path / "jobreport" / "summary.json").read_text())
    assert set(summary["ranks"]) == {"0", "1"} and all(r["steps"] > 0 for r in summary["ranks"].values())
    assert set(summary["nodes"]) == {"local"} and summary["job"]["state"] == "succeeded"
    # ... and it is a job like a cluster job's: listed, with its ranks' lines in its logs.
    listed = json.loads(subprocess.run([*dtrain_cmd, "jobs", "--json"], capture_output=True, text=True,
                                       timeout=60).stdout)
    assert [(j["id"], j["state"], j["world_size"]) for j in listed] == [(job.group(1), "succeeded", 2)]
    logs = subprocess.run([*dtrain_cmd, "logs", job.group(1)], capture_output=True, text=True, timeout=60).stdout
    assert "[local:r0] training " in logs  # rank 0 speaks for the trainer

    # What the quickstart trains leaves as a verified ONNX model (its arch exports).
    model_dir = work / "model"
    exported = subprocess.run([*dtrain_cmd, "export", str(work / "train" / "checkpoints" / "last.pt"), "--out",
                               str(model_dir), "--format", "onnx"], capture_output=True, text=True, timeout=600)
    assert exported.returncode == 0, exported.stderr[-3000:]
    card = json.loads((model_dir / "model.json").read_text())
    assert card["arch"] == report["config"]["model"]["arch"] and card["threshold_rule"] == "bound95"
    assert card["verification"]["ort-fp32"]["verdict_agreement"] == 1.0 and card["views"] == 8

    # A second run reuses the data set rather than synthesising it again: the quickstart's own
    # data step with the options the command line gave (not a second training: that costs minutes).
    from dtrain.quickstart import QuickstartOptions, ensure_data

    manifest = work / "data" / "manifest.json"
    before, said = manifest.stat().st_mtime_ns, io.StringIO()
    opts = QuickstartOptions(workdir=work, images=300, epochs=1, nproc=2, seed=3, precision="fp32")
    opts.image_size = 32
    ensure_data(work / "data", opts, 300, said)
    assert "data: reusing" in said.getvalue() and manifest.stat().st_mtime_ns == before
    # ... and a set drawn with other settings (another seed) is drawn again, not reused.
    opts.seed, said = 4, io.StringIO()
    ensure_data(work / "data", opts, 300, said)
    assert "made with other settings" in said.getvalue() and json.loads(manifest.read_text())["seed"] == 4


def test_a_workdir_inside_the_data_root_is_not_read_as_photos(class_folders_data, tmp_path, dtrain_cmd, dtrain_home):
    """`cd photos && dtrain quickstart --data .` puts runs/quickstart beside the class folders;
    the second run read its plots as a class of photos named `runs`. dtrain's output folders
    carry a mark (.dtrain-output) that every scan for photos leaves out."""
    import shutil

    from quickstart_helpers import quickstart_data

    photos = tmp_path / "photos"
    for name in ("ok", "scratch"):
        shutil.copytree(class_folders_data / name, photos / name, symlinks=True)
    work = photos / "runs" / "quickstart"
    for _ in range(2):  # the second run meets the first one's plots, report and checkpoints
        quickstart_data(dtrain_cmd, photos, work, epochs=1)
        report = json.loads((work / "report.json").read_text())
        assert report["classes"] == ["ok", "scratch"], report["classes"]
        (work / "report.json").unlink()  # the next run writes its own
    assert all((d / ".dtrain-output").is_file() for d in (work, work / "train", work / "eval"))
    assert list((work / "eval").glob("*.png"))  # there were photos to be misread
