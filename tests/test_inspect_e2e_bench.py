"""bench/inspect_e2e.py --quick runs end to end and reports what the acceptance check
reads (behaviour only: no figure is asserted)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "inspect_e2e.py"


def _check(result: dict, images: int) -> None:
    assert result["images"] == images
    assert result["inspect"]["images_per_s"] > 0 and result["naive"]["images_per_s"] > 0
    assert result["ratio"] == pytest.approx(result["inspect"]["images_per_s"] / result["naive"]["images_per_s"])
    assert 0.0 <= result["verdict_agreement"] <= 1.0
    assert result["inspect"]["test_miss_rate"] is not None and result["naive"]["test_miss_rate"] is not None
    assert set(result["inspect"]["summary"]["stages_s"]) == {"decode", "resize", "inference", "write", "wait"}
    assert result["flops_per_image"] > 0 and result["backend_peak_flops"] > 0
    assert 0 < result["inspect"]["share_of_peak"] < 1
    pm = result["test_misses_paired"]  # the same misses as the rates, paired image by image
    for who, only in (("inspect", "missed_by_inspect_only"), ("naive", "missed_by_naive_only")):
        assert (pm["missed_by_both"] + pm[only]) / pm["defective"] == pytest.approx(result[who]["test_miss_rate"])
    assert 0.0 <= pm["mcnemar_p"] <= 1.0


def test_paired_misses_and_the_exact_mcnemar_p():
    import importlib.util

    spec = importlib.util.spec_from_file_location("inspect_e2e", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    defects = [f"/d/test/dent/{i}.png" for i in range(8)]
    naive = {p: "defect" for p in defects} | {"/d/test/ok/0.png": "ok", "/d/train/dent/0.png": "ok"}
    inspect = dict(naive)
    for p in defects[:5]:  # 5 misses only dtrain inspect makes, none the other way
        inspect[p] = "ok"
    inspect[defects[5]] = naive[defects[5]] = "ok"  # one both miss
    pm = bench.paired_misses(inspect, naive)
    assert pm == {"defective": 8, "missed_by_both": 1, "missed_by_inspect_only": 5, "missed_by_naive_only": 0,
                  "mcnemar_p": pytest.approx(2 / 32)}  # two-sided: 2 x P(X <= 0), X ~ Bin(5, 1/2)
    naive[defects[6]] = "ok"  # and one only the naive loop misses: 5 vs 1, 2 x P(X <= 1), X ~ Bin(6, 1/2)
    assert bench.paired_misses(inspect, naive)["mcnemar_p"] == pytest.approx(2 * (1 + 6) / 64)
    inspect[defects[6]] = "ok"
    naive.update({p: "ok" for p in defects[:5]})  # the same misses: no discordant pair, p = 1
    assert bench.paired_misses(inspect, naive)["mcnemar_p"] == 1.0


def test_quick_bench_on_an_existing_run(trained_checkpoint, synth_data, exported_model, tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--checkpoint", str(trained_checkpoint),
                           "--data", str(synth_data), "--model", str(exported_model), "--workdir", str(tmp_path),
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    _check(result, len(list(synth_data.rglob("*.png"))))
    assert result["naive"]["images"] == 40
    # The inspect miss rate covers the same images as the naive loop's (the first 40 sorted
    # paths), recomputed here from the command's own CSV.
    with open(next(tmp_path.rglob("results.csv")), newline="") as f:
        rows = sorted(csv.DictReader(f), key=lambda r: Path(r["path"]))[:40]
    defective = [r for r in rows if Path(r["path"]).parent.parent.name == "test" and Path(r["path"]).parent.name != "ok"]
    assert defective
    assert result["inspect"]["test_miss_rate"] == sum(r["verdict"] == "ok" for r in defective) / len(defective)
    assert "verdict agreement" in proc.stdout and "peak" in proc.stdout


@pytest.mark.slow
def test_quick_bench_synthesises_trains_and_exports(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--workdir", str(tmp_path), "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check(json.loads(out.read_text()), 120)
