"""Code sync and setup commands before a launch (local runner: the tar-stream path)."""

from __future__ import annotations

import dataclasses
import io
import os
import subprocess
import sys

import pytest

from dtrain.cluster.runner import runner_for
from dtrain.cluster.spec import ClusterSpec
from dtrain.errors import DtrainError
from dtrain.launch.plan import build_plan
from dtrain.launch.prepare import prepare_nodes
from dtrain.launch.spec import JobSpec
from dtrain.launch.sync import files_to_sync, for_plan


def _project(root):
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("print('hi')\n")
    (root / "pkg" / "util.py").write_text("X = 1\n")
    (root / "big.bin").write_bytes(b"0" * 1000)
    (root / ".gitignore").write_text("big.bin\n")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "add", "train.py", ".gitignore"], check=True)
    return root


def _prepare(tmp_path, monkeypatch, nodes, job=None):
    proj = _project(tmp_path / "proj")
    monkeypatch.chdir(proj)
    cluster = ClusterSpec.model_validate({"nodes": nodes})
    job = job or JobSpec(command=["python", "train.py"])
    plan = build_plan(job, cluster.nodes, "J", head_cwd=str(proj))
    out = io.StringIO()
    runners = {n.name: runner_for(n, cluster) for n in cluster.nodes}
    sync = for_plan(plan)
    if sync is not None:
        sync.write()
    try:
        prepare_nodes(plan, cluster, runners, sync, out=out)
    finally:
        if sync is not None and not any(n.sync_at_launch for n in plan.nodes):
            sync.remove()
    return proj, out.getvalue()


def test_git_files_respect_gitignore(tmp_path):
    proj = _project(tmp_path / "p")
    # tracked + untracked-but-not-ignored, never the ignored file
    assert files_to_sync(proj) == [".gitignore", "pkg/util.py", "train.py"]


def test_copies_to_a_node_that_does_not_see_the_directory(tmp_path, monkeypatch):
    remote = tmp_path / "remote"
    proj, out = _prepare(tmp_path, monkeypatch, [
        {"name": "same", "host": "local"},
        {"name": "other", "host": "local", "workdir": str(remote),
         "setup": ["echo ready > setup-ran.txt"]},
    ])
    assert (remote / "train.py").read_text() == "print('hi')\n" and (remote / "pkg" / "util.py").exists()
    assert not (remote / "big.bin").exists()
    assert (remote / "setup-ran.txt").read_text() == "ready\n"  # setup runs in the node's workdir
    assert "code copied to other (3 files)" in out
    assert not list(proj.glob(".dtrain-sync-*")), "the marker is removed afterwards"


def test_file_names_that_are_not_utf8_are_copied_as_their_own_bytes(tmp_path, monkeypatch):
    # A data or asset file from a Windows zip unpacked here: its name is Latin-1 bytes.
    # git lists it raw (-z); it used to stop the listing (strict decode) and the tar feed.
    remote = tmp_path / "remote"
    proj = _project(tmp_path / "proj")
    odd = os.fsencode(proj) + b"/pkg/d\xe9faut.txt"
    with open(odd, "wb") as fh:
        fh.write(b"tracked\n")
    with open(os.fsencode(proj) + b"/t\xe2che\tnotes.txt", "wb") as fh:  # untracked, a tab too
        fh.write(b"untracked\n")
    subprocess.run(["git", "-C", str(proj), "add", "pkg"], check=True)
    monkeypatch.chdir(proj)
    # a setup command: the code is looked for, and copied, before the launch
    cluster = ClusterSpec.model_validate({"nodes": [{"name": "other", "host": "local", "workdir": str(remote),
                                                      "setup": ["true"]}]})
    plan = build_plan(JobSpec(command=["python", "train.py"]), cluster.nodes, "J", head_cwd=str(proj))
    sync = for_plan(plan)
    sync.write()
    try:
        prepare_nodes(plan, cluster, {"other": runner_for(cluster.nodes[0], cluster)}, sync, out=io.StringIO())
    finally:
        sync.remove()
    with open(os.fsencode(remote) + b"/pkg/d\xe9faut.txt", "rb") as fh:
        assert fh.read() == b"tracked\n"
    with open(os.fsencode(remote) + b"/t\xe2che\tnotes.txt", "rb") as fh:
        assert fh.read() == b"untracked\n"


