"""top, report and dashboard over a stored job (the collection itself is tested in
test_monitor_agent/netns): 2 nodes, one GPU each, 4 ranks, rank 3 a straggler, the GPU
of node b idle. In `stored_job` node b's agent is lost 40 s before the end (killed
mid-job); in `finished_job` it goes quiet with the job, as agents do when a job ends."""

from __future__ import annotations

import json
import math
import os

import pytest

from dtrain.monitor.views.jobs import JobInfo
from dtrain.monitor.head.metrics_db import MetricsDB

T0 = 1_800_000_000.0
N = 400  # one poll a second: 6.7 minutes
B_LOST = N - 40  # polls node b answered in `stored_job`
B_QUIET = N - 4  # ... in `finished_job`


def write_job(job_dir, b_polls):
    store = MetricsDB.for_job(job_dir)
    store.set_meta(job=job_dir.name, started=T0)
    for node in ("a", "b"):
        store.upsert_node(node, f"http://{node}:9464", T0, "pending")
        store.set_state(node, "reporting", T0, f"node {node} reporting")
    totals = {r: [0, 0.0, 0.0, 0] for r in range(4)}
    for i in range(N):
        t = T0 + i
        nodes, gpus, ranks = [], [], []
        for k, node in enumerate(("a", "b")):
            if node == "b" and i >= b_polls:
                continue  # b stopped answering
            nodes.append((node, {
                "cpu": 0.5 + 0.4 * math.sin(i / 20 + k), "mem_used": 6e9 + 1e6 * i, "mem_total": 16 * 2**30,
                "net_rx_bps": 2.5e6, "net_tx_bps": 1.2e6, "disk_read_bps": 4e6, "disk_write_bps": 1e5,
                "disk_read_iops": 100, "disk_write_iops": 3, "job_cpu": 0.4, "job_rss": 3e9, "job_procs": 3,
            }, json.dumps({"cpu_cores": [0.5, 0.5]})))
            gpus.append((node, 0, {"util": 0.93 if node == "a" else 0.02, "mem_used": 20e9, "mem_total": 80e9,
                                   "power_w": 250.0, "temp_c": 60.0, "sm_clock_hz": 1.4e9}))
        for rank in range(4):
            node = "a" if rank < 2 else "b"
            if node == "b" and i >= b_polls:
                continue
            step_time = 0.25 if rank == 3 else 0.1
            steps = int(1 / step_time)
            tot = totals[rank]
            tot[0] += steps
            tot[1] += steps * step_time
            tot[2] += steps * 0.01
            tot[3] += steps * 32
            ranks.append((node, rank, {
                "step": tot[0], "epoch": i // 100, "loss": 2.0 * math.exp(-i / 150) + 0.1, "lr": 0.1,
                "steps": steps, "step_time": step_time, "data_wait": 0.01, "samples_per_s": steps * 32.0,
                "steps_total": tot[0], "step_time_total": tot[1], "data_wait_total": tot[2], "samples_total": tot[3],
            }))
        store.write_poll(t, nodes, gpus, ranks)
    lost = T0 + b_polls + 2  # the third missed poll
    store.set_state("b", "not_reporting", lost, "node b stopped reporting: 3 polls failed")
    store.add_finding("not_reporting:b:None:None:x", lost, "not_reporting", "b", None, None,
                      "node b stopped reporting: 3 polls failed")
    store.set_meta(stopped=T0 + N)
    store.close()


@pytest.fixture(scope="module")
def stored_job(tmp_path_factory):
    job_dir = tmp_path_factory.mktemp("jobs") / "20261202-120000-abcd"
    write_job(job_dir, B_LOST)
    return JobInfo(id=job_dir.name, dir=job_dir, name="demo", state="succeeded")


@pytest.fixture(scope="module")
def finished_job(tmp_path_factory):
    job_dir = tmp_path_factory.mktemp("jobs") / "20261202-130000-ef01"
    write_job(job_dir, B_QUIET)
    return JobInfo(id=job_dir.name, dir=job_dir, name="demo", state="succeeded")


