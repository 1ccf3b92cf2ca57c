"""A dtrain job under Slurm, through Slurm's own commands: refuse a request the partition
cannot satisfy (`scontrol show partition`), submit (`sbatch --parsable`), follow
(`scontrol show job`: pending with its reason, then the job's output), stop (`scancel`)
and map Slurm's final state into the registry.

The registry row carries `extra = {"scheduler": "slurm", "slurm_job_id": ...}` and no
supervisor pid: Slurm, not a dtrain process, keeps the job alive, so a reader refreshes
the row from Slurm (`refresh`) instead of checking a pid. The slurm client commands are
passed in (`SlurmClient(run=...)`) so every call site names its side effect.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from dtrain.errors import ConfigError, DtrainError, ExitStatus, JobFailed
from dtrain.jobs.registry import JobRecord, JobRegistry, JobState
from dtrain.launch.plan import LaunchPlan
from dtrain.launch.slurm import TRAINING_STEP, SlurmCluster, SlurmFacts, SlurmSpec, parse_version, secret_names
from dtrain.launch.slurm_check import FAILED
from dtrain.launch.spec import JobSpec
from dtrain.launch.summary import PREFIXED, Addresses, NodeEnd, root_cause
from dtrain.launch.supervisor import spawn, write_job_file
from dtrain.paths import job_dir
from dtrain.signals import raising

# Slurm's job states (squeue/scontrol/sacct spelling) -> dtrain's.
_LIVE = {"PENDING": JobState.PENDING, "CONFIGURING": JobState.PENDING, "REQUEUED": JobState.PENDING,
         "RESV_DEL_HOLD": JobState.PENDING, "REQUEUE_HOLD": JobState.PENDING, "SUSPENDED": JobState.RUNNING,
         "RUNNING": JobState.RUNNING, "COMPLETING": JobState.RUNNING, "STAGE_OUT": JobState.RUNNING,
         "SIGNALING": JobState.RUNNING, "RESIZING": JobState.RUNNING, "STOPPED": JobState.RUNNING}
_ENDED = {"COMPLETED": JobState.SUCCEEDED, "CANCELLED": JobState.STOPPED}
# srun's report of the first task that failed: "srun: error: h2: task 1: Exited with exit code 1"
_TASK_ERROR = re.compile(r"^srun: error: (\S+): tasks? [\d,-]+: (.+)$", re.MULTILINE)
_PREFLIGHT_FAILED = re.compile(r"^" + re.escape(FAILED) + r"(\S+): (.+)$", re.MULTILINE)


@dataclass
class SlurmJob:
    """What Slurm says about one job (one line of `scontrol show job -o`)."""

    state: str  # Slurm's word, e.g. PENDING, RUNNING, TIMEOUT
    reason: str = ""
    exit_code: int | None = None
    nodes: list[str] = field(default_factory=list)

    @property
    def dtrain_state(self) -> JobState:
        return _LIVE.get(self.state) or _ENDED.get(self.state) or JobState.FAILED

    def describe(self) -> str:
        """The registry's reason for a job that ended."""
        if self.state == "COMPLETED":
            return ""
        if self.state == "TIMEOUT":
            return "timed out: Slurm's time limit ended the job"
        if self.state == "CANCELLED":
            return "cancelled in Slurm" + (f" ({self.reason})" if self.reason else "")
        why = f" (reason {self.reason})" if self.reason else ""
        code = f", exit code {self.exit_code}" if self.exit_code else ""
        return f"Slurm says {self.state}{why}{code}"


def parse_job(line: str) -> SlurmJob:
    """`scontrol show job -o` fields -> SlurmJob (`JobState=TIMEOUT Reason=TimeLimit ExitCode=0:15`)."""
    fields = dict(word.split("=", 1) for word in line.split() if "=" in word)
    state = fields.get("JobState", "UNKNOWN").split("+")[0]
    code, _, sig = fields.get("ExitCode", "").partition(":")
    exit_code = int(code) if code.isdigit() else None
    if exit_code == 0 and sig.isdigit() and int(sig):
        exit_code = 128 + int(sig)
    nodelist = fields.get("NodeList", "(null)")
    reason = fields.get("Reason", "")
    return SlurmJob(state, "" if reason == "None" else reason, exit_code, [] if nodelist == "(null)" else [nodelist])


