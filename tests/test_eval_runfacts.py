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
