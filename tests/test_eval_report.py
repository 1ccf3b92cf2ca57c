"""The HTML report is self-contained and shows the figures, curves and error samples;
`dtrain eval` turns a missing checkpoint or data directory into a one-line error."""

from __future__ import annotations

import json
import re
import subprocess

import numpy as np
from PIL import Image

from dtrain.evaluation.evaluate import summarise, write_outputs
from dtrain.evaluation.predict import Predictions
from dtrain.evaluation.html_report import read_jsonl, write_report


def _fixture(tmp_path):
    rng = np.random.default_rng(0)
    paths = []
    for i in range(8):
        path = tmp_path / "imgs" / f"img{i}.png"
        path.parent.mkdir(exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    # Classes ok/scratch; P(defect) = probs[:, 1]. Val: defects .9 .7, OK .2 -> t = (.2+.7)/2.
    val = Predictions(np.array([[0.1, 0.9], [0.3, 0.7], [0.8, 0.2]]), np.array([1, 1, 0]), paths[:3], [])
    # Test: defect at .3 is missed, OK at .6 is a false alarm.
    test_probs = np.array([[0.05, 0.95], [0.7, 0.3], [0.4, 0.6], [0.9, 0.1], [0.2, 0.8]])
    test = Predictions(test_probs, np.array([1, 1, 0, 0, 1]), paths[3:], [])
    return summarise(["ok", "scratch"], 0, val, test, 0.05), test


def test_report_is_self_contained(tmp_path):
    result, test = _fixture(tmp_path)
    eval_dir = tmp_path / "eval"
    write_outputs(eval_dir, result, test)
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"kind": "train", "step": s, "epoch": 0, "loss": 1.0 / s, "lr": 0.001, "images_per_s": 50.0} for s in range(1, 6)]
    rows.append({"kind": "val", "step": 5, "epoch": 1, "loss": 0.3, "accuracy": 0.9, "images": 3})
    metrics.write_text("\n".join(json.dumps(r) for r in rows) + "\n{\"torn")  # a killed writer's last line
    assert len(read_jsonl(metrics)) == 6
    report = {**result, "world_size": 2, "train_time_s": 12.0, "train_images_per_s": 50.0, "config": {"epochs": 1}}
    json_path, html_path = write_report(tmp_path, report, eval_dir, metrics)
    saved = json.loads(json_path.read_text())
    assert saved["world_size"] == 2 and saved["miss_rate"] == 1 / 3
    page = html_path.read_text()
    # Every image is embedded: 3 plots + training curves + 2 threshold setters + 1 miss + 1 false alarm.
    assert len(re.findall(r'src="data:image/png;base64,', page)) == 8
    assert 'src="' not in page.replace('src="data:', "")
    assert (eval_dir / "training_curves.png").is_file()
    assert "The faintest defects of the validation split: they set the threshold (2)" in page
    assert "scratch, P(defect) 0.700; caught; catching it flags 0.00 % of good parts" in page
    assert "Missed defects (defective judged OK) (1)" in page
    assert "False alarms (OK judged defective) (1)" in page
    assert "misses the 5.00 % target" in page
    assert "33.33 %" in page  # the miss rate


def test_a_file_name_that_is_not_utf8_does_not_lose_the_report(tmp_path):
    """Python keeps such a name (a Windows zip's, unpacked here) as surrogates; a UTF-8 write
    refused them at the very end of a run."""
    result, test = _fixture(tmp_path)
    result["misses"] = [{**result["misses"][0], "path": str(tmp_path / "d\udce9faut.png")}]
    json_path, html_path = write_report(tmp_path / "out", result, tmp_path / "eval")
    assert "faut.png" in html_path.read_text(encoding="utf-8") and json.loads(json_path.read_text())["misses"]


def test_eval_missing_checkpoint_names_it(tmp_path, dtrain_cmd):
    missing = tmp_path / "nope" / "last.pt"
    data = tmp_path / "data"
    data.mkdir()
    proc = subprocess.run([*dtrain_cmd, "eval", str(missing), str(data)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert str(missing) in proc.stderr and "Traceback" not in proc.stderr


def test_eval_missing_data_names_it(tmp_path, dtrain_cmd):
    ckpt = tmp_path / "last.pt"
    ckpt.write_bytes(b"not read: the data directory is checked first")
    missing = tmp_path / "no-such-data"
    proc = subprocess.run([*dtrain_cmd, "eval", str(ckpt), str(missing)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert f"data directory not found: {missing}" in proc.stderr and "Traceback" not in proc.stderr
