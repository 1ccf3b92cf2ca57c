"""Elastic recovery on a rented cluster: a node whose instance disappeared mid-job (a spot
reclaim, a terminate from the console) gets a new instance, which is set up, checked and
launched into the running job under the lost node's name.

`dtrain run cloud.yaml --rdzv elastic --max-replacements K` hands a `Replacer` to the
job's session; the session calls it (in a thread of its own) with the lost node's
launch. The survivors' torchrun agents meanwhile restart their workers and wait in the
rendezvous; the new node joins it, so the job goes on at the full world size, and a
training script that resumes from its last checkpoint (dtrain's trainer does) loses
only the steps since then. The master node cannot be replaced: it holds the
rendezvous store, and with it the job.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

from dtrain.cluster.providers import make_provider
from dtrain.cluster.providers.autostop import arm
from dtrain.cluster.providers.base import ProviderError
from dtrain.cluster.providers.config import read_cloud_file
from dtrain.cluster.providers.lifecycle import node_list, wait_ssh
from dtrain.cluster.providers.records import ClusterRecords
from dtrain.errors import ConfigError, DtrainError

SETUP_TIMEOUT = 1800.0
# What the node must do to join: its Python imports torch, and it reaches the rendezvous.
_PROBE = ("import socket,sys,torch;socket.create_connection((sys.argv[1],int(sys.argv[2])),10).close();"
          "print('torch',torch.__version__)")


class Replacer:
    def __init__(self, cluster_file: str | None, limit: int, echo: Callable[[str], None] = print,
                 records: ClusterRecords | None = None, **deps: Any) -> None:
        cloud = read_cloud_file(cluster_file) if cluster_file else None
        if cloud is None:
            raise ConfigError("--max-replacements replaces rented instances, and no cluster file with a cloud: "
                              "section was given",
                              "name a cluster file with a cloud: section, or drop --max-replacements")
        self.spec, self.rest = cloud
        self.left = limit  # the session counts it down as it asks for replacements
        self.echo = echo
        self.records = records or ClusterRecords()
        self.provider = make_provider(self.spec, echo=echo, **deps)

    def __call__(self, lost, plan) -> tuple[Any, Any]:
        """(the new node's launch, its runner) for `lost` (a NodeLaunch of `plan`)."""
        from dtrain.cluster.runner import runner_for

        spec = self.spec
        row = self.records.get(spec.name)
        if row is None:
            raise DtrainError(f"no record of {spec.name}", "the cluster was not rented by this head")
        known = {n.address for n in plan.nodes}
        # The lost node's instance may still run as far as the cloud knows (the head hears
        # of a reclaim before the API shows it, or the machine hangs): it is ended first,
        # so that `create` counts it as missing and nothing lost keeps costing money.
        behind = [i.id for i in self.provider.query(spec.name)
                  if i.alive and _address(self.provider, i) == lost.address]
        if behind:
            self.echo(f"[dtrain] terminating {behind[0]}, the instance behind {lost.name}")
            self.provider.terminate(behind, spec.wait_timeout)
        self.provider.create(spec.name, row.token, spec.count)
        instances = self.provider.wait(spec.name, spec.count, spec.wait_timeout)
        self.records.reconcile(spec.name, self.provider.query(spec.name), self.provider.price)
        fresh = [i for i in instances if self.provider.address(i) not in known]
        if not fresh:
            raise DtrainError(f"no new instance for {lost.name} (the cloud shows all of them known)",
                              "`dtrain clusters --refresh`, then run the job again")
        new = fresh[0]
        wait_ssh(spec, [new], self.provider)
        address = self.provider.address(new)
        nodes = node_list(spec, self.rest, [new], self.provider)
        node = nodes.nodes[0].model_copy(update={"name": lost.name})
        cluster = nodes.model_copy(update={"nodes": [node]})
        arm(spec, cluster, [new], self.provider, self.echo)
        runner = runner_for(node, cluster)
        runner.open_job(plan.job_id)
        # A fresh machine has no copy of the code: its launch looks for it and copies it
        # (the session's code sync), also when the lost node's setup commands did that.
        launch = dataclasses.replace(_moved(lost, lost.address, address), sync_at_launch=bool(lost.sync_marker))
        if node.setup and launch.cwd:
            self._check(runner.run(["mkdir", "-p", launch.cwd], timeout=60), "workdir", lost.name)
        for command in node.setup:
            self._check(runner.run(["sh", "-c", command], timeout=SETUP_TIMEOUT, env=launch.env, cwd=launch.cwd),
                        f"setup command {command!r}", lost.name)
        self._check(runner.run([node.python, "-c", _PROBE, plan.master_addr, str(plan.master_port)], timeout=60),
                    f"preflight (torch, the rendezvous at {plan.master_addr})", lost.name)
        self.echo(f"[dtrain] {lost.name} is now {new.id} ({address}, {new.zone}): set up and checked, joining the job")
        return launch, runner

    @staticmethod
    def _check(res, what: str, name: str) -> None:
        if res.returncode != 0:
            tail = " | ".join((res.stderr or res.stdout).strip().splitlines()[-3:])
            raise DtrainError(f"the replacement for {name} failed its {what} (exit {res.returncode}): {tail}",
                              "fix the cluster file's setup/python, then run the job again")


def _address(provider, instance) -> str | None:
    try:
        return provider.address(instance)
    except ProviderError:  # no address yet, or none any more
        return None


def _moved(launch, old: str, new: str):
    """`launch` with the lost node's address replaced by the new one (its torchrun's
    --local-addr, its agent's bind address, the env that names it)."""
    exact = re.compile(rf"(?<![\w.]){re.escape(old)}(?![\w])")  # not 10.0.0.12 inside 10.0.0.125
    swap = lambda text: exact.sub(new, text)  # noqa: E731
    return dataclasses.replace(
        launch, address=new, argv=[swap(a) for a in launch.argv], env={k: swap(v) for k, v in launch.env.items()},
        agent_argv=[swap(a) for a in launch.agent_argv], agent_url=swap(launch.agent_url))


def replacer_for(cluster_file: str | None, job, limit: int, detach: bool,
                 echo: Callable[[str], None] = print) -> Replacer | None:
    """`dtrain run --max-replacements K`'s replacer, None for K = 0."""
    if limit <= 0:
        return None
    if job.rdzv != "elastic" or job.max_restarts < 1:
        raise ConfigError("--max-replacements needs an elastic job whose survivors may restart",
                          "add --rdzv elastic --max-restarts N (N >= the replacements)")
    if detach:
        raise ConfigError("--max-replacements needs the foreground dtrain run (it rents the replacements)",
                          "drop --detach")
    return Replacer(cluster_file, limit, echo)
