import subprocess

import pytest

from dtrain.configio import load_config, parse_override
from dtrain.errors import ConfigError
from dtrain.train.config import TrainConfig


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("epochs: 3\ndata:\n  image_size: 96\noptim:\n  lr: 0.01\n")
    cfg = load_config(TrainConfig, path, ["optim.lr=3e-4", "data.root=/nas/parts", "channels_last=false"])
    assert cfg.epochs == 3
    assert cfg.data.image_size == 96
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.data.root == "/nas/parts"
    assert cfg.channels_last is False


def test_misspelt_key_names_the_closest_valid_key(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("data:\n  imgae_size: 96\n")
    with pytest.raises(ConfigError) as err:
        load_config(TrainConfig, path)
    assert "data.imgae_size" in str(err.value)
    assert "did you mean 'data.image_size'" in str(err.value)


def test_override_misspelt_and_wrong_type():
    with pytest.raises(ConfigError, match="did you mean 'epochs'"):
        load_config(TrainConfig, None, ["epoch=3"])
    with pytest.raises(ConfigError, match="batch_size"):
        load_config(TrainConfig, None, ["batch_size=lots"])


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("epochs")


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(TrainConfig, tmp_path / "nope.yaml")


@pytest.mark.parametrize("text,said", [("epochs: [1, 2\n", "is not valid YAML"),
                                        ("epochs: " + "[" * 2000 + "]" * 2000 + "\n", "nested too deeply")])
def test_a_config_that_is_not_yaml_is_a_config_error(tmp_path, text, said):
    """PyYAML recurses per nesting level: a file nested a thousand deep raised RecursionError."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=said):
        load_config(TrainConfig, path)


def test_cli_help_and_version(dtrain_cmd):
    out = subprocess.run([*dtrain_cmd, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "Usage" in out.stdout
    out = subprocess.run([*dtrain_cmd, "--version"], capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("dtrain ")


def test_a_path_that_is_not_utf8_is_printed_not_fatal_under_a_strict_locale(dtrain_cmd, tmp_path):
    """A folder unpacked from a Windows zip may name bytes that are not UTF-8; under en_US.UTF-8
    Python's stdout refuses them (strict), and printing the path stopped the command."""
    import os

    out_dir = os.fsdecode(os.fsencode(tmp_path) + b"/d\xe9faut")
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict"}
    out = subprocess.run([*dtrain_cmd, "data", "synth", out_dir, "-n", "30"], capture_output=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr.decode(errors="replace")[-500:]
    assert b"d\\udce9faut" in out.stdout and os.path.isdir(out_dir)


def test_a_config_saved_in_latin1_is_a_config_error_naming_its_line(tmp_path):
    """A Windows editor's Latin-1 'é' in a comment raised UnicodeDecodeError with a traceback."""
    path = tmp_path / "c.yaml"
    path.write_bytes(b"epochs: 2\n# d\xe9faut de surface\n")
    with pytest.raises(ConfigError, match=r"c\.yaml is not YAML text at line 2 \(invalid continuation byte: #xe9\)") as err:
        load_config(TrainConfig, path)
    assert "save it as UTF-8" in err.value.hint


def test_a_utf8_config_reads_the_same_under_an_ascii_locale(tmp_path):
    """YAML is UTF-8 whatever LANG says: under LC_ALL=C without Python's UTF-8 mode (a cron job,
    a minimal container) read_text() decoded it as ASCII and failed on the first 'è'."""
    import os
    import sys

    path = tmp_path / "c.yaml"
    path.write_text("data:\n  root: /nas/pièces\n", encoding="utf-8")
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": "utf-8"}
    code = "import sys; from dtrain.configio import read_mapping; print(read_mapping(sys.argv[1])['data']['root'])"
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr.decode(errors="replace")[-500:]
    assert out.stdout.decode("utf-8").strip() == "/nas/pièces"
