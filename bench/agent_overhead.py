"""The node agent's cost: CPU time at 1 Hz over 60 s (target <= 1 % of one core) and RSS.

Side by side in one run:
- ours: `python -m dtrain.monitor.node.agent` at --interval 1, polled by a real Collector once
  a second (as on a job's head), scraped by Prometheus-style GETs of /metrics every 5 s,
  and fed by a stand-in rank sending report_step datagrams at 100 steps/s;
- baseline: a bare psutil loop reading the same kernel counters once a second (CPU per
  core, memory, network per interface, disk) with no server, no ranks, no JSON — the
  floor any psutil-based agent pays.
Also: report_step's cost per call, unconfigured and with an agent.

    .venv/bin/python bench/agent_overhead.py [--seconds 60]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BASELINE = """
import time, psutil
psutil.cpu_percent(percpu=True)
while True:
    psutil.cpu_percent(percpu=True); psutil.virtual_memory()
    psutil.net_io_counters(pernic=True); psutil.disk_io_counters()
    time.sleep(1.0)
"""

RANK = """
import sys, time
from dtrain.monitor.rank.client import report_step
end = time.monotonic() + float(sys.argv[1])
i = 0
while time.monotonic() < end:
    time.sleep(0.01)
    report_step(step=i, epoch=0, loss=0.5, lr=0.1, step_time_s=0.01, data_wait_s=0.001, samples=32)
    i += 1
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def measure(proc: psutil.Process, seconds: float) -> tuple[float, int]:
    """CPU seconds used by `proc` over `seconds` (after warm-up), and its peak RSS."""
    c0, rss = cpu_seconds(proc), 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(1.0)
        rss = max(rss, proc.memory_info().rss)
    return cpu_seconds(proc) - c0, rss


def report_step_cost() -> tuple[float, float]:
    from dtrain.monitor.rank import client as report

    def per_call(n: int) -> float:
        t = time.perf_counter()
        for i in range(n):
            report.report_step(step=i, epoch=0, loss=0.5, lr=0.1, step_time_s=0.01, data_wait_s=0.0, samples=32)
        return (time.perf_counter() - t) / n * 1e6

    for key in ("DTRAIN_AGENT_ADDR", "DTRAIN_HEARTBEAT_DIR"):
        os.environ.pop(key, None)
    report.reset()
    idle = per_call(200_000)
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    os.environ["DTRAIN_AGENT_ADDR"] = f"127.0.0.1:{sink.getsockname()[1]}"
    report.reset()
    active = per_call(20_000)
    os.environ.pop("DTRAIN_AGENT_ADDR")
    report.reset()
    sink.close()
    return idle, active


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=60.0)
    args = p.parse_args()
    from dtrain.monitor.head.startup import agent_argv, agent_env, agent_url
    from dtrain.monitor.head.collector import Collector

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    agent = subprocess.Popen(agent_argv("bench", "node0", "127.0.0.1", port, sys.executable), cwd=REPO, env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    base = subprocess.Popen([sys.executable, "-c", BASELINE])
    url = agent_url("127.0.0.1", port)
    for _ in range(100):
        try:
            urllib.request.urlopen(url + "/healthz", timeout=1).read()
            break
        except OSError:
            time.sleep(0.1)
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(args.seconds + 10)], cwd=REPO,
                            env={**env, **agent_env(port), "RANK": "0"})
    stop = threading.Event()

    def scrape() -> None:
        while not stop.wait(5.0):
            urllib.request.urlopen(url + "/metrics", timeout=2).read()

    with tempfile.TemporaryDirectory() as tmp:
        coll = Collector(Path(tmp) / "bench", {"node0": url}).start()
        threading.Thread(target=scrape, daemon=True).start()
        time.sleep(3.0)  # warm-up: imports, first samples
        results = {}
        threads = []
        for name, proc in (("ours", agent), ("baseline", base)):
            t = threading.Thread(target=lambda n=name, pr=proc: results.__setitem__(n, measure(psutil.Process(pr.pid), args.seconds)))
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        stop.set()
        coll.stop()
    for proc in (rank, base):
        proc.kill()
        proc.wait()
    agent.stdin.close()
    agent.wait(timeout=10)

    idle_us, active_us = report_step_cost()
    ours_cpu, ours_rss = results["ours"]
    base_cpu, base_rss = results["baseline"]
    ours_pct = 100 * ours_cpu / args.seconds
    base_pct = 100 * base_cpu / args.seconds
    print(f"window: {args.seconds:.0f} s at 1 Hz; collector polling 1 Hz, /metrics every 5 s, a rank at 100 steps/s")
    print(f"{'':28s}{'CPU % of one core':>20s}{'peak RSS MiB':>15s}")
    print(f"{'ours (dtrain agent)':28s}{ours_pct:20.3f}{ours_rss / 2**20:15.1f}")
    print(f"{'baseline (bare psutil loop)':28s}{base_pct:20.3f}{base_rss / 2**20:15.1f}")
    print(f"ratio ours/baseline CPU: {ours_pct / base_pct:.2f}x" if base_pct else "baseline CPU below resolution")
    print(f"target <= 1 % of one core: {'PASS' if ours_pct <= 1.0 else 'FAIL'}")
    print(f"report_step per call: {idle_us:.2f} us unconfigured, {active_us:.1f} us sending to an agent")


if __name__ == "__main__":
    main()
