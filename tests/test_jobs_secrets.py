"""Secret job environment values reach the ranks and no file under $DTRAIN_HOME; every
file there is private to its user (real `dtrain run` with local nodes)."""

from __future__ import annotations

import hashlib
import os
import secrets as stdlib_secrets
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import SCRIPTS, dtrain, free_port, job_id_of, wait_gone

from dtrain.errors import ConfigError
from dtrain.jobs import secrets

ENV_DIGEST = str(SCRIPTS / "env_digest.py")


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:16]


def _assert_private_and_clean(home: Path, values: list[str]) -> None:
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    for path in home.rglob("*"):
        mode = stat.S_IMODE(path.lstat().st_mode)
        if path.is_dir():
            assert mode == 0o700, f"{path} is {oct(mode)}"
        elif path.is_file():
            assert mode & 0o077 == 0, f"{path} is {oct(mode)}"
            data = path.read_bytes()
            for value in values:
                assert value.encode() not in data, f"a secret value is in {path}"


def test_names_that_look_secret():
    for name in ("API_TOKEN", "AWS_SECRET_ACCESS_KEY", "db_password", "WANDB_API_KEY", "PGPASSWD",
                 "GOOGLE_APPLICATION_CREDENTIALS", "BASIC_AUTH", "SSH_PRIVATE"):
        assert secrets.looks_secret(name), name
    for name in ("OMP_NUM_THREADS", "PYTHONPATH", "NCCL_DEBUG", "EPOCHS", secrets.MARKED_ENV):
        assert not secrets.looks_secret(name), name


def test_split_and_join_round_trip():
    data = {"job": {"env": {"HF_TOKEN": "t0k", "MINE": "m1", "LR": "0.1"}, "secret_env": ["MINE"]},
            "plan": {"nodes": [{"env": {"HF_TOKEN": "t0k", "LR": "0.1"}}, {"env": {"HF_TOKEN": "other"}}]}}
    clean, values = secrets.split(data, ["MINE"])
    assert "t0k" not in str(clean) and "m1" not in str(clean) and "other" not in str(clean)
    assert clean["job"]["env"]["LR"] == "0.1"
    assert sorted(values.values()) == ["m1", "other", "t0k"]
    assert secrets.join(clean, values) == data
    with pytest.raises(ConfigError):
        secrets.join(clean, {})
    assert secrets.mask("export HF_TOKEN=t0k", values.values()) == "export HF_TOKEN=<secret>"


def test_secret_env_name_must_be_set():
    with pytest.raises(ConfigError, match="not set"):
        secrets.resolve(["NOT_HERE"], {}, {})
    with pytest.raises(ConfigError, match="bad secret name"):
        secrets.resolve(["A=b"], {}, {})


@pytest.mark.slow
def test_secret_values_reach_ranks_but_no_file(dtrain_home):
    token = "xyz" + stdlib_secrets.token_hex(8)  # by name (API_TOKEN)
    marked = "mk" + stdlib_secrets.token_hex(8)  # marked with --secret-env, from the shell
    env = {**os.environ, "PLAIN_BUT_MARKED": marked}
    common = ["--no-preflight", "--env", f"API_TOKEN={token}", "--secret-env", "PLAIN_BUT_MARKED"]
    command = ["--", "python", ENV_DIGEST, "API_TOKEN", "PLAIN_BUT_MARKED"]

    dry = dtrain("run", *common, "--dry-run", *command, env=env)
    assert dry.returncode == 0, dry.stderr
    assert "API_TOKEN=<secret>" in dry.stdout and token not in dry.stdout and marked not in dry.stdout

    res = dtrain("run", *common, "--port", str(free_port()), *command, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"API_TOKEN sha256 {_digest(token)}" in res.stdout
    assert f"PLAIN_BUT_MARKED sha256 {_digest(marked)}" in res.stdout

    # Detached: the supervisor gets the values through a pipe.
    res = dtrain("run", *common, "--detach", "--port", str(free_port()), *command, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    job_id = job_id_of(res.stdout)
    follow = dtrain("logs", job_id, "-f", timeout=120)
    assert f"API_TOKEN sha256 {_digest(token)}" in follow.stdout, follow.stdout
    assert f"PLAIN_BUT_MARKED sha256 {_digest(marked)}" in follow.stdout
    assert wait_gone(job_id) == []

    _assert_private_and_clean(dtrain_home, [token, marked])


def test_ssh_remote_command_reads_secret_values_from_stdin(tmp_path):
    from dtrain.cluster.ssh import remote_command, secret_lines

    env = {"API_TOKEN": "t $(touch pwned) 'q \\ ", "MINE": "m  v", secrets.MARKED_ENV: "MINE", "X": "plain"}
    cmd = remote_command([sys.executable, "-c", "import os,sys; print(repr([os.environ[k] for k in "
                          "('API_TOKEN', 'MINE', 'X')]), sys.stdin.read())"], env=env, cwd=str(tmp_path))
    assert "touch pwned" not in cmd and "m  v" not in cmd and "X=plain" in cmd
    # Through a real shell, as sshd runs it; what follows the values is the command's stdin.
    out = subprocess.run(["sh", "-c", cmd], input=secret_lines(env) + "keep-alive", capture_output=True,
                         text=True, check=True).stdout
    assert out == repr([env["API_TOKEN"], "m  v", "plain"]) + " keep-alive\n"
    assert not list(tmp_path.iterdir())
    with pytest.raises(ConfigError, match="line break"):
        secret_lines({"API_TOKEN": "a\nb"})
    with pytest.raises(ConfigError, match="bad environment variable name"):
        remote_command(["true"], env={"A;B": "1"}, cwd=None)
