"""The ssh runner against real sshd's: hostile words arrive verbatim, the node's env and
directory apply, and the user's ssh_config (here a ProxyJump) is honoured."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtrain.cluster.runner import runner_for
from dtrain.cluster.spec import load_cluster

pytestmark = pytest.mark.netns

HOSTILE = ["a b", "$(touch pwned)", "`touch pwned`", "x;touch pwned", "'q'", '"dq"', "\\", "*", "-v", "", "a\nb"]
SHOW = "import json, os, sys; print(json.dumps([sys.argv[1:], os.getcwd(), os.environ.get('NODE_ENV'), " \
       "os.environ.get('X'), os.environ.get('SSH_CONNECTION')]))"


def test_hostile_arguments_env_and_cwd_reach_the_remote_process_verbatim(netns_cluster, tmp_path):
    workdir = tmp_path / "dir with space;ls"
    workdir.mkdir()
    yaml = netns_cluster.cluster_yaml(1, node_extra={"h1": "    env: {NODE_ENV: 'from cluster.yaml'}"})
    cluster = load_cluster(yaml)
    runner = runner_for(cluster.nodes[0], cluster)
    res = runner.run([sys.executable, "-c", SHOW, *HOSTILE], timeout=60, env={"X": "$(id) 'x'"}, cwd=str(workdir))
    assert res.returncode == 0, res.stderr
    argv, cwd, node_env, x, conn = json.loads(res.stdout)
    assert argv == HOSTILE and cwd == str(workdir)
    assert node_env == "from cluster.yaml" and x == "$(id) 'x'"
    assert conn.split()[2] == netns_cluster.hosts[0].address  # it ran on h1
    assert not list(workdir.iterdir()) and not (tmp_path / "pwned").exists()


def test_the_users_ssh_config_is_honoured_proxyjump(netns_cluster, tmp_path):
    h1, h2 = netns_cluster.hosts[:2]
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Include {netns_cluster.ssh_config}\n"
                   f"Host behind-h1\n  HostName {h2.address}\n  ProxyJump h1\n  User root\n"
                   f"  IdentityFile {netns_cluster.identity}\n  UserKnownHostsFile /dev/null\n"
                   "  StrictHostKeyChecking no\n  LogLevel ERROR\n")
    yaml = tmp_path / "cluster.yaml"
    yaml.write_text(f"ssh_config: {cfg}\nnodes: [{{host: behind-h1, python: {sys.executable}}}]\n")
    cluster = load_cluster(yaml)
    res = runner_for(cluster.nodes[0], cluster).run([sys.executable, "-c", SHOW], timeout=60)
    assert res.returncode == 0, res.stderr
    conn = json.loads(res.stdout)[-1].split()
    assert conn[0] == h1.address and conn[2] == h2.address  # reached h2 from h1, not from the head


def test_multiplexed_connections_reuse_one_master_and_still_capture_output(netns_cluster):
    yaml = netns_cluster.cluster_yaml(1, extra="ssh_multiplex: true\n")
    cluster = load_cluster(yaml)
    runner = runner_for(cluster.nodes[0], cluster)
    first = runner.run(["echo", "one"], timeout=30)  # returns although the master stays behind
    assert (first.returncode, first.stdout) == (0, "one\n"), first.stderr
    ssh = runner.ssh_argv()
    check = subprocess.run([*ssh[:-2], "-O", "check", ssh[-1]], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0 and "Master running" in check.stderr
    second = runner.run([sys.executable, "-c", SHOW], timeout=30)
    assert second.returncode == 0 and json.loads(second.stdout)[-1].split()[2] == netns_cluster.hosts[0].address
    subprocess.run([*ssh[:-2], "-O", "exit", ssh[-1]], capture_output=True, timeout=30)
