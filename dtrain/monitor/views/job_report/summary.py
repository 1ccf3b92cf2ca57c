"""summary.json: per node and per rank means, totals, findings — from the stored series."""

from __future__ import annotations

import json
import statistics
from typing import Any

from dtrain.cluster.providers.cost import job_cost
from dtrain.monitor.head import findings as rules
from dtrain.monitor.views.jobs import JobInfo
from dtrain.monitor.head.metrics_db import MetricsDB

NODE_MEANS = ("cpu", "mem_used", "net_rx_bps", "net_tx_bps", "disk_read_bps", "disk_write_bps", "disk_read_iops",
              "disk_write_iops", "job_cpu", "job_rss")  # fmt: skip
GPU_MEANS = ("util", "mem_used", "power_w", "temp_c", "sm_clock_hz")


def _mean(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _span(ts: list[float], interval: float) -> float:
    """Seconds covered by samples taken every `interval` (one sample covers one interval)."""
    return (ts[-1] - ts[0] + interval) if ts else 0.0


def _interval(ts: list[float]) -> float:
    gaps = [b - a for a, b in zip(ts, ts[1:]) if b > a]
    return statistics.median(gaps) if gaps else 1.0


def summarize(store: MetricsDB, job: JobInfo) -> dict[str, Any]:
    nodes_s = store.node_series()
    gpus_s = store.gpu_series()
    ranks_s = store.rank_series()
    span = store.time_range()
    end = job.end(store)
    states = {n["node"]: n for n in rules.node_states(store.nodes(), end)}

    nodes: dict[str, Any] = {}
    node_seconds = 0.0
    for node, s in sorted(nodes_s.items()):
        secs = _span(s["t"], _interval(s["t"]))
        node_seconds += secs
        nodes[node] = {f"{c}_mean": _mean(s[c]) for c in NODE_MEANS}
        nodes[node].update(mem_total=_mean(s["mem_total"]), seconds=secs, samples=len(s["t"]),
                           state=states.get(node, {}).get("state"), gpus={})  # fmt: skip
    gpu_seconds, gpu_util_weighted = 0.0, 0.0
    for (node, gpu), s in sorted(gpus_s.items()):
        secs = _span(s["t"], _interval(s["t"]))
        gpu_seconds += secs
        util = _mean(s["util"])
        gpu_util_weighted += (util or 0.0) * secs
        entry = {f"{c}_mean": _mean(s[c]) for c in GPU_MEANS}
        entry.update(mem_total=_mean(s["mem_total"]), seconds=secs)
        nodes.setdefault(node, {"gpus": {}})["gpus"][str(gpu)] = entry

    ranks: dict[str, Any] = {}
    total_wait = total_step = 0.0
    total_steps = total_samples = 0
    for (node, rank), s in sorted(ranks_s.items(), key=lambda kv: kv[0][1]):
        idx = [i for i, k in enumerate(s["steps"]) if k and s["step_time"][i] is not None]
        steps = s["steps_total"][-1] or 0
        step_s, wait_s, samples = s["step_time_total"][-1] or 0.0, s["data_wait_total"][-1] or 0.0, s["samples_total"][-1] or 0
        ranks[str(rank)] = {
            "node": node,
            "steps": steps,
            "samples": samples,
            "step_time_mean": step_s / steps if steps else None,
            "step_time_median": statistics.median(s["step_time"][i] for i in idx) if idx else None,
            "data_wait_mean": wait_s / steps if steps else None,
            "data_wait_fraction": wait_s / step_s if step_s else None,
            "data_wait_s": wait_s,
            "samples_per_s_mean": _mean(s["samples_per_s"]),
            "final_step": s["step"][-1],
            "final_loss": next((v for v in reversed(s["loss"]) if v is not None), None),
        }
        total_wait += wait_s
        total_step += step_s
        total_steps += steps
        total_samples += samples

    duration = (span[1] - span[0]) if span else 0.0
    cpu_means = [n["cpu_mean"] for n in nodes.values() if n.get("cpu_mean") is not None]
    found = rules.from_store(store, end, window_s=None)
    return {
        "job": job.as_dict(),
        "start": span[0] if span else None,
        "end": span[1] if span else None,
        "duration_s": duration,
        "nodes": nodes,
        "ranks": ranks,
        "totals": {
            "nodes": len(nodes),
            "ranks": len(ranks),
            "gpus": len(gpus_s),
            "node_hours": node_seconds / 3600.0,
            "gpu_hours": gpu_seconds / 3600.0,
            "mean_cpu_utilization": sum(cpu_means) / len(cpu_means) if cpu_means else None,
            "mean_gpu_utilization": gpu_util_weighted / gpu_seconds if gpu_seconds else None,
            "steps": total_steps,
            "samples": total_samples,
            "samples_per_s": total_samples / duration if duration else None,
            # rank-seconds the ranks spent waiting for data, and that over their step time
            "data_wait_s": total_wait,
            "data_wait_hours": total_wait / 3600.0,
            "data_wait_fraction": total_wait / total_step if total_step else None,
        },
        "findings": [f.as_dict() for f in found],
        # node-hours and cost on a rented cluster (None elsewhere); owner: cloud
        "cloud": job_cost(job.nodes, job.started, job.ended),
        "replacements": _replacements(job.dir),
    }


def _replacements(job_dir) -> list[dict[str, Any]]:
    """Nodes replaced mid-job on a rented cluster, one JSON line each (launch.session)."""
    path = job_dir / "replacements.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []
