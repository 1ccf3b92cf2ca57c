"""`dtrain inspect` with the files of issue 10: an animated GIF is a row with an error
(the run goes on), and a run that dies leaves the previous results file whole and its judged rows beside it."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.image_fixtures import animated_gif, png16


def test_an_animated_gif_and_a_16_bit_png_in_an_inspect_folder(exported_model, synth_data, tmp_path, dtrain_cmd):
    good = sorted((synth_data / "test" / "ok").glob("*.png"))[:2]
    # A long name with brackets: the summary must print it whole, on one line, not as markup.
    folder = tmp_path / ("line [bold]3[red] station 12 camera left " + "x" * 60)
    folder.mkdir()
    for p in good:
        shutil.copy(p, folder / p.name)
    (folder / "anim.gif").write_bytes(animated_gif())
    (folder / "deep.png").write_bytes(png16(40, 40, 4))
    out = tmp_path / "results [line 3]" / "r.jsonl"  # rich would drop "[line 3]" as a style tag
    out.parent.mkdir()
    proc = subprocess.run(dtrain_cmd + ["inspect", str(exported_model), str(folder), "--out", str(out), "--batch", "4"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = {json.loads(line)["path"].rsplit("/", 1)[-1]: json.loads(line) for line in out.read_text().splitlines()}
    assert "GIF with 5 frames" in rows["anim.gif"]["error"] and rows["anim.gif"]["verdict"] == ""
    assert rows["deep.png"]["error"] is None and rows["deep.png"]["verdict"] in ("ok", "defect")
    assert all(rows[p.name]["verdict"] in ("ok", "defect") for p in good)
    assert "1 unreadable" in proc.stderr
    assert f"  unreadable: {folder / 'anim.gif'}" in proc.stderr.splitlines(), proc.stderr
    assert f" -> {out}" in proc.stderr


class _Dies:
    """A predictor that fails on its second batch, like a run killed midway."""

    def __init__(self, predictor) -> None:
        self._p, self.image_size, self.calls = predictor, predictor.image_size, 0

    def predict(self, images):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("killed midway")
        return self._p.predict(images)


def test_a_failed_run_keeps_the_previous_results_file(exported_model, synth_data, tmp_path):
    from dtrain.serve.inspect_batch import run_inspection
    from dtrain.serve.predictor import Predictor

    predictor = Predictor(exported_model)
    paths = sorted((synth_data / "test").rglob("*.png"))[:8]
    out = tmp_path / "results.csv"
    run_inspection(predictor, paths, out, batch=4, workers=1)
    before = out.read_text()
    assert len(before.splitlines()) == 1 + len(paths)
    with pytest.raises(RuntimeError, match="killed midway") as info:
        run_inspection(_Dies(predictor), paths, out, batch=4, workers=1)
    assert out.read_text() == before
    # The rows judged before the failure were flushed beside it, and the error says where.
    partial = tmp_path / "results.csv.partial"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.csv", partial.name]
    assert partial.read_text().splitlines() == before.splitlines()[:5]
    assert any(str(partial) in note for note in info.value.__notes__)
