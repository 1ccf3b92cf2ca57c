"""`dtrain check` on this machine: the quick form, the JSON form, and user errors
reported in one line without a traceback."""

from __future__ import annotations

import json
import subprocess

from dtrain.errors import ExitStatus
from dtrain.ports import free_port


def run(dtrain_cmd, *args):
    return subprocess.run([*dtrain_cmd, "check", *args], capture_output=True, text=True, timeout=120)


def test_check_hosts_local_passes_and_json_names_the_interface(dtrain_cmd):
    res = run(dtrain_cmd, "--hosts", "local,local", "--port", str(free_port()), "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert [n["node"] for n in report["nodes"]] == ["local0", "local1"]
    assert [n["ifname"] for n in report["nodes"]] == ["lo", "lo"]
    assert [n["port"] for n in report["nodes"]] == ["free", "open"]


def test_check_user_errors_are_one_line_without_traceback(dtrain_cmd, tmp_path):
    res = run(dtrain_cmd)
    assert res.returncode == ExitStatus.CONFIG and "no cluster given" in res.stderr

    yaml = tmp_path / "cluster.yaml"
    yaml.write_text("nodes: [{host: h1}, {host: h2, pyhton: /x}]\n")
    res = run(dtrain_cmd, str(yaml))
    assert res.returncode == ExitStatus.CONFIG
    assert "did you mean 'nodes.1.python'" in res.stderr

    yaml.write_text("nodes: [h1, h2]\n")
    res = run(dtrain_cmd, str(yaml), "--hosts", "h3")
    assert res.returncode == ExitStatus.CONFIG and "no node named 'h3'" in res.stderr and "h1, h2" in res.stderr
    assert "Traceback" not in res.stderr


def test_check_fails_with_the_preflight_status_when_a_node_fails(dtrain_cmd, tmp_path):
    res = run(dtrain_cmd, "--hosts", "local", "--python", str(tmp_path / "no-python"), "--port", str(free_port()))
    assert res.returncode == ExitStatus.PREFLIGHT
    assert "local: python" in res.stdout and "not found" in res.stdout
    assert "preflight failed on 1 node(s): local" in res.stderr and "Traceback" not in res.stderr


def test_a_node_that_writes_latin1_to_stderr_is_reported_with_its_words(dtrain_cmd, tmp_path):
    """A login script or an ssh Banner on an older host may write Latin-1 ("Accès réservé").
    The probe's stderr was read as strict UTF-8 in a thread, which died with a traceback, and
    the failing node was reported with "no output" instead of what it said."""
    python = tmp_path / "python"
    python.write_bytes(b"#!/bin/sh\nprintf 'Acc\\351s r\\351serv\\351\\n' >&2\nexit 3\n")
    python.chmod(0o755)
    res = run(dtrain_cmd, "--hosts", "local", "--python", str(python), "--port", str(free_port()))
    assert res.returncode == ExitStatus.PREFLIGHT
    assert "(exit 3: Acc\ufffds r\ufffdserv\ufffd)" in res.stdout, res.stdout
    assert "Traceback" not in res.stderr and "UnicodeDecodeError" not in res.stderr, res.stderr[-800:]
