"""`dtrain inspect` with the files of issue 10: an animated GIF is a row with an error
(the run goes on), and a run that dies leaves the previous results file whole and its judged rows beside it."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess

import pytest

from tests.image_fixtures import animated_gif, damaged_files, encoded, png16


def test_an_animated_gif_and_a_16_bit_png_in_an_inspect_folder(exported_model, synth_data, tmp_path, dtrain_cmd):
    good = sorted((synth_data / "test" / "ok").glob("*.png"))[:2]
    # A long name with brackets: the summary must print it whole, on one line, not as markup.
    folder = tmp_path / ("line [bold]3[red] station 12 camera left " + "x" * 60)
    folder.mkdir()
    for p in good:
        shutil.copy(p, folder / p.name)
    (folder / "anim.gif").write_bytes(animated_gif())
    (folder / "deep.png").write_bytes(png16(40, 40, 4))
    (folder / "bad\x1b]0;owned\x07.png").write_bytes(b"not a png")  # a name that would set the terminal's title
    out = tmp_path / "results [line 3]" / "r.jsonl"  # rich would drop "[line 3]" as a style tag
    out.parent.mkdir()
    proc = subprocess.run(dtrain_cmd + ["inspect", str(exported_model), str(folder), "--out", str(out), "--batch", "4"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = {json.loads(line)["path"].rsplit("/", 1)[-1]: json.loads(line) for line in out.read_text().splitlines()}
    assert "GIF of several frames" in rows["anim.gif"]["error"] and rows["anim.gif"]["verdict"] == ""
    assert rows["deep.png"]["error"] is None and rows["deep.png"]["verdict"] in ("ok", "defect")
    assert all(rows[p.name]["verdict"] in ("ok", "defect") for p in good)
    assert rows["bad\x1b]0;owned\x07.png"]["error"]  # the results keep the name as it is on disk
    assert "2 unreadable" in proc.stderr
    assert f"  unreadable: {folder / 'anim.gif'}" in proc.stderr.splitlines(), proc.stderr
    assert f"  unreadable: {folder}/bad\\x1b]0;owned\\x07.png" in proc.stderr.splitlines(), proc.stderr
    assert "\x1b" not in proc.stderr
    assert f" -> {out}" in proc.stderr


def test_files_whose_header_pillow_chokes_on_are_error_rows_among_judged_ones(exported_model, synth_data, tmp_path,
                                                                              dtrain_cmd):
    """Pillow's TypeError, KeyError, NotImplementedError on a header ended the whole run."""
    folder = tmp_path / "parts"
    folder.mkdir()
    good = sorted((synth_data / "test" / "ok").glob("*.png"))[:3]
    for p in good:
        shutil.copy(p, folder / p.name)
    bad = []
    for name, data in damaged_files().items():  # named: a folder's .im and .dds files are not read
        bad.append(tmp_path / name)
        bad[-1].write_bytes(data)
    out = tmp_path / "r.csv"
    proc = subprocess.run(dtrain_cmd + ["inspect", str(exported_model), str(folder), *map(str, bad), "--out", str(out),
                                        "--batch", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr  # error rows are results, as an animated GIF's
    rows = {r["path"].rsplit("/", 1)[-1]: r for r in csv.DictReader(out.read_text().splitlines())}
    assert sorted(rows) == sorted([p.name for p in good] + list(damaged_files()))
    assert all(rows[p.name]["verdict"] in ("ok", "defect") and not rows[p.name]["error"] for p in good)
    assert all(rows[n]["verdict"] == "" and rows[n]["error"] for n in damaged_files())
    assert f"{len(damaged_files())} unreadable" in proc.stderr and "Traceback" not in proc.stderr


def test_a_file_larger_than_any_image_within_the_limits_is_an_error_row_and_not_read(exported_model, synth_data,
                                                                                     tmp_path):
    """A 2 GiB TIFF stack was read whole before its header was looked at: 2.3 GB per thread."""
    import os

    from PIL import Image

    from dtrain.serve.inspect_batch import inspect_paths
    from dtrain.serve.predictor import Predictor

    big = tmp_path / "stack.tif"
    big.write_bytes(encoded(Image.new("RGB", (20, 24)), "TIFF"))  # a readable image, and zeros after it
    os.truncate(big, 320_000_001)  # past twice the default decode limit; a sparse file: no disk used
    good = sorted((synth_data / "test" / "ok").glob("*.png"))[0]
    rows = list(inspect_paths(Predictor(exported_model), [good, big], batch=2, workers=1))
    assert rows[0].verdict in ("ok", "defect") and not rows[0].error
    assert rows[1].verdict == "" and rows[1].error.startswith(
        "the file is 320 MB, more than an image within the decode limit of 160 MB can need (320 MB); not read"), rows[1]


def _slow_to_decode(path) -> None:
    """A 2000 x 2000 PNG: ~30 ms to decode and resize, 46 kB on disk."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:2000, 0:2000]
    Image.fromarray(np.stack([(x // 8) % 256, (y // 8) % 256, ((x + y) // 16) % 256], -1).astype(np.uint8)).save(path)


def test_ctrl_c_says_where_the_judged_rows_are_and_keeps_them(exported_model, tmp_path, dtrain_cmd):
    """Typer turned the KeyboardInterrupt into a bare exit 130: the note naming the .partial
    file with the rows judged so far was never printed."""
    import signal
    import time

    image = tmp_path / "part.png"
    _slow_to_decode(image)
    out, partial = tmp_path / "r.csv", tmp_path / "r.csv.partial"
    proc = subprocess.Popen(dtrain_cmd + ["inspect", str(exported_model), *[str(image)] * 400, "--out", str(out),
                                          "--batch", "2", "--workers", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120  # a guard against a hang, not a measure
        while not (partial.exists() and len(partial.read_text().splitlines()) >= 3):  # the header and a batch
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    rows = list(csv.DictReader(partial.read_text().splitlines()))
    assert 2 <= len(rows) < 400 and all(r["verdict"] in ("ok", "defect") for r in rows)
    assert err.splitlines()[-2:] == ["dtrain: interrupted",
                                     f"dtrain inspect: the {len(rows)} rows judged before this are in {partial}"], err
    assert not out.exists()


class _Dies:
    """A predictor that fails on its second batch, like a run killed midway."""

    def __init__(self, predictor) -> None:
        self._p, self.input_hw, self.sample_bits, self.calls = predictor, predictor.input_hw, predictor.sample_bits, 0

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


def test_a_model_of_12_bit_samples_judges_16_bit_files_as_it_was_trained(exported_model, synth_data, tmp_path):
    """The card's preprocessing.sample_bits reaches `dtrain inspect`'s decoder: a 16-bit file
    holding an 8-bit picture's values x 16 (12 bits) is judged exactly as the 8-bit picture."""
    import json
    import shutil

    import numpy as np
    from PIL import Image

    from dtrain.serve.inspect_batch import inspect_paths
    from dtrain.serve.predictor import Predictor
    from tests.image_fixtures import png16_of

    model = tmp_path / "model"
    shutil.copytree(exported_model, model)
    card = json.loads((model / "model.json").read_text())
    assert card["preprocessing"]["sample_bits"] == 16  # what the export wrote for 8-bit training data
    card["preprocessing"]["sample_bits"] = 12
    (model / "model.json").write_text(json.dumps(card))
    eight, sixteen = [], []
    for i, path in enumerate(sorted((synth_data / "test").rglob("*.png"))[:6]):
        rgb = np.asarray(Image.open(path).convert("RGB")).astype(np.uint16)
        (tmp_path / f"{i}.png").write_bytes(png16_of(rgb * 16 + 15))
        eight.append(path)
        sixteen.append(tmp_path / f"{i}.png")
    twelve_bit = Predictor(model)
    assert twelve_bit.sample_bits == 12
    as_trained = [r.p_defect for r in inspect_paths(Predictor(exported_model), eight, batch=3, workers=1)]
    shifted = [r.p_defect for r in inspect_paths(twelve_bit, sixteen, batch=3, workers=1)]
    assert shifted == as_trained
    high_byte = [r.p_defect for r in inspect_paths(Predictor(exported_model), sixteen, batch=3, workers=1)]
    assert high_byte != as_trained  # the default would have judged pictures of 16 grey levels
