"""The facts of what ran (precision, device, processor, world size, seed, torch) reach
the checkpoint, `dtrain eval --json` and the HTML report."""

from __future__ import annotations

import json

import torch

from dtrain.evaluation.html_report import render_html
from dtrain.train.facts import cpu_model, describe, run_facts

PLAIN = (str, int, float, bool, type(None))


def _plain(obj) -> bool:
    if isinstance(obj, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in obj.items())
    if isinstance(obj, list):
        return all(_plain(v) for v in obj)
    return type(obj) in PLAIN  # exact types: a str subclass is not plain to yaml or weights_only


def test_cpu_model_reads_the_model_name(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t: fpu\n")
    assert cpu_model(info) == "Intel(R) Xeon(R) Platinum 8480+"
    assert cpu_model(tmp_path / "absent")  # no procfs: still a name, never an exception


def test_bf16_on_a_cpu_says_whether_it_is_native():
    facts = run_facts(torch.device("cpu"), "bf16", 2, 7)
    assert _plain(facts) and json.loads(json.dumps(facts)) == facts
    assert facts["precision"] == "bf16" and facts["world_size"] == 2 and facts["seed"] == 7
    assert facts["bf16_native"] == (facts["avx512_bf16"] or facts["amx"])
    assert ("emulated" in describe(facts)) == (not facts["bf16_native"])
    assert "bf16_native" not in run_facts(torch.device("cpu"), "fp32", 1, 0)
    assert "predates" in describe(None)


def test_the_checkpoint_and_the_evaluation_state_what_ran(trained_checkpoint, synth_data):
    from dtrain.evaluation.evaluate import evaluate

    blob = torch.load(trained_checkpoint, map_location="cpu", weights_only=False)
    run = blob["run"]
    assert _plain(run)
    # The fixture trains fp32 in one CPU process with the default seed.
    assert (run["precision"], run["device"], run["world_size"], run["seed"]) == ("fp32", "cpu", 1, 0)
    assert run["torch"] == torch.__version__ and run["cpu"]
    assert (trained_checkpoint.parent.parent / "run.yaml").is_file()

    result = evaluate(trained_checkpoint, synth_data, 0.05)
    assert result["run"] == run
    assert result["eval_device"].startswith("cpu (")
    page = render_html({**result, "plots": {}}, trained_checkpoint.parent)
    assert "training precision" in page and "<td>fp32</td>" in page and run["cpu"] in page


def test_new_photos_laid_out_otherwise_are_read_in_their_own_layout(trained_checkpoint, synth_data, class_folders_data):
    """A model trained on train/val/test folders, evaluated on photos in bare class folders:
    read with the run's own layout, the data set had no split 'val'. The layout the given root
    holds replaces the run's where they differ; the run's other data settings stay."""
    from dtrain.evaluation.evaluate import evaluate

    result = evaluate(trained_checkpoint, class_folders_data, 0.05)
    assert result["n_images"] > 0 and result["negative_class"] == "ok"
    from dtrain.recipe.stats import relocated
    from dtrain.serve.verify import data_config

    meta = torch.load(trained_checkpoint, map_location="cpu", weights_only=True)
    assert data_config(str(class_folders_data), meta).layout == "classfolders"  # dtrain export --data, likewise
    base = {"layout": "imagefolder", "root": str(synth_data), "negative_class": "ok", "split_seed": 7}
    moved = relocated(base, str(class_folders_data))
    assert moved["layout"] == "classfolders" and moved["split_seed"] == 7 and moved["negative_class"] == "ok"
    assert relocated(base, str(synth_data)) is base  # the same root, or the same layout: as trained
    as_classfolders = {**base, "layout": "classfolders"}  # a layout forced on its own root (--set data.layout)
    assert relocated(as_classfolders, str(synth_data) + "/./") is as_classfolders  # written otherwise, the same folder
    assert relocated({**base, "root": "elsewhere"}, str(synth_data)) == {**base, "root": "elsewhere"}
    assert relocated({**base, "layout": "shards"}, "s3://bucket/set") == {**base, "layout": "shards"}
    # A model trained without a val split (a k-fold final model) keeps having none: a val carved
    # out of the new root would be photos it trained on (dtrain export would choose its threshold there).
    kfold = relocated({**base, "val_split": ""}, str(class_folders_data))
    assert kfold["layout"] == "classfolders" and kfold["val_split"] == "" and kfold["val_from_train"] == 0.0
