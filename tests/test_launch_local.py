"""`dtrain run` end to end with local nodes (real torchrun, real processes, no SSH).

The multi-host versions of these checks, over SSH between namespace hosts, are in
test_launch_netns.py.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from launch_helpers import SCRIPTS, dtrain, free_port, job_id_of, job_processes, wait_gone

pytestmark = pytest.mark.slow  # end to end: ./dev test -m 'not slow' leaves it out

TICKER = str(SCRIPTS / "ticker.py")


def test_fail_fast_two_local_nodes(dtrain_home):
    res = dtrain("run", "--no-preflight", "--hosts", "local,local", "--port", str(free_port()), "--",
                 "python", TICKER, "--ticks", "400", "--fail-rank", "1", "--fail-at", "3")
    assert res.returncode == 5, res.stdout + res.stderr
    assert "first failure: node local1 rank 1 exited with code 7" in res.stderr
    assert "rank 1 failing on purpose" in res.stderr  # its last lines, in the summary
    assert "Traceback" not in res.stderr.split("dtrain: error:")[0][-200:]
    job_id = job_id_of(res.stdout)
    assert "[local0:r0] rank 0 tick 0" in res.stdout
    logs = dtrain_home / "jobs" / job_id / "logs"
    assert "[local1:r1] rank 1 failing on purpose" in (logs / "local1.log").read_text()
    status = json.loads(dtrain("status", job_id, "--json").stdout)
    assert status["state"] == "failed" and status["exit_code"] and status["world_size"] == 2
    assert job_processes(job_id) == []


def test_hang_watchdog_names_the_silent_rank(dtrain_home):
    res = dtrain("run", "--no-preflight", "--nproc-per-node", "2", "--port", str(free_port()),
                 "--hang-timeout", "4", "--", "python", TICKER, "--ticks", "1000", "--every", "0.4",
                 "--stall-rank", "1", "--stall-at", "2", "--quiet-ranks", "1", "--heartbeat")
    assert res.returncode == 5, res.stdout + res.stderr
    assert "no progress for" in res.stderr and "suspected local:r1" in res.stderr, res.stderr
    assert wait_gone(job_id_of(res.stdout)) == []


def test_detach_logs_stop_and_dead_supervisor(dtrain_home):
    ids = []
    for _ in range(2):
        res = dtrain("run", "--no-preflight", "--detach", "--name", "bg", "--port", str(free_port()), "--",
                     "python", TICKER, "--ticks", "100000", "--every", "0.2")
        assert res.returncode == 0, res.stderr
        ids.append(job_id_of(res.stdout))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all("tick 1" in dtrain("logs", j).stdout for j in ids):
        time.sleep(0.5)
    stopped, killed = ids
    listed = json.loads(dtrain("jobs", "--json").stdout)
    assert [j["id"] for j in listed] == [killed, stopped]  # newest first
    assert {j["state"] for j in listed} == {"running"}

    # dtrain stop: the supervisor stops every node, the job ends "stopped".
    res = dtrain("stop", stopped)
    assert res.returncode == 0 and f"job {stopped} stopped" in res.stdout, res.stderr
    follow = dtrain("logs", stopped, "-f", timeout=60)  # returns: the job has ended
    assert "[local:r0] rank 0 tick 1" in follow.stdout and "stopped" in follow.stdout.splitlines()[-1]
    assert "[local:r0]" in dtrain("logs", stopped, "--node", "local").stdout
    assert wait_gone(stopped) == []

    # A supervisor that dies: its nodes stop (their stdin closed) and the job reads failed.
    pid = json.loads(dtrain("status", killed, "--json").stdout)["supervisor_pid"]
    os.kill(pid, signal.SIGKILL)
    assert wait_gone(killed) == []
    status = json.loads(dtrain("status", killed, "--json").stdout)
    assert status["state"] == "failed" and status["reason"] == "supervisor died"


def test_ctrl_c_stops_the_whole_job(dtrain_home):
    import subprocess
    import sys

    from launch_helpers import REPO

    proc = subprocess.Popen([sys.executable, "-m", "dtrain", "run", "--no-preflight", "--hosts", "local,local",
                             "--port", str(free_port()), "--", "python", TICKER, "--ticks", "100000"],
                            cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "rank 1 tick 1" in line:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    job_id = job_id_of("".join(lines))
    assert f"job {job_id} stopped: interrupted (Ctrl-C)" in out
    assert json.loads(dtrain("status", job_id, "--json").stdout)["state"] == "stopped"
    assert wait_gone(job_id) == []


def test_a_script_named_in_bytes_that_are_not_utf8_runs_and_is_listed_by_an_escaped_name(dtrain_home, tmp_path):
    """A project unpacked from a Windows zip: the job's name (the script's) went into SQLite,
    which refuses such bytes, and the launch died with a traceback after the preflight."""
    folder = os.fsencode(tmp_path)
    with open(folder + b"/d\xe9faut.py", "w") as fh:
        fh.write("import os, sys\nprint('arg', os.fsencode(sys.argv[1]).hex(), flush=True)\n")
    script, arg = os.fsdecode(folder + b"/d\xe9faut.py"), os.fsdecode(b"lot\xff")
    res = dtrain("run", "--no-preflight", "--no-monitor", "--port", str(free_port()), "--", "python", script, arg,
                 errors="surrogateescape")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[local:r0] arg 6c6f74ff" in res.stdout  # the argument arrives as its own bytes, b"lot\xff"
    named = dtrain("run", "--no-preflight", "--no-monitor", "--name", "line\nbreak", "--port", str(free_port()),
                   "--", "python", script, "x", errors="surrogateescape")
    assert named.returncode == 0, named.stdout + named.stderr
    listed = json.loads(dtrain("jobs", "--json").stdout)
    assert [j["name"] for j in listed] == ["line\\nbreak", "d\\xe9faut"]


def test_a_terminal_that_stops_reading_does_not_stop_the_job(dtrain_home):
    """`dtrain run ... | less` (or Ctrl-S): the head's loop wrote each line to the terminal
    itself, so once the pipe was full it blocked there, sent no keep-alives, and after
    HEAD_TIMEOUT (20 s) the node stopped a healthy job ("failed (exit 1)")."""
    import subprocess
    import sys

    from launch_helpers import REPO

    proc = subprocess.Popen([sys.executable, "-m", "dtrain", "run", "--no-preflight", "--no-monitor",
                             "--port", str(free_port()), "--", "python", str(SCRIPTS / "burst_then_wait.py"),
                             "--lines", "2000", "--wait", "25"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(32)  # 220 kB of lines fill the 64 kB pipe at once; nobody reads past the head's timeout
    out, err = proc.communicate(timeout=120)
    out, err = out.decode(errors="replace"), err.decode(errors="replace")
    assert proc.returncode == 0, err[-1500:]
    job_id = job_id_of(out)
    assert json.loads(dtrain("status", job_id, "--json").stdout)["state"] == "succeeded"
    log = (dtrain_home / "jobs" / job_id / "output.log").read_text()
    assert "[local:r0] rank 0 finished normally" in log and "rank 0 line 1999 " in log
    # The terminal got every line too, or was told how many it missed and where they are.
    assert "rank 0 line 1999 " in out or f"not shown here: the terminal was not reading fast enough (`dtrain logs {job_id}`" in out


def test_stop_sends_each_worker_one_sigterm(dtrain_home):
    """The node wrapper sent SIGTERM to every descendant and torchrun passed on its own: a rank
    saving a checkpoint in its SIGTERM handler was interrupted by the second one (the handler
    ran again mid-save). A hand-written torchrun launch sends one."""
    res = dtrain("run", "--no-preflight", "--no-monitor", "--detach", "--nproc-per-node", "2",
                 "--port", str(free_port()), "--", "python", str(SCRIPTS / "save_on_sigterm.py"))
    assert res.returncode == 0, res.stderr
    job_id = job_id_of(res.stdout)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(f"rank {r} tick 2" in dtrain("logs", job_id).stdout for r in (0, 1)):
        time.sleep(0.5)
    res = dtrain("stop", job_id)
    assert res.returncode == 0, res.stderr
    assert wait_gone(job_id) == []
    log = dtrain("logs", job_id).stdout
    for r in (0, 1):
        assert log.count(f"rank {r} got SIGTERM, saving") == 1, log[-2000:]
        assert log.count(f"rank {r} saved") == 1, log[-2000:]


def test_a_killed_node_wrapper_takes_torchrun_and_the_workers_with_it(dtrain_home):
    """kill -9 of the node wrapper (the OOM killer, or the head's last resort on a local node)
    left torchrun and its workers running for good, each in a session of its own, holding the
    master port."""
    import subprocess

    res = dtrain("run", "--no-preflight", "--no-monitor", "--detach", "--port", str(free_port()), "--",
                 "python", TICKER, "--ticks", "100000", "--every", "0.2")
    assert res.returncode == 0, res.stderr
    job_id = job_id_of(res.stdout)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "rank 0 tick 1" not in dtrain("logs", job_id).stdout:
        time.sleep(0.5)
    wrappers = [pid for pid, cmd in job_processes(job_id) if "dtrain.launch.node" in cmd]
    assert len(wrappers) == 1, job_processes(job_id)
    os.kill(wrappers[0], signal.SIGKILL)
    left = wait_gone(job_id)
    for pid, _ in left:  # on the code before the fix: do not leave them running
        subprocess.run(["kill", "-9", str(pid)], check=False)
    assert left == []
    assert json.loads(dtrain("status", job_id, "--json").stdout)["state"] == "failed"


def test_stop_during_the_setup_commands_stops_the_job_and_ends_them(dtrain_home, tmp_path):
    """`dtrain stop` while a node's setup command ran: the launcher (the job's supervisor
    until then) died of the SIGTERM without a word, the job read "failed: supervisor died",
    and the setup command ran on and finished its work."""
    import subprocess
    import sys

    from launch_helpers import REPO

    marker = tmp_path / "setup-finished"
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("nodes:\n  - {name: n0, host: local, setup: [\"sleep 27.5; touch %s\"]}\n" % marker)
    proc = subprocess.Popen([sys.executable, "-m", "dtrain", "run", str(cluster), "--no-preflight", "--no-monitor",
                             "--port", str(free_port()), "--", "python", TICKER, "--ticks", "3"],
                            cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any("sleep 27.5" in cmd for _, cmd in _all_processes()):
        time.sleep(0.2)
    job_id = json.loads(dtrain("jobs", "--json").stdout)[0]["id"]
    res = dtrain("stop", job_id)
    assert res.returncode == 0 and f"job {job_id} stopped" in res.stdout, res.stdout + res.stderr
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    status = json.loads(dtrain("status", job_id, "--json").stdout)
    assert status["state"] == "stopped" and "while preparing" in status["reason"], status
    assert not any("sleep 27.5" in cmd for _, cmd in _all_processes())
    assert not marker.exists()


def test_a_supervisor_that_dies_of_dtrain_stop_before_its_handlers_reads_stopped(dtrain_home):
    """A detached supervisor stopped in its first half second (`dtrain run --detach && dtrain
    stop`) was still importing, died of the SIGTERM, and the job read "failed: supervisor died"."""
    import subprocess

    from dtrain.jobs.registry import JobRegistry, JobState
    from dtrain.jobs.views import stop_job

    registry = JobRegistry()
    rec = registry.create("early", ["local"], 1)
    starting = subprocess.Popen(["sleep", "60"])  # dies of SIGTERM, as a supervisor does while it imports
    try:
        registry.set_supervisor(rec.id, starting.pid)
        import io

        stop_job(rec.id, wait=30, registry=registry, out=io.StringIO())
    finally:
        starting.kill()
        starting.wait()
    got = registry.get(rec.id)
    assert got.state == JobState.STOPPED and got.exit_code == 130, got
    assert got.reason.startswith("stopped (SIGTERM"), got.reason


def test_stop_right_after_detach_reads_stopped(dtrain_home):
    res = dtrain("run", "--no-preflight", "--no-monitor", "--detach", "--port", str(free_port()), "--",
                 "python", TICKER, "--ticks", "100000")
    assert res.returncode == 0, res.stderr
    job_id = job_id_of(res.stdout)
    res = dtrain("stop", job_id)
    assert res.returncode == 0 and f"job {job_id} stopped" in res.stdout, res.stdout + res.stderr
    assert json.loads(dtrain("status", job_id, "--json").stdout)["state"] == "stopped"
    assert wait_gone(job_id) == []


def _all_processes() -> list[tuple[int, str]]:
    from pathlib import Path

    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found.append((int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")))
            except OSError:
                continue
    return found
