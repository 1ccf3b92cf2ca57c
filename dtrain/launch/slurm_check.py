"""A Slurm job's preflight: its first `srun` step, on every allocated node, before the
training step. The same per-node checks as `dtrain check` - the probe of
cluster/probe_remote.py, judged by cluster/checks.py - run on the node itself (the
nodes are only known inside the allocation). Each node prints one line into the job's
log; a node that fails prints `[dtrain] preflight failed on NODE: ...` and exits 1, and
srun's --kill-on-bad-exit ends the step, so the training step never starts.

    python -m dtrain.launch.slurm_check --node h2 --node-rank 1 --master h1 --port 29500 [--gpus 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from dtrain.cluster import checks, probe_remote
from dtrain.cluster.check_results import NodeReport
from dtrain.cluster.spec import NodeSpec

PROBE_TIMEOUT = 60.0
FAILED = "[dtrain] preflight failed on "


def check_node(node: str, node_rank: int, master: str, port: int, gpus: int | None) -> NodeReport:
    """Probe this node and judge it; node rank 0 hosts the rendezvous, so its port must be free."""
    args = {"deadline_s": 10, "master_address": master, "own_address": node,
            "listen_port": port if node_rank == 0 else None}
    # stdin is closed at once: the master's probe releases the port right after checking it
    res = subprocess.run([sys.executable, probe_remote.__file__, json.dumps(args)], stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, errors="replace", timeout=PROBE_TIMEOUT)
    spec = NodeSpec(name=node, host=node, python=sys.executable, gpus=gpus)
    master_spec = spec if node_rank == 0 else NodeSpec(name=master, host=master, python=sys.executable)
    report = NodeReport(node=node, host=node, address=node, is_master=node_rank == 0)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith(probe_remote.MARK)), None)
    if line is None:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        report.fail("python", f"the probe failed under {sys.executable} (exit {res.returncode}: {last})")
        return report
    probe = json.loads(line[len(probe_remote.MARK):])
    checks.fill(report, probe, time.time())
    checks.judge_node(report, probe, spec, master=master_spec, master_port=port)
    return report


def describe(report: NodeReport) -> list[str]:
    """The node's lines for the job log: the first failure, else 'ok' and its warnings."""
    failures = [f for f in report.findings if f.level == "fail"]
    if failures:
        return [f"{FAILED}{report.node}: {failures[0].check}: {failures[0].message}"]
    torch = report.torch or "?"
    lines = [f"[dtrain] preflight {report.node}: ok (python {report.python_version}, torch {torch}, "
             f"{report.gpus or 0} GPU(s), interface {report.ifname or '?'})"]
    return lines + [f"[dtrain] preflight {report.node}: warning: {f.check}: {f.message}" for f in report.findings]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtrain.launch.slurm_check")
    parser.add_argument("--node", required=True)
    parser.add_argument("--node-rank", type=int, required=True)
    parser.add_argument("--master", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--gpus", type=int, default=None)
    args = parser.parse_args(argv)
    report = check_node(args.node, args.node_rank, args.master, args.port, args.gpus)
    print("\n".join(describe(report)), flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
