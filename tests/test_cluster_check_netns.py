"""`dtrain check` across namespace hosts: a healthy cluster passes; each broken node is
named with what to fix, and the exit status is the preflight one. `dtrain run` on the
same broken clusters stops at the same checks and launches nothing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from dtrain.errors import ExitStatus

pytestmark = pytest.mark.netns


def check(dtrain_cmd, cluster_yaml, *args, timeout=60):
    return subprocess.run([*dtrain_cmd, "check", str(cluster_yaml), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "200"})


def run_is_refused(dtrain_cmd, netns_cluster, cluster_yaml, port, node, dtrain_home):
    """`dtrain run` on the same cluster stops at preflight, names the node, starts nothing."""
    res = subprocess.run([*dtrain_cmd, "run", str(cluster_yaml), "--port", str(port), "--", "python", "-c", "pass"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert res.returncode == ExitStatus.PREFLIGHT, res.stdout + res.stderr
    assert f"{node}: " in res.stderr and "nothing was launched" in res.stderr
    assert not list((dtrain_home / "jobs").glob("*/job.json"))
    for h in netns_cluster.hosts:
        assert not [c for _, c in netns_cluster.processes(h) if "torch.distributed.run" in c]


def test_two_healthy_hosts_pass_and_name_the_interface_to_the_master(netns_cluster, dtrain_cmd, tmp_path):
    shared = tmp_path / "shared"
    (shared / "a").mkdir(parents=True)
    (shared / "a" / "x.bin").write_bytes(b"123")
    yaml = netns_cluster.cluster_yaml(2, extra=f"shared_paths: [{shared}]\n")
    res = check(dtrain_cmd, yaml, "--port", "29611")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "h1 *" in res.stdout and "h2" in res.stdout and "FAIL" not in res.stdout

    res = check(dtrain_cmd, yaml, "--port", "29611", "--json")
    report = json.loads(res.stdout)
    assert res.returncode == 0
    assert [n["node"] for n in report["nodes"]] == ["h1", "h2"]
    assert {n["ifname"] for n in report["nodes"]} == {"eth0"}
    assert [n["port"] for n in report["nodes"]] == ["free", "open"]
    assert report["nodes"][1]["shared"][0]["digest"] == report["nodes"][0]["shared"][0]["digest"]


def test_an_unreachable_host_is_named(netns_cluster, dtrain_cmd, dtrain_home):
    ghost = netns_cluster.hosts[0].address.rsplit(".", 1)[0] + ".77"  # on the bridge, nobody there
    yaml = netns_cluster.cluster_yaml(2, extra=f"  - {{name: ghost, host: '{ghost}'}}\n")
    res = check(dtrain_cmd, yaml, "--port", "29612", "--timeout", "15")
    assert res.returncode == ExitStatus.PREFLIGHT, res.stdout + res.stderr
    assert "ghost: cannot connect with ssh" in res.stdout
    assert "is the host up, and reachable from this machine?" in res.stdout
    assert "preflight failed on 1 node(s): ghost" in res.stderr
    run_is_refused(dtrain_cmd, netns_cluster, yaml, 29612, "ghost", dtrain_home)


def test_a_wrong_python_path_is_named(netns_cluster, dtrain_cmd, dtrain_home):
    yaml = netns_cluster.cluster_yaml(2, node_extra={"h2": "    python: /opt/nowhere/bin/python3"})
    res = check(dtrain_cmd, yaml, "--port", "29613")
    assert res.returncode == ExitStatus.PREFLIGHT, res.stdout + res.stderr
    assert "h2: python '/opt/nowhere/bin/python3' not found" in res.stdout
    assert "failed on 1 node(s): h2" in res.stderr
    run_is_refused(dtrain_cmd, netns_cluster, yaml, 29613, "h2", dtrain_home)


def test_a_torch_version_mismatch_is_named(netns_cluster, dtrain_cmd, dtrain_home, tmp_path):
    # A node whose interpreter finds another torch first, as when an old install shadows
    # the new one: a package `torch` whose version.py says 2.3.0, ahead on sys.path.
    fake = tmp_path / "old-site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("from torch.version import __version__\n")
    (fake / "version.py").write_text("__version__ = '2.3.0+cu121'\ncuda: str = '12.1'\n")
    wrapper = tmp_path / "bin" / "python3"
    wrapper.parent.mkdir()
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={fake.parent} exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    shown = subprocess.run([str(wrapper), "-c", "import torch; print(torch.__version__)"],
                           capture_output=True, text=True).stdout.strip()
    assert shown == "2.3.0+cu121"

    yaml = netns_cluster.cluster_yaml(2, node_extra={"h2": f"    python: {wrapper}"})
    res = check(dtrain_cmd, yaml, "--port", "29614")
    assert res.returncode == ExitStatus.PREFLIGHT, res.stdout + res.stderr
    assert "h2: torch 2.3.0+cu121 here but" in res.stdout and "on h1" in res.stdout
    run_is_refused(dtrain_cmd, netns_cluster, yaml, 29614, "h2", dtrain_home)


def test_a_blocked_master_port_is_named_with_its_holder(netns_cluster, dtrain_cmd, dtrain_home):
    port = 29615
    blocker = netns_cluster.popen("h1", [sys.executable, "-c", textwrap.dedent(f"""
        import socket, sys, time
        s = socket.socket(); s.bind(("0.0.0.0", {port})); s.listen(); print("up", flush=True); time.sleep(120)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert blocker.stdout.readline().strip() == "up"
        yaml = netns_cluster.cluster_yaml(2)
        res = check(dtrain_cmd, yaml, "--port", str(port))
        assert res.returncode == ExitStatus.PREFLIGHT, res.stdout + res.stderr
        assert f"h1: master port {port} is already in use by python" in res.stdout
        assert f"(pid {blocker.pid})" in res.stdout
        assert "failed on 1 node(s): h1" in res.stderr
        run_is_refused(dtrain_cmd, netns_cluster, yaml, port, "h1", dtrain_home)
    finally:
        blocker.kill()
        blocker.wait()


