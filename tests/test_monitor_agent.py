"""The node agent and the head collector on this host: real agent processes on
loopback, real rank processes calling report_step, real SQLite."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dtrain.monitor.head.startup import agent_argv, agent_env, agent_url
from dtrain.monitor.head.collector import Collector
from dtrain.monitor.node.metrics import METRICS
from dtrain.monitor.head.metrics_db import MetricsDB
from dtrain.ports import free_port

REPO = Path(__file__).resolve().parents[1]

# A stand-in training rank: `steps` steps of `sleep` seconds, reported like the trainer does.
RANK_CODE = """
import sys, time
from dtrain.monitor.rank.client import report_step
steps, sleep = int(sys.argv[1]), float(sys.argv[2])
for i in range(steps):
    t0 = time.perf_counter()
    time.sleep(sleep)
    report_step(step=i, epoch=0, loss=1.0 / (i + 1), lr=0.1, step_time_s=time.perf_counter() - t0,
                data_wait_s=0.1 * sleep, samples=8)
"""


def wait_http(url: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def start_agent(job: str, node: str, port: int, bind: str = "127.0.0.1") -> subprocess.Popen:
    argv = agent_argv(job, node, bind, port, sys.executable)
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, cwd=REPO)
    wait_http(agent_url(bind, port) + "/healthz")
    return proc


def start_rank(rank: int, port: int, steps: int, sleep: float, job: str = "jobX") -> subprocess.Popen:
    env = {**os.environ, **agent_env(port), "RANK": str(rank), "DTRAIN_JOB_ID": job}
    return subprocess.Popen([sys.executable, "-c", RANK_CODE, str(steps), str(sleep)], env=env, cwd=REPO)


def readme_metrics() -> dict[str, str]:
    """metric name -> its README row (the README's "Metrics" section)."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): line for line in section.splitlines() if (m := re.match(r"\| `(dtrain_\w+)`", line))}


@pytest.fixture
def agent():
    port = free_port()
    proc = start_agent("jobX", "nodeA", port)
    yield port, proc
    proc.stdin.close()  # the agent ends when its stdin closes, like over SSH
    assert proc.wait(timeout=10) == 0


def test_prometheus_endpoint_parses_and_has_every_documented_metric(agent):
    port, _ = agent
    start_rank(0, port, steps=3, sleep=0.01).wait(timeout=30)
    time.sleep(0.2)  # datagrams are asynchronous
    text = urllib.request.urlopen(agent_url("127.0.0.1", port) + "/metrics", timeout=5).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    exposed = {s.name: s for f in families.values() for s in f.samples}

    documented = readme_metrics()
    assert set(documented) == {m.name for m in METRICS}, "README's metric list drifted from metrics.py"
    have_gpu = any(n.startswith("dtrain_gpu_") for n in exposed)
    if not Path("/dev/nvidia0").exists():
        assert not have_gpu  # no GPU: the series are absent, and the agent still serves
    for name, row in documented.items():
        if "NVIDIA GPUs only" in row and not have_gpu:
            continue
        assert name in exposed, f"{name} is documented but not exposed"
    for s in exposed.values():
        assert s.labels["job"] == "jobX" and s.labels["node"] == "nodeA"
    steps = [s for s in families["dtrain_rank_steps"].samples if s.name == "dtrain_rank_steps_total"]
    assert [(s.labels["rank"], s.value) for s in steps] == [("0", 3.0)]
    assert 0.0 <= exposed["dtrain_node_cpu_utilization_ratio"].value <= 1.0
    assert exposed["dtrain_node_memory_total_bytes"].value > 1e8


def test_agent_listens_on_loopback_by_default():
    import psutil

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dtrain.monitor.node.agent", "--job", "j", "--node", "n", "--port",
                             str(port)], stdout=subprocess.DEVNULL, cwd=REPO)
    try:
        wait_http(agent_url("127.0.0.1", port) + "/healthz")
        listening = {(c.laddr.ip, c.type) for c in psutil.Process(proc.pid).net_connections("inet")
                     if c.laddr and c.laddr.port == port}
        assert listening == {("127.0.0.1", socket.SOCK_STREAM), ("127.0.0.1", socket.SOCK_DGRAM)}
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