def test_shared_directory_is_not_copied_and_never_sync_is_honoured(tmp_path, monkeypatch):
    remote = tmp_path / "remote"
    _, out = _prepare(tmp_path, monkeypatch, [{"name": "other", "host": "local", "workdir": str(remote)}],
                      job=JobSpec(command=["python", "train.py"], sync="never"))
    assert not remote.exists() and out == ""


def test_failing_setup_names_the_node(tmp_path, monkeypatch):
    with pytest.raises(DtrainError, match="setup command 'exit 3' failed on n2 \\(exit 3\\)"):
        _prepare(tmp_path, monkeypatch, [{"name": "n1", "host": "local"},
                                         {"name": "n2", "host": "local", "setup": ["exit 3"]}])


def test_the_launch_itself_looks_for_the_code_and_says_when_it_is_missing(tmp_path, monkeypatch):
    from dtrain.launch.node import MARK
    from dtrain.launch.plan import node_command

    remote = tmp_path / "remote"
    proj, out = _prepare(tmp_path, monkeypatch, [{"name": "other", "host": "local", "workdir": str(remote)}])
    assert out == "" and not remote.exists()  # no separate check and no copy: the launch looks
    assert (proj / ".dtrain-sync-J").exists()  # kept for the launch to find

    cluster = ClusterSpec.model_validate({"nodes": [{"name": "other", "host": "local", "workdir": str(remote)}]})
    runner = runner_for(cluster.nodes[0], cluster)
    launch = build_plan(JobSpec(command=["python", "train.py"]), cluster.nodes, "J", head_cwd=str(proj)).nodes[0]
    assert launch.sync_marker == ".dtrain-sync-J" and launch.sync_at_launch
    launch = dataclasses.replace(launch, argv=["sh", "-c", 'echo "started in $PWD"'])  # stands in for the wrapper
    missing = MARK + '{"sync": "missing"}\n'

    def launched() -> str:
        argv, cwd = node_command(launch)
        res = runner.run(argv, cwd=cwd, timeout=30)
        assert res.returncode == 0, res.stderr
        return res.stdout

    assert launched() == missing  # no workdir yet
    remote.mkdir()
    assert launched() == missing  # a workdir without this job's marker
    (remote / ".dtrain-sync-J").write_text("J")
    assert launched() == f"started in {remote}\n"  # it sees the code: the wrapper runs there
    assert node_command(launch, check_sync=False) == (launch.argv, str(remote))


@pytest.mark.slow
def test_dtrain_run_copies_to_a_node_whose_launch_finds_no_code(tmp_path, dtrain_home):
    from launch_helpers import dtrain, free_port

    proj, remote = _project(tmp_path / "proj"), tmp_path / "remote"
    (proj / "show.py").write_text("import os\nprint('cwd=' + os.getcwd(), flush=True)\n")
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(f"defaults: {{python: {sys.executable}}}\n"
                   f"nodes:\n  - {{name: a, host: local}}\n  - {{name: b, host: local, workdir: {remote}}}\n")
    res = dtrain("run", str(cfg), "--no-preflight", "--no-monitor", "--port", str(free_port()), "--",
                 "python", "show.py", cwd=proj)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"[b:r1] cwd={remote}" in res.stdout and f"[a:r0] cwd={proj}" in res.stdout
    assert "[dtrain] code copied to b (4 files)" in res.stdout, res.stdout
    assert (remote / "show.py").exists() and not list(proj.glob(".dtrain-sync-*"))
