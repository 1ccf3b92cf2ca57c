"""The job spec and the per-node torchrun plan, checked through the printed dry run."""

from __future__ import annotations

import json
import socket
import shlex
import subprocess
import sys

import pytest

from dtrain.cluster.spec import ClusterSpec
from dtrain.errors import ConfigError
from dtrain.launch.plan import Facts, build_plan
from dtrain.launch.spec import JobSpec, torchrun_target

PY = "/opt/venv/bin/python"


def cluster(n=2):
    return ClusterSpec.model_validate({
        "defaults": {"python": PY, "workdir": "/srv/job"},
        "nodes": [{"name": f"n{i}", "host": f"gpu{i}", "address": f"10.0.0.{i + 1}"} for i in range(n)],
    })


@pytest.mark.parametrize("command, target", [
    (["python", "train.py", "--lr", "1"], ["train.py", "--lr", "1"]),
    (["/usr/bin/python3.11", "-m", "pkg.train", "a"], ["-m", "pkg.train", "a"]),
    (["-m", "pkg.train"], ["-m", "pkg.train"]),
    (["dtrain", "train", "cfg.yaml", "--set", "epochs=2"], ["-m", "dtrain.train", "cfg.yaml", "--set", "epochs=2"]),
    (["train.py"], ["train.py"]),
    (["./run.sh", "x"], ["--no-python", "./run.sh", "x"]),
])
def test_command_forms(command, target):
    assert torchrun_target(command) == target


def test_spec_errors():
    with pytest.raises(ConfigError, match="needs a script"):
        torchrun_target(["python"])
    with pytest.raises(ValueError, match="rdzv: elastic"):
        JobSpec(command=["x.py"], max_restarts=1)
    with pytest.raises(ConfigError, match="does not fit"):
        JobSpec(command=["x.py"], rdzv="elastic", nnodes="1:3").nnodes_range(2)


def test_static_plan_is_a_hand_written_launch():
    plan = build_plan(JobSpec(command=["python", "train.py", "--epochs", "3"], nproc_per_node=2, port=29400),
                      cluster().nodes, "J1", head_cwd="/home/me")
    assert plan.world_size == 4
    n1 = plan.nodes[1]
    assert n1.argv[:3] == [PY, "-m", "dtrain.launch.node"]
    torchrun = n1.argv[n1.argv.index("--") + 1:]
    assert torchrun == [
        PY, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", "1",
        "--master-addr", "10.0.0.1", "--master-port", "29400", "--nproc-per-node", "2",
        "--tee", "3", "--log-dir", "/tmp/dtrain-J1-n1/torchrun",
        "--log-line-prefix-template", "[n1:r${rank}] ", "train.py", "--epochs", "3",
    ]
    assert n1.cwd == "/srv/job"
    assert {k: n1.env[k] for k in ("DTRAIN_JOB_ID", "DTRAIN_NODE_RANK", "DTRAIN_NUM_NODES", "DTRAIN_NODE_ADDRS")} == {
        "DTRAIN_JOB_ID": "J1", "DTRAIN_NODE_RANK": "1", "DTRAIN_NUM_NODES": "2",
        "DTRAIN_NODE_ADDRS": "10.0.0.1,10.0.0.2"}
    assert n1.env["DTRAIN_HEARTBEAT_DIR"] == "/tmp/dtrain-J1-n1/heartbeat"
    assert "DTRAIN_AUTO_RESUME" not in n1.env
    # The monitor's agent on every node, bound to the node's cluster address; ranks find it.
    assert n1.agent_argv[:6] == ["nice", "-n", "10", PY, "-m", "dtrain.monitor.node.agent"] and "10.0.0.2" in n1.agent_argv
    assert n1.agent_url == "http://10.0.0.2:9464" and n1.env["DTRAIN_AGENT_ADDR"] == "127.0.0.1:9464"
    assert not build_plan(JobSpec(command=["x.py"], monitor=False), cluster().nodes, "J", head_cwd="/").nodes[0].agent_argv


def test_elastic_plan_and_extras():
    job = JobSpec(command=["dtrain", "train", "c.yaml"], rdzv="elastic", nnodes="1:2", max_restarts=1,
                  tf_config=True, env={"A": "1"})
    plan = build_plan(job, cluster().nodes, "J2", head_cwd="/h",
                      facts=Facts(ifnames={"n0": "eth0"}, gpus={"n1": 3}))
    n0, n1 = plan.nodes
    t0 = n0.argv[n0.argv.index("--") + 1:]
    assert t0[3:17] == ["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:29500",
                        "--rdzv-id", "J2", "--rdzv-conf", "is_host=true", "--local-addr", "10.0.0.1",
                        "--max-restarts", "1"]
    assert "is_host=false" in n1.argv and (n0.nproc, n1.nproc) == (1, 3)  # gpus detected on n1
    assert n0.env["GLOO_SOCKET_IFNAME"] == "eth0" and "GLOO_SOCKET_IFNAME" not in n1.env
    assert n0.env["DTRAIN_AUTO_RESUME"] == "1" and n0.env["A"] == "1"
    tf = json.loads(n1.env["TF_CONFIG"])
    assert tf == {"cluster": {"worker": ["10.0.0.1:29501", "10.0.0.2:29501"]}, "task": {"type": "worker", "index": 1}}


