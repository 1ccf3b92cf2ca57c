"""cluster.yaml validation and the argv runners build: fast, no processes except `local`."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from dtrain.cluster.runner import runner_class, runner_for
from dtrain.cluster.spec import ClusterSpec, load_cluster
from dtrain.cluster.ssh import SshRunner, remote_command
from dtrain.errors import ConfigError

HOSTILE = ["a b", "$(touch /tmp/pwned)", "`id`", "x;rm -rf /", "'quoted'", '"dq"', "\\", "*", "\n", "", "-v"]


def test_defaults_apply_to_nodes_and_env_merges(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "ssh_config: ~/cfg\n"
        "defaults: {python: /opt/py, gpus: 2, env: {A: '1', B: '2'}, setup: [echo d]}\n"
        "nodes:\n"
        "  - host: gpu1\n"
        "    address: 10.0.0.1\n"
        "  - {host: ubuntu@gpu2, gpus: 1, env: {B: x}, setup: [echo n]}\n"
        "  - local\n"
    )
    c = load_cluster(path)
    assert [n.name for n in c.nodes] == ["gpu1", "gpu2", "local"]
    assert c.master.name == "gpu1" and c.master.reach_address == "10.0.0.1"
    assert c.nodes[1].reach_address == "gpu2" and c.nodes[2].reach_address == "127.0.0.1"
    assert c.nodes[0].python == "/opt/py" and c.nodes[0].gpus == 2 and c.nodes[1].gpus == 1
    assert c.nodes[1].env == {"A": "1", "B": "x"} and c.nodes[1].setup == ["echo d", "echo n"]
    assert not c.ssh_config.startswith("~")
    assert [n.transport for n in c.nodes] == ["ssh", "ssh", "local"]


@pytest.mark.parametrize("yaml_text, expect", [
    ("nodes: []\n", "at least 1"),
    ("nodes: [{host: '-oProxyCommand=evil'}]\n", "SSH destination"),
    ("nodes: [{host: 'a b'}]\n", "SSH destination"),
    ("nodes: [{host: '-v'}]\n", "SSH destination"),
    ("nodes: [{host: 'u@-v'}]\n", "SSH destination"),
    ("nodes: [{host: h1, address: 'a;b'}]\n", "address must be"),
    ("nodes: [{host: h1, python: '-c'}]\n", "python must be"),
    ("nodes: [{host: h1, name: 'x/y'}]\n", "node name"),
    ("nodes: [h1, h1]\n", "two nodes are named 'h1'"),
    ("nodes: [{host: h1, env: {'A;B': '1'}}]\n", "environment variable name"),
    ("nodes: [h1]\nssh_options: ['-oProxyCommand=x']\n", "ssh option"),
    ("nodes: [{host: h1, gpu: 2}]\n", "did you mean 'nodes.0.gpus'"),
    ("nodes: [h1]\ndefaults: {pyton: x}\n", "did you mean 'defaults.python'"),
])
def test_bad_cluster_files_are_config_errors_that_say_why(tmp_path, yaml_text, expect):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=expect.replace("(", r"\(")):
        load_cluster(path)


def test_from_hosts_and_select():
    c = ClusterSpec.from_hosts(["h1", "root@h2", " "], defaults={"python": "/p"})
    assert [n.name for n in c.nodes] == ["h1", "h2"] and c.nodes[1].python == "/p"
    assert [n.name for n in c.select(["h2", "h1"]).nodes] == ["h2", "h1"]
    with pytest.raises(ConfigError, match="no node named 'h3'"):
        c.select(["h3"])
    with pytest.raises(ConfigError, match="no hosts"):
        ClusterSpec.from_hosts([""])
    assert [n.name for n in ClusterSpec.from_hosts(["local", "local"]).nodes] == ["local0", "local1"]


def test_one_loader_for_every_command_line_form(tmp_path):
    from dtrain.cluster.spec import cluster_from_args

    with pytest.raises(ConfigError, match="no cluster given"):
        cluster_from_args(None, None)  # dtrain check needs one
    alone = cluster_from_args(None, None, default_local=True)  # dtrain run: this machine
    assert [(n.host, n.python) for n in alone.nodes] == [("local", sys.executable)]
    quick = cluster_from_args(None, "h1, h2", python="/opt/py")
    assert [(n.name, n.python) for n in quick.nodes] == [("h1", "/opt/py"), ("h2", "/opt/py")]
    path = tmp_path / "cluster.yaml"
    path.write_text("defaults: {python: /p}\nnodes: [a1, a2, a3]\n")
    assert [(n.name, n.python) for n in cluster_from_args(path, "a3,a1").nodes] == [("a3", "/p"), ("a1", "/p")]
    assert {n.python for n in cluster_from_args(path, None, python="/q").nodes} == {"/q"}


def test_unknown_runner_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="did you mean 'ssh'"):
        runner_class("shh")


def test_ssh_argv_quotes_every_word_so_the_remote_shell_sees_them_unchanged():
    c = ClusterSpec.from_hosts(["gpu1"], ssh_config="/etc/cfg", ssh_options=["ProxyJump=bastion"])
    runner = runner_for(c.nodes[0], c)
    assert isinstance(runner, SshRunner)
    argv = runner.argv(["python3", *HOSTILE], env={"X": "$(id) ;'"}, cwd="/tmp/dir with space;ls")
    dest = argv.index("--")
    assert argv[:3] == ["ssh", "-F", "/etc/cfg"] and "ProxyJump=bastion" in argv
    assert argv[dest + 1] == "gpu1" and len(argv) == dest + 3
    # What the remote POSIX shell will parse: exactly our words, nothing executed.
    words = shlex.split(argv[-1])
    assert words[:2] == ["cd", "/tmp/dir with space;ls"]
    assert words[words.index("exec") + 1:] == ["python3", *HOSTILE]
    assert "X=$(id) ;'" in words


def test_remote_command_really_runs_hostile_words_verbatim_through_sh(tmp_path):
    # Run the string the ssh runner sends through a real shell, as sshd would.
    cmd = remote_command([sys.executable, "-c", "import sys,os; print(repr(sys.argv[1:]), os.environ['X'])", *HOSTILE],
                         env={"X": "$(touch pwned)"}, cwd=str(tmp_path))
    out = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, check=True).stdout
    assert out == f"{HOSTILE!r} $(touch pwned)\n"
    assert not list(tmp_path.iterdir())


def test_remote_command_keeps_a_leading_tilde_for_the_remote_home():
    assert remote_command(["ls"], env={}, cwd="~/my job").startswith("cd ~'/my job' && ")


def test_local_runner_runs_with_env_and_cwd(tmp_path):
    c = ClusterSpec.from_hosts(["local"], defaults={"env": {"NODE_ENV": "n"}})
    runner = runner_for(c.nodes[0], c)
    res = runner.run([sys.executable, "-c", "import os,sys; print(os.getcwd(), os.environ['NODE_ENV'], "
                      "os.environ['X'], sys.argv[1:])", *HOSTILE],
                     env={"X": "a=b c"}, cwd=str(tmp_path), timeout=30)
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"{tmp_path} n a=b c {HOSTILE!r}\n"
    assert runner.argv(["echo"]) == ["env", "NODE_ENV=n", "echo"]


def test_multiplexing_is_off_unless_asked():
    plain = ClusterSpec.from_hosts(["gpu1"])
    assert not any("ControlMaster" in a for a in runner_for(plain.nodes[0], plain).argv(["true"]))
    mux = ClusterSpec.from_hosts(["gpu1"], ssh_multiplex=True)
    argv = runner_for(mux.nodes[0], mux).argv(["true"])
    assert "ControlMaster=auto" in argv and any(a.startswith("ControlPath=") and a.endswith("/%C") for a in argv)
    assert argv.index("ControlMaster=auto") < argv.index("--")


def test_ordinary_destinations_are_accepted():
    hosts = ["gpu1", "ubuntu@gpu-2.plant.local", "ssh://ops@10.0.0.7:2222", "10.0.0.8", "fe80::1", "my_host"]
    c = ClusterSpec.from_hosts(hosts)
    assert [n.host for n in c.nodes] == hosts
    assert [n.reach_address for n in c.nodes] == ["gpu1", "gpu-2.plant.local", "10.0.0.7", "10.0.0.8",
                                                  "fe80::1", "my_host"]
