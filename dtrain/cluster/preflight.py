"""Preflight: probe every node in parallel, each with a timeout, and judge the answers.

The master's probe binds the master port and keeps it open while the others connect to
it, so "port free on the master" and "reachable from every node" are measured with real
sockets, in the same round of SSH connections as everything else. `run_preflight` raises
nothing: whatever goes wrong on a node becomes a finding on that node.
"""

from __future__ import annotations

import json
import queue
import secrets
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dtrain.cluster import checks
from dtrain.cluster.check_results import NodeReport, PreflightReport
from dtrain.cluster.runner import CommandRunner, runner_for
from dtrain.cluster.spec import ClusterSpec, NodeSpec

PROBE_SOURCE = (Path(__file__).with_name("probe_remote.py")).read_text()
MARK = "DTRAIN-PROBE "
DEFAULT_PORT = 29500
_SET = threading.Event()
_SET.set()


def run_preflight(cluster: ClusterSpec, *, master_port: int = DEFAULT_PORT, timeout: float = 20.0,
                  out=None, clock: Callable[[], float] = time.time,
                  runner_factory: Callable[[NodeSpec, ClusterSpec], CommandRunner] = runner_for) -> PreflightReport:
    """Check every node of `cluster`; render the table to `out` (a rich Console) if given."""
    t0 = time.monotonic()
    master = cluster.master
    token = secrets.token_hex(8)
    common = {"master_address": master.reach_address, "shared_paths": cluster.shared_paths,
              "deadline_s": timeout, "token": token, "dns_cap_s": 3.0}
    others_done = threading.Event()
    reports = [NodeReport(node=n.name, host=n.host, address=n.reach_address, is_master=n is master)
               for n in cluster.nodes]
    probes: dict[str, dict[str, Any]] = {}
    done: list[str] = []
    lock = threading.Lock()
    status = out.status(f"checking {len(reports)} node(s)...") if out is not None else None

    def one(node: NodeSpec, report: NodeReport) -> None:
        args = {**common, "own_address": node.reach_address}
        if node is master:
            args["listen_port"] = master_port
        else:
            # Refused connections are retried this long: the master's listener starts with
            # its own ssh session, which may be slower than ours.
            args.update(connect_port=master_port, connect_s=timeout / 2)
        started = time.monotonic()
        try:
            runner = runner_factory(node, cluster)
            argv = [node.python, "-c", PROBE_SOURCE, json.dumps(args)]
            # The master's probe keeps listening until the others are done; theirs end at once.
            probe = _probe(runner, argv, report, node, timeout, others_done if node is master else _SET, clock)
            if probe is not None:
                checks.judge_node(report, probe, node, master=master, master_port=master_port)
                probes[node.name] = probe
        except Exception as exc:  # a bug or an odd node must not take the whole check down
            report.fail("ssh", f"the check itself failed: {type(exc).__name__}: {exc}")
        report.seconds = round(time.monotonic() - started, 2)
        with lock:
            done.append(node.name)
            if status:
                status.update(f"checking {len(reports)} node(s): {len(done)} answered")

    if status:
        status.start()
    try:
        with ThreadPoolExecutor(max_workers=len(cluster.nodes)) as pool:
            futures = [pool.submit(one, n, r) for n, r in zip(cluster.nodes, reports)]
            for f in futures[1:]:
                f.result()
            others_done.set()  # the master may stop listening now
            futures[0].result()
    finally:
        if status:
            status.stop()
    checks.judge_cluster(reports, probes, master_port)
    report = PreflightReport(master=master.name, master_address=master.reach_address, master_port=master_port,
                             nodes=reports, seconds=round(time.monotonic() - t0, 2))
    if out is not None:
        report.render(out)
    return report


def _probe(runner: CommandRunner, argv: list[str], report: NodeReport, node: NodeSpec, timeout: float,
           release: threading.Event, clock: Callable[[], float]) -> dict[str, Any] | None:
    """Run a node's probe and read its answer as it is printed (the clock-skew reading
    is taken right then), then close its stdin once `release` is set and let it end."""
    deadline = time.monotonic() + timeout
    try:
        proc = runner.popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, encoding="utf-8", errors="replace")
    except FileNotFoundError as exc:
        report.reachable = True
        report.fail("python", _missing_python(node, str(exc)))
        return None
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
    errors: list[str] = []
    err_reader = threading.Thread(target=lambda: errors.append(proc.stderr.read()), daemon=True)
    err_reader.start()
    stdout, received, timed_out = [], None, False
    while received is None:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            timed_out = True
            break
        if line is None:
            break
        stdout.append(line)
        if line.startswith(MARK):
            received = clock()
    if received is not None:
        release.wait(max(0.0, deadline - time.monotonic()))
    if timed_out:
        proc.kill()
        proc.wait()
        report.fail("ssh", f"no answer within {timeout:.0f} s; check that the node is up and `ssh {node.host}` works")
        return None
    try:
        proc.stdin.close()  # the master's probe stops listening on EOF
    except OSError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    err_reader.join(timeout=5)
    return _parse("".join(stdout), "".join(errors), proc.returncode, report, node, received or clock())


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _parse(stdout: str, stderr: str, code: int, report: NodeReport, node: NodeSpec,
           received: float) -> dict[str, Any] | None:
    for line in stdout.splitlines():
        if line.startswith(MARK):
            probe = json.loads(line[len(MARK):])
            checks.fill(report, probe, received)
            return probe
    last = (stderr.strip().splitlines() or [""])[-1].strip()
    if node.transport == "ssh" and code == 255:
        report.fail("ssh", f"cannot connect with ssh to {node.host} ({last or 'exit 255'}); {_ssh_hint(last, node)}")
        return None
    report.reachable = True
    if code in (126, 127):
        report.fail("python", _missing_python(node, last))
    else:
        report.fail("python", f"the probe failed under {node.python} (exit {code}: {last or 'no output'}); "
                              "check that it is a working Python 3.8+ interpreter")
    return None


# What the OpenSSH client says -> what to do about it. First match wins.
SSH_HINTS = [
    ("Permission denied", "set up key authentication for it (ssh-copy-id {host}), or name the key "
                          "with IdentityFile in ~/.ssh/config"),
    ("Host key verification failed", "connect once with `ssh {host}` to accept its host key"),
    ("Could not resolve hostname", "check the name, or give it a HostName in ~/.ssh/config"),
    ("Connection refused", "is sshd running on it, on the port ~/.ssh/config names?"),
    ("No route to host", "is the host up, and reachable from this machine?"),
    ("timed out", "is the host up, and reachable from this machine?"),
]


def _ssh_hint(stderr_line: str, node: NodeSpec) -> str:
    for needle, hint in SSH_HINTS:
        if needle in stderr_line:
            return hint.format(host=node.host)
    return f"check that `ssh {node.host}` works without a password prompt"


def _missing_python(node: NodeSpec, detail: str) -> str:
    return (f"python {node.python!r} not found or not executable ({detail}); set python: for this node in "
            "cluster.yaml to the interpreter's full path")
