"""Time from `dtrain run` to the first training step, vs torchrun started by hand.

Two namespace hosts (the test harness in tests/netns.py, needs root). Each round runs,
one after the other so that load drifts hit every variant alike:
  baseline: `ssh hN "cd REPO && env ... python -m torch.distributed.run --nnodes 2
            --node-rank i --master-addr A --master-port P ... plain_ddp.py"` on both hosts,
            started in parallel (what a careful person types),
  ours:     dtrain run cluster.yaml --no-preflight --nproc-per-node 1 -- python plain_ddp.py
  ours + preflight: the same without --no-preflight,
  check:    `dtrain check cluster.yaml` alone (the preflight's own cost),
and measures the wall time until rank 0's first "step 0" line reaches the head, and until
torchrun has started on both nodes (stamped by the nodes' interpreter, see Stamps): the
part dtrain adds before torchrun, apart from the torch start-up that follows, which is
the same work in both and only noise on a loaded machine. Reported: medians, dtrain's
overhead and the preflight's cost as medians of per-round differences, the load average.

    sudo flock /tmp/dtrain-bench.lock .venv/bin/python bench/launch_latency.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SCRIPT = str(REPO / "tests" / "scripts" / "plain_ddp.py")
FIRST_STEP = "step 0 "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Stamps:
    """The interpreter both variants run on the nodes: the venv's python behind a shell
    script that notes when torchrun starts (one `date`, the same for both), so the time
    to torchrun's start - what dtrain adds before it - is read apart from the rest."""

    def __init__(self, tmpdir: Path) -> None:
        self.log = tmpdir / "torchrun-starts.log"
        self.python = tmpdir / "python"
        self.python.write_text(f'#!/bin/sh\ncase "$2" in torch.distributed.run) date +%s.%N >> {self.log};; esac\n'
                               f'exec {sys.executable} "$@"\n')
        self.python.chmod(0o755)

    def reset(self) -> None:
        self.log.write_text("")

    def started(self, t0: float, n_nodes: int) -> float:
        """Seconds from t0 until torchrun had started on every node."""
        stamps = [float(x) for x in self.log.read_text().split()]
        if len(stamps) < n_nodes:
            raise RuntimeError(f"torchrun started on {len(stamps)} of {n_nodes} nodes")
        return max(stamps[:n_nodes]) - t0


def until_first_step(procs: list[subprocess.Popen], watch: subprocess.Popen, t0: float, timeout: float) -> float:
    deadline = t0 + timeout
    for line in watch.stdout:
        if FIRST_STEP in line:
            elapsed = time.time() - t0
            break
        if time.time() > deadline:
            raise RuntimeError("no first step before the timeout")
    else:
        raise RuntimeError(f"the run ended before its first step (rc {watch.wait()})")
    for p in procs:
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
    return elapsed


def ours(yaml: Path, home: str, preflight: bool, stamps: Stamps, extra: list[str] = ()) -> tuple[float, float]:
    """(seconds to the first step, seconds until torchrun ran on every node)"""
    argv = [sys.executable, "-m", "dtrain", "run", str(yaml), "--nproc-per-node", "1",
            "--port", str(free_port()), *([] if preflight else ["--no-preflight"]), *extra,
            "--", "python", SCRIPT, "--epochs", "1"]
    stamps.reset()
    t0 = time.time()
    proc = subprocess.Popen(argv, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, "DTRAIN_HOME": home})
    return until_first_step([proc], proc, t0, 300), stamps.started(t0, 2)


def by_hand(cluster, hosts, stamps: Stamps) -> tuple[float, float]:
    port = free_port()
    master = hosts[0].address
    procs = []
    stamps.reset()
    t0 = time.time()
    for rank, h in enumerate(hosts):
        remote = (f"cd {shlex.quote(str(REPO))} && GLOO_SOCKET_IFNAME=eth0 PYTHONUNBUFFERED=1 "
                  f"exec {shlex.quote(str(stamps.python))} -m torch.distributed.run --nnodes 2 --node-rank {rank} "
                  f"--master-addr {master} --master-port {port} --nproc-per-node 1 {shlex.quote(SCRIPT)} --epochs 1")
        procs.append(subprocess.Popen(["ssh", "-F", str(cluster.ssh_config), h.name, remote], text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL))
    return until_first_step(procs, procs[0], t0, 300), stamps.started(t0, 2)


