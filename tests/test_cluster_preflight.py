"""Preflight with local nodes (real probes, real sockets) and the judging rules."""

from __future__ import annotations

import sys

import pytest
from rich.console import Console

from dtrain.cluster.checks import fill, judge_cluster, judge_node
from dtrain.cluster.preflight import run_preflight
from dtrain.cluster.check_results import NodeReport
from dtrain.cluster.spec import ClusterSpec
from dtrain.ports import free_port


def local_cluster(n=2, **fields) -> ClusterSpec:
    defaults = {"python": sys.executable, **fields.pop("defaults", {})}
    return ClusterSpec.from_hosts(["local"] * n, defaults=defaults, **fields)


def test_two_local_nodes_pass_and_the_second_reaches_the_master_port(tmp_path):
    console = Console(file=open(tmp_path / "out.txt", "w"), width=120)
    report = run_preflight(local_cluster(2), master_port=free_port(), timeout=30, out=console)
    assert report.ok, report.failures
    assert [n.port for n in report.nodes] == ["free", "open"]
    assert report.ifname == {"local0": "lo", "local1": "lo"}
    assert all(n.torch and n.python_version for n in report.nodes)
    console.file.close()
    text = (tmp_path / "out.txt").read_text()
    assert "local0 *" in text and "local1" in text


def test_gpus_promised_but_absent_and_missing_shared_paths_fail(tmp_path):
    missing = tmp_path / "nas" / "defects"
    cluster = local_cluster(1, defaults={"gpus": 2}, shared_paths=[str(missing)])
    report = run_preflight(cluster, master_port=free_port(), timeout=30)
    if (report.nodes[0].gpus or 0) >= 2:
        pytest.skip("this machine has 2 GPUs")
    assert not report.ok
    assert any("says 2 GPU(s) but 0 answered" in line for line in report.failures)
    assert f"local: shared path {missing} does not exist here; mount the shared storage" in report.failures


def test_a_node_that_never_answers_times_out_with_its_name(tmp_path):
    hang = tmp_path / "python3"
    hang.write_text("#!/bin/sh\nexec sleep 60\n")
    hang.chmod(0o755)
    cluster = ClusterSpec.model_validate({"nodes": [{"name": "good", "python": sys.executable},
                                                    {"name": "stuck", "python": str(hang)}]})
    report = run_preflight(cluster, master_port=free_port(), timeout=3)
    assert report.failures == ["stuck: no answer within 3 s; check that the node is up and `ssh local` works"]


def test_a_probe_that_crashes_is_reported_not_raised(tmp_path):
    broken = tmp_path / "python3"
    broken.write_text("#!/bin/sh\necho 'Fatal Python error: init_fs_encoding' >&2\nexit 1\n")
    broken.chmod(0o755)
    report = run_preflight(local_cluster(1, defaults={"python": str(broken)}), master_port=free_port(), timeout=10)
    assert report.failures == [f"local: the probe failed under {broken} (exit 1: Fatal Python error: "
                               "init_fs_encoding); check that it is a working Python 3.8+ interpreter"]


# ---- the rules on their own: what a probe said -> findings


def probe(**over):
    base = {"python": "/usr/bin/python3", "python_version": "3.11.7", "torch": "2.4.0", "gpus": 0,
            "hostname": "n1", "ifname": "eth0", "route": {"master_ip": "10.0.0.1", "dev": "eth0"},
            "names": {"reverse_master": {"result": "m", "seconds": 0.01},
                      "own_hostname": {"result": "10.0.0.2", "seconds": 0.01}}, "shared": []}
    return {**base, **over}


def judged(p, **node_fields):
    cluster = ClusterSpec.model_validate({"nodes": [{"name": "m", "host": "m", "address": "10.0.0.1"},
                                                    {"name": "n1", "host": "n1", **node_fields}]})
    r = NodeReport(node="n1", host="n1", address="n1")
    fill(r, p, received_at=0)
    judge_node(r, p, cluster.nodes[1], master=cluster.master, master_port=29500)
    return r


def test_a_stalled_reverse_lookup_warns_with_the_hosts_file_fix():
    r = judged(probe(names={"reverse_master": {"result": "timed out", "seconds": 3.0},
                            "own_hostname": {"result": "x", "seconds": 0.0}}))
    assert r.ok
    assert [f.message for f in r.findings] == [
        "reverse lookup of the master address 10.0.0.1 took 3.0 s (torch's rendezvous waits on it); "
        "add '10.0.0.1 m' to /etc/hosts here"]


