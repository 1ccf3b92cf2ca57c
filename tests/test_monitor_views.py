"""top, report and dashboard over a stored job (the collection itself is tested in
test_monitor_agent/netns): 2 nodes, one GPU each, 4 ranks, rank 3 a straggler, the GPU
of node b idle, node b's agent lost at the end."""

from __future__ import annotations

import json
import math

import pytest

from dtrain.monitor.jobs import JobInfo
from dtrain.monitor.store import Store

T0 = 1_800_000_000.0
N = 400  # one poll a second: 6.7 minutes


def write_job(job_dir):
    store = Store.for_job(job_dir)
    store.set_meta(job=job_dir.name, started=T0)
    for node in ("a", "b"):
        store.upsert_node(node, f"http://{node}:9464", T0, "pending")
        store.set_state(node, "reporting", T0, f"node {node} reporting")
    totals = {r: [0, 0.0, 0.0, 0] for r in range(4)}
    for i in range(N):
        t = T0 + i
        nodes, gpus, ranks = [], [], []
        for k, node in enumerate(("a", "b")):
            if node == "b" and i > N - 5:
                continue  # b stopped answering
            nodes.append((node, {
                "cpu": 0.5 + 0.4 * math.sin(i / 20 + k), "mem_used": 6e9 + 1e6 * i, "mem_total": 16 * 2**30,
                "net_rx_bps": 2.5e6, "net_tx_bps": 1.2e6, "disk_read_bps": 4e6, "disk_write_bps": 1e5,
                "disk_read_iops": 100, "disk_write_iops": 3, "job_cpu": 0.4, "job_rss": 3e9, "job_procs": 3,
            }, json.dumps({"cpu_cores": [0.5, 0.5]})))
            gpus.append((node, 0, {"util": 0.93 if node == "a" else 0.02, "mem_used": 20e9, "mem_total": 80e9,
                                   "power_w": 250.0, "temp_c": 60.0, "sm_clock_hz": 1.4e9}))
        for rank in range(4):
            node = "a" if rank < 2 else "b"
            if node == "b" and i > N - 5:
                continue
            step_time = 0.25 if rank == 3 else 0.1
            steps = int(1 / step_time)
            tot = totals[rank]
            tot[0] += steps
            tot[1] += steps * step_time
            tot[2] += steps * 0.01
            tot[3] += steps * 32
            ranks.append((node, rank, {
                "step": tot[0], "epoch": i // 100, "loss": 2.0 * math.exp(-i / 150) + 0.1, "lr": 0.1,
                "steps": steps, "step_time": step_time, "data_wait": 0.01, "samples_per_s": steps * 32.0,
                "steps_total": tot[0], "step_time_total": tot[1], "data_wait_total": tot[2], "samples_total": tot[3],
            }))
        store.write_poll(t, nodes, gpus, ranks)
    store.set_state("b", "not_reporting", T0 + N - 2, "node b stopped reporting: 3 polls failed")
    store.add_finding("not_reporting:b:None:None:x", T0 + N - 2, "not_reporting", "b", None, None,
                      "node b stopped reporting: 3 polls failed")
    store.set_meta(stopped=T0 + N)
    store.close()


@pytest.fixture(scope="module")
def stored_job(tmp_path_factory):
    job_dir = tmp_path_factory.mktemp("jobs") / "20261202-120000-abcd"
    write_job(job_dir)
    return JobInfo(id=job_dir.name, dir=job_dir, name="demo", state="succeeded")


def test_top_renders_every_node_and_the_findings_in_80_columns(stored_job):
    from dtrain.monitor.top import render_text

    store = stored_job.open()
    text = render_text(store, stored_job, width=80)
    store.close()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, text
    row_a = next(line for line in lines if line.startswith("a "))
    row_b = next(line for line in lines if line.startswith("b "))
    assert "2.5M/1.2M" in row_a and "4.0M/100k" in row_a  # net in/out, disk r/w
    assert "0: 93%" in row_a and "0:  2%" in row_b  # GPU util per GPU
    assert "r0 0.1s" in row_a and "r2 0.1s" in row_b
    assert "r3 0.25s" in text  # b's slowest rank, on the line under r2
    assert any(c in row_a for c in "▁▂▃▄▅▆▇█")  # CPU sparkline
    assert "rank 3 on b is a straggler" in text
    assert "GPU 0 on b was idle" in text
    assert "node b stopped reporting" in text
    assert "nodes 1/2 reporting" in text
