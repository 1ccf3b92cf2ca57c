"""Turn a JobSpec and a cluster into one exact command line and environment per node.

Each node runs `python -m dtrain.launch.node ... -- python -m torch.distributed.run ...`:
the node wrapper owns the lifetime of torchrun there (see node.py); torchrun's arguments
are exactly those of a hand-written launch. The plan is plain data, so `--dry-run` prints
it and the tests compare it with the argv they expect.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field

from dtrain.launch.spec import JobSpec, torchrun_target, uses_dtrain_trainer

SCRATCH_ROOT = "/tmp"
MARKER_PREFIX = ".dtrain-sync-"  # the code-sync marker the head writes into its directory  # node-local scratch: torchrun's --log-dir and the heartbeat dir
# The head writes a keep-alive byte to every node every KEEPALIVE s; a node that hears
# nothing for HEAD_TIMEOUT s (a partition) stops its part of the job by itself.
KEEPALIVE = 2.0
HEAD_TIMEOUT = 20.0


@dataclass
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
    # Set: the launch itself first checks that the node sees this marker file in `cwd`
    # (the head's directory, shared); without it nothing starts and the head copies the
    # code, then launches again (node_command). Empty: no check (see prepare.py).
    sync_marker: str = ""


@dataclass
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

    @property
    def world_size(self) -> int:
        return sum(n.nproc for n in self.nodes)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> LaunchPlan:
        data = dict(data)
        data["nnodes"] = tuple(data["nnodes"])
        data["nodes"] = [NodeLaunch(**n) for n in data["nodes"]]
        return cls(**data)


def build_plan(
    job: JobSpec,
    nodes: list,
    job_id: str,
    *,
    head_cwd: str,
    ifnames: dict[str, str] | None = None,
    gpus: dict[str, int] | None = None,
) -> LaunchPlan:
    """`nodes`: the cluster's NodeSpecs in rank order (node 0 hosts the master/rendezvous).

    `ifnames` / `gpus`: what the preflight found per node (interface towards the master,
    GPU count); either may be missing, then the wrapper detects the interface itself.
    """
    ifnames = ifnames or {}
    gpus = gpus or {}
    lo, hi = job.nnodes_range(len(nodes))
    master = nodes[0].reach_address
    addrs = [n.reach_address for n in nodes]
    plan = LaunchPlan(
        job_id=job_id, name=job.display_name(), rdzv=job.rdzv, master_addr=master,
        master_port=job.port, nnodes=(lo, hi), hang_timeout=job.hang_timeout, grace=job.grace,
    )
    target = torchrun_target(job.command)
    for rank, node in enumerate(nodes):
        n_gpus = node.gpus if node.gpus is not None else gpus.get(node.name)
        nproc = job.nproc_per_node or n_gpus or 1
        scratch = f"{SCRATCH_ROOT}/dtrain-{job_id}-{node.name}"
        torchrun = [node.python, "-m", "torch.distributed.run", *_rdzv_args(job, plan, rank, addrs[rank])]
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
        env = _node_env(job, node, rank, nodes, addrs, job_id, scratch, ifnames.get(node.name))
        launch = NodeLaunch(
            name=node.name, node_rank=rank, nproc=nproc, address=addrs[rank],
            argv=wrapper + torchrun, env=env, cwd=node.workdir or head_cwd, scratch=scratch,
        )
        if job.monitor:
            _add_agent(launch, job, node, job_id)
        if _checks_sync_at_launch(job, node, launch.cwd, head_cwd):
            launch.sync_marker = f"{MARKER_PREFIX}{job_id}"
            plan.sync_root = head_cwd
        plan.nodes.append(launch)
    return plan


def _checks_sync_at_launch(job: JobSpec, node, cwd: str | None, head_cwd: str) -> bool:
    """Whether the node's launch checks for the code itself (one SSH session, not two).

    Not for a local node in the head's own directory (nothing to check), and not for a
    node with setup commands: those run before the launch, after any copy, so that
    node's check stays in prepare_nodes."""
    if job.sync != "auto" or not cwd or node.setup:
        return False
    if node.is_local:
        from pathlib import Path

        return Path(cwd).expanduser().resolve() != Path(head_cwd).resolve()
    return True


# Run by the node's login shell before the wrapper: `~` is the node user's home; a
# missing directory or marker prints MARK {"sync": "missing"} and starts nothing.
_SYNC_GUARD = ('d=$1; case $d in "~") d=$HOME;; "~/"*) d=$HOME/${d#"~/"};; esac; '
               'cd "$d" 2>/dev/null && test -f "$2" || { printf "%s\\n" "$3"; exit 0; }; shift 3; exec "$@"')
SYNC_MISSING = {"sync": "missing"}


def node_command(launch: NodeLaunch, *, check_sync: bool = True) -> tuple[list[str], str | None]:
    """(argv, cwd) to hand the node's runner: the wrapper, behind the code-sync check
    when the launch carries one."""
    if not (check_sync and launch.sync_marker):
        return launch.argv, launch.cwd
    from dtrain.launch.node import MARK

    missing = MARK + json.dumps(SYNC_MISSING)
    return ["sh", "-c", _SYNC_GUARD, "sh", launch.cwd or ".", launch.sync_marker, missing, *launch.argv], None


def _add_agent(launch: NodeLaunch, job: JobSpec, node, job_id: str) -> None:
    from dtrain.monitor.api import agent_argv, agent_env, agent_url

    port = job.monitor_port + (launch.node_rank if node.is_local else 0)
    launch.agent_argv = agent_argv(job_id, node.name, launch.address, port, node.python)
    launch.agent_url = agent_url(launch.address, port)
    launch.env.update(agent_env(port))


def _rdzv_args(job: JobSpec, plan: LaunchPlan, rank: int, own_addr: str) -> list[str]:
    lo, hi = plan.nnodes
    if job.rdzv == "static":
        return [
            "--nnodes", str(hi), "--node-rank", str(rank),
            "--master-addr", plan.master_addr, "--master-port", str(plan.master_port),
        ]
    # is_host is explicit: torch guesses it from the hostname, which is wrong wherever the
    # hostname does not resolve to the node's cluster address (namespaces, multi-NIC hosts).
    return [
        "--nnodes", f"{lo}:{hi}", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{plan.master_addr}:{plan.master_port}", "--rdzv-id", plan.job_id,
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
    if job.rdzv == "elastic" and uses_dtrain_trainer(job.command):
        env["DTRAIN_AUTO_RESUME"] = "1"  # a restarted worker group continues from last.pt
    if job.tf_config:
        workers = [f"{a}:{job.port + 1}" for a in addrs]
        env["TF_CONFIG"] = json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}})
    return env


def remove_sync_marker(plan: LaunchPlan) -> None:
    """Remove the marker the nodes' launches look for (once they all have looked)."""
    from pathlib import Path

    for marker in {n.sync_marker for n in plan.nodes if n.sync_marker}:
        try:
            (Path(plan.sync_root) / marker).unlink(missing_ok=True)
        except OSError:
            pass


def render(plan: LaunchPlan, local_argv: dict[str, list[str]] | None = None) -> str:
    """The dry-run text: per node, its environment and the exact command line."""
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
        if n.agent_argv:
            lines.append(f"  agent: {shlex.join(n.agent_argv)}")
        if local_argv and n.name in local_argv:
            lines.append(f"  via: {shlex.join(local_argv[n.name])}")
    return "\n".join(lines)
