"""Hang watchdog and root-cause rules (pure logic, fed the way the session feeds them)."""

from __future__ import annotations

from dtrain.launch.summary import NodeEnd, root_cause
from dtrain.launch.watchdog import Watchdog


def test_watchdog_heartbeats_and_output():
    wd = Watchdog(timeout=10, start=0.0, nodes=["a", "b"], startup_timeout=100)
    assert wd.check(50.0) is None  # still starting: no rank has shown life yet
    wd.output("a", None, now=5.0)  # torchrun's own lines do not end the start phase
    assert wd.check(50.0) is None
    wd.output("a", 0, now=5.0)
    wd.heartbeats("b", {"2": 1.0, "3": 4.0}, now=12.0)  # r2 at 11, r3 at 8
    assert wd.check(20.0) is None
    hang = wd.check(21.5)
    assert hang is not None and (hang.node, hang.rank) == ("a", 0)
    assert "suspected a:r0" in hang.describe()
    wd.heartbeats("a", {"0": 0.0}, now=21.5)
    hang = wd.check(40.0)
    assert (hang.node, hang.rank, hang.source) == ("b", 3, "heartbeat")
    wd.restart(40.0)
    assert wd.check(45.0) is None


def test_watchdog_without_any_sign_of_life_names_the_master():
    hang = Watchdog(timeout=5, start=0.0, nodes=["a", "b"], startup_timeout=20).check(21.0)
    assert hang.node == "a" and hang.rank is None and "no rank started within 21 s" in hang.describe()


def _ended(name, code, at, rank_lines=(), agent=(), stopped=False, lost=False):
    end = NodeEnd(name, exit_code=code, ended_at=at, stopped_by_us=stopped, connection_lost=lost)
    for rank, text in rank_lines:
        end.add(rank, text)
    for text in agent:
        end.add(None, text)
    return end


TORCHRUN_REPORT = [
    "Root Cause (first observed failure):", "[0]:", "  time      : 2026-12-02_11:23:34",
    "  host      : h", "  rank      : {rank} (local_rank: 1)", "  exitcode  : {code} (pid: 1)",
]


def _report(rank, code):
    return [ln.format(rank=rank, code=code) for ln in TORCHRUN_REPORT]


def test_root_cause_prefers_own_failure_over_peer_echo():
    # h1's rank 0 died of the peer's death and its agent happened to exit first.
    h1 = _ended("h1", 1, 10.0, [(0, "Traceback (most recent call last):"),
                                 (0, "RuntimeError: [gloo] Connection closed by peer [10.0.0.2]:1234")],
                _report(0, 1))
    h2 = _ended("h2", 1, 10.2, [(3, "epoch 0 step 5")], _report(3, -9))
    h3 = _ended("h3", 143, 11.0, stopped=True)
    cause = root_cause([h1, h2, h3])
    assert (cause.node, cause.rank, cause.rank_exit_code) == ("h2", 3, -9)
    assert "node h2 rank 3 exited with code -9 (SIGKILL)" in cause.describe()


def test_root_cause_looks_among_the_stopped_nodes_when_every_failure_reported_is_an_echo():
    # h2's rank was SIGKILLed; h1's ranks aborted on the broken connection and h1's torchrun
    # reported first, so the head stopped h2, whose torchrun had already seen its rank die.
    h1 = _ended("h1", 1, 10.0, [(0, "Traceback (most recent call last):"),
                                 (0, "RuntimeError: [gloo] Read error [10.0.0.2]:15497: Connection reset by peer"),
                                 (0, "terminate called without an active exception")], _report(0, -6))
    h2 = _ended("h2", 1, 10.1, [(2, "epoch 0 step 2")], _report(2, -9), stopped=True)
    bystander = _ended("h3", 1, 10.2, [(4, "epoch 0 step 2")], _report(4, -15), stopped=True)
    cause = root_cause([h1, h2, bystander])
    assert (cause.node, cause.rank, cause.rank_exit_code) == ("h2", 2, -9), cause
    # a node we stopped is not taken over a node that failed on its own
    own = _ended("h4", 1, 10.3, [(6, "ValueError: bad batch")], _report(6, 1))
    assert root_cause([h1, h2, own]).node == "h4"
    # nor over a lone echo when the stopped node's ranks only ended by our SIGTERM
    assert root_cause([h1, bystander]).node == "h1"


def test_root_cause_traceback_tail_and_lost_connection():
    tb = [(1, "Traceback (most recent call last):"), (1, '  File "x.py", line 3'), (1, "ZeroDivisionError: boom")]
    a = _ended("a", 1, 5.0, [(1, "old line"), *tb], _report(1, 1))
    cause = root_cause([a])
    assert cause.tail == [t for _, t in tb]
    lost = _ended("b", 255, 6.0, lost=True)
    assert root_cause([lost, _ended("c", 0, 7.0)]).describe().startswith("first failure: node b: lost the connection")
    assert root_cause([_ended("c", 0, 7.0)]) is None
