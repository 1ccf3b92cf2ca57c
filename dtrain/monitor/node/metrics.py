"""The metric names: one table that the agent exports, the README lists and tests check.

Prometheus conventions: `dtrain_` prefix, base units in the name (bytes, seconds, hertz,
watts, celsius), ratios in 0..1 named `_ratio`, counters named `_total`. Every series
carries the labels `job` and `node`; the extra labels are listed per metric.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class Metric:
    name: str
    kind: Literal["gauge", "counter"]
    help: str
    labels: tuple[str, ...] = ()
    # Where the series exists: every node, only with NVIDIA GPUs (NVML), or only once a
    # rank on the node has called report_step.
    scope: Literal["node", "gpu", "rank"] = "node"

    @property
    def family(self) -> str:
        """The name prometheus-client wants for a counter family (without `_total`)."""
        return self.name.removesuffix("_total") if self.kind == "counter" else self.name


BASE_LABELS = ("job", "node")

METRICS: tuple[Metric, ...] = (
    # Node (psutil)
    Metric("dtrain_node_cpu_utilization_ratio", "gauge", "CPU busy time over all cores, 0-1"),
    Metric("dtrain_node_cpu_core_utilization_ratio", "gauge", "CPU busy time per core, 0-1", ("cpu",)),
    Metric("dtrain_node_memory_used_bytes", "gauge", "memory in use (total - available)"),
    Metric("dtrain_node_memory_total_bytes", "gauge", "physical memory"),
    Metric("dtrain_node_network_receive_bytes_total", "counter", "bytes received", ("interface",)),
    Metric("dtrain_node_network_transmit_bytes_total", "counter", "bytes sent", ("interface",)),
    Metric("dtrain_node_disk_read_bytes_total", "counter", "bytes read from all disks"),
    Metric("dtrain_node_disk_written_bytes_total", "counter", "bytes written to all disks"),
    Metric("dtrain_node_disk_reads_completed_total", "counter", "read operations on all disks"),
    Metric("dtrain_node_disk_writes_completed_total", "counter", "write operations on all disks"),
    # The job's own processes on this node (ranks, their data loader workers, torchrun)
    Metric("dtrain_job_processes", "gauge", "processes of the job on this node"),
    Metric("dtrain_job_cpu_utilization_ratio", "gauge", "CPU used by the job's processes over the node's capacity, 0-1"),
    Metric("dtrain_job_memory_rss_bytes", "gauge", "resident memory of the job's processes"),
    # GPUs (nvidia-ml-py); absent without an NVIDIA GPU or driver
    Metric("dtrain_gpu_utilization_ratio", "gauge", "time a kernel was running, 0-1", ("gpu",), "gpu"),
    Metric("dtrain_gpu_memory_used_bytes", "gauge", "GPU memory in use", ("gpu",), "gpu"),
    Metric("dtrain_gpu_memory_total_bytes", "gauge", "GPU memory", ("gpu",), "gpu"),
    Metric("dtrain_gpu_power_watts", "gauge", "board power draw", ("gpu",), "gpu"),
    Metric("dtrain_gpu_temperature_celsius", "gauge", "GPU core temperature", ("gpu",), "gpu"),
    Metric("dtrain_gpu_sm_clock_hertz", "gauge", "SM clock", ("gpu",), "gpu"),
    # Training ranks on this node (report_step)
    Metric("dtrain_rank_steps_total", "counter", "training steps finished", ("rank",), "rank"),
    Metric("dtrain_rank_step_seconds_total", "counter", "time spent in training steps", ("rank",), "rank"),
    Metric("dtrain_rank_data_wait_seconds_total", "counter", "time steps spent waiting for data", ("rank",), "rank"),
    Metric("dtrain_rank_samples_total", "counter", "samples processed", ("rank",), "rank"),
    Metric("dtrain_rank_step", "gauge", "last reported global step", ("rank",), "rank"),
    Metric("dtrain_rank_epoch", "gauge", "last reported epoch", ("rank",), "rank"),
    Metric("dtrain_rank_loss", "gauge", "last reported training loss", ("rank",), "rank"),
    Metric("dtrain_rank_learning_rate", "gauge", "last reported learning rate", ("rank",), "rank"),
    Metric("dtrain_rank_last_step_seconds", "gauge", "duration of the last reported step", ("rank",), "rank"),
    Metric("dtrain_rank_last_report_timestamp_seconds", "gauge", "Unix time of the last report", ("rank",), "rank"),
    # The agent itself
    Metric("dtrain_agent_cpu_seconds_total", "counter", "CPU time used by the agent"),
    Metric("dtrain_agent_memory_rss_bytes", "gauge", "resident memory of the agent"),
    Metric("dtrain_agent_sample_duration_seconds", "gauge", "wall time of the last sampling pass"),
)

BY_NAME = {m.name: m for m in METRICS}


def markdown_table() -> str:
    """The README's metric list, generated so it cannot drift from the code."""
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for m in METRICS:
        labels = ", ".join(BASE_LABELS + m.labels)
        note = {"gpu": " (NVIDIA GPUs only)", "rank": " (once a rank reports)"}.get(m.scope, "")
        rows.append(f"| `{m.name}` | {m.kind} | {labels} | {m.help}{note} |")
    return "\n".join(rows)
