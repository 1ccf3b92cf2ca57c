"""report_step: the per-step API the trainer calls on every rank."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtrain.monitor.rank import client as report
from dtrain.monitor.node.ranks import RankTable

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def sink(monkeypatch):
    """A UDP socket standing where the agent would listen."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.settimeout(2)
    monkeypatch.setenv("DTRAIN_AGENT_ADDR", f"127.0.0.1:{s.getsockname()[1]}")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.delenv("DTRAIN_HEARTBEAT_DIR", raising=False)
    report.reset()
    yield s
    report.reset()
    s.close()


def step(i, t=0.1, wait=0.02, n=8):
    report.report_step(step=i, epoch=1, loss=2.0 / (i + 1), lr=0.01, step_time_s=t, data_wait_s=wait, samples=n)


def test_unconfigured_is_a_no_op(monkeypatch, tmp_path):
    monkeypatch.delenv("DTRAIN_AGENT_ADDR", raising=False)
    monkeypatch.delenv("DTRAIN_HEARTBEAT_DIR", raising=False)
    report.reset()
    step(0)
    assert report._get().active is False and report._get().sock is None


def test_steps_are_batched_into_cumulative_counters(sink):
    step(0)  # the first step is sent at once
    first = json.loads(sink.recv(4096))
    for i in range(1, 10):
        step(i)
    with pytest.raises(TimeoutError):
        sink.settimeout(0.1)
        sink.recv(4096)  # nothing more within the send period
    report.reset()  # flushes, like interpreter exit does
    sink.settimeout(2)
    last = json.loads(sink.recv(4096))
    assert first["steps_total"] == 1 and first["rank"] == 5
    assert last["steps_total"] == 10 and last["samples_total"] == 80 and last["step"] == 9
    assert last["step_time_total"] == pytest.approx(1.0) and last["data_wait_total"] == pytest.approx(0.2)
    assert last["loss"] == pytest.approx(0.2) and last["lr"] == 0.01 and last["epoch"] == 1


def test_a_rank_flushes_its_last_steps_at_exit(sink):
    code = ("from dtrain.monitor.rank.client import report_step\n"
            "for i in range(7): report_step(step=i, step_time_s=0.01, samples=2)\n")
    env = {**os.environ}
    subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, check=True, timeout=60)
    msgs = []
    sink.settimeout(1)
    try:
        while True:
            msgs.append(json.loads(sink.recv(4096)))
    except TimeoutError:
        pass
    assert msgs[-1]["steps_total"] == 7 and msgs[-1]["samples_total"] == 14


def test_dead_agent_never_raises(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("DTRAIN_AGENT_ADDR", f"127.0.0.1:{port}")  # nobody listens
    report.reset()
    for i in range(3):
        report._get().next_send = 0.0  # send every step: the 2nd send meets the ICMP "refused"
        step(i)
        time.sleep(0.01)
    monkeypatch.setenv("DTRAIN_AGENT_ADDR", "not an address")
    report.reset()
    step(0)
    report.reset()


def test_heartbeat_file_is_touched_at_most_once_a_second(monkeypatch, tmp_path):
    monkeypatch.delenv("DTRAIN_AGENT_ADDR", raising=False)
    monkeypatch.setenv("DTRAIN_HEARTBEAT_DIR", str(tmp_path / "hb"))
    monkeypatch.setenv("RANK", "3")
    report.reset()
    step(0)
    beat = tmp_path / "hb" / "rank3"
    first = beat.stat().st_mtime_ns
    os.utime(beat, ns=(1, 1))  # pretend it is old; a second call within 1 s must not touch it
    step(1)
    assert beat.stat().st_mtime_ns == 1
    report._get().next_beat = 0.0  # a second later
    step(2)
    assert beat.stat().st_mtime_ns >= first
    report.reset()


def test_agent_counters_stay_monotonic_across_a_rank_restart():
    table = RankTable()

    def msg(pid, steps, t):
        return json.dumps({"rank": 0, "pid": pid, "steps_total": steps, "step_time_total": t,
                           "data_wait_total": 0.0, "samples_total": steps * 4, "step": steps}).encode()

    table.ingest(msg(100, 10, 1.0))
    table.ingest(msg(100, 8, 0.8))  # overtaken datagram: ignored
    assert table.snapshot()["0"]["steps_total"] == 10
    table.ingest(msg(200, 3, 0.3))  # the restarted process counts from zero
    row = table.snapshot()["0"]
    assert row["steps_total"] == 13 and row["samples_total"] == 52 and row["step_time_total"] == pytest.approx(1.3)
    assert table.ingest(b"not json") is None and table.bad_datagrams == 1


def test_a_forked_child_does_not_report_as_its_parent(sink):
    step(0)
    assert report._reporter is not None
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # e.g. a data loader worker
        os.write(w, b"fresh" if report._reporter is None else b"stale")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 16) == b"fresh"
    assert report._reporter is not None  # the parent keeps its own


def test_the_agent_ignores_ranks_of_another_job():
    table = RankTable("jobA")
    ours = {"rank": 0, "pid": 1, "steps_total": 1, "step_time_total": 0.1, "data_wait_total": 0.0, "samples_total": 4}
    assert table.ingest(json.dumps({**ours, "job": "jobB"}).encode()) is None
    assert table.foreign_datagrams == 1 and table.snapshot() == {}
    assert table.ingest(json.dumps({**ours, "job": "jobA"}).encode()) is not None
    assert table.ingest(json.dumps({**ours, "job": "", "steps_total": 2}).encode()) is not None  # a plain script
    assert table.snapshot()["0"]["steps_total"] == 2
