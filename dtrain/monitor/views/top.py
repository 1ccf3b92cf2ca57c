"""`dtrain top`: one row per node, readable in 80 columns over SSH, findings below.

`render(store, job)` builds a rich renderable from the stored series only, so the view
is the same live (the collector writes while we read) and after the job, and a test can
render it to a string with a Console of width 80.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from dtrain.monitor.head import findings as rules
from dtrain.monitor.views.jobs import JobInfo, refresh
from dtrain.monitor.head.metrics_db import MetricsDB

HISTORY_S = 120.0  # what the sparklines cover
SPARK_LEN = 6
BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float | None], width: int = SPARK_LEN, top: float | None = None) -> str:
    """`values` (oldest first) averaged into at most `width` buckets, one bar each."""
    vals = [v for v in values if v is not None]
    if not vals:
        return ""
    size = max(1, math.ceil(len(vals) / width))
    buckets = [sum(vals[i : i + size]) / len(vals[i : i + size]) for i in range(0, len(vals), size)]
    hi = top if top is not None else max(buckets)
    if hi <= 0:
        return BARS[0] * len(buckets)
    return "".join(BARS[max(0, min(len(BARS) - 1, int(v / hi * (len(BARS) - 1) + 0.5)))] for v in buckets)


def human(n: float | None, unit: str = "") -> str:
    """1234567 -> '1.2M' (decimal prefixes, as for network rates)."""
    if n is None:
        return "-"
    for prefix in ("", "k", "M", "G", "T"):
        if abs(n) < 999.5 or prefix == "T":
            return f"{n:.0f}{prefix}{unit}" if prefix == "" or abs(n) >= 9.95 else f"{n:.1f}{prefix}{unit}"
        n /= 1000.0
    return f"{n:.0f}{unit}"


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f}" if n < 10 * 2**30 else f"{n / 2**30:.0f}"


def _last(values: list) -> Any:
    return next((v for v in reversed(values) if v is not None), None)


def node_rows(store: MetricsDB, end: rules.JobEnd | None, window_s: float = rules.WINDOW_S) -> list[dict[str, Any]]:
    """Per node: state (as of the job's `end`), latest values, CPU history, GPUs, and the
    fastest/slowest rank of the node by median step time over the last `window_s` of
    stored samples."""
    span = store.time_range()
    since = 0.0 if span is None else span[1] - HISTORY_S
    series = store.node_series(since)
    gpus = store.gpu_series(since)
    ranks = store.rank_series(0.0 if span is None else span[1] - window_s)
    states = {n["node"]: n["state"] for n in rules.node_states(store.nodes(), end)}
    rows = []
    for node in sorted(set(series) | set(states)):
        s = series.get(node, {})
        row: dict[str, Any] = {"node": node, "state": states.get(node, "unknown")}
        for col in ("cpu", "mem_used", "mem_total", "net_rx_bps", "net_tx_bps", "disk_read_bps", "disk_write_bps"):
            row[col] = _last(s.get(col, []))
        row["cpu_hist"] = s.get("cpu", [])
        row["gpus"] = [
            {"gpu": g, "util": _last(v["util"]), "mem_used": _last(v["mem_used"]), "mem_total": _last(v["mem_total"]),
             "util_hist": v["util"]}
            for (n, g), v in sorted(gpus.items()) if n == node
        ]  # fmt: skip
        medians = []
        for (n, rank), v in ranks.items():
            times = [t for t, k in zip(v["step_time"], v["steps"]) if k and t is not None]
            if n == node and times:
                medians.append((statistics.median(times), rank))
        row["fastest"] = min(medians) if medians else None
        row["slowest"] = max(medians) if medians else None
        rows.append(row)
    return rows


def _header(store: MetricsDB, job: JobInfo, rows: list[dict[str, Any]], ended: bool) -> Text:
    span = store.time_range()
    shown = "finished" if ended else "reporting"
    counted = sum(r["state"] == shown for r in rows)
    elapsed = "" if span is None else f"  {(span[1] - span[0]) / 60:.1f} min"
    ranks = store.rank_series(0.0 if span is None else span[1] - 10)
    rate = sum(_last(v["samples_per_s"]) or 0.0 for v in ranks.values())
    loss = next((_last(v["loss"]) for k, v in sorted(ranks.items(), key=lambda kv: kv[0][1])), None)
    text = Text(f"job {job.id}", style="bold")
    text.append(f"  {job.state}{elapsed}  nodes {counted}/{len(rows)} {shown}")
    if ranks:
        text.append(f"  {human(rate)} samples/s")
    if loss is not None:
        text.append(f"  loss {loss:.4g}")
    return text


def render(store: MetricsDB, job: JobInfo) -> Group:
    end = job.end(store)
    rows = node_rows(store, end)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True)
    for header, justify in (("node", "left"), ("cpu", "left"), ("mem G", "right"), ("net i/o", "right"),
                            ("disk r/w", "right"), ("gpu util mem", "left"), ("step", "left")):  # fmt: skip
        table.add_column(header, no_wrap=True, justify=justify, overflow="ellipsis")
    table.columns[0].max_width = 10
    for r in rows:
        # long names usually differ at the end (gpu-node-07, gpu-node-08): keep the end
        short = r["node"] if len(r["node"]) <= 10 else "…" + r["node"][-9:]
        name = Text(short, style="red" if r["state"] == "not_reporting" else "")
        cpu = "-" if r["cpu"] is None else f"{r['cpu']:4.0%} {sparkline(r['cpu_hist'], top=1.0)}"
        mem = f"{gib(r['mem_used'])}/{gib(r['mem_total'])}"
        net = f"{human(r['net_rx_bps'])}/{human(r['net_tx_bps'])}"
        disk = f"{human(r['disk_read_bps'])}/{human(r['disk_write_bps'])}"
        gpu = "\n".join(
            f"{g['gpu']}:{(g['util'] or 0):4.0%} {sparkline(g['util_hist'], 4, top=1.0):4} "
            f"{gib(g['mem_used'])}/{gib(g['mem_total'])}"
            for g in r["gpus"]
        ) or "-"
        if r["fastest"] is None:
            step = "-"
        else:
            (fast, fr), (slow, sr) = r["fastest"], r["slowest"]
            step = f"r{fr} {fast:.3g}s" if fr == sr else f"r{fr} {fast:.3g}s\nr{sr} {slow:.3g}s"
        table.add_row(name, cpu, mem, net, disk, gpu, step)
    found = rules.from_store(store, end)
    lines: list[Any] = [_header(store, job, rows, end is not None), table]
    if found:
        lines.append(Text("findings", style="bold"))
        lines += [Text(f"! {f.message}", style="yellow") for f in found]
    else:
        lines.append(Text("no findings", style="dim"))
    return Group(*lines)


def render_text(store: MetricsDB, job: JobInfo, width: int = 80) -> str:
    console = Console(width=width, record=True, file=open("/dev/null", "w"), color_system=None)
    console.print(render(store, job))
    return console.export_text()


def run_live(job: JobInfo, console: Console, refresh_s: float = 1.0, stop: Callable[[], bool] = lambda: False) -> None:
    store = job.open()
    try:
        with Live(render(store, job), console=console, refresh_per_second=4, screen=False) as live:
            while not stop():
                time.sleep(refresh_s)
                job = refresh(job)  # how the job ended decides which findings stand
                live.update(render(store, job))
    finally:
        store.close()