def test_a_stalling_resolver_on_a_node_is_reported_with_the_hosts_file_fix(netns_cluster, dtrain_cmd):
    # h2 loses its hosts entries and gets a resolver on the bridge that never answers:
    # every reverse lookup now stalls for the resolver's timeout, as on a host without DNS.
    silent = netns_cluster.hosts[0].address.rsplit(".", 1)[0] + ".99"
    h1 = netns_cluster.hosts[0]
    plain_hosts = f"127.0.0.1 localhost {socket.gethostname()}\n"
    with netns_cluster.edit_etc("h2", "hosts", plain_hosts), \
            netns_cluster.edit_etc("h2", "resolv.conf", f"nameserver {silent}\noptions timeout:2 attempts:1\n"):
        res = check(dtrain_cmd, netns_cluster.cluster_yaml(2), "--port", "29616")
    assert res.returncode == 0, res.stdout + res.stderr  # a warning, not a failure
    assert f"h2: reverse lookup of the master address {h1.address} took" in res.stdout
    assert f"add '{h1.address} h1' to /etc/hosts here" in res.stdout
    assert "h1: reverse lookup" not in res.stdout


def test_a_node_name_that_resolves_to_loopback_at_home_still_gets_its_real_interface(netns_cluster, dtrain_cmd):
    # Debian writes "127.0.1.1 <hostname>" into /etc/hosts: on the node itself its name
    # is loopback, and gloo left alone would listen where no other node can reach it.
    h1 = netns_cluster.hosts[0]
    with open(f"/etc/netns/{h1.netns}/hosts") as f:
        hosts = f.read()
    with netns_cluster.edit_etc("h1", "hosts", "127.0.1.1 h1\n" + hosts), \
            netns_cluster.edit_etc("h2", "hosts", hosts.replace(" h2\n", " h2\n127.0.1.1 h2\n")):
        assert netns_cluster.ssh("h1", "getent hosts h1").stdout.split()[0] == "127.0.1.1"
        yaml = netns_cluster.cluster_yaml(2)
        yaml.write_text(yaml.read_text().replace(f"address: {h1.address}", "address: h1")
                        .replace(f"address: {netns_cluster.hosts[1].address}", "address: h2"))
        res = check(dtrain_cmd, yaml, "--port", "29617", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    assert {n["node"]: n["ifname"] for n in json.loads(res.stdout)["nodes"]} == {"h1": "eth0", "h2": "eth0"}


def test_a_host_that_refuses_our_key_gets_the_key_hint(netns_cluster, dtrain_cmd):
    yaml = netns_cluster.cluster_yaml(2, extra="ssh_options: [PubkeyAuthentication=no]\n")
    res = check(dtrain_cmd, yaml, "--port", "29618")
    assert res.returncode == ExitStatus.PREFLIGHT
    for h in ("h1", "h2"):
        assert f"{h}: cannot connect with ssh to {h} (" in res.stdout and f"ssh-copy-id {h}" in res.stdout


def test_a_master_address_that_is_not_the_masters_is_flagged(netns_cluster, dtrain_cmd):
    h1 = netns_cluster.hosts[0]
    wrong = h1.address.rsplit(".", 1)[0] + ".78"  # a typo: nobody has it
    yaml = netns_cluster.cluster_yaml(2)
    yaml.write_text(yaml.read_text().replace(f"address: {h1.address}", f"address: {wrong}"))
    res = check(dtrain_cmd, yaml, "--port", "29619")
    assert res.returncode == ExitStatus.PREFLIGHT, res.stdout + res.stderr
    assert f"h1: the master's address {wrong} is not an address of this machine (eth0 {h1.address})" in res.stdout
    assert f"h2: cannot reach the master h1 at {wrong}:29619" in res.stdout
