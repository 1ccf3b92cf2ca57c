"""A real Slurm cluster on the netns hosts: fixture `slurm_cluster`.

Built on `netns_cluster` (tests/netns.py): one munged and one slurmctld on the head (the
root namespace, listening on the bridge), one `slurmd -N hN` inside each host's
namespace, so every node has its own address exactly like a real cluster. Everything
(munge key and socket, slurm.conf, state and spool directories, logs) lives in one
temporary directory; `SLURM_CONF` points sbatch/squeue/scontrol/scancel at it. No
accounting database: job states come from `scontrol show job` (kept MinJobAge seconds).
The daemons are stopped and the directory removed after the tests.

Namespaces share the filesystem and the hostname, so: per-node spool/pid/log files use
slurm's %n, and SlurmctldHost must carry this machine's real hostname (slurmctld refuses
to run on a host that is not named there) with the bridge address.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from dtrain.ports import free_port

DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo", "srun")
PARTITION = "debug"
CRED_EXPIRE = 20  # seconds


@dataclass
class SlurmCluster:
    netns: object  # the NetnsCluster underneath
    conf: Path
    tmpdir: Path
    nodes: list[str]
    partition: str = PARTITION

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def cmd(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), env=self.env(), capture_output=True, text=True, timeout=timeout)


def unavailable_reason() -> str | None:
    missing = [p for p in DAEMONS if not Path(p).exists()] + [c for c in CLIENTS if shutil.which(c) is None]
    if missing:
        return f"slurm/munge not installed ({', '.join(missing)}): apt-get install slurmctld slurmd munge slurm-client"
    return None


def _worker_index() -> int:
    """0, 1, ... for pytest-xdist's workers gw0, gw1, ...; 0 without xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name[2:]) if name[2:].isdigit() else 0


def _slurm_conf(tmp: Path, netns, ctld_port: int) -> str:
    ncpus = os.cpu_count() or 1
    nodes = "".join(
        f"NodeName={h.name} NodeAddr={h.address} NodeHostname={h.name} CPUs={max(ncpus, 4)} State=UNKNOWN\n"
        for h in netns.hosts
    )
    return (
        "ClusterName=dtraintest\n"
        f"SlurmctldHost={socket.gethostname().split('.')[0]}({netns.head_address})\n"
        f"SlurmctldPort={ctld_port}\n"
        "SlurmdPort=6818\n"
        # cred_expire also delays a requeued job's restart (by that + 1 s; default 120)
        f"AuthInfo=socket={tmp / 'munge.socket'},cred_expire={CRED_EXPIRE}\n"
        "SlurmUser=root\nSlurmdUser=root\n"
        f"StateSaveLocation={tmp / 'state'}\n"
        f"SlurmdSpoolDir={tmp / 'spool-%n'}\n"
        f"SlurmctldPidFile={tmp / 'slurmctld.pid'}\n"
        f"SlurmdPidFile={tmp / 'slurmd-%n.pid'}\n"
        f"SlurmctldLogFile={tmp / 'slurmctld.log'}\n"
        f"SlurmdLogFile={tmp / 'slurmd-%n.log'}\n"
        "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
        "JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n"
        "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n"
        "SchedulerType=sched/backfill\nMpiDefault=none\nReturnToService=2\n"
        # the hosts' CPU count is the test machine's; let the conf's count stand
        "SlurmdParameters=config_overrides\n"
        "MinJobAge=600\nKillWait=5\nInactiveLimit=0\nSlurmdTimeout=30\n"
        # Test workers (pytest-xdist) each run a cluster with the same node names on one
        # machine: distinct job ids keep their slurmstepd state and logs apart.
        f"FirstJobId={1 + 100_000 * _worker_index()}\n"
        f"{nodes}"
        f"PartitionName={PARTITION} Nodes={','.join(h.name for h in netns.hosts)} Default=YES "
        "MaxTime=INFINITE State=UP\n"
    )


