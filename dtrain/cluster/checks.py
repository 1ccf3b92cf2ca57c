"""Judging probe results: pure functions from what a node said to findings on it.

`judge_node` looks at one node on its own; `judge_cluster` compares the nodes (versions,
shared storage contents) against a reference node, normally the master, and turns an
unreachable master port into one finding on the node that has to be fixed.
"""

from __future__ import annotations

from typing import Any

from dtrain.cluster.check_results import NodeReport
from dtrain.cluster.spec import NodeSpec

SLOW_LOOKUP_S = 1.0
MAX_SKEW_S = 2.0


def fill(report: NodeReport, probe: dict[str, Any], received_at: float) -> None:
    """Copy what the probe measured into the report."""
    report.reachable = True
    for key in ("python", "python_version", "torch", "torch_cuda", "gpus", "gpu_names", "driver",
                "hostname", "ifname", "shared"):
        if key in probe:
            setattr(report, key, probe[key])
    reverse = probe.get("names", {}).get("reverse_master", {})
    report.reverse_lookup_s = reverse.get("seconds")
    if "time" in probe:
        report.clock_skew_s = round(probe["time"] - received_at, 3)
    if "listen" in probe:
        report.port = "free" if probe["listen"]["ok"] else "in use"
    elif "connect" in probe:
        report.port = "open" if probe["connect"]["ok"] else "closed"


def judge_node(report: NodeReport, probe: dict[str, Any], node: NodeSpec, *, master: NodeSpec,
               master_port: int) -> None:
    if probe.get("torch") is None:
        real = probe.get("python")
        shown = node.python + (f" (= {real})" if real and real != node.python else "")
        report.fail("torch", f"torch is not installed for {shown}; install it there "
                             "or set python: in cluster.yaml to an interpreter that has it")
    if node.gpus is not None and (probe.get("gpus") or 0) < node.gpus:
        report.fail("gpus", f"cluster.yaml says {node.gpus} GPU(s) but {probe.get('gpus') or 0} answered"
                            f"{': ' + probe['gpu_error'] if probe.get('gpu_error') else ''}; "
                            "check the driver (nvidia-smi) or lower gpus:")
    elif probe.get("gpu_error"):
        report.warn("gpus", f"GPU query failed ({probe['gpu_error']}); training will run on the CPU")

    route = probe.get("route", {})
    if not route.get("master_ip"):
        report.fail("network", f"cannot resolve the master's address {master.reach_address!r} here; "
                               "give the master an IP as address: in cluster.yaml, or add it to /etc/hosts")
    elif not report.ifname:
        report.warn("network", "could not tell which network interface reaches the master (is `ip` installed?); "
                               "GLOO_SOCKET_IFNAME will not be set")

    _judge_own_address(report, probe, node, master)
    _judge_names(report, probe, master)
    if report.clock_skew_s is not None and abs(report.clock_skew_s) > MAX_SKEW_S:
        report.warn("clock", f"clock is {report.clock_skew_s:+.1f} s off the head's; timestamps in logs and "
                             "metrics will disagree: enable NTP (timedatectl set-ntp true)")

    for shared in probe.get("shared", []):
        if not shared.get("exists"):
            report.fail("shared", f"shared path {shared['path']} does not exist here; mount the shared storage")

    listen = probe.get("listen")
    if listen and not listen["ok"]:
        holder = f" by {listen['holder']}" if listen.get("holder") else ""
        report.fail("port", f"master port {master_port} is already in use{holder} ({listen['error']}); "
                            "stop that process or choose another port (--port)")


def _judge_own_address(report: NodeReport, probe: dict[str, Any], node: NodeSpec, master: NodeSpec) -> None:
    # Only a warning: behind NAT (cloud public IPs) the address others use is not local.
    own, local = probe.get("own_ip"), probe.get("addresses") or {}
    if node is not master or not own or not local or own in local or own.startswith("127."):
        return
    mine = ", ".join(f"{dev} {ip}" for ip, dev in local.items() if dev != "lo" and ":" not in ip)
    report.warn("network", f"the master's address {node.reach_address} is not an address of this machine "
                           f"({mine}); unless it is NAT-ed here, set address: in cluster.yaml to one of them")


