"""One sampling pass over a node: CPU, memory, network, disk (psutil), GPUs, job processes.

Counters (bytes, operations) are kept as psutil reports them, so the Prometheus side can
export them as `_total` counters; rates per second are derived here from the previous
pass so `top` and the collector need no history of their own.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import psutil

from dtrain.monitor.gpu import NvmlGpus

JOB_ENV = "DTRAIN_JOB_ID"


class JobProcesses:
    """The job's processes on this node: ranks that reported (by pid), anything whose
    environment carries `DTRAIN_JOB_ID=<job>` (torchrun, ranks, data loader workers),
    and the descendants of both."""

    def __init__(self, job: str, scan_every_s: float = 5.0) -> None:
        self.job = job
        self.scan_every_s = scan_every_s
        self._next_scan = 0.0
        self._procs: dict[int, psutil.Process] = {}
        self._checked: set[int] = set()
        self.rank_of: dict[int, int] = {}

    def add(self, pid: int, rank: int | None = None) -> None:
        if rank is not None:
            self.rank_of[pid] = rank
        if pid not in self._procs:
            try:
                proc = psutil.Process(pid)
                proc.cpu_percent(None)  # first call primes the CPU counter
                self._procs[pid] = proc
            except psutil.Error:
                pass

    def _scan(self) -> None:
        me = os.getpid()
        for proc in psutil.process_iter():
            pid = proc.pid
            if pid in self._checked or pid == me:
                continue
            self._checked.add(pid)
            try:
                if self.job and proc.environ().get(JOB_ENV) == self.job:
                    self.add(pid)
            except psutil.Error:
                pass
        for proc in list(self._procs.values()):
            try:
                for child in proc.children(recursive=True):
                    self.add(child.pid)
            except psutil.Error:
                pass

    def sample(self, now: float) -> list[dict[str, Any]]:
        if now >= self._next_scan:
            self._next_scan = now + self.scan_every_s
            self._scan()
        out = []
        for pid, proc in list(self._procs.items()):
            try:
                with proc.oneshot():
                    cpu = proc.cpu_percent(None) / 100.0  # in cores
                    rss = proc.memory_info().rss
                    name = proc.name()
            except psutil.Error:
                del self._procs[pid]
                self.rank_of.pop(pid, None)
                continue
            out.append({"pid": pid, "name": name, "rank": self.rank_of.get(pid), "cpu_cores": cpu, "rss": rss})
        # pids are reused: forget checked pids that no longer exist, so the set stays small
        if len(self._checked) > 4096:
            self._checked &= set(psutil.pids())
        return out


class NodeSampler:
    def __init__(self, job: str, clock: Callable[[], float] = time.monotonic, gpus: NvmlGpus | None = None) -> None:
        self.clock = clock
        self.ncpu = psutil.cpu_count() or 1
        self.gpus = gpus if gpus is not None else NvmlGpus()
        self.procs = JobProcesses(job)
        self._me = psutil.Process()
        self._prev_t: float | None = None
        self._prev_net: dict[str, Any] = {}
        self._prev_disk: Any = None
        psutil.cpu_percent(percpu=True)  # prime: the first real reading covers one interval

    def sample(self) -> dict[str, Any]:
        start = self.clock()
        dt = None if self._prev_t is None else max(start - self._prev_t, 1e-6)
        cores = [c / 100.0 for c in psutil.cpu_percent(percpu=True)]
        vm = psutil.virtual_memory()
        net = psutil.net_io_counters(pernic=True)
        disk = psutil.disk_io_counters(perdisk=False)
        nets = {}
        for nic, c in net.items():
            prev = self._prev_net.get(nic)
            nets[nic] = {
                "rx_total": c.bytes_recv,
                "tx_total": c.bytes_sent,
                "rx_bps": _rate(c.bytes_recv, prev and prev.bytes_recv, dt),
                "tx_bps": _rate(c.bytes_sent, prev and prev.bytes_sent, dt),
            }
        disks: dict[str, Any] = {}
        if disk is not None:
            p = self._prev_disk
            disks = {
                "read_total": disk.read_bytes,
                "write_total": disk.write_bytes,
                "reads_total": disk.read_count,
                "writes_total": disk.write_count,
                "read_bps": _rate(disk.read_bytes, p and p.read_bytes, dt),
                "write_bps": _rate(disk.write_bytes, p and p.write_bytes, dt),
                "read_iops": _rate(disk.read_count, p and p.read_count, dt),
                "write_iops": _rate(disk.write_count, p and p.write_count, dt),
            }
        procs = self.procs.sample(start)
        job_cpu = sum(p["cpu_cores"] for p in procs)
        snapshot = {
            "cpu": sum(cores) / len(cores) if cores else 0.0,
            "cpu_cores": cores,
            "mem_used": vm.total - vm.available,
            "mem_total": vm.total,
            "net": nets,
            "net_rx_bps": _sum_external(nets, "rx_bps"),
            "net_tx_bps": _sum_external(nets, "tx_bps"),
            "disk": disks,
            "gpus": self.gpus.sample(),
            "job": {
                "processes": len(procs),
                "cpu": min(job_cpu / self.ncpu, 1.0),
                "rss": sum(p["rss"] for p in procs),
                "procs": procs,
            },
        }
        self._prev_t, self._prev_net, self._prev_disk = start, net, disk
        times = self._me.cpu_times()
        snapshot["agent"] = {
            "cpu_s": times.user + times.system,
            "rss": self._me.memory_info().rss,
            "sample_s": self.clock() - start,
        }
        return snapshot


def _rate(now: float, before: float | None, dt: float | None) -> float | None:
    if before is None or dt is None:
        return None
    # A counter that went backwards was reset (interface re-created): no rate this pass.
    return (now - before) / dt if now >= before else None


def _sum_external(nets: dict[str, dict[str, Any]], key: str) -> float | None:
    values = [v[key] for nic, v in nets.items() if nic != "lo" and v[key] is not None]
    return sum(values) if values else None
