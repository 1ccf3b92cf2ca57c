"""The findings rules on hand-made series (numbers chosen so each verdict is checkable)."""

from __future__ import annotations

from dtrain.monitor.head import findings as F


def rank_series(step_times, t0=0.0, steps=10, data_wait=None):
    n = len(step_times)
    return {
        "t": [t0 + i for i in range(n)],
        "steps": [steps] * n,
        "step_time": list(step_times),
        "data_wait": list(data_wait) if data_wait is not None else [0.0] * n,
    }


def test_straggler_is_the_rank_above_1_2x_the_cluster_median():
    ranks = {
        ("h1", 0): rank_series([0.10] * 10),
        ("h1", 1): rank_series([0.11] * 10),
        ("h2", 2): rank_series([0.10] * 10),
        ("h2", 3): rank_series([0.13] * 10),  # 0.13 > 1.2 * 0.105 = 0.126
    }
    found = F.stragglers(ranks)
    assert [(f.node, f.rank, f.kind) for f in found] == [("h2", 3, "straggler")]
    assert "rank 3 on h2" in found[0].message


def test_no_straggler_at_exactly_the_threshold_or_alone():
    ranks = {("h1", 0): rank_series([0.10] * 5), ("h1", 1): rank_series([0.10] * 5),
             ("h1", 2): rank_series([0.12] * 5)}  # median 0.10 -> 0.12 is not > 0.12
    assert F.stragglers(ranks) == []
    assert F.stragglers({("h1", 0): rank_series([5.0] * 5)}) == []


def test_straggler_window_only_counts_recent_intervals():
    # rank 1 was slow for its first 15 s and is fine in its last 5 s
    ranks = {("h1", 0): rank_series([0.1] * 20), ("h1", 1): rank_series([0.5] * 15 + [0.1] * 5)}
    assert [f.rank for f in F.stragglers(ranks)] == [1]
    assert F.stragglers(ranks, start=15.0) == []


def test_straggler_median_is_weighted_by_steps():
    slow_few = {"t": [0, 1, 2], "steps": [1, 1, 30], "step_time": [1.0, 1.0, 0.1], "data_wait": [0, 0, 0]}
    ranks = {("h1", 0): rank_series([0.1] * 3), ("h1", 1): slow_few}
    assert F.stragglers(ranks) == []  # 30 of its 32 steps took 0.1 s


def test_intervals_without_timed_steps_are_ignored():
    idle = {"t": [0, 1, 2], "steps": [0, 0, 5], "step_time": [None, None, None], "data_wait": [None] * 3}
    ranks = {("h1", 0): rank_series([0.1] * 3), ("h1", 1): rank_series([0.1] * 3), ("h1", 2): idle}
    assert F.stragglers(ranks) == [] and F.data_starvation(ranks) == []


def test_data_starvation_above_20_percent_of_step_time():
    ranks = {
        ("h1", 0): rank_series([0.1] * 5, data_wait=[0.03] * 5),  # 30 %
        ("h1", 1): rank_series([0.1] * 5, data_wait=[0.02] * 5),  # 20 %: not above
    }
    found = F.data_starvation(ranks)
    assert [(f.node, f.rank) for f in found] == [("h1", 0)]
    assert "30%" in found[0].message


def test_a_slow_start_of_the_loader_is_not_starvation():
    # session 31's recipe run: the first steps waited 2.5, 1.1 and 0.7 s of 6.0, 4.3 and 3.6 s
    # while the loader's workers started and lifted their transplants, then ~1 % of 1.3 s
    start = {"t": list(range(8)), "steps": [1] * 8, "step_time": [6.0, 4.3, 3.6] + [1.3] * 5,
             "data_wait": [2.5, 1.1, 0.7] + [0.01] * 5}
    assert F.data_starvation({("h1", 0): start}) == []
    assert [f.rank for f in F.data_starvation({("h1", 0): start}, warmup_steps=0)] == [0]  # what it said before


def test_starvation_after_the_start_is_found_from_running_totals():
    # a window late in a run: its first interval is not the rank's start (steps_total says so)
    late = {"t": [100, 101], "steps": [5, 5], "step_time": [1.0, 1.0], "data_wait": [0.5, 0.5],
            "steps_total": [405, 410]}
    assert [f.rank for f in F.data_starvation({("h1", 0): late})] == [0]
    # the same two intervals as a rank's first ten steps are start-up
    assert F.data_starvation({("h1", 0): {**late, "steps_total": [5, 10]}}) == []


def gpu_series(utils, dt=1.0):
    return {"t": [i * dt for i in range(len(utils))], "util": list(utils)}


