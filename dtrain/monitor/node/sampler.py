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

from dtrain.monitor.node.gpu import NvmlGpus

JOB_ENV = "DTRAIN_JOB_ID"


class JobProcesses:
    """The job's processes on this node: ranks that reported (by pid), anything whose
    environment carries `DTRAIN_JOB_ID=<job>` (torchrun, ranks, data loader workers),
    and the descendants of both."""

    def __init__(self, job: str, scan_every_s: float = 10.0) -> None:
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
        """One pass over the process table: new pids are checked for the job's marker
        once; descendants of the job's processes are found from the same pass."""
        me = os.getpid()
        children: dict[int, list[int]] = {}
        for pid, ppid in _parent_map().items():
            children.setdefault(ppid, []).append(pid)
            if pid in self._checked or pid == me:
                continue
            self._checked.add(pid)
            if self.job and _environ_has(pid, f"{JOB_ENV}={self.job}"):
                self.add(pid)
        todo = list(self._procs)
        while todo:
            for child in children.get(todo.pop(), ()):
                if child not in self._procs and child != me:
                    self.add(child)
                    todo.append(child)

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


def _parent_map() -> dict[int, int]:
    """pid -> parent pid. Read from /proc directly: psutil's process_iter costs ~3x more,
    and this runs on every node of every job."""
    if not os.path.isdir("/proc/self"):
        return {p.pid: p.info["ppid"] or 0 for p in psutil.process_iter(["ppid"])}
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as fh:
                    data = fh.read()
            except OSError:
                continue  # exited meanwhile
            # the command name may hold spaces and parentheses: parse after the last ')'
            out[int(name)] = int(data[data.rfind(b")") + 2 :].split(None, 2)[1])
    return out


def _environ_has(pid: int, entry: str) -> bool:
    try:
        if os.path.isdir("/proc/self"):
            with open(f"/proc/{pid}/environ", "rb") as fh:
                return entry.encode() in fh.read().split(b"\0")
        key, _, value = entry.partition("=")
        return psutil.Process(pid).environ().get(key) == value
    except (OSError, psutil.Error):
        return False


class DiskCounters:
    """Whole-disk totals from /proc/diskstats (sectors are always 512 bytes there).

    psutil.disk_io_counters() re-checks every device in /sys/block on every call, which
    made it the largest part of a sampling pass; the disk list is re-read once a minute.
    """

    DISKSTATS = "/proc/diskstats"

    def __init__(self) -> None:
        self._disks: set[str] = set()
        self._listed = -1e9
        self.native = os.path.exists(self.DISKSTATS) and os.path.isdir("/sys/block")

    def read(self, now: float) -> tuple[int, int, int, int] | None:
        """(read bytes, written bytes, reads, writes) or None when the node has no disks."""
        if not self.native:
            d = psutil.disk_io_counters(perdisk=False)
            return None if d is None else (d.read_bytes, d.write_bytes, d.read_count, d.write_count)
        if now - self._listed > 60:
            self._disks, self._listed = set(os.listdir("/sys/block")), now
        rb = wb = rc = wc = 0
        with open(self.DISKSTATS) as fh:
            for line in fh:
                f = line.split()
                if len(f) >= 10 and f[2] in self._disks:
                    rc += int(f[3])
                    rb += int(f[5]) * 512
                    wc += int(f[7])
                    wb += int(f[9]) * 512
        return (rb, wb, rc, wc) if self._disks else None


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
        self.disks = DiskCounters()
        psutil.cpu_percent(percpu=True)  # prime: the first real reading covers one interval

    def sample(self) -> dict[str, Any]:
        start = self.clock()
        dt = None if self._prev_t is None else max(start - self._prev_t, 1e-6)
        cores = [c / 100.0 for c in psutil.cpu_percent(percpu=True)]
        vm = psutil.virtual_memory()
        net = psutil.net_io_counters(pernic=True)
        disk = self.disks.read(start)
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
                "read_total": disk[0],
                "write_total": disk[1],
                "reads_total": disk[2],
                "writes_total": disk[3],
                "read_bps": _rate(disk[0], p and p[0], dt),
                "write_bps": _rate(disk[1], p and p[1], dt),
                "read_iops": _rate(disk[2], p and p[2], dt),
                "write_iops": _rate(disk[3], p and p[3], dt),
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