@pytest.mark.slow  # two agent processes and three reporting ranks in real time: ~10 s on the loaded 2-core machine
def test_collector_stores_series_flags_straggler_and_dead_node(tmp_path):
    ports = {"n1": free_port(), "n2": free_port()}
    agents = {n: start_agent("jobX", n, p) for n, p in ports.items()}
    job_dir = tmp_path / "jobX"  # named as the job: the collector checks whose agent answers
    found = []
    coll = Collector(job_dir, {n: agent_url("127.0.0.1", p) for n, p in ports.items()}, on_finding=found.append,
                     findings_every_s=1.0).start()
    try:
        # 0.1 s vs 0.5 s steps: scheduling delays on a loaded machine stay far below the
        # 1.2x margin of the fast ranks
        ranks = [start_rank(0, ports["n1"], 25, 0.1), start_rank(1, ports["n2"], 25, 0.1),
                 start_rank(2, ports["n2"], 6, 0.5)]
        for r in ranks:
            assert r.wait(timeout=60) == 0
        time.sleep(2.5)
        stragglers = [f for f in found if f.kind == "straggler"]
        assert [(f.node, f.rank) for f in stragglers] == [("n2", 2)], found

        agents["n1"].send_signal(signal.SIGKILL)
        agents["n1"].wait()
        killed = time.monotonic()
        while not any(f.kind == "not_reporting" for f in found) and time.monotonic() - killed < 10:
            time.sleep(0.1)
        dead = [f for f in found if f.kind == "not_reporting"]
        assert [f.node for f in dead] == ["n1"], found
        assert time.monotonic() - killed < 10
    finally:
        coll.stop()
        for a in agents.values():
            a.kill()
            a.wait()
    store = MetricsDB.for_job(job_dir, readonly=True)
    nodes = {n["node"]: n for n in store.nodes()}
    assert nodes["n1"]["state"] == "not_reporting" and nodes["n2"]["state"] == "reporting"
    series = store.node_series()
    assert set(series) == {"n1", "n2"} and len(series["n2"]["t"]) >= 3
    ranks = store.rank_series()
    assert set(ranks) == {("n1", 0), ("n2", 1), ("n2", 2)}
    assert sum(ranks[("n2", 2)]["steps"]) == 6
    assert ranks[("n1", 0)]["steps_total"][-1] == 25
    assert "n1 stopped reporting" in (job_dir / "monitor.log").read_text()


def test_an_agent_still_starting_gets_a_grace_before_it_is_called_missing(tmp_path):
    # Under Slurm the head starts polling when the training step starts, and the agents
    # start with it (niced, next to the ranks' start-up): early refusals are not a dead node.
    now = [1000.0]
    found = []
    coll = Collector(tmp_path / "jobZ", {"n1": agent_url("127.0.0.1", free_port())}, clock=lambda: now[0],
                     on_finding=found.append, interval_s=0.2, start_grace_s=30)
    for _ in range(5):  # refused, within the grace
        now[0] += 1
        coll.poll_once()
    assert found == []
    now[0] += 30
    coll.poll_once()
    coll.stop()
    assert [f.kind for f in found] == ["not_reporting"]
    assert found[0].message.startswith("node n1 has not reported since monitoring started 35 s ago: 6 polls of")
    nodes = {n["node"]: n for n in MetricsDB.for_job(tmp_path / "jobZ", readonly=True).nodes()}
    assert nodes["n1"]["state"] == "not_reporting"


def test_a_quiet_grace_keeps_a_node_that_ends_with_its_job_out_of_the_live_findings(tmp_path):
    # Under Slurm each node's agent ends with its ranks, seconds before the head hears
    # that the job ended: that is no "stopped reporting". A node the job outlives is.
    def lose_an_agent(job: str):
        port, now, found = free_port(), [1000.0], []
        agent = start_agent(job, "n1", port)
        coll = Collector(tmp_path / job, {"n1": agent_url("127.0.0.1", port)}, clock=lambda: now[0],
                         on_finding=found.append, interval_s=0.5, quiet_grace_s=15)
        coll.poll_once()
        agent.kill()
        agent.wait()
        for _ in range(3):
            now[0] += 1
            coll.poll_once()
        return coll, now, found

    coll, now, found = lose_an_agent("jobEnd")  # the job ends 3 s after the agent
    coll.stop()
    assert found == []
    nodes = {n["node"]: n for n in MetricsDB.for_job(tmp_path / "jobEnd", readonly=True).nodes()}
    assert nodes["n1"]["state"] == "not_reporting" and nodes["n1"]["state_since"] == 1003.0  # stored as it was
    log = tmp_path / "jobEnd" / "monitor.log"
    assert not log.exists() or "stopped reporting" not in log.read_text()

    coll, now, found = lose_an_agent("jobOn")  # the job goes on without it
    now[0] += 14
    coll.poll_once()
    assert found == []
    now[0] += 1
    coll.poll_once()
    coll.stop()
    assert [(f.kind, f.node, f.t) for f in found] == [("not_reporting", "n1", 1003.0)], found
    assert found[0].message.startswith("node n1 stopped reporting: 3 polls of")
    assert "n1 stopped reporting" in (tmp_path / "jobOn" / "monitor.log").read_text()


