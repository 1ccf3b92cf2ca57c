"""The multi-host harness itself: hosts reachable over ssh, isolated, resolvable, shared files."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.netns


def test_every_host_answers_over_ssh_from_its_own_namespace(netns_cluster, tmp_path):
    marker = tmp_path / "shared.txt"
    marker.write_text("same filesystem\n")
    for h in netns_cluster.hosts:
        res = netns_cluster.ssh(h.name, f"ip -4 -o addr show dev eth0; cat {marker}")
        assert res.returncode == 0, res.stderr
        assert f"inet {h.address}/24" in res.stdout
        assert "same filesystem" in res.stdout


def test_hosts_reach_each_other_and_the_head(netns_cluster):
    h1, h2 = netns_cluster.hosts[:2]
    for target in (h2.address, netns_cluster.head_address):
        res = netns_cluster.exec(h1, ["bash", "-c", f"exec 3<>/dev/tcp/{target}/22 && echo open"]
                                 if target != netns_cluster.head_address else
                                 ["ip", "route", "get", target])
        assert res.returncode == 0, res.stderr
    assert "dev eth0" in netns_cluster.exec(h1, ["ip", "route", "get", netns_cluster.head_address]).stdout


def test_reverse_lookups_inside_a_host_answer_from_its_hosts_file_at_once(netns_cluster):
    h1, h2 = netns_cluster.hosts[:2]
    t0 = time.monotonic()
    res = netns_cluster.ssh(h1.name, f"getent hosts {h2.address} {netns_cluster.head_address}")
    assert res.returncode == 0, res.stderr
    assert h2.name in res.stdout and "head" in res.stdout
    assert time.monotonic() - t0 < 10  # a stalled resolver would take its full timeout


def test_processes_lists_what_runs_in_a_host_but_not_its_sshd(netns_cluster):
    h = netns_cluster.hosts[2]
    assert not any("[listener]" in cmd for _, cmd in netns_cluster.processes(h))
    proc = netns_cluster.popen(h, ["sleep", "30"])
    try:
        deadline = time.monotonic() + 5
        while not any("sleep 30" in cmd for _, cmd in netns_cluster.processes(h)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any("sleep 30" in cmd for _, cmd in netns_cluster.processes(h))
    finally:
        proc.kill()
        proc.wait()
    assert not any("sleep 30" in cmd for _, cmd in netns_cluster.processes(h))


def test_leftovers_of_a_killed_session_are_removed_by_the_next(netns_cluster):
    import subprocess
    from pathlib import Path

    from tests import netns

    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs, as after SIGKILL of a test session
    ns, veth, tmp = f"dt{dead.pid}h1", f"dt{dead.pid}v1", Path(f"/tmp/dtrain-netns-{dead.pid}-x")
    subprocess.run(["ip", "netns", "add", ns], check=True)
    subprocess.run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns], check=True)
    tmp.mkdir()
    (netns.NETNS_ETC / ns).mkdir(parents=True)
    orphan = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "302"])
    try:
        netns._clean_stale()
        assert orphan.wait(timeout=10) != 0  # killed, not finished
        assert ns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert subprocess.run(["ip", "link", "show", veth], capture_output=True).returncode != 0
        assert not tmp.exists() and not (netns.NETNS_ETC / ns).exists()
    finally:
        orphan.kill()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    # the live session's hosts are untouched
    assert all(netns_cluster.ssh(h.name, "true").returncode == 0 for h in netns_cluster.hosts)