def test_idle_gpu_after_five_minutes_below_ten_percent():
    busy_then_idle = [0.9] * 10 + [0.05] * 301  # idle from t=10 to t=310: 300 s
    short_idle = [0.9] * 10 + [0.05] * 200 + [0.9] * 10
    found = F.idle_gpus({("h1", 0): gpu_series(busy_then_idle), ("h1", 1): gpu_series(short_idle)})
    assert [(f.node, f.gpu) for f in found] == [("h1", 0)]
    assert "5.0 min" in found[0].message


def test_idle_stretch_is_broken_by_busy_samples_and_gaps():
    flicker = ([0.05] * 200 + [0.5]) * 2
    assert F.idle_gpus({("h1", 0): gpu_series(flicker)}) == []
    gappy = {"t": [0, 100, 200, 300, 400], "util": [0.0] * 5}  # 100 s holes: no evidence
    assert F.idle_gpus({("h1", 0): gappy}) == []
    assert F.idle_gpus({("h1", 0): gpu_series([0.0] * 31)}, min_idle_s=30) != []
    assert F.idle_gpus({("h1", 0): gpu_series([None] * 400)}) == []  # no reading is not idle


def test_not_reporting_nodes():
    nodes = [{"node": "h1", "state": "reporting", "state_since": 1.0},
             {"node": "h2", "state": "not_reporting", "state_since": 5.0}]
    found = F.not_reporting(nodes)
    assert [(f.kind, f.node, f.t) for f in found] == [("not_reporting", "h2", 5.0)]


def test_a_node_silent_at_a_normal_end_is_finished_not_lost():
    # h2 went quiet 100 s before the end (killed mid-job), h3 2 s before (with the job)
    nodes = [{"node": "h1", "state": "reporting", "state_since": 1.0},
             {"node": "h2", "state": "not_reporting", "state_since": 100.0},
             {"node": "h3", "state": "not_reporting", "state_since": 198.0},
             {"node": "h4", "state": "pending", "state_since": 0.0}]
    for state in ("succeeded", "stopped", "unknown"):
        end = F.JobEnd(200.0, state)
        assert [n["state"] for n in F.node_states(nodes, end)] == ["finished", "not_reporting", "finished", "pending"]
        assert [f.node for f in F.not_reporting(nodes, end)] == ["h2"]
    # a failed job keeps every lost node (one that died is often why it failed); a running one too
    assert [f.node for f in F.not_reporting(nodes, F.JobEnd(200.0, "failed"))] == ["h2", "h3"]
    assert [n["state"] for n in F.node_states(nodes, None)] == [n["state"] for n in nodes]
    assert [f.node for f in F.not_reporting(nodes)] == ["h2", "h3"]


def test_recorded_findings_are_judged_against_the_end(tmp_path):
    from dtrain.monitor.head.metrics_db import MetricsDB

    store = MetricsDB.for_job(tmp_path)
    for node in ("h1", "h2"):
        store.upsert_node(node, f"http://{node}:9464", 0.0, "pending")
        store.write_poll(0.0, [(node, {}, "{}")], [], [])
    # h2 stopped reporting at 50 s and came back; h1 went quiet with the job, at 199 s
    store.add_finding("not_reporting:h2:None:None:50", 50.0, "not_reporting", "h2", None, None, "h2 stopped")
    store.set_state("h2", "reporting", 60.0, "node h2 reporting again")
    store.add_finding("not_reporting:h1:None:None:199", 199.0, "not_reporting", "h1", None, None, "h1 stopped")
    store.set_state("h1", "not_reporting", 199.0, "node h1 stopped reporting")
    assert [f.t for f in F.from_store(store, F.JobEnd(200.0, "succeeded"))] == [50.0]
    assert [f.t for f in F.from_store(store, F.JobEnd(200.0, "failed"))] == [50.0, 199.0]
    assert [f.t for f in F.from_store(store)] == [50.0, 199.0]
    store.close()


def test_analyze_uses_a_window_ending_at_the_newest_sample():
    early_slow = rank_series([0.5] * 100 + [0.1] * 100)
    ranks = {("h1", 0): rank_series([0.1] * 200), ("h1", 1): early_slow}
    assert F.analyze([], ranks, {}, window_s=60) == []
    assert [f.rank for f in F.analyze([], ranks, {}, window_s=None)] == []  # weighted median over the run: tie
    ranks[("h1", 1)] = rank_series([0.5] * 150 + [0.1] * 50)
    assert [f.rank for f in F.analyze([], ranks, {}, window_s=None)] == [1]