class SlurmClient:
    """Slurm's commands; `run` is subprocess.run's signature (the side effect, passed in)."""

    def __init__(self, run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
                 env: dict[str, str] | None = None) -> None:
        self._run = run
        self.env = env

    def call(self, *argv: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
        try:
            res = self._run(list(argv), capture_output=True, text=True, errors="replace", timeout=60, env=env or self.env)
        except FileNotFoundError:
            raise DtrainError(f"`{argv[0]}` is not installed here", "run dtrain on a Slurm login node "
                              "(or install slurm-client and point SLURM_CONF at the cluster)") from None
        if check and res.returncode != 0:
            raise DtrainError(f"{argv[0]} failed: {(res.stderr or res.stdout).strip()}",
                              "check the request with `sinfo` and your Slurm account")
        return res

    def partitions(self) -> dict[str, dict[str, str]]:
        res = self.call("scontrol", "show", "partition", "-o")
        parts = {}
        for line in res.stdout.splitlines():
            fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
            if "PartitionName" in fields:
                parts[fields["PartitionName"]] = fields
        return parts

    def facts(self) -> SlurmFacts:
        """The version (`sbatch --version`) and whether accounting (sacct) is set up."""
        version = parse_version(self.call("sbatch", "--version").stdout)
        config = self.call("scontrol", "show", "config", check=False).stdout
        m = re.search(r"^AccountingStorageType\s*=\s*(\S+)", config, re.MULTILINE)
        return SlurmFacts(version, accounting=bool(m) and m.group(1) != "accounting_storage/none")

    def submit(self, script: Path, env: dict[str, str]) -> str:
        out = self.call("sbatch", "--parsable", str(script), env=env).stdout.strip()
        return out.split(";")[0]  # "ID" or "ID;cluster"

    def job(self, slurm_id: str, *, sacct: bool = True) -> SlurmJob | None:
        """None when Slurm no longer knows the job (past MinJobAge, and no accounting:
        `sacct` False says there is none to ask)."""
        res = self.call("scontrol", "show", "job", "-o", slurm_id, check=False)
        if res.returncode == 0 and "JobState=" in res.stdout:
            job = parse_job(res.stdout.splitlines()[0])
            if job.nodes:
                hosts = self.call("scontrol", "show", "hostnames", job.nodes[0], check=False).stdout.split()
                job.nodes = hosts or job.nodes
            return job
        if not sacct:
            return None
        acct = self.call("sacct", "-n", "-X", "-P", "-j", slurm_id, "-o", "State,ExitCode,Reason", check=False)
        if acct.returncode == 0 and acct.stdout.strip():
            state, code, reason = (acct.stdout.splitlines()[0].split("|") + ["", ""])[:3]
            return parse_job(f"JobState={state.split()[0]} ExitCode={code} Reason={reason}")
        return None

    def node_address(self, node: str) -> str:
        """The address Slurm reaches `node` at (NodeAddr), else its name."""
        res = self.call("scontrol", "show", "node", "-o", node, check=False)
        fields = dict(w.split("=", 1) for w in res.stdout.split() if "=" in w)
        return fields.get("NodeAddr") or node

    def cancel(self, slurm_id: str) -> None:
        self.call("scancel", slurm_id)


def check_request(spec: SlurmSpec, partitions: dict[str, dict[str, str]]) -> None:
    """Refuse, before submitting, what the partition can never satisfy."""
    if spec.partition is None:
        return
    part = partitions.get(spec.partition)
    if part is None:
        close = difflib.get_close_matches(spec.partition, list(partitions), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"the partitions are: {', '.join(sorted(partitions))}"
        raise ConfigError(f"Slurm has no partition {spec.partition!r}; nothing was submitted", hint)
    total = int(part.get("TotalNodes", "0") or 0)
    if spec.nodes > total:
        raise ConfigError(f"partition {spec.partition!r} has {total} node(s), the job asks for {spec.nodes}; "
                          "nothing was submitted", f"ask for at most {total} (--nodes {total})")
    tres = dict(item.split("=", 1) for item in part.get("TRES", "").split(",") if "=" in item)
    gpus = int(tres.get("gres/gpu", "0") or 0)
    if spec.gpus_per_node and spec.gpus_per_node * spec.nodes > gpus:
        raise ConfigError(f"partition {spec.partition!r} has {gpus} GPU(s) in all, the job asks for "
                          f"{spec.nodes} x {spec.gpus_per_node}; nothing was submitted",
                          "ask for fewer GPUs or pick a GPU partition (`sinfo -o '%P %G'`)")
    limit = minutes(part.get("MaxTime", "UNLIMITED"))
    if spec.time is not None and limit is not None and minutes(spec.time) > limit:
        raise ConfigError(f"partition {spec.partition!r} allows at most {part['MaxTime']}, the job asks for "
                          f"{spec.time}; nothing was submitted", f"ask for time: {part['MaxTime']} or less")


def minutes(value: str) -> float | None:
    """Slurm's time forms (MIN, MIN:SEC, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) in minutes;
    None for no limit."""
    if value in ("UNLIMITED", "INFINITE", ""):
        return None
    days, _, rest = value.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:  # D-HH[:MM[:SS]]
        h, m, sec = (parts + [0, 0])[:3]
        return int(days) * 1440 + h * 60 + m + sec / 60
    if len(parts) == 3:
        return parts[0] * 60 + parts[1] + parts[2] / 60
    return parts[0] + (parts[1] / 60 if len(parts) == 2 else 0)


def execute(plan: LaunchPlan, job: JobSpec, cluster: SlurmCluster, *, registry: JobRegistry, out: TextIO,
            facts: SlurmFacts, detach: bool = False, client: SlurmClient | None = None, poll: float = 1.0) -> int:
    """Submit the plan's batch script (the job is registered and its job.json written
    already) and follow the job to its end -> the exit status; with `detach`, return at
    once and leave a watcher process to follow it (so the head still collects the node
    agents' metrics for `dtrain report`)."""
    client = client or SlurmClient()
    job_id, directory = plan.job_id, job_dir(plan.job_id)
    script = directory / "job.sbatch"
    # An argument may be bytes that are not UTF-8 (Python holds them as surrogates): written
    # back as those bytes, so the ranks get what the user typed.
    script.write_bytes(os.fsencode(plan.batch.script))
    # Secret values reach the job through sbatch's environment (it exports the submitter's).
    secret = secret_names(job, cluster)
    env = {**os.environ, **{k: v for k, v in {**cluster.defaults.env, **job.env}.items() if k in secret}}
    try:
        slurm_id = client.submit(script, env)
    except DtrainError as exc:
        registry.finish(job_id, JobState.FAILED, 1, f"sbatch refused the job: {exc.message}")
        raise
    registry.update(job_id, extra={"scheduler": "slurm", "slurm_job_id": slurm_id, "sacct": facts.accounting})
    write_job_file(directory, plan, cluster, job, extra={"slurm_job_id": slurm_id})
    out.write(f"[dtrain] job {job_id}: Slurm job {slurm_id}, {plan.batch.nodes} node(s), "
              f"world size {plan.world_size}\n")
    if detach:
        if job.monitor:
            spawn(job_id, registry, {}, record=False)  # Slurm, not this watcher, keeps the job alive
        out.write(f"  follow it: dtrain logs {job_id} -f    stop it: dtrain stop {job_id}\n")
        return 0
    try:
        with _interrupts_cancel():
            rec = follow(registry, job_id, client, out=out, poll=poll,
                         monitor_port=job.monitor_port if job.monitor else None)
    except KeyboardInterrupt:
        client.cancel(slurm_id)
        out.write(f"\n[dtrain] cancelled Slurm job {slurm_id}\n")
        rec = wait_ended(registry, registry.get(job_id), client, timeout=60)
    return _exit_status(rec, out)


@contextmanager
def _interrupts_cancel() -> Iterator[None]:
    """Ctrl-C and SIGTERM raise KeyboardInterrupt while a job is followed, so they cancel
    it in Slurm as they stop an SSH job (the supervisor's handlers) - also where dtrain
    was started with SIGINT ignored (a shell script's `cmd &`), where Python would
    otherwise never raise it and the job would run on after its follower is gone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with raising((signal.SIGINT, signal.SIGTERM), lambda _sig: KeyboardInterrupt()):
        yield


def watch(job_id: str, job: JobSpec, *, out: TextIO, registry: JobRegistry | None = None) -> int:
    """The detached watcher of a Slurm job: collect its node agents' metrics until it ends."""
    registry = registry or JobRegistry()
    rec = follow(registry, job_id, SlurmClient(), out=out, monitor_port=job.monitor_port if job.monitor else None)
    return 0 if rec.state == JobState.SUCCEEDED else 1


def follow(registry: JobRegistry, job_id: str, client: SlurmClient, *, out: TextIO, poll: float = 1.0,
           monitor_port: int | None = None) -> JobRecord:
    """Print the pending reason while queued, then the job's output, until it ends;
    with `monitor_port`, collect the node agents' metrics meanwhile (`dtrain report`)."""
    log = job_dir(job_id) / "output.log"
    pos, said, collector, stepping = 0, "", None, False
    try:
        while True:
            rec = refresh(registry, registry.get(job_id), client)
            if log.exists():  # (before the state line: a requeued job's log says why first)
                with open(log, encoding="utf-8", errors="replace") as fh:
                    fh.seek(pos)
                    chunk = fh.read()
                cut = len(chunk) if rec.state.terminal else chunk.rfind("\n") + 1
                out.write(chunk[:cut])
                out.flush()
                pos += len(chunk[:cut].encode("utf-8"))
                stepping = stepping or TRAINING_STEP in chunk[:cut]
            if rec.state == JobState.PENDING and rec.reason != said:
                said = rec.reason
                out.write(f"[dtrain] pending in Slurm: {said or 'queued'}\n")
            if rec.state == JobState.PENDING:  # (again, if requeued: its next run may get other nodes)
                stepping = False
                if collector is not None:
                    collector.stop()
                    collector = None
            # the agents start with the training step (after the preflight step): collect from then on
            if collector is None and monitor_port and stepping and rec.state == JobState.RUNNING and rec.nodes:
                collector = _collect(job_id, rec.nodes, client, monitor_port, out)
            if rec.state.terminal:
                return rec
            time.sleep(poll)
    finally:
        if collector is not None:
            collector.stop()


def _collect(job_id: str, nodes: list[str], client: SlurmClient, port: int, out: TextIO):
    """The head's collector over the allocated nodes' agents; monitoring never stops a job."""
    from dtrain.monitor.head.collector import Collector
    from dtrain.monitor.head.findings import END_GRACE_S
    from dtrain.monitor.head.startup import agent_url

    try:
        endpoints = {n: agent_url(client.node_address(n), port) for n in nodes}
        # Each node's agent ends with its ranks, seconds before Slurm says the job ended:
        # a node gone quiet is news only if the job outlives it by END_GRACE_S.
        return Collector(job_dir(job_id), endpoints, job_id=job_id, quiet_grace_s=END_GRACE_S,
                         on_finding=lambda f: out.write(f"[dtrain] finding: {f.message}\n")).start()
    except Exception as exc:  # monitoring is optional; the job is not
        out.write(f"[dtrain] monitoring: collector not started: {exc}\n")
        return None


def refresh(registry: JobRegistry, rec: JobRecord, client: SlurmClient | None = None) -> JobRecord:
    """Bring a Slurm job's registry row up to date with what Slurm says."""
    slurm_id = rec.extra.get("slurm_job_id")
    if not slurm_id or rec.state.terminal:
        return rec
    client = client or SlurmClient()
    job = client.job(slurm_id, sacct=rec.extra.get("sacct", True))
    if job is None:
        registry.finish(rec.id, JobState.FAILED, None, f"Slurm no longer knows job {slurm_id}")
    elif job.dtrain_state.terminal:
        if job.nodes:
            registry.update(rec.id, nodes=job.nodes)
        reason = job.describe()
        # The nodes' addresses are looked up only if every failed node merely echoes a lost peer.
        lookup = functools.partial(_addresses, client, job.nodes or rec.nodes)
        if job.dtrain_state == JobState.FAILED and (culprit := first_task_error(Path(rec.dir) / "output.log", lookup)):
            reason += f"; first failure on {culprit}"
        registry.finish(rec.id, job.dtrain_state, job.exit_code, reason)
    elif job.dtrain_state == JobState.RUNNING:
        fields = {"nodes": job.nodes} if job.nodes and job.nodes != rec.nodes else {}
        if rec.state == JobState.PENDING:
            fields.update(state=JobState.RUNNING, started=registry.clock())
        if rec.reason:  # the pending reason (first queued, or requeued) no longer holds
            fields.update(reason="")
        if fields:
            registry.update(rec.id, **fields)
    elif rec.state != JobState.PENDING or job.reason != rec.reason:  # queued, or requeued after a run
        registry.update(rec.id, state=JobState.PENDING, reason=job.reason or "requeued")
    return registry.get(rec.id)


def _addresses(client: SlurmClient, nodes: list[str]) -> dict[str, str]:
    """{node: the address Slurm reaches it at}; a node scontrol cannot show keeps its name."""
    try:
        return {n: client.node_address(n) for n in nodes}
    except Exception:  # attribution is a courtesy: the job's end is recorded without it
        return {}


def first_task_error(log: Path, addresses: Addresses | None = None) -> str:
    """'h2 (Exited with exit code 1)': the node whose task failed on its own, from srun's task
    errors in the job's output, or 'h2 (preflight: port: ...)' when the preflight step failed.
    `addresses`: {node: address} (or a function looking them up, called only when needed), to
    follow peer-loss echoes to the node they name.

    srun reports tasks in the order they ended, and a node whose ranks only lost their peers
    (gloo's "Connection closed by peer") can end before the node that lost a rank; so, as for
    an SSH job (`summary.root_cause`), such echoes come after a node that failed on its own.
    """
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    if m := _PREFLIGHT_FAILED.search(text):
        return f"{m.group(1)} (preflight: {m.group(2).strip()})"
    said: dict[str, str] = {}
    for m in _TASK_ERROR.finditer(text):
        said.setdefault(m.group(1), m.group(2).strip())
    if not said:
        return ""
    # every node srun named failed (any nonzero code will do for root_cause); srun's order is the time order
    ends = {node: NodeEnd(node, exit_code=1, ended_at=float(i)) for i, node in enumerate(said)}
    for line in text.splitlines():
        if (m := PREFIXED.match(line)) and m.group("node") in ends:
            ends[m.group("node")].add(int(m.group("rank")), m.group("text"))
    cause = root_cause(list(ends.values()), addresses)
    return f"{cause.node} ({said[cause.node]})" if cause else ""


def stop(registry: JobRegistry, rec: JobRecord, *, wait: float, client: SlurmClient | None = None) -> JobRecord:
    """`dtrain stop` for a Slurm job: scancel, then wait until Slurm says it ended."""
    client = client or SlurmClient()
    client.cancel(rec.extra["slurm_job_id"])
    return wait_ended(registry, rec, client, timeout=wait)


def wait_ended(registry: JobRegistry, rec: JobRecord, client: SlurmClient, *, timeout: float) -> JobRecord:
    deadline = time.monotonic() + timeout
    while True:
        rec = refresh(registry, rec, client)
        if rec.state.terminal:
            return rec
        if time.monotonic() > deadline:
            raise DtrainError(f"Slurm job {rec.extra['slurm_job_id']} did not end within {timeout:.0f} s",
                              f"see `squeue -j {rec.extra['slurm_job_id']}`")
        time.sleep(0.5)


def _exit_status(rec: JobRecord, out: TextIO) -> int:
    if rec.state == JobState.SUCCEEDED:
        out.write(f"[dtrain] job {rec.id} succeeded on {', '.join(rec.nodes)}\n")
        return 0
    if rec.state == JobState.STOPPED:
        out.write(f"[dtrain] job {rec.id} stopped: {rec.reason}\n")
        return int(ExitStatus.INTERRUPTED)
    raise JobFailed(f"job {rec.id} failed: {rec.reason}", f"full log: dtrain logs {rec.id}   ({rec.dir}/output.log)")
