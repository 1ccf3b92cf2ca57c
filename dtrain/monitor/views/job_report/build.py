"""`dtrain report JOB`: summary.json + PNGs + report.html in one folder."""

from __future__ import annotations

import html
import json
import time
from pathlib import Path
from typing import Any

from dtrain.monitor.views.job_report.plots import write_plots
from dtrain.monitor.views.job_report.summary import summarize
from dtrain.monitor.views.jobs import JobInfo


def write_report(job: JobInfo, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    store = job.open()
    try:
        summary = summarize(store, job)
        plots = write_plots(store, out)
    finally:
        store.close()
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    # The page declares UTF-8 (and shows "–" for a missing figure): written so under any locale; a name
    # of bytes that are not UTF-8 is shown as a replacement character rather than losing the report.
    (out / "report.html").write_text(_html(summary, plots), encoding="utf-8", errors="replace")
    return summary


def _f(v: Any, fmt: str = "{:.3g}") -> str:
    return "–" if v is None else fmt.format(v)


def _pct(v: float | None) -> str:
    return _f(None if v is None else 100 * v, "{:.0f} %")


def _gb(v: float | None) -> str:
    return _f(None if v is None else v / 1e9, "{:.1f} GB")


def _mbs(v: float | None) -> str:
    return _f(None if v is None else v / 1e6, "{:.2f} MB/s")


def _table(head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def _cost_rows(c: dict[str, Any] | None) -> list[list[str]]:
    """The rented cluster's rows (dtrain.cluster.providers.cost), none for owned nodes."""
    if not c:
        return []
    usd = lambda v: "unknown (set cloud.prices)" if v is None else f"${v:.2f}"  # noqa: E731
    return [["cluster", f"{c['cluster']} ({c['provider']}, {c['instance_type']})"],
            ["this job", f"{c['node_hours']:.3f} node-hours, {usd(c['cost'])}"],
            ["the cluster so far", f"{c['cluster_node_hours']:.3f} node-hours, {usd(c['cluster_cost'])}, "
                                   f"{c['idle_node_hours']:.3f} idle"]]


def _html(s: dict[str, Any], plots: dict[str, str]) -> str:
    tot, job = s["totals"], s["job"]
    when = "–" if s["start"] is None else time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(s["start"]))
    totals = _table(["", ""], [
        ["started", when], ["duration", f"{s['duration_s'] / 60:.1f} min"],
        ["nodes / ranks / GPUs", f"{tot['nodes']} / {tot['ranks']} / {tot['gpus']}"],
        ["node-hours", f"{tot['node_hours']:.3f}"], ["GPU-hours", f"{tot['gpu_hours']:.3f}"],
        ["mean CPU utilisation", _pct(tot["mean_cpu_utilization"])],
        ["mean GPU utilisation", _pct(tot["mean_gpu_utilization"])],
        ["steps / samples", f"{tot['steps']} / {tot['samples']}"], ["samples/s", _f(tot["samples_per_s"])],
        ["time lost to data waits", f"{tot['data_wait_s']:.1f} rank-s ({_pct(tot['data_wait_fraction'])} of step time)"],
    ] + _cost_rows(s.get("cloud")))  # fmt: skip
    nodes = _table(
        ["node", "state", "CPU", "job CPU", "memory", "net in", "net out", "disk read", "disk write", "GPUs"],
        [[name, str(n.get("state") or "–"), _pct(n.get("cpu_mean")), _pct(n.get("job_cpu_mean")),
          f"{_gb(n.get('mem_used_mean'))} / {_gb(n.get('mem_total'))}", _mbs(n.get("net_rx_bps_mean")),
          _mbs(n.get("net_tx_bps_mean")), _mbs(n.get("disk_read_bps_mean")), _mbs(n.get("disk_write_bps_mean")),
          ", ".join(f"{g}: {_pct(v['util_mean'])}" for g, v in n.get("gpus", {}).items()) or "–"]
         for name, n in s["nodes"].items()],
    )  # fmt: skip
    ranks = _table(
        ["rank", "node", "steps", "mean step", "median step", "data wait", "samples/s", "final loss"],
        [[r, v["node"], str(v["steps"]), _f(v["step_time_mean"], "{:.3g} s"), _f(v["step_time_median"], "{:.3g} s"),
          _pct(v["data_wait_fraction"]), _f(v["samples_per_s_mean"]), _f(v["final_loss"], "{:.4g}")]
         for r, v in s["ranks"].items()],
    )  # fmt: skip
    findings = "".join(f"<li class=finding>{html.escape(f['message'])}</li>" for f in s["findings"])
    findings += "".join(
        f"<li class=finding>{html.escape(r['node'])} was lost (exit {r['exit']}) and replaced: {r['old_address']} "
        f"-&gt; {r['new_address']}, back in the job after {r['replaced_at'] - r['lost_at']:.0f} s</li>"
        for r in s.get("replacements", []))
    figs = "".join(f"<h3>{html.escape(t)}</h3><img src='{html.escape(n)}' alt='{html.escape(t)}'>" for t, n in plots.items())
    title = html.escape(f"dtrain job {job['id']}" + (f" ({job['name']})" if job.get("name") else ""))
    return f"""<!doctype html><html><head><meta charset=utf-8><title>{title}</title><style>
body{{font-family:system-ui,sans-serif;margin:2em;max-width:1000px;color:#222}}
table{{border-collapse:collapse;margin:.5em 0 1.5em}}td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}
td:first-child,th:first-child{{text-align:left}}.finding{{color:#a40}}img{{max-width:100%}}</style></head><body>
<h1>{title}</h1><p>state: {html.escape(str(job.get("state")))}</p>
<h2>Findings</h2><ul>{findings or "<li>none</li>"}</ul>
<h2>Totals</h2>{totals}<h2>Nodes (means)</h2>{nodes}<h2>Ranks</h2>{ranks}<h2>Over time</h2>{figs}
<p>Machine-readable: <a href="summary.json">summary.json</a></p></body></html>
"""