def test_dry_run_cli_prints_exact_quoted_argv(tmp_path, dtrain_home):
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(
        "defaults: {python: /opt/py, workdir: /srv/w}\n"
        "nodes:\n  - {name: a, host: gpu-a, address: 10.1.0.1}\n  - {name: b, host: gpu-b, address: 10.1.0.2}\n"
    )
    hostile = "x; touch /tmp/pwned $(id) 'q'"
    res = subprocess.run(
        [sys.executable, "-m", "dtrain", "run", str(cfg), "--dry-run", "--no-preflight", "--nproc-per-node", "2",
         "--env", "MSG=hello world", "--", "python", "train.py", hostile],
        capture_output=True, text=True, timeout=60,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    runs = [shlex.split(ln.split("run: ", 1)[1]) for ln in lines if ln.startswith("  run: ")]
    vias = [shlex.split(ln.split("via: ", 1)[1]) for ln in lines if ln.startswith("  via: ")]
    assert len(runs) == 2 and runs[1][-2:] == ["train.py", hostile]
    assert "--node-rank" in runs[1] and runs[1][runs[1].index("--node-rank") + 1] == "1"
    # The ssh argv: the remote command is ONE word in which the hostile argument stays one word.
    assert vias[1][0] == "ssh" and vias[1][-2] == "gpu-b"
    remote = shlex.split(vias[1][-1].split("exec ", 1)[1])
    # The launch looks for the code itself (one ssh session): `sh -c GUARD sh DIR MARKER LINE` + the wrapper.
    assert remote[:2] == ["sh", "-c"] and remote[4] == "/srv/w" and remote[5].startswith(".dtrain-sync-")
    assert remote[7:] == runs[1]
    assert "  env: MSG='hello world'" in lines
    # Without probing the nodes, what only the launch can decide is said plainly.
    assert sum("decided at launch: the network interface" in ln for ln in lines) == 2
    assert not list(dtrain_home.glob("jobs/*")), "a dry run registers nothing"


def test_run_without_command_is_a_user_error(dtrain_home):
    res = subprocess.run([sys.executable, "-m", "dtrain", "run", "--dry-run"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode != 0 and "no command to run" in res.stderr and "Traceback" not in res.stderr


def test_job_yaml_with_flags_on_top(tmp_path, dtrain_home):
    job = tmp_path / "job.yaml"
    job.write_text("name: nightly\ncommand: [python, train.py, --lr, '0.1']\nnproc_per_node: 2\n"
                   "rdzv: elastic\nmax_restarts: 2\nenv: {A: '1'}\n")
    res = subprocess.run([sys.executable, "-m", "dtrain", "run", "--job", str(job), "--dry-run",
                          "--nproc-per-node", "3", "--env", "B=2"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    run = shlex.split(next(ln for ln in res.stdout.splitlines() if ln.startswith("  run: ")).split("run: ", 1)[1])
    assert run[run.index("--nproc-per-node") + 1] == "3" and run[run.index("--max-restarts") + 1] == "2"
    assert run[-3:] == ["train.py", "--lr", "0.1"] and "(nightly)" in res.stdout
    assert "  env: A=1" in res.stdout and "  env: B=2" in res.stdout
    job.write_text("command: [x.py]\nrdvz: elastic\n")
    res = subprocess.run([sys.executable, "-m", "dtrain", "run", "--job", str(job), "--dry-run"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 3 and "did you mean 'rdzv'" in res.stderr


def test_the_wrapper_names_the_interface_holding_each_local_address():
    import psutil

    from dtrain.launch.node import _primary_holder, interface_towards

    assert interface_towards("127.0.0.1") == "lo"
    for name, addrs in psutil.net_if_addrs().items():
        v4 = [a.address for a in addrs if a.family == socket.AF_INET]
        if v4:  # the primary address; a secondary one is left to psutil
            assert _primary_holder(v4[0]) == name


def test_launch_asks_no_runner_its_kind_and_its_modules_depend_one_way():
    """launch/ reaches nodes only through the CommandRunner interface, and nothing the
    launcher uses imports the launcher back (no launcher <-> supervisor cycle)."""
    import ast
    from pathlib import Path

    import dtrain.launch

    imports: dict[str, set[str]] = {}
    for path in Path(dtrain.launch.__file__).parent.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        imports[path.stem] = names
        text = path.read_text()
        assert "cluster.ssh" not in text and '.name == "ssh"' not in text, path
    assert all("dtrain.cluster.ssh" not in names for names in imports.values())
    importers = [mod for mod, names in imports.items() if "dtrain.launch.launcher" in names]
    assert importers == [], importers