def test_clock_skew_over_two_seconds_warns():
    r = NodeReport(node="n1", host="n1", address="n1")
    fill(r, probe(time=1000.0), received_at=1003.5)
    judge_node(r, probe(), ClusterSpec.from_hosts(["n1"]).nodes[0], master=ClusterSpec.from_hosts(["m"]).master,
               master_port=1)
    assert r.clock_skew_s == -3.5 and [f.check for f in r.findings] == ["clock"] and r.ok


def test_an_unresolvable_master_fails():
    r = judged(probe(route={"master_ip": None}))
    assert not r.ok and "cannot resolve the master's address '10.0.0.1'" in r.findings[0].message


def test_cross_node_mismatches_land_on_the_node_that_differs():
    reports = [NodeReport(node=n, host=n, address=n, is_master=(n == "m")) for n in ("m", "a", "b")]
    probes = {
        "m": probe(torch="2.4.0", shared=[{"path": "/d", "exists": True, "digest": "aa", "entries": 5}],
                   listen={"ok": True}),
        "a": probe(torch="2.4.0", python_version="3.10.1",
                   shared=[{"path": "/d", "exists": True, "digest": "bb", "entries": 4}], connect={"ok": True}),
        "b": probe(torch="2.3.1", shared=[{"path": "/d", "exists": True, "digest": "aa", "entries": 5}],
                   connect={"ok": False, "error": "No route to host"}),
    }
    for r in reports:
        fill(r, probes[r.node], received_at=0)
    judge_cluster(reports, probes, master_port=29500)
    by_node = {r.node: sorted(f.check for f in r.findings if f.level == "fail") for r in reports}
    assert by_node == {"m": [], "a": ["python", "shared"], "b": ["port", "torch"]}


def fake_nvidia_smi(bindir, driver, n):
    # What `nvidia-smi --query-gpu=name,driver_version --format=csv,noheader` prints.
    bindir.mkdir()
    rows = "".join(f"NVIDIA A10, {driver}\\n" for _ in range(n))
    (bindir / "nvidia-smi").write_text(f"#!/bin/sh\nprintf '{rows}'\n")
    (bindir / "nvidia-smi").chmod(0o755)
    return f"{bindir}:/usr/local/bin:/usr/bin:/bin"


def test_gpus_and_drivers_are_read_from_nvidia_smi_and_compared(tmp_path):
    import os

    path0 = fake_nvidia_smi(tmp_path / "b0", "550.54.15", 2)
    path1 = fake_nvidia_smi(tmp_path / "b1", "535.104.05", 1)
    # NVML cannot start without a driver, so the probe falls back to nvidia-smi, as on
    # a node whose Python lacks nvidia-ml-py.
    cluster = ClusterSpec.model_validate({"nodes": [
        {"name": "a", "python": sys.executable, "env": {"PATH": path0}},
        {"name": "b", "python": sys.executable, "env": {"PATH": path1}, "gpus": 2},
    ]})
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("a real NVIDIA driver answers NVML here")
    report = run_preflight(cluster, master_port=free_port(), timeout=30)
    a, b = report.nodes
    assert (a.gpus, a.gpu_names, a.driver) == (2, ["NVIDIA A10"] * 2, "550.54.15")
    assert (b.gpus, b.driver) == (1, "535.104.05")
    assert report.gpus == {"a": 2, "b": 1}
    assert report.failures == ["b: cluster.yaml says 2 GPU(s) but 1 answered; check the driver (nvidia-smi) "
                               "or lower gpus:"]
    assert report.warnings == ["b: GPU driver 535.104.05 here but 550.54.15 on a"]


def test_the_table_prints_remote_text_verbatim_not_as_markup(tmp_path):
    from dtrain.cluster.check_results import PreflightReport

    r = NodeReport(node="n1", host="n1", address="n1", torch="[bold]2.4")
    r.fail("python", "python '/opt/[red]x[/red]/python' not found")
    console = Console(file=open(tmp_path / "t.txt", "w"), width=200)
    PreflightReport(master="n1", master_address="n1", master_port=1, nodes=[r]).render(console)
    console.file.close()
    text = (tmp_path / "t.txt").read_text()
    assert "/opt/[red]x[/red]/python" in text and "[bold]2.4" in text


def test_an_interpreter_without_torch_is_named(tmp_path):
    # The same Python without its site-packages (-S): it runs, but finds no torch.
    bare = tmp_path / "python3"
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    bare.chmod(0o755)
    cluster = ClusterSpec.model_validate({"nodes": [{"name": "a", "python": sys.executable},
                                                    {"name": "b", "python": str(bare)}]})
    report = run_preflight(cluster, master_port=free_port(), timeout=30)
    assert report.failures == [f"b: torch is not installed for {bare} (= {sys.executable}); install it there "
                               "or set python: in cluster.yaml to an interpreter that has it"]
