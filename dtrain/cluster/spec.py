"""Where things run: the typed cluster description (`cluster.yaml`).

```yaml
ssh_config: ~/.ssh/config.d/plant   # optional, passed to ssh as -F
ssh_options: [ProxyJump=bastion]     # optional, each passed as -o
shared_paths: [/mnt/nas/defects]     # must exist with the same content on every node
defaults: {python: /opt/venv/bin/python, workdir: /srv/job, gpus: 2, env: {A: "1"}}
nodes:
  - host: gpu1                       # an SSH destination (~/.ssh/config applies) or "local"
    address: 10.0.0.11               # how other nodes reach it (default: host)
  - {host: ubuntu@gpu2, gpus: 1}
```

The first node is the master (node rank 0). Node fields omitted in a node are taken from
`defaults`; `env` maps are merged (the node's keys win) and `setup` commands run
defaults first. Names and destinations are validated here so that nothing later can be
tricked into passing an option or a shell word through them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from dtrain.configio import StrictModel, load_config, validate
from dtrain.errors import ConfigError

LOCAL = "local"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# user@host, host, host:port-less forms, ssh://user@host:port; no spaces, no leading "-".
# The user is a portable POSIX user name: the remote side may hand it to a shell.
_DESTINATION = re.compile(r"^(ssh://)?([A-Za-z0-9_][A-Za-z0-9_.-]*@)?[A-Za-z0-9_.\[\]:%][A-Za-z0-9_.\-\[\]:%]*$")


class NodeDefaults(StrictModel):
    """Values every node gets unless it sets its own."""

    gpus: int | None = Field(None, ge=0, description="GPUs per node; None = detect")
    python: str = "python3"
    workdir: str | None = None
    env: dict[str, str] = {}
    setup: list[str] = []

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        return _check_env(env)


class NodeSpec(StrictModel):
    name: str
    host: str = LOCAL
    # How the other nodes reach this one (rendezvous, GLOO/NCCL traffic).
    address: str | None = None
    gpus: int | None = Field(None, ge=0)
    python: str = "python3"
    workdir: str | None = None
    env: dict[str, str] = {}
    setup: list[str] = []

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("name") and data.get("host"):
            data = {**data, "name": _name_from_host(str(data["host"]))}
        return data

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _NAME.match(name):
            raise ValueError("a node name is letters, digits, '.', '_' or '-' (it names log files and prefixes)")
        return name

    @field_validator("host")
    @classmethod
    def _host(cls, host: str) -> str:
        if host != LOCAL and not _DESTINATION.match(host):
            raise ValueError("host must be 'local' or an SSH destination such as 'gpu1' or 'user@gpu1'")
        return host

    @field_validator("address")
    @classmethod
    def _address(cls, address: str | None) -> str | None:
        if address is not None and not re.match(r"^[A-Za-z0-9_.:\-\[\]%]+$", address):
            raise ValueError("address must be a host name or an IP address")
        return address

    @field_validator("python")
    @classmethod
    def _python(cls, python: str) -> str:
        if not python.strip() or python.startswith("-"):
            raise ValueError("python must be an interpreter path or command, e.g. /opt/venv/bin/python")
        return python

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        return _check_env(env)

    @property
    def is_local(self) -> bool:
        return self.host == LOCAL

    @property
    def transport(self) -> str:
        """The runner registry name for this node."""
        return LOCAL if self.is_local else "ssh"

    @property
    def reach_address(self) -> str:
        """The address other nodes (and the master) use for this node."""
        if self.address:
            return self.address
        return "127.0.0.1" if self.is_local else _ssh_hostname(self.host)


class ClusterSpec(StrictModel):
    nodes: list[NodeSpec] = Field(min_length=1)
    ssh_config: str | None = None
    ssh_options: list[str] = []
    defaults: NodeDefaults = NodeDefaults()
    shared_paths: list[str] = []
    connect_timeout: int = Field(10, ge=1, le=300, description="seconds for an SSH connection")
    # Keep one SSH connection per node open for a minute (OpenSSH ControlMaster) so the
    # commands after the first skip the handshake. Off unless asked: it leaves a
    # background ssh process on this machine for that minute.
    ssh_multiplex: bool = False

    @model_validator(mode="before")
    @classmethod
    def _apply_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
            return data
        defaults = data.get("defaults") or {}
        if not isinstance(defaults, dict):
            return data
        nodes = []
        for node in data["nodes"]:
            if isinstance(node, str):  # "- gpu1" is short for "- host: gpu1"
                node = {"host": node}
            if isinstance(node, dict):
                node = _merge_defaults(defaults, node)
            nodes.append(node)
        return {**data, "nodes": nodes}

    @field_validator("ssh_options")
    @classmethod
    def _ssh_options(cls, options: list[str]) -> list[str]:
        for opt in options:
            if opt.startswith("-") or not re.match(r"^[A-Za-z]+[= ]\S", opt):
                raise ValueError(f"ssh option {opt!r} must look like 'Port=2222' (each is passed as -o)")
        return options

    @field_validator("ssh_config")
    @classmethod
    def _expand(cls, path: str | None) -> str | None:
        return str(Path(path).expanduser()) if path else None

    @model_validator(mode="after")
    def _unique_names(self) -> ClusterSpec:
        seen: set[str] = set()
        for node in self.nodes:
            if node.name in seen:
                raise ValueError(f"two nodes are named {node.name!r}; give each node a distinct name")
            seen.add(node.name)
        return self

    @property
    def master(self) -> NodeSpec:
        return self.nodes[0]

    def node(self, name: str) -> NodeSpec:
        for node in self.nodes:
            if node.name == name:
                return node
        raise ConfigError(f"no node named {name!r}", f"the nodes are: {', '.join(n.name for n in self.nodes)}")

    def select(self, names: list[str]) -> ClusterSpec:
        """The same cluster restricted to `names` (node names or hosts), in that order."""
        picked = []
        for name in names:
            match = [n for n in self.nodes if name in (n.name, n.host)]
            if not match:
                raise ConfigError(f"no node named {name!r} in the cluster",
                                  f"the nodes are: {', '.join(n.name for n in self.nodes)}")
            picked.append(match[0])
        return self.model_copy(update={"nodes": picked})

    @classmethod
    def from_hosts(cls, hosts: list[str], **fields: Any) -> ClusterSpec:
        """The quick form: `--hosts h1,h2` (plus any ClusterSpec field, e.g. defaults)."""
        hosts = [h.strip() for h in hosts if h.strip()]
        if not hosts:
            raise ConfigError("no hosts given", "name at least one host, e.g. --hosts gpu1,gpu2 (or 'local')")
        data = {**fields, "nodes": [{"host": h} for h in hosts]}
        if hosts.count(LOCAL) > 1:  # several local "nodes" need distinct names
            data["nodes"] = [{"host": h, "name": f"{h}{i}" if h == LOCAL else None}
                             for i, h in enumerate(hosts)]
        return validate(cls, data, "--hosts")


def load_cluster(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> ClusterSpec:
    return load_config(ClusterSpec, path, overrides)


def cluster_from_args(cluster_file: str | Path | None, hosts: str | None, *, python: str | None = None,
                      ssh_config: str | None = None, default_local: bool = False) -> ClusterSpec:
    """The cluster a command line names (`dtrain check`, `dtrain run`): a cluster.yaml,
    `--hosts h1,h2`, or both (the file restricted to those nodes).

    The quick form runs the head's own interpreter path on every node (a venv at the same
    path everywhere); `python` overrides the interpreter and `ssh_config` the ssh client
    configuration (ssh -F) in both forms. Neither given: this machine alone if
    `default_local`, else a ConfigError."""
    import sys

    names = [h.strip() for h in (hosts or "").split(",") if h.strip()]
    if cluster_file is None and not names:
        if not default_local:
            raise ConfigError("no cluster given",
                              "pass a cluster.yaml, or --hosts h1,h2 (use 'local' for this machine)")
        names = [LOCAL]
    if cluster_file is None:
        extra = {"ssh_config": ssh_config} if ssh_config else {}
        return ClusterSpec.from_hosts(names, defaults={"python": python or sys.executable}, **extra)
    spec = load_cluster(cluster_file)
    if ssh_config:
        spec = spec.model_copy(update={"ssh_config": str(Path(ssh_config).expanduser())})
    if names:
        spec = spec.select(names)
    if python:
        spec = spec.model_copy(update={"nodes": [n.model_copy(update={"python": python}) for n in spec.nodes]})
    return spec


def _merge_defaults(defaults: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    merged = {k: v for k, v in defaults.items() if k not in ("env", "setup")}
    merged.update(node)
    if isinstance(defaults.get("env"), dict) or isinstance(node.get("env"), dict):
        merged["env"] = {**(defaults.get("env") or {}), **(node.get("env") or {})}
    if defaults.get("setup") or node.get("setup"):
        merged["setup"] = [*(defaults.get("setup") or []), *(node.get("setup") or [])]
    return merged


def _check_env(env: dict[str, str]) -> dict[str, str]:
    for key in env:
        if not _ENV_NAME.match(key):
            raise ValueError(f"environment variable name {key!r} is not valid (letters, digits, '_')")
    return env


def _ssh_hostname(destination: str) -> str:
    host = destination.removeprefix("ssh://").rpartition("@")[2]
    if host.startswith("["):  # [v6addr]:port
        return host[1:host.index("]")]
    return host.split(":")[0] if destination.startswith("ssh://") else host


def _name_from_host(host: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]", "-", _ssh_hostname(host)).strip("-.") or "node"
    return name[:64]
