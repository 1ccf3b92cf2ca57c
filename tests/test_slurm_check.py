"""The Slurm job's preflight step (dtrain.launch.slurm_check), run here as on a node:
the real probe, the real port."""

from __future__ import annotations

import socket

from dtrain.launch.slurm_check import check_node, describe


def test_a_node_whose_rendezvous_port_is_taken_fails_with_one_line_naming_it():
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        report = check_node("h1", 0, "127.0.0.1", taken.getsockname()[1], None)
    assert not report.ok
    [line] = describe(report)
    assert line.startswith("[dtrain] preflight failed on h1: port: master port ") and "already in use" in line, line


def test_a_healthy_node_says_ok_and_a_missing_gpu_fails_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report = check_node("h2", 1, "127.0.0.1", port, None)
    assert report.ok, report.findings
    assert describe(report)[0].startswith("[dtrain] preflight h2: ok (python "), describe(report)
    no_gpu = check_node("h2", 1, "127.0.0.1", port, 64)  # no machine here has 64 GPUs
    assert describe(no_gpu)[0].startswith("[dtrain] preflight failed on h2: gpus: "), describe(no_gpu)
