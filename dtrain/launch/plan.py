"""Turn a JobSpec and a cluster into one exact command line and environment per node.

Each node runs `python -m dtrain.launch.node ... -- python -m torch.distributed.run ...`:
the node wrapper owns the lifetime of torchrun there (see node.py); torchrun's arguments
are exactly those of a hand-written launch. The plan is plain, frozen data: `--dry-run`
prints it, the real run executes it and stores it unchanged in job.json, and nothing edits
it once `build_plan` returned it.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field

from dtrain.launch.spec import JobSpec, torchrun_target, uses_dtrain_trainer
from dtrain.launch.sync import guarded, marker_name, needs_check

SCRATCH_ROOT = "/tmp"  # node-local scratch: torchrun's --log-dir and the heartbeat dir
# The head writes a keep-alive byte to every node every KEEPALIVE s; a node that hears
# nothing for HEAD_TIMEOUT s (a partition) stops its part of the job by itself.
KEEPALIVE = 2.0
HEAD_TIMEOUT = 20.0


@dataclass(frozen=True)
class Facts:
    """What the launch found out about the nodes before planning (preflight, the head's
    directory). A fact left out is decided on the node at launch: no interface here ->
    the node wrapper picks the one towards the master; no GPU count -> one process."""

    ifnames: dict[str, str] = field(default_factory=dict)  # node -> interface towards the master
    gpus: dict[str, int] = field(default_factory=dict)  # node -> GPUs detected
    can_mark: bool = True  # the head can write the code-sync marker into its directory


@dataclass(frozen=True)
class NodeLaunch:
    name: str
    node_rank: int
    nproc: int
    address: str
    argv: list[str]  # what runs on the node (the runner adds ssh and quoting)
    env: dict[str, str]
    cwd: str | None
    scratch: str
    agent_argv: list[str] = field(default_factory=list)  # the monitor's node agent, if on
    agent_url: str = ""
    # The code-sync marker this node must see in `cwd` (sync.py); empty: no check. With
    # `sync_at_launch` the launch command itself checks (one SSH session, not two),
    # otherwise the check runs before the node's setup commands.
    sync_marker: str = ""
    sync_at_launch: bool = False


@dataclass(frozen=True)
class BatchJob:
    """A job a scheduler runs (Slurm): the exact script it is given. Its nodes come from
    the allocation, so the plan lists none; the script spells out what each one runs."""

    scheduler: str
    script: str
    nodes: int
    nproc_per_node: int


@dataclass(frozen=True)
class LaunchPlan:
    job_id: str
    name: str
    rdzv: str
    master_addr: str
    master_port: int
    nnodes: tuple[int, int]
    nodes: list[NodeLaunch] = field(default_factory=list)
    hang_timeout: float = 600.0
    grace: float = 5.0
    sync_root: str = ""  # the head directory holding the marker and the code to copy
    batch: BatchJob | None = None  # a scheduler's job (then `nodes` is empty)

    @property
    def world_size(self) -> int:
        if self.batch is not None:
            return self.batch.nodes * self.batch.nproc_per_node
        return sum(n.nproc for n in self.nodes)

    def node(self, name: str) -> NodeLaunch:
        return next(n for n in self.nodes if n.name == name)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> LaunchPlan:
        data = dict(data)
        data["nnodes"] = tuple(data["nnodes"])
        data["nodes"] = [NodeLaunch(**n) for n in data["nodes"]]
        if data.get("batch"):
            data["batch"] = BatchJob(**data["batch"])
        return cls(**data)


def build_plan(job: JobSpec, nodes: list, job_id: str, *, head_cwd: str, facts: Facts | None = None) -> LaunchPlan:
    """The one place a job becomes commands. `nodes`: the cluster's NodeSpecs in rank
    order (node 0 hosts the master/rendezvous), their addresses already resolved."""
    facts = facts or Facts()
    lo, hi = job.nnodes_range(len(nodes))
    master = nodes[0].reach_address
    addrs = [n.reach_address for n in nodes]
    marker = marker_name(job_id) if job.sync == "auto" and facts.can_mark else ""
    target = torchrun_target(job.command)
    launches = []
    for rank, node in enumerate(nodes):
        n_gpus = node.gpus if node.gpus is not None else facts.gpus.get(node.name)
        nproc = job.nproc_per_node or n_gpus or 1
        scratch = f"{SCRATCH_ROOT}/dtrain-{job_id}-{node.name}"
        torchrun = [node.python, "-m", "torch.distributed.run", *_rdzv_args(job, (lo, hi), job_id, master, rank, addrs[rank])]
        torchrun += [
            "--nproc-per-node", str(nproc),
            "--tee", "3",
            "--log-dir", f"{scratch}/torchrun",
            "--log-line-prefix-template", "[" + node.name.replace("$", "$$") + ":r${rank}] ",
            *target,
        ]
        wrapper = [
            node.python, "-m", "dtrain.launch.node",
            "--job", job_id, "--node", node.name, "--master", master,
            "--scratch", scratch, "--grace", str(job.grace), "--head-timeout", str(HEAD_TIMEOUT), "--",
        ]
        env = _node_env(job, node, rank, nodes, addrs, job_id, scratch, facts.ifnames.get(node.name))
        cwd = node.workdir or head_cwd
        agent: dict = {}
        if job.monitor:
            agent = _agent(job, node, rank, addrs[rank], job_id)
            env.update(agent.pop("env"))
        checked = bool(marker) and needs_check(node, cwd, head_cwd)
        launches.append(NodeLaunch(
            name=node.name, node_rank=rank, nproc=nproc, address=addrs[rank],
            argv=wrapper + torchrun, env=env, cwd=cwd, scratch=scratch, **agent,
            sync_marker=marker if checked else "",
            # A node with setup commands is checked before they run (they may need the code).
            sync_at_launch=checked and not node.setup,
        ))
    return LaunchPlan(
        job_id=job_id, name=job.display_name(), rdzv=job.rdzv, master_addr=master, master_port=job.port,
        nnodes=(lo, hi), nodes=launches, hang_timeout=job.hang_timeout, grace=job.grace,
        sync_root=head_cwd if any(n.sync_marker for n in launches) else "",
    )


def node_command(launch: NodeLaunch, *, check_sync: bool = True) -> tuple[list[str], str | None]:
    """(argv, cwd) to hand the node's runner: the wrapper, behind the code-sync check
    when the launch carries one."""
    if not (check_sync and launch.sync_at_launch):
        return launch.argv, launch.cwd
    return guarded(launch.argv, launch.cwd, launch.sync_marker), None


def _agent(job: JobSpec, node, rank: int, address: str, job_id: str) -> dict:
    from dtrain.monitor.head.startup import agent_argv, agent_env, agent_url

    port = job.monitor_port + (rank if node.is_local else 0)
    return {"agent_argv": agent_argv(job_id, node.name, address, port, node.python),
            "agent_url": agent_url(address, port), "env": agent_env(port)}


def _rdzv_args(job: JobSpec, nnodes: tuple[int, int], job_id: str, master: str, rank: int,
               own_addr: str) -> list[str]:
    lo, hi = nnodes
    if job.rdzv == "static":
        return [
            "--nnodes", str(hi), "--node-rank", str(rank),
            "--master-addr", master, "--master-port", str(job.port),
        ]
    # is_host is explicit: torch guesses it from the hostname, which is wrong wherever the
    # hostname does not resolve to the node's cluster address (namespaces, multi-NIC hosts).
    return [
        "--nnodes", f"{lo}:{hi}", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{master}:{job.port}", "--rdzv-id", job_id,
        "--rdzv-conf", f"is_host={'true' if rank == 0 else 'false'}",
        "--local-addr", own_addr, "--max-restarts", str(job.max_restarts),
    ]


def _node_env(job, node, rank, nodes, addrs, job_id, scratch, ifname) -> dict[str, str]:
    env = {**job.env, **(node.env or {})}
    env.update({
        "DTRAIN_JOB_ID": job_id,
        "DTRAIN_NODE_RANK": str(rank),
        "DTRAIN_NUM_NODES": str(len(nodes)),
        "DTRAIN_NODE_ADDRS": ",".join(addrs),
        "DTRAIN_HEARTBEAT_DIR": f"{scratch}/heartbeat",
        # Workers write to torchrun's tee files: unbuffered, so lines reach the head live.
        "PYTHONUNBUFFERED": "1",
    })
    if job.secret_env:
        from dtrain.jobs.secrets import MARKED_ENV

        env[MARKED_ENV] = ",".join(job.secret_env)
    if ifname:
        env.setdefault("GLOO_SOCKET_IFNAME", ifname)
        env.setdefault("NCCL_SOCKET_IFNAME", ifname)
    if job.rdzv == "elastic":
        # torch's agents share one TCPStore and keep its address from their first round: a
        # node joining a later round (a replaced instance, a late node) would wait for a
        # MASTER_ADDR that nobody writes again. Unshared, every round publishes it anew.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if job.rdzv == "elastic" and uses_dtrain_trainer(job.command):
        env["DTRAIN_AUTO_RESUME"] = "1"  # a restarted worker group continues from last.pt
    if job.tf_config:
        workers = [f"{a}:{job.port + 1}" for a in addrs]
        env["TF_CONFIG"] = json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}})
    return env


def render(plan: LaunchPlan, local_argv: dict[str, list[str]] | None = None) -> str:
    """The dry-run text: per node, its environment and the exact command line; for a
    scheduler's job, the exact batch script (so `--dry-run > job.sbatch` is that job)."""
    if plan.batch is not None:
        return plan.batch.script.rstrip("\n")
    lines = [
        f"job {plan.job_id} ({plan.name}): {len(plan.nodes)} node(s), world size {plan.world_size}, "
        f"{plan.rdzv} rendezvous at {plan.master_addr}:{plan.master_port}"
    ]
    for n in plan.nodes:
        lines.append(f"node {n.name} (node rank {n.node_rank}, {n.nproc} proc, address {n.address})")
        lines.append(f"  cwd: {n.cwd}")
        for key in sorted(n.env):
            lines.append(f"  env: {key}={shlex.quote(n.env[key])}")
        lines.append(f"  run: {shlex.join(n.argv)}")
        if "GLOO_SOCKET_IFNAME" not in n.env:
            lines.append("  decided at launch: the network interface towards the master (the node wrapper picks it)")
        if n.sync_marker:
            when = "by the launch itself" if n.sync_at_launch else "before its setup commands"
            lines.append(f"  decided at launch: whether the code is copied (checked {when}: {n.sync_marker} in cwd)")
        if n.agent_argv:
            lines.append(f"  agent: {shlex.join(n.agent_argv)}")
        if local_argv and n.name in local_argv:
            lines.append(f"  via: {shlex.join(local_argv[n.name])}")
    return "\n".join(lines)
