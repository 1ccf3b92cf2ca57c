"""The job registry: states, newest-first listing, id lookup, dead-supervisor detection."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dtrain.errors import DtrainError
from dtrain.jobs.registry import JobRegistry, JobState


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_lifecycle_and_listing(dtrain_home):
    reg = JobRegistry(clock=Clock())
    a = reg.create("first", ["h1", "h2"], 4)
    b = reg.create("second", ["h1"], 2)
    assert reg.get(a.id).state is JobState.PENDING
    reg.mark_running(a.id)
    reg.finish(a.id, JobState.SUCCEEDED, 0)
    # A terminal state is final: a late "failed" from a dying process does not overwrite it.
    reg.finish(a.id, JobState.FAILED, 1, "late")
    got = reg.get(a.id)
    assert (got.state, got.exit_code, got.nodes, got.world_size) == (JobState.SUCCEEDED, 0, ["h1", "h2"], 4)
    assert got.duration(now=got.ended + 100) == got.ended - got.started
    assert [r.id for r in reg.list()] == [b.id, a.id]
    assert (dtrain_home / "jobs.sqlite").is_file()
    with pytest.raises(ValueError):
        reg.finish(b.id, JobState.RUNNING, None)


def test_lookup_by_prefix_and_name(dtrain_home):
    reg = JobRegistry()
    a = reg.create("alpha", ["h1"], 1)
    assert reg.get("alpha").id == a.id
    assert reg.get(a.id[:-2]).id == a.id
    with pytest.raises(DtrainError, match="no job 'nope'"):
        reg.get("nope")


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_dead_supervisor_marked_failed_on_read(dtrain_home, reaped):
    # Not reaped: in a container whose PID 1 never reaps orphans, a killed supervisor
    # stays a zombie, which still has a start time.
    import signal
    import time

    reg = JobRegistry()
    rec = reg.create("orphan", ["h1"], 1)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    reg.set_supervisor(rec.id, proc.pid)
    reg.mark_running(rec.id)
    assert reg.get(rec.id).state is JobState.RUNNING
    proc.send_signal(signal.SIGKILL)
    if reaped:
        proc.wait()
    else:
        time.sleep(0.5)  # dead, not waited for
    got = reg.get(rec.id)
    assert got.state is JobState.FAILED and got.reason == "supervisor died"
    assert reg.list()[0].state is JobState.FAILED
    proc.wait()


def test_live_supervisor_stays_running(dtrain_home):
    import os

    reg = JobRegistry()
    rec = reg.create("live", ["h1"], 1)
    reg.set_supervisor(rec.id, os.getpid())
    reg.mark_running(rec.id)
    assert reg.get(rec.id).state is JobState.RUNNING
    # A reused pid (same number, different start) is not our supervisor: by its start ticks
    # where /proc has them (see test_a_clock_step...), by its start time where not.
    from dtrain.jobs.registry import START_KEY

    reg.update(rec.id, supervisor_started=1.0, extra={START_KEY: "another-boot:1"})
    assert reg.get(rec.id).state is JobState.FAILED


def test_start_time_without_procfs_comes_from_psutil(monkeypatch, tmp_path):
    # A head without /proc (a macOS laptop) must not take every live process for dead.
    import os

    from dtrain.jobs import registry

    with_proc = registry.process_start_time(os.getpid())
    monkeypatch.setattr(registry, "PROC", str(tmp_path / "no-procfs"))
    without = registry.process_start_time(os.getpid())
    assert with_proc is not None and without is not None and abs(with_proc - without) < 1.0


def test_a_clock_step_does_not_make_a_live_supervisor_dead(tmp_path):
    """The supervisor was told from a reused pid by its start time in wall-clock seconds,
    which /proc derives from btime, and btime moves when the clock is stepped (an NTP step,
    a VM resumed): any reader then marked a running job "failed: supervisor died" and its
    real end was dropped. Its boot id and start ticks do not move."""
    import subprocess

    from dtrain.jobs.registry import START_KEY, JobRegistry, JobState

    registry = JobRegistry(tmp_path / "jobs.sqlite")
    rec = registry.create("long", ["local"], 1)
    registry.update(rec.id, extra={"kept": 1})
    sup = subprocess.Popen(["sleep", "60"])
    try:
        registry.set_supervisor(rec.id, sup.pid)
        stored = registry.get(rec.id)
        assert stored.extra["kept"] == 1 and stored.extra[START_KEY].rsplit(":", 1)[1].isdigit()
        # What a reading taken after a 30 s step of the clock looks like next to the stored one.
        registry.update(rec.id, supervisor_started=stored.supervisor_started + 30.0)
        assert registry.get(rec.id).state == JobState.PENDING
        # The same pid with another start (a reused pid) is not the supervisor.
        boot, ticks = stored.extra[START_KEY].rsplit(":", 1)
        other = registry.create("other", ["local"], 1)
        registry.update(other.id, supervisor_pid=sup.pid, supervisor_started=stored.supervisor_started,
                        extra={START_KEY: f"{boot}:{int(ticks) + 5}"})
        assert registry.get(other.id).state == JobState.FAILED
    finally:
        sup.kill()
        sup.wait()
    gone = registry.get(rec.id)
    assert gone.state == JobState.FAILED and gone.reason == "supervisor died"