@pytest.fixture
def dashboard(dtrain_home):
    """A real dashboard server on a free loopback port, in a thread; yields (server, base URL)."""
    import threading

    from dtrain.monitor.views.dashboard.server import make_server

    server = make_server("127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_top_renders_every_node_and_the_findings_in_80_columns(stored_job):
    from dtrain.monitor.views.top import render_text

    store = stored_job.open()
    text = render_text(store, stored_job, width=80)
    store.close()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, text
    row_a = next(line for line in lines if line.startswith("a "))
    row_b = next(line for line in lines if line.startswith("b "))
    assert "2.5M/1.2M" in row_a and "4.0M/100k" in row_a  # net in/out, disk r/w
    assert "0: 93%" in row_a and "0:  2%" in row_b  # GPU util per GPU
    assert "r0 0.1s" in row_a and "r2 0.1s" in row_b
    assert "r3 0.25s" in text  # b's slowest rank, on the line under r2
    assert any(c in row_a for c in "▁▂▃▄▅▆▇█")  # CPU sparkline
    assert "rank 3 on b is a straggler" in text
    assert "node b stopped reporting" in text  # killed mid-job
    assert "nodes 1/2 finished" in text


def test_a_job_that_ended_normally_shows_no_lost_node(finished_job):
    from dtrain.monitor.views.job_report import write_report
    from dtrain.monitor.views.jobs import resolve
    from dtrain.monitor.views.top import render_text

    store = finished_job.open()
    text = render_text(store, finished_job, width=80)
    store.close()
    assert "stopped reporting" not in text and "nodes 2/2 finished" in text
    assert "rank 3 on b is a straggler" in text and "GPU 0 on b was idle" in text
    # `dtrain report DIR` (what a copied job directory resolves to)
    out = finished_job.dir / "report"
    summary = write_report(resolve(str(finished_job.dir)), out)
    assert {f["kind"] for f in summary["findings"]} == {"straggler", "idle_gpu"}
    assert {n: v["state"] for n, v in summary["nodes"].items()} == {"a": "finished", "b": "finished"}
    assert "stopped reporting" not in (out / "report.html").read_text()


def test_report_writes_html_pngs_and_summary(stored_job, tmp_path, dtrain_cmd):
    import subprocess

    out = tmp_path / "rep"
    res = subprocess.run([*dtrain_cmd, "report", str(stored_job.dir), "--out", str(out)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "2 nodes, 4 ranks" in res.stdout
    for name in ("report.html", "summary.json", "utilization.png", "throughput.png", "loss.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "utilization.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    s = json.loads((out / "summary.json").read_text())
    tot = s["totals"]
    assert tot["nodes"] == 2 and tot["ranks"] == 4 and tot["gpus"] == 2
    # node a: 400 samples 1 s apart -> 400 s; node b: 360 s
    assert tot["node_hours"] == pytest.approx((N + B_LOST) / 3600)
    assert tot["gpu_hours"] == pytest.approx((N + B_LOST) / 3600)
    assert tot["mean_gpu_utilization"] == pytest.approx((0.93 * N + 0.02 * B_LOST) / (N + B_LOST))
    # every step waits 0.01 s: rank 3 (4 steps/s, 360 polls) + ranks 0..2 (10 steps/s)
    steps = 10 * N * 2 + 10 * B_LOST + 4 * B_LOST
    assert tot["steps"] == steps and tot["data_wait_s"] == pytest.approx(0.01 * steps)
    assert s["ranks"]["3"]["node"] == "b" and s["ranks"]["3"]["step_time_median"] == pytest.approx(0.25)
    assert s["ranks"]["0"]["data_wait_fraction"] == pytest.approx(0.1)
    assert s["nodes"]["a"]["gpus"]["0"]["util_mean"] == pytest.approx(0.93)
    kinds = {(f["kind"], f["node"], f["rank"], f["gpu"]) for f in s["findings"]}
    assert kinds == {("straggler", "b", 3, None), ("idle_gpu", "b", None, 0), ("not_reporting", "b", None, None)}
    assert s["nodes"]["a"]["state"] == "finished" and s["nodes"]["b"]["state"] == "not_reporting"
    html = (out / "report.html").read_text()
    assert "rank 3 on b is a straggler" in html and "<img src='utilization.png'" in html
    assert "node b stopped reporting" in html


def test_report_of_a_node_without_gpus_under_an_ascii_locale(tmp_path, dtrain_cmd):
    """The page shows "–" for a figure a node lacks (GPUs on a CPU node); under LC_ALL=C without
    Python's UTF-8 mode the write used ASCII and `dtrain report` died with UnicodeEncodeError."""
    import subprocess

    job_dir = tmp_path / "jobs" / "20261202-140000-c0de"
    store = MetricsDB.for_job(job_dir)
    store.set_meta(job=job_dir.name, started=T0)
    store.upsert_node("cpu1", "http://cpu1:9464", T0, "pending")
    sample = {"cpu": 0.5, "mem_used": 1e9, "mem_total": 2e9, "net_rx_bps": 1.0, "net_tx_bps": 1.0,
              "disk_read_bps": 1.0, "disk_write_bps": 1.0, "disk_read_iops": 1, "disk_write_iops": 1,
              "job_cpu": 0.1, "job_rss": 1e8, "job_procs": 1}
    store.write_poll(T0 + 1, [("cpu1", sample, json.dumps({}))], [], [])
    store.set_meta(stopped=T0 + 2)
    store.close()
    out = tmp_path / "rep"
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0"}
    res = subprocess.run([*dtrain_cmd, "report", str(job_dir), "--out", str(out)], capture_output=True,
                         text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-800:]
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "<meta charset=utf-8>" in page and "<td>cpu1</td>" in page and "<td>–</td>" in page


def test_a_failed_job_keeps_a_node_lost_at_its_end(finished_job, dtrain_home):
    # A node that dies makes the job fail seconds later: that loss explains the failure.
    # `top` learns the end from the registry while it watches.
    from dtrain.jobs.registry import JobRegistry, JobState
    from dtrain.monitor.views.jobs import JobInfo, refresh
    from dtrain.monitor.views.top import render_text

    registry = JobRegistry()
    rec = registry.create("demo", ["a", "b"], 4, finished_job.dir, job_id=finished_job.id)
    registry.mark_running(rec.id)
    watched = refresh(JobInfo(id=rec.id, dir=finished_job.dir, state="running"))
    assert watched.state == "running"
    registry.finish(rec.id, JobState.FAILED, 1, "node b failed")
    watched = refresh(watched)
    assert watched.state == "failed" and watched.ended is not None
    store = watched.open()
    text = render_text(store, watched, width=80)
    store.close()
    assert "node b stopped reporting" in text and "nodes 1/2 finished" in text


def test_views_of_an_unknown_job_fail_with_a_message(dtrain_home, dtrain_cmd):
    import subprocess

    for argv in (["report", "nope"], ["top", "nope", "--once"]):
        res = subprocess.run([*dtrain_cmd, *argv], capture_output=True, text=True, timeout=60)
        assert res.returncode != 0
        assert "no job 'nope'" in res.stderr and "Traceback" not in res.stderr


def test_top_cli_once(stored_job, dtrain_cmd):
    import subprocess

    res = subprocess.run([*dtrain_cmd, "top", str(stored_job.dir), "--once"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "COLUMNS": "80"})
    assert res.returncode == 0, res.stderr
    assert "rank 3 on b is a straggler" in res.stdout and "r3 0.25s" in res.stdout


def test_views_of_a_job_directory_whose_path_is_no_plain_uri(stored_job, tmp_path, dtrain_cmd):
    """The store is opened read-only through a SQLite URI: pasted in unescaped, `#` cut the
    path short (and SQLite created an empty file there) and `?` or `%3F` broke it."""
    import shutil
    import subprocess

    copies = tmp_path / "copies"
    copies.mkdir()
    job_dir = copies / "run #1?x%3F é"
    shutil.copytree(stored_job.dir, job_dir)
    top = subprocess.run([*dtrain_cmd, "top", str(job_dir), "--once"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "80"})  # fmt: skip
    assert top.returncode == 0, top.stderr[-800:]
    assert "rank 3 on b is a straggler" in top.stdout
    report = subprocess.run([*dtrain_cmd, "report", str(job_dir), "--out", str(tmp_path / "rep")],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert report.returncode == 0, report.stderr[-800:]
    assert "2 nodes, 4 ranks" in report.stdout
    assert [p.name for p in copies.iterdir()] == [job_dir.name]  # no stray file beside it


@pytest.mark.slow  # a dashboard server and headless chromium: ~12 s on the loaded 2-core machine
def test_dashboard_of_a_finished_job_in_headless_chromium(finished_job, stored_job, dtrain_home, dashboard,
                                                          tmp_path):  # fmt: skip
    import re
    import shutil
    import subprocess
    import urllib.request

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(chromium):
        if os.environ.get("CI"):
            pytest.fail("chromium is missing in CI (.ci/run installs it)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    for job in (stored_job, finished_job):
        shutil.copytree(job.dir, dtrain_home / "jobs" / job.id)
    logs = dtrain_home / "jobs" / finished_job.id / "logs"
    logs.mkdir()
    (logs / "a.log").write_text("[a:r0] epoch 0 step 10 loss 1.93\n")
    base = dashboard[1]
    jobs = json.loads(urllib.request.urlopen(base + "/api/jobs", timeout=10).read())
    assert {j["id"] for j in jobs} == {stored_job.id, finished_job.id}
    js = urllib.request.urlopen(base + "/static/plotly.min.js", timeout=10).read()
    assert len(js) > 1_000_000 and b"plotly" in js[:2000].lower()
    assert urllib.request.urlopen(base + "/api/jobs/" + finished_job.id + "/logs", timeout=10).status == 200
    # live updates: the page asks only for samples newer than the last it has
    newer = json.loads(urllib.request.urlopen(f"{base}/api/jobs/{finished_job.id}/series?since={T0 + N - 3}",
                                              timeout=10).read())
    assert newer["nodes"]["a"]["t"] == [T0 + N - 2, T0 + N - 1] and "b" not in newer["nodes"]
    assert newer["last"] == T0 + N - 1
    # a node killed mid-job is still reported
    lost = json.loads(urllib.request.urlopen(f"{base}/api/jobs/{stored_job.id}/series", timeout=10).read())
    assert {n["node"]: n["state"] for n in lost["states"]} == {"a": "finished", "b": "not_reporting"}
    assert [f["node"] for f in lost["findings"] if f["kind"] == "not_reporting"] == ["b"]

    shot = tmp_path / "dashboard.png"
    res = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1400,2000", "--virtual-time-budget=5000",
         f"--screenshot={shot}", "--dump-dom", f"{base}/#job={finished_job.id}"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    dom = res.stdout
    charts = dict(re.findall(r'<div id="chart-(\w+)" class="chart js-plotly-plot" data-points="(\d+)"', dom))
    assert set(charts) == {"cpu", "mem", "net_rx", "net_tx", "disk_r", "disk_w", "gpu_util", "gpu_mem", "step_time",
                           "samples", "loss", "data_wait"}, charts  # fmt: skip
    assert int(charts["cpu"]) == N + B_QUIET and int(charts["step_time"]) == N * 2 + B_QUIET * 2
    assert all(int(n) > 0 for n in charts.values())
    assert dom.count('class="js-line"') >= 12  # plotly drew the lines in SVG
    assert "rank 3 on b is a straggler" in dom and "[a:r0] epoch 0 step 10 loss 1.93" in dom
    assert finished_job.id in dom and "stopped reporting" not in dom
    assert ">a: finished<" in dom and ">b: finished<" in dom
    assert shot.stat().st_size > 20_000 and shot.read_bytes()[:4] == b"\x89PNG"


def test_a_diverged_loss_is_stored_as_a_gap(tmp_path):
    store = MetricsDB.for_job(tmp_path)
    store.write_poll(T0, [], [], [("a", 0, {"loss": float("nan"), "step_time": float("inf"), "steps": 1})])
    row = store.rank_series()[("a", 0)]
    assert row["loss"] == [None] and row["step_time"] == [None] and row["steps"] == [1]
    store.close()


def test_dashboard_thins_long_histories_keeping_the_newest(stored_job, dtrain_home, monkeypatch):
    import shutil

    from dtrain.errors import DtrainError
    from dtrain.monitor.views.dashboard import server

    shutil.copytree(stored_job.dir, dtrain_home / "jobs" / stored_job.id)
    with pytest.raises(DtrainError):
        server.series(str(stored_job.dir), 0.0)  # a path is not a job id: the API serves listed jobs only
    monkeypatch.setattr(server, "MAX_POINTS", 100)
    data = server.series(stored_job.id, 0.0)
    t = data["nodes"]["a"]["t"]
    assert 50 <= len(t) <= 100 and t[-1] == T0 + N - 1 and t == sorted(t)
    assert len(data["ranks"]["3"]["loss"]) == len(data["ranks"]["3"]["t"]) <= 100


def test_dashboard_command_serves_on_loopback(stored_job, dtrain_home, dtrain_cmd):
    import shutil
    import subprocess
    import urllib.request

    shutil.copytree(stored_job.dir, dtrain_home / "jobs" / stored_job.id)
    proc = subprocess.Popen([*dtrain_cmd, "dashboard", "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("dtrain dashboard on http://127.0.0.1:"), line
        url = line.split()[3]
        page = urllib.request.urlopen(url, timeout=10).read().decode()
        assert "/static/plotly.min.js" in page and "/static/app.js" in page
        jobs = json.loads(urllib.request.urlopen(url + "api/jobs", timeout=10).read())
        assert [j["id"] for j in jobs] == [stored_job.id]
        taken = subprocess.run([*dtrain_cmd, "dashboard", "--port", url.rsplit(":", 1)[1].strip("/")],
                                 capture_output=True, text=True, timeout=60)
        assert taken.returncode != 0 and "cannot listen on 127.0.0.1" in taken.stderr
        assert "Traceback" not in taken.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_dashboard_drops_a_connection_whose_request_head_does_not_come(dashboard):
    """http.server waits forever for a request head, a thread per connection: 300 half-sent
    requests held 300 threads and 800 left the dashboard answering nobody."""
    import socket
    import urllib.request

    server, base = dashboard
    server.client_timeout_s = 1.0  # the default (10 s) would only make the test slow
    stalled = socket.create_connection(server.server_address[:2])
    try:
        stalled.sendall(b"GET /api/jo")  # half a request head, then silence
        stalled.settimeout(30)  # far beyond the server's limit: a hang fails the test
        assert stalled.recv(1024) == b""  # closed by the server, nothing answered
    finally:
        stalled.close()
    assert json.loads(urllib.request.urlopen(base + "/api/jobs", timeout=10).read()) == []


def test_a_store_without_its_schema_reads_as_one_without_samples(tmp_path, dtrain_cmd):
    """The collector creates metrics.sqlite empty and writes its schema a moment later (never
    on a full disk): top and report died on "no such table: meta" in between."""
    import subprocess

    job_dir = tmp_path / "20261202-150000-0000"
    job_dir.mkdir()
    (job_dir / "metrics.sqlite").touch()
    for argv in (["top", str(job_dir), "--once"], ["report", str(job_dir), "--out", str(tmp_path / "rep")]):
        res = subprocess.run([*dtrain_cmd, *argv], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-800:]
    assert "0 nodes, 0 ranks" in res.stdout
    # a reader opened in that moment (`dtrain top` keeps its store) sees the samples once they come
    reader = MetricsDB.for_job(job_dir, readonly=True)
    assert reader.meta() == {} and reader.nodes() == [] and reader.time_range() is None
    assert reader.node_series() == {} and reader.rank_series() == {}
    writer = MetricsDB.for_job(job_dir)
    writer.upsert_node("a", "http://a:9464", T0, "pending")
    writer.write_poll(T0 + 1, [("a", {"cpu": 0.5}, "{}")], [], [("a", 0, {"step": 1})])
    writer.close()
    assert [n["node"] for n in reader.nodes()] == ["a"] and reader.time_range() == (T0 + 1, T0 + 1)
    assert reader.rank_series()[("a", 0)]["step"] == [1]
    reader.close()


def test_dashboard_answers_for_a_store_without_schema_and_a_damaged_one(dashboard, dtrain_home):
    """A job whose metrics.sqlite is still empty shows no samples; one that is no database
    at all gets a 500 naming the error, where the connection used to be dropped unanswered."""
    import urllib.error
    import urllib.request

    base = dashboard[1]
    for job, content in (("20261202-160000-e0e0", b""), ("20261202-170000-bad0", b"not sqlite" * 500)):
        (dtrain_home / "jobs" / job).mkdir(parents=True)
        (dtrain_home / "jobs" / job / "metrics.sqlite").write_bytes(content)
    empty = json.loads(urllib.request.urlopen(f"{base}/api/jobs/20261202-160000-e0e0/series", timeout=10).read())
    assert empty["nodes"] == {} and empty["ranks"] == {} and empty["findings"] == [] and empty["first"] is None
    with pytest.raises(urllib.error.HTTPError) as failed:
        urllib.request.urlopen(f"{base}/api/jobs/20261202-170000-bad0/series", timeout=10)
    assert failed.value.code == 500
    assert json.loads(failed.value.read()) == {"error": "DatabaseError: file is not a database"}
    assert urllib.request.urlopen(f"{base}/api/jobs", timeout=10).status == 200  # still serving


def test_dashboard_log_tails_are_read_from_the_end_and_bounded(stored_job, dashboard, dtrain_home):
    """Log tails used to be read whole: `lines=50` of a 60 MB log without newlines sent 60 MB,
    and the page asks for 200 lines of every log each 2 s."""
    import shutil
    import urllib.request

    job_dir = dtrain_home / "jobs" / stored_job.id
    shutil.copytree(stored_job.dir, job_dir)
    (job_dir / "logs").mkdir()
    before = "".join(f"old {i}\n" for i in range(2000))
    after = "".join(f"new {i}\n" for i in range(100)) + "w" * 10_000 + "\n" + "".join(f"end {i}\r\n" for i in range(20))
    (job_dir / "logs" / "a.log").write_text(before + "x" * 5_000_000 + "\n" + after)
    (job_dir / "logs" / "b.log").write_text(before + "y" * 5_000_000)  # still being written, no newline
    body = urllib.request.urlopen(f"{dashboard[1]}/api/jobs/{stored_job.id}/logs?lines=50", timeout=30).read()
    assert len(body) < 20_000  # two short tails, not the 5 MB lines
    from dtrain.monitor.views.dashboard.server import LINE_CUT, MAX_LOG_LINE, START_CUT

    tails = json.loads(body)
    # a: the last 50 lines, the 10,000-character one cut; the 5 MB line further back is not read
    assert tails["a"][:29] == [f"new {i}" for i in range(71, 100)]
    assert tails["a"][29] == "w" * MAX_LOG_LINE + LINE_CUT
    assert tails["a"][30:] == [f"end {i}" for i in range(20)]
    # b: only the end of its last line, whose start lies too far back, marked at both ends
    assert tails["b"] == [START_CUT + "y" * MAX_LOG_LINE + LINE_CUT]


def test_top_and_report_of_a_store_that_is_no_database_say_so_in_one_line(tmp_path, dtrain_cmd):
    """A metrics.sqlite damaged or replaced by another file gave a sqlite3 traceback."""
    import subprocess

    job_dir = tmp_path / "20261202-150000-bad0"
    job_dir.mkdir()
    (job_dir / "metrics.sqlite").write_text("not a database at all\n" * 200)
    for args in (["top", "--once", str(job_dir)], ["report", str(job_dir), "--out", str(tmp_path / "rep")]):
        res = subprocess.run([*dtrain_cmd, *args], capture_output=True, text=True, timeout=120)
        assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr[-800:]
        assert "metrics.sqlite cannot be read as the job's metrics (file is not a database)" in res.stderr, res.stderr
