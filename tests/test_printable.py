"""Names from the data shown on a terminal: escapes and direction overrides are written
out, never sent to the terminal."""

import io
import os
import shutil

import pytest
from rich.console import Console

from dtrain.data.config import DataConfig
from dtrain.data.datasets import open_split
from dtrain.errors import DtrainError
from dtrain.printable import printable

TITLE = "\x1b]0;owned\x07"  # sets the terminal's title
ERASE = "\x1b[2K\r"  # erases the line printed so far


def test_control_and_direction_characters_are_written_as_escapes_and_the_rest_is_kept():
    assert printable("défaut ✓ [scratch]/p 1.png") == "défaut ✓ [scratch]/p 1.png"
    assert printable(f"a{TITLE}b") == "a\\x1b]0;owned\\x07b"
    assert printable(f"{ERASE}ok.png\tx\n") == "\\x1b[2K\\rok.png\\tx\\n"
    assert printable("gnp.\u202eexe") == "gnp.\\u202eexe"  # shown as ...exe.png without the escape
    assert printable("\x9b31m") == "\\x9b31m"  # the 8-bit CSI
    assert printable(os.fsdecode(b"d\xe9faut.png")) == "d\\xe9faut.png"  # a byte that is not UTF-8


def test_a_class_folder_named_with_a_terminal_escape_is_refused_and_named_harmlessly(synth_data, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(synth_data, root)
    for split in ("train", "val", "test"):
        os.rename(root / split / "pit", root / split / f"pit{TITLE}")
    with pytest.raises(DtrainError, match="holds control characters") as err:
        open_split(DataConfig(root=str(root), image_size=32), "train", train=True)
    assert "\x1b" not in err.value.message and "pit\\x1b]0;owned\\x07" in err.value.message
    assert "rename" in err.value.hint


@pytest.mark.parametrize("name", ["tab\tbed", "new\nline"])
def test_a_class_folder_with_a_tab_or_a_newline_is_refused(class_folders_data, tmp_path, name):
    flat = tmp_path / "flat"
    shutil.copytree(class_folders_data, flat, symlinks=True)
    os.rename(flat / "dent", flat / name)
    with pytest.raises(DtrainError, match="holds control characters"):
        open_split(DataConfig(root=str(flat), layout="classfolders", image_size=32), "val", train=False)


def test_the_faintest_defects_table_and_its_warning_show_an_escaped_photo_name():
    from dtrain.cli.eval_cmd import print_summary
    from dtrain.evaluation.evaluate import summarise
    from test_eval_summary import OK_SCORES, _binary

    val = _binary([0.9, 0.12, 0.95, 0.62], OK_SCORES)
    val.paths[1] = f"/data/val/scratch/p{TITLE}{ERASE}1.png"
    result = summarise(["ok", "scratch"], 0, val, val, 0.10)
    out = io.StringIO()
    print_summary(result, None, Console(file=out, width=300))
    text = out.getvalue()
    assert "\x1b" not in text and "\x07" not in text and "\r" not in text
    assert "scratch/p\\x1b]0;owned\\x07\\x1b[2K\\r1.png" in text
    assert result["threshold_setters"][0]["path"] == val.paths[1]  # the JSON keeps the name as it is
    [called] = [w for w in result["warnings"] if w.startswith("One defect sets the threshold")]
    assert "\x1b" not in called and "p\\x1b]0;owned" in called


def test_an_unreadable_photo_is_logged_by_an_escaped_name_and_listed_by_its_own(synth_data, tmp_path, caplog):
    root = tmp_path / "data"
    shutil.copytree(synth_data, root)
    bad = root / "val" / "ok" / f"z{TITLE}.png"
    bad.write_bytes(b"not a png")
    ds = open_split(DataConfig(root=str(root), image_size=32, cache_decoded=False), "val", train=False)
    with caplog.at_level("WARNING", logger="dtrain.data"):
        assert ds[ds.paths.index(str(bad))] is None
    [logged] = [r.getMessage() for r in caplog.records if "skipping unreadable image" in r.getMessage()]
    assert "\x1b" not in logged and "z\\x1b]0;owned\\x07.png" in logged
    assert ds.bad_files == [str(bad)]


def test_an_error_quoting_a_name_is_printed_with_its_own_lines_and_the_name_escaped(tmp_path):
    import subprocess
    import sys

    missing = tmp_path / f"photos{ERASE}fine"
    proc = subprocess.run([sys.executable, "-m", "dtrain", "quickstart", "--data", str(missing)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "\x1b" not in proc.stderr and "\r" not in proc.stderr
    assert "photos\\x1b[2K\\rfine" in proc.stderr and "\n  hint: " in proc.stderr, proc.stderr