def _judge_names(report: NodeReport, probe: dict[str, Any], master: NodeSpec) -> None:
    names = probe.get("names", {})
    ip = probe.get("route", {}).get("master_ip") or master.reach_address
    reverse = names.get("reverse_master", {})
    if (reverse.get("seconds") or 0) > SLOW_LOOKUP_S or reverse.get("result") == "timed out":
        report.warn("dns", f"reverse lookup of the master address {ip} took {reverse['seconds']:.1f} s "
                           f"(torch's rendezvous waits on it); add '{ip} {master.name}' to /etc/hosts here")
    own = names.get("own_hostname", {})
    host = probe.get("hostname", "")
    if (own.get("seconds") or 0) > SLOW_LOOKUP_S or own.get("result") == "timed out":
        report.warn("dns", f"looking up this node's own hostname {host!r} took {own['seconds']:.1f} s; "
                           f"add '{host}' to /etc/hosts here")


def judge_cluster(reports: list[NodeReport], probes: dict[str, dict[str, Any]], master_port: int) -> None:
    """Cross-node checks; `probes` holds the probe dict of every node that answered."""
    answered = [r for r in reports if r.node in probes]
    if not answered:
        return
    ref = next((r for r in answered if r.is_master), answered[0])
    for r in answered:
        if r is ref:
            continue
        if r.torch and ref.torch and r.torch != ref.torch:
            r.fail("torch", f"torch {r.torch} here but {ref.torch} on {ref.node}; install the same torch "
                            "version on every node (DDP needs matching versions)")
        if _minor(r.python_version) != _minor(ref.python_version):
            r.fail("python", f"Python {r.python_version} here but {ref.python_version} on {ref.node}; "
                             "use the same Python minor version on every node")
        if r.driver and ref.driver and r.driver != ref.driver:
            r.warn("gpus", f"GPU driver {r.driver} here but {ref.driver} on {ref.node}")
        _compare_shared(r, ref)
    _judge_master_port(reports, probes, master_port)
    _master_ifname(reports, probes)


def _compare_shared(r: NodeReport, ref: NodeReport) -> None:
    theirs = {s["path"]: s for s in ref.shared}
    for s in r.shared:
        other = theirs.get(s["path"], {})
        if s.get("exists") and other.get("exists") and other["digest"] != s["digest"]:
            r.fail("shared", f"shared path {s['path']} differs from {ref.node}'s ({s['entries']} vs "
                             f"{other['entries']} files listed); sync it or mount the same storage")


def _judge_master_port(reports: list[NodeReport], probes: dict[str, dict[str, Any]], master_port: int) -> None:
    master = next(r for r in reports if r.is_master)
    listening = probes.get(master.node, {}).get("listen", {}).get("ok")
    if not listening:  # the master's own finding says why; the others could not be judged
        for r in reports:
            if not r.is_master and r.node in probes:
                r.port = "-"
        return
    for r in reports:
        connect = probes.get(r.node, {}).get("connect")
        if connect is not None and not connect["ok"]:
            r.fail("port", f"cannot reach the master {master.node} at {master.address}:{master_port} "
                           f"({connect['error']}); open the port between the nodes or set the master's "
                           "address: to one this node can reach")


def _minor(version: str | None) -> str | None:
    return ".".join(version.split(".")[:2]) if version else None


def _master_ifname(reports: list[NodeReport], probes: dict[str, dict[str, Any]]) -> None:
    """When the master's own name resolves to loopback on the master itself, its probe
    cannot tell its real interface; the address the other nodes resolved it to can."""
    master = next(r for r in reports if r.is_master)
    mine = probes.get(master.node, {}).get("addresses", {})
    if master.ifname != "lo" or not mine:
        return
    for r in reports:
        seen = probes.get(r.node, {}).get("route", {}).get("master_ip")
        if not r.is_master and seen in mine and mine[seen] != "lo":
            master.ifname = mine[seen]
            return
