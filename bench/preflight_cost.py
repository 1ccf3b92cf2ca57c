"""What `dtrain check` costs, vs the version check people write by hand.

Two namespace hosts (the test harness in tests/netns.py, needs root). Each round runs,
alternating:
  ours (API):      run_preflight(cluster) - every check: ssh, Python/torch versions, GPUs,
                   master port held + connected to from the other node, interface,
                   reverse lookups, shared path digest, clock skew
  ours (CLI):      `dtrain check cluster.yaml` as a process (adds the CLI's start-up)
  by hand, serial: for h in hosts: ssh h python -c "import torch, sys; print(versions)"
  by hand, parallel: the same ssh commands started together
The hand-written loop checks far less (only that ssh works and which torch imports); it
is the baseline for what the extra checks cost in wall time.

    sudo .venv/bin/python bench/preflight_cost.py [--rounds 5] [--hosts 2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BY_HAND = "import torch, sys; print(torch.__version__, sys.version.split()[0])"


def by_hand(cluster, hosts, parallel: bool) -> float:
    argv = [["ssh", "-F", str(cluster.ssh_config), h.name, f"{sys.executable} -c '{BY_HAND}'"] for h in hosts]
    t0 = time.perf_counter()
    if parallel:
        procs = [subprocess.Popen(a, stdout=subprocess.PIPE, text=True) for a in argv]
        outs = [p.communicate()[0] for p in procs]
    else:
        outs = [subprocess.run(a, capture_output=True, text=True, check=True).stdout for a in argv]
    elapsed = time.perf_counter() - t0
    assert all(o.strip() for o in outs), outs
    return elapsed


def ours_api(spec, port: int) -> float:
    from dtrain.cluster.preflight import run_preflight

    t0 = time.perf_counter()
    report = run_preflight(spec, master_port=port, timeout=60)
    elapsed = time.perf_counter() - t0
    assert report.ok, report.failures
    return elapsed


def ours_cli(yaml: Path, port: int) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "dtrain", "check", str(yaml), "--port", str(port), "--json"],
                   check=True, capture_output=True, cwd=REPO)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hosts", type=int, default=2)
    args = parser.parse_args()

    from dtrain.cluster.spec import load_cluster
    from tests import netns

    reason = netns.unavailable_reason()
    if reason:
        sys.exit(f"cannot build namespace hosts: {reason}")
    cluster = netns.build()
    try:
        yaml = cluster.cluster_yaml(args.hosts, extra=f"shared_paths: [{REPO / 'dtrain'}]\n")
        spec = load_cluster(yaml)
        hosts = cluster.hosts[: args.hosts]
        times: dict[str, list[float]] = {"ours (API)": [], "ours (CLI)": [], "by hand, serial": [],
                                         "by hand, parallel": []}
        by_hand(cluster, hosts, parallel=True)  # warm the page cache for both sides
        for r in range(args.rounds):
            port = 29700 + r
            times["ours (API)"].append(ours_api(spec, port))
            times["by hand, serial"].append(by_hand(cluster, hosts, parallel=False))
            times["ours (CLI)"].append(ours_cli(yaml, port + 50))
            times["by hand, parallel"].append(by_hand(cluster, hosts, parallel=True))
    finally:
        netns.teardown(cluster)

    base = statistics.median(times["by hand, parallel"])
    print(f"{args.hosts} namespace hosts, {args.rounds} rounds, median wall time (min-max)")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:<18} {med:6.2f} s  ({min(ts):.2f}-{max(ts):.2f})  x{med / base:.2f} of by hand, parallel")


if __name__ == "__main__":
    main()