def test_an_agent_of_another_job_is_not_taken_for_ours(agent, tmp_path):
    # Two jobs on one node, the second one's agent could not bind the port: the first
    # job's agent answers. Its series must not be stored as the second job's.
    port, _ = agent  # the fixture's agent belongs to job "jobX"
    found = []
    coll = Collector(tmp_path / "jobY", {"nodeA": agent_url("127.0.0.1", port)}, on_finding=found.append,
                     interval_s=0.2)
    for _ in range(3):
        coll.poll_once()
    coll.stop()
    assert [f.kind for f in found] == ["not_reporting"]
    assert "belongs to job 'jobX'" in found[0].message
    store = MetricsDB.for_job(tmp_path / "jobY", readonly=True)
    assert store.node_series() == {}


def _snapshot(port: int) -> dict:
    import json

    return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/snapshot", timeout=5).read())


def test_bad_datagrams_neither_stop_the_agent_nor_break_its_metrics(agent):
    """Any process on a node may send the agent a datagram. `"pid": -1` (psutil's ValueError)
    or `"rank": 1e999` (OverflowError) ended its receiving thread for good; a loss sent as
    text made every /metrics scrape fail (and `top` and the report after the collector)."""
    import json

    port, _ = agent
    counters = {"steps_total": 1, "step_time_total": 0.1, "data_wait_total": 0.0, "samples_total": 8}
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for msg in ({"job": "jobX", "rank": 0, "pid": -1, **counters},
                {"job": "jobX", "rank": 1e999, "pid": os.getpid(), **counters},
                {"job": "jobX", "rank": 1, "pid": os.getpid(), "loss": "diverged", "step": [1], **counters}):
        sender.sendto(json.dumps(msg).encode(), ("127.0.0.1", port))
    time.sleep(0.3)
    sender.sendto(json.dumps({"job": "jobX", "rank": 2, "pid": os.getpid(), "loss": 0.5, **counters}).encode(),
                  ("127.0.0.1", port))
    deadline = time.monotonic() + 10
    while "2" not in (ranks := _snapshot(port)["ranks"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    sender.close()
    assert set(ranks) == {"0", "1", "2"}, ranks  # still receiving after the bad ones
    assert ranks["1"]["loss"] is None and ranks["1"]["step"] is None and ranks["2"]["loss"] == 0.5
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert list(text_string_to_metric_families(text))


def test_one_slow_or_odd_agent_costs_only_its_own_node(agent, tmp_path):
    """An agent that sent its answer a byte at a time held the collector's poll for good (the
    timeout is per read), and an answer of another shape ({"gpus": [{}]}) aborted the poll
    before anything was stored: no node had a row, the healthy one included."""
    import http.server
    import json
    import threading

    port, _ = agent
    good_snapshot = _snapshot(port)

    class Odd(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if self.server.server_port == slow.server_port:
                self.send_response(200)
                self.end_headers()
                for ch in b'{"job": "jobX", "host": {}}' * 100:
                    self.wfile.write(bytes([ch]))
                    self.wfile.flush()
                    time.sleep(0.3)
                return
            body = json.dumps({**good_snapshot, "host": {"gpus": [{"util": "high"}]}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    slow = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Odd)
    odd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Odd)
    slow.daemon_threads = odd.daemon_threads = True
    for server in (slow, odd):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    coll = Collector(tmp_path / "jobX", {"good": agent_url("127.0.0.1", port),
                                         "slow": agent_url("127.0.0.1", slow.server_port),
                                         "odd": agent_url("127.0.0.1", odd.server_port)},
                     interval_s=0.5, start_grace_s=0.0).start()
    time.sleep(4)
    coll.stop()
    slow.shutdown()
    odd.shutdown()
    store = MetricsDB.for_job(tmp_path / "jobX", readonly=True)
    series = store.node_series()
    assert set(series) == {"good"} and len(series["good"]["t"]) >= 3, series.keys()
    states = {n["node"]: n["state"] for n in store.nodes()}
    assert states["good"] == "reporting" and states["slow"] == states["odd"] == "not_reporting", states


@pytest.mark.parametrize("env", [{"DTRAIN_AGENT_ADDR": "127.0.0.1:70000"}, {"RANK": "", "LOCAL_RANK": "x"}])
def test_report_step_never_takes_a_training_step_down(env, tmp_path):
    """Metrics are best effort: an agent address with a port out of range raised
    OverflowError from sendto at every step (and at exit), and RANK="" or LOCAL_RANK="x"
    (a user's own launcher) raised ValueError from the first call."""
    code = ("from dtrain.monitor.rank.client import report_step\n"
            "for i in range(3):\n"
            "    report_step(step=i, loss=1.0, step_time_s=0.01, samples=1)\n"
            "print('trained')\n")
    full = {**os.environ, "DTRAIN_HEARTBEAT_DIR": str(tmp_path / "hb"), **env}
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "trained" and not out.stderr, out.stderr[-800:]
