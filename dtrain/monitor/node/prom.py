"""A node snapshot as Prometheus metric families (names from `metrics.METRICS`).

A custom collector over the latest snapshot rather than long-lived Gauge objects: series
that vanish (a GPU without power readings, a rank that ended) simply are not yielded.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from dtrain.monitor.node.metrics import BASE_LABELS, BY_NAME

# (metric name, extra label values, value) triples for one snapshot
Sample = tuple[str, tuple[str, ...], float | None]


def samples(snap: dict[str, Any]) -> Iterator[Sample]:
    host = snap.get("host") or {}
    if host:
        yield "dtrain_node_cpu_utilization_ratio", (), host["cpu"]
        for i, v in enumerate(host["cpu_cores"]):
            yield "dtrain_node_cpu_core_utilization_ratio", (str(i),), v
        yield "dtrain_node_memory_used_bytes", (), host["mem_used"]
        yield "dtrain_node_memory_total_bytes", (), host["mem_total"]
        for nic, n in sorted(host["net"].items()):
            yield "dtrain_node_network_receive_bytes_total", (nic,), n["rx_total"]
            yield "dtrain_node_network_transmit_bytes_total", (nic,), n["tx_total"]
        disk = host.get("disk") or {}
        if disk:
            yield "dtrain_node_disk_read_bytes_total", (), disk["read_total"]
            yield "dtrain_node_disk_written_bytes_total", (), disk["write_total"]
            yield "dtrain_node_disk_reads_completed_total", (), disk["reads_total"]
            yield "dtrain_node_disk_writes_completed_total", (), disk["writes_total"]
        job = host["job"]
        yield "dtrain_job_processes", (), job["processes"]
        yield "dtrain_job_cpu_utilization_ratio", (), job["cpu"]
        yield "dtrain_job_memory_rss_bytes", (), job["rss"]
        for g in host["gpus"]:
            idx = (str(g["gpu"]),)
            yield "dtrain_gpu_utilization_ratio", idx, g["util"]
            yield "dtrain_gpu_memory_used_bytes", idx, g["mem_used"]
            yield "dtrain_gpu_memory_total_bytes", idx, g["mem_total"]
            yield "dtrain_gpu_power_watts", idx, g["power_w"]
            yield "dtrain_gpu_temperature_celsius", idx, g["temp_c"]
            yield "dtrain_gpu_sm_clock_hertz", idx, g["sm_clock_hz"]
        agent = host["agent"]
        yield "dtrain_agent_cpu_seconds_total", (), agent["cpu_s"]
        yield "dtrain_agent_memory_rss_bytes", (), agent["rss"]
        yield "dtrain_agent_sample_duration_seconds", (), agent["sample_s"]
    for rank, r in (snap.get("ranks") or {}).items():
        lab = (rank,)
        yield "dtrain_rank_steps_total", lab, r["steps_total"]
        yield "dtrain_rank_step_seconds_total", lab, r["step_time_total"]
        yield "dtrain_rank_data_wait_seconds_total", lab, r["data_wait_total"]
        yield "dtrain_rank_samples_total", lab, r["samples_total"]
        yield "dtrain_rank_step", lab, r.get("step")
        yield "dtrain_rank_epoch", lab, r.get("epoch")
        yield "dtrain_rank_loss", lab, r.get("loss")
        yield "dtrain_rank_learning_rate", lab, r.get("lr")
        yield "dtrain_rank_last_step_seconds", lab, r.get("last_step_time")
        yield "dtrain_rank_last_report_timestamp_seconds", lab, r.get("last_t")


class SnapshotCollector(Collector):
    def __init__(self, get_snapshot: Callable[[], dict[str, Any]]) -> None:
        self.get_snapshot = get_snapshot

    def collect(self):
        snap = self.get_snapshot()
        base = (str(snap.get("job", "")), str(snap.get("node", "")))
        families: dict[str, Any] = {}
        for name, extra, value in samples(snap):
            if value is None:
                continue
            family = families.get(name)
            if family is None:
                m = BY_NAME[name]
                cls = CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily
                family = families[name] = cls(m.family, m.help, labels=list(BASE_LABELS + m.labels))
            family.add_metric(list(base + extra), float(value))
        yield from families.values()


def registry_for(get_snapshot: Callable[[], dict[str, Any]]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(get_snapshot))
    return registry
