"""Monitoring across two namespace hosts reached over real SSH: agents started through
the cluster runners exactly as a launcher does, ranks on both hosts calling report_step,
the collector on the head storing both hosts' series."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from test_monitor_agent import RANK_CODE, wait_http

from dtrain.cluster.runner import runner_for
from dtrain.cluster.spec import load_cluster
from dtrain.monitor.head.startup import agent_argv, agent_env, agent_url
from dtrain.monitor.head.collector import Collector
from dtrain.monitor.head.metrics_db import MetricsDB

pytestmark = [pytest.mark.netns, pytest.mark.slow]
PORT = 19464  # not the launcher's default, so agents of other tests cannot answer for ours


def test_two_hosts_collected_straggler_flagged_lost_nodes_reported(netns_cluster, tmp_path):
    cluster = load_cluster(netns_cluster.cluster_yaml(2))
    nodes = cluster.nodes[:2]
    runners = {n.name: runner_for(n, cluster) for n in nodes}
    agents = {
        n.name: runners[n.name].popen(agent_argv("job2", n.name, n.reach_address, PORT, n.python), cwd=n.workdir,
                                      stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        for n in nodes
    }
    endpoints = {n.name: agent_url(n.reach_address, PORT) for n in nodes}
    for url in endpoints.values():
        wait_http(url + "/healthz")
    job_dir = tmp_path / "job2"
    found = []
    coll = Collector(job_dir, endpoints, on_finding=found.append, findings_every_s=1.0).start()
    try:
        # 2 ranks per host; global rank 3 on the second host sleeps 5x longer in every step
        plan = [(nodes[0], 0, 25, 0.1), (nodes[0], 1, 25, 0.1), (nodes[1], 2, 25, 0.1), (nodes[1], 3, 6, 0.5)]
        ranks = [
            runners[node.name].popen([node.python, "-c", RANK_CODE, str(steps), str(sleep)],
                                     env={**agent_env(PORT), "RANK": str(rank), "DTRAIN_JOB_ID": "job2"},
                                     cwd=node.workdir, stdin=subprocess.DEVNULL)
            for node, rank, steps, sleep in plan
        ]
        for r in ranks:
            assert r.wait(timeout=90) == 0
        time.sleep(2.0)  # let the collector poll the last steps before an agent dies
        deadline = time.monotonic() + 10
        while not any(f.kind == "straggler" for f in found) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [(f.node, f.rank) for f in found if f.kind == "straggler"] == [(nodes[1].name, 3)], found

        victim = nodes[1].name
        [pid] = [p for p, cmd in netns_cluster.processes(victim) if "dtrain.monitor.node.agent" in cmd
                 and not cmd.startswith(("bash", "sh "))]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        while not any(f.kind == "not_reporting" for f in found) and time.monotonic() - killed < 10:
            time.sleep(0.1)
        assert [f.node for f in found if f.kind == "not_reporting"] == [victim], found
        assert time.monotonic() - killed < 10

        # a node that drops off the network (polls time out instead of being refused)
        cut = nodes[0].name
        netns_cluster.set_link(cut, False)
        try:
            t_cut = time.monotonic()
            while not any(f.node == cut for f in found if f.kind == "not_reporting") and time.monotonic() - t_cut < 10:
                time.sleep(0.1)
            assert time.monotonic() - t_cut < 10, found
        finally:
            netns_cluster.set_link(cut, True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "reporting again" not in (job_dir / "monitor.log").read_text():
            time.sleep(0.2)
        assert f"node {cut} is reporting again" in (job_dir / "monitor.log").read_text()
    finally:
        coll.stop()
        for a in agents.values():
            a.stdin.close()  # the SSH session ends -> the remote agent sees EOF and exits
        for a in agents.values():
            a.wait(timeout=15)

    store = MetricsDB.for_job(job_dir, readonly=True)
    states = {n["node"]: n["state"] for n in store.nodes()}
    assert states == {nodes[0].name: "reporting", nodes[1].name: "not_reporting"}
    series = store.node_series()
    assert set(series) == {nodes[0].name, nodes[1].name}
    for name in series:
        assert len(series[name]["t"]) >= 3 and all(c is not None for c in series[name]["cpu"])
    ranks = store.rank_series()
    assert set(ranks) == {(nodes[0].name, 0), (nodes[0].name, 1), (nodes[1].name, 2), (nodes[1].name, 3)}
    assert max(ranks[(nodes[1].name, 3)]["steps_total"]) == 6
    # every host's agent is gone: nothing of the monitor is left running anywhere
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
        "dtrain.monitor.node.agent" in cmd for n in nodes for _, cmd in netns_cluster.processes(n.name)
    ):
        time.sleep(0.2)
    assert not [cmd for n in nodes for _, cmd in netns_cluster.processes(n.name) if "dtrain.monitor.node.agent" in cmd]