def timed_min(argv: list[str], n: int, **kwargs) -> float:
    """Fastest of n runs: on a shared machine the minimum is the least disturbed one."""
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(argv, capture_output=True, timeout=120, **kwargs)
        best = min(best, time.perf_counter() - t0)
    return best


def parts(cluster, yaml: Path, home: str, n: int) -> None:
    """What dtrain adds before torchrun starts, piece by piece (the rest is identical)."""
    env = {**os.environ, "DTRAIN_HOME": home}
    py = sys.executable
    base = timed_min([py, "-c", "pass"], n)
    cli = timed_min([py, "-m", "dtrain", "run", str(yaml), "--dry-run", "--", "python", SCRIPT], n, cwd=REPO, env=env)
    wrapper = timed_min([py, "-c", "import dtrain.launch.node"], n)
    ssh = timed_min(["ssh", "-F", str(cluster.ssh_config), cluster.hosts[1].name, "exec", "true"], n)
    print(f"\noverhead parts, fastest of {n} (python start-up alone: {base:.2f} s):")
    print(f"  dtrain CLI start-up + cluster/job validation + plan (dry run): {cli:.2f} s")
    print(f"  node wrapper start-up before it starts torchrun:           {wrapper - base:+.2f} s over python")
    print(f"  one ssh session (handshake + login shell), paid once per node by both: {ssh:.2f} s")


def check(yaml: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "dtrain", "check", str(yaml), "--port", str(free_port())],
                   cwd=REPO, capture_output=True, timeout=120)
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--parts-only", action="store_true", help="only the overhead parts (quick)")
    parser.add_argument("--dtrain-args", default="", help="extra `dtrain run` arguments, e.g. --no-monitor")
    args = parser.parse_args()
    from tests import netns

    reason = netns.unavailable_reason()
    if reason:
        print(f"skipped: {reason}")
        return 1
    cluster = netns.build(2)
    try:
        stamps = Stamps(cluster.tmpdir)
        yaml = cluster.cluster_yaml(2)
        yaml.write_text(yaml.read_text().replace(f"python: {sys.executable}", f"python: {stamps.python}"))
        home = tempfile.mkdtemp(prefix="dtrain-bench-home-")
        print(f"load average at the start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        parts(cluster, yaml, home, max(3, args.rounds))
        if args.parts_only:
            return 0
        base, mine, checked, checks, loads = [], [], [], [], []
        for i in range(args.rounds):
            base.append(by_hand(cluster, cluster.hosts, stamps))
            mine.append(ours(yaml, home, False, stamps, args.dtrain_args.split()))
            checked.append(ours(yaml, home, True, stamps, args.dtrain_args.split()))
            checks.append(check(yaml))
            loads.append(os.getloadavg()[0])
            print(f"round {i + 1}: first step / torchrun started on both: by hand {base[-1][0]:.2f} / "
                  f"{base[-1][1]:.2f} s   dtrain run {mine[-1][0]:.2f} / {mine[-1][1]:.2f} s   "
                  f"+ preflight {checked[-1][0]:.2f} / {checked[-1][1]:.2f} s   dtrain check {checks[-1]:.2f} s   "
                  f"load {loads[-1]:.1f}", flush=True)
        med = statistics.median

        def diff(a, b, k):  # the median of per-round differences: load drifts cancel
            return med([x[k] - y[k] for x, y in zip(a, b)])

        print(f"\nmedian over {args.rounds} rounds (load average {min(loads):.1f}-{max(loads):.1f}), "
              "2 hosts x 1 proc:")
        for label, runs in (("torchrun by hand (ssh in parallel)", base), ("dtrain run --no-preflight", mine),
                            ("dtrain run (with preflight)", checked)):
            print(f"  {label:36s} first step {med([r[0] for r in runs]):6.2f} s   "
                  f"torchrun started {med([r[1] for r in runs]):5.2f} s")
        print(f"  overhead of dtrain run --no-preflight: {diff(mine, base, 0):+.2f} s to the first step, "
              f"{diff(mine, base, 1):+.2f} s to torchrun's start")
        print(f"  preflight's own cost: {diff(checked, mine, 0):+.2f} s to the first step, "
              f"{diff(checked, mine, 1):+.2f} s to torchrun's start; dtrain check alone {med(checks):.2f} s")
    finally:
        netns.teardown(cluster)
    return 0


if __name__ == "__main__":
    sys.exit(main())