def _start_slurmctld(tmp: Path, netns, conf: Path, env: dict[str, str]) -> subprocess.Popen:
    """Write the conf and start slurmctld; if another process took its port first, try
    another port (the slurmds start after this, so they read the final conf)."""
    for _ in range(5):
        port = free_port()  # free on every address: slurmctld listens on the wildcard
        conf.write_text(_slurm_conf(tmp, netns, port))
        with open(tmp / "slurmctld.out", "w") as log:
            proc = subprocess.Popen(["/usr/sbin/slurmctld", "-D", "-i", "-f", str(conf)], env=env,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            with socket.socket() as s:
                s.settimeout(1)
                if s.connect_ex((netns.head_address, port)) == 0:
                    return proc
            time.sleep(0.1)
        if proc.poll() is None:
            return proc  # alive but slow: the wait for idle nodes below reports it
        out = (tmp / "slurmctld.out").read_text(errors="replace")
        if "Address already in use" not in out:
            raise RuntimeError(f"slurmctld exited with {proc.returncode}:\n{out[-1500:]}")
    raise RuntimeError(f"slurmctld found its port taken 5 times:\n{out[-1500:]}")


def _cgroup_conf() -> str:
    # slurmd initialises its cgroup plugin even with proctrack/linuxproc; its autodetection
    # fails on a hybrid v1 layout (tmpfs on /sys/fs/cgroup), so name the version there.
    root = Path("/sys/fs/cgroup")
    if not (root / "cgroup.controllers").exists() and (root / "freezer").is_dir():
        return "CgroupPlugin=cgroup/v1\n"
    # unified v2: no systemd scope (several slurmd on one machine, none started by systemd)
    return "CgroupPlugin=cgroup/v2\nIgnoreSystemd=yes\n"


def _cgroup_refusal(logs: list[Path]) -> str:
    for path in logs:
        for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
            if "cgroup" in line.lower() and ("error" in line or "fatal" in line):
                return line
    return ""


def _wait(check, timeout: float, what: str, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    text = "".join(f"--- {p.name}:\n{p.read_text()[-1500:]}\n" for p in logs if p.exists())
    raise RuntimeError(f"{what} did not come up within {timeout:.0f} s\n{text}")


def _stop_pidfile(path: Path) -> None:
    """SIGTERM the daemon named in `path` and wait for it: munged writes its seed file as
    it exits, which must happen before the directory is removed."""
    try:
        pid = int(path.read_text().strip())
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError):
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


@pytest.fixture(scope="session")
def slurm_cluster(netns_cluster):
    """slurmctld + one slurmd per netns host; see the module docstring."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    netns = netns_cluster
    tmp = Path(tempfile.mkdtemp(prefix=f"dtrain-slurm-{os.getpid()}-"))
    procs: list[subprocess.Popen] = []
    pidfiles: list[Path] = []
    try:
        (tmp / "state").mkdir()
        key = tmp / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        munged = subprocess.run(
            ["/usr/sbin/munged", "--force", f"--key-file={key}", f"--socket={tmp / 'munge.socket'}",
             f"--pid-file={tmp / 'munged.pid'}", f"--log-file={tmp / 'munged.log'}",
             f"--seed-file={tmp / 'munged.seed'}"],
            capture_output=True, text=True, timeout=30)
        pidfiles.append(tmp / "munged.pid")
        if munged.returncode != 0:
            raise RuntimeError(f"munged failed: {munged.stderr}")
        conf = tmp / "slurm.conf"
        (tmp / "cgroup.conf").write_text(_cgroup_conf())
        for h in netns.hosts:
            (tmp / f"spool-{h.name}").mkdir()
        cluster = SlurmCluster(netns, conf, tmp, [h.name for h in netns.hosts])
        env = cluster.env()
        procs.append(_start_slurmctld(tmp, netns, conf, env))
        for h in netns.hosts:
            with open(tmp / f"slurmd-{h.name}.out", "w") as log:
                procs.append(netns.popen(h, ["/usr/sbin/slurmd", "-D", "-N", h.name, "-f", str(conf)], env=env,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

        def all_idle() -> bool:
            res = cluster.cmd("sinfo", "-h", "-N", "-o", "%N %t")
            states = dict(line.split() for line in res.stdout.splitlines() if line.strip())
            return res.returncode == 0 and len(states) == len(netns.hosts) and all(
                s == "idle" for s in states.values())

        logs = sorted(tmp.glob("slurm*.log")) + sorted(tmp.glob("*.out"))
        try:
            _wait(all_idle, 60, "the slurm nodes", logs)
            # one step on every node: slurmstepd sets up its cgroups only now
            smoke = cluster.cmd("srun", f"-N{len(netns.hosts)}", "--ntasks-per-node=1", "true", timeout=90)
            if smoke.returncode != 0:
                raise RuntimeError(f"a first step on every node failed: {smoke.stderr}")
        except RuntimeError:
            refusal = _cgroup_refusal(logs)
            if refusal:  # the machine's cgroup setup, not dtrain: say so instead of failing
                pytest.skip(f"slurm cannot run jobs here: {refusal}")
            raise
        yield cluster
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        for path in pidfiles:
            _stop_pidfile(path)
        shutil.rmtree(tmp, ignore_errors=True)
