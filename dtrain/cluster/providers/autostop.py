"""The head side of autostop: arm every rented node (`dtrain up`, and each `dtrain run`
on the cluster), so that it terminates itself when idle or cut off from its head, even
after this head is gone for good. The node side is autostop_node.py.

Arming is one SSH command per node: the node's Python reads the daemon's source and
its config (the instance id, the provider's endpoint, credentials where there is no
instance role) from stdin, writes them 0600 under the node's `~/.dtrain/autostop`, and
starts the daemon detached unless one already watches that instance. Nothing secret is
ever on a command line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from dtrain.cluster.providers import autostop_node
from dtrain.cluster.providers.base import Instance, Provider, ProviderError
from dtrain.cluster.providers.config import CloudSpec

# Runs on the node: the daemon's source arrives on stdin with its config, so the node
# needs Python (and boto3 for EC2), not dtrain, before its first `setup:`.
BOOT = ("import json,sys;d=json.load(sys.stdin);g={'__name__':'dtrain_autostop'};"
        "exec(compile(d['source'],'autostop_node.py','exec'),g);g['install'](d)")


def arm(spec: CloudSpec, nodes, instances: list[Instance], provider: Provider,
        echo: Callable[[str], None] = print) -> None:
    """Arm autostop on each of `nodes` (a ClusterSpec, in the order of `instances`);
    nothing when the cloud: section has no autostop."""
    if spec.autostop is None:
        return
    from dtrain.cluster.runner import runner_for

    source = Path(autostop_node.__file__).read_text(encoding="utf-8")
    for node, inst in zip(nodes.nodes, instances):
        config = {**provider.node_access(inst), "cluster": spec.name, "limit": spec.autostop}
        res = runner_for(node, nodes).run([node.python, "-c", BOOT], timeout=120,
                                          input=json.dumps({"source": source, "config": config}))
        answer = _last_json(res.stdout)
        if res.returncode != 0 or "beat" not in answer:
            why = answer.get("error") or (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1]
            raise ProviderError(f"autostop could not be armed on {node.name} ({inst.id}): {why}",
                                f"{spec.name} is up and costs money: fix the node's python (defaults.python) "
                                f"and run `dtrain up` again, or `dtrain down {spec.name}`")
    fallback = "" if spec.iam_instance_profile else " (with this head's credentials; see cloud.iam_instance_profile)"
    echo(f"{spec.name}: autostop armed on {len(instances)} node(s): each terminates itself after "
         f"{spec.autostop:.0f} s without a job or without its head{fallback}")


def _last_json(stdout: str) -> dict:
    for line in reversed(stdout.strip().splitlines()):
        try:
            found = json.loads(line)
        except ValueError:
            continue
        if isinstance(found, dict):
            return found
    return {}
