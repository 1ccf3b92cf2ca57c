"""How a command reaches a node: a `CommandRunner` per node, chosen by name.

A runner turns an argv meant for the node into the local argv that runs it there
(`argv`), so every launch can be printed as a dry run and tested without running it.
`run` and `popen` only execute that argv. Every argument travels as its own quoted word;
no caller ever builds a shell string.

The node's own `env` (cluster.yaml) is applied to every command; `env` given to a call
is added on top. `setup` commands are the launcher's business, not the runner's.

A runner also owns its transport, so the launcher never asks which runner it holds: the
job's shared connection (`open_job` / `close_job`), copying a tree of files to the node
(`copy_tree`) and the address the other nodes use for it (`reach_address`).
"""

from __future__ import annotations

import difflib
import os
import subprocess
from pathlib import Path
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar

from dtrain.cluster.spec import ClusterSpec, NodeSpec
from dtrain.errors import ConfigError, DtrainError

COPY_TIMEOUT = 1800.0


class CommandRunner(ABC):
    name: ClassVar[str]

    def __init__(self, node: NodeSpec, cluster: ClusterSpec) -> None:
        self.node = node
        self.cluster = cluster

    @abstractmethod
    def argv(self, remote_argv: Sequence[str], *, env: Mapping[str, str] | None = None,
             cwd: str | None = None) -> list[str]:
        """The local argv that runs `remote_argv` on the node, in `cwd`, with `env` added."""

    def stdin_preamble(self, env: Mapping[str, str]) -> str:
        """What the command built by `argv` reads from its stdin before anything else
        (the ssh runner's secret values); `run` and `popen` send it first."""
        return ""

    def run(self, remote_argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None,
            cwd: str | None = None, input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run to completion, capturing text output; raises subprocess.TimeoutExpired."""
        preamble = self.stdin_preamble(self.merged_env(env))
        if preamble:
            input = preamble + (input or "")
        return subprocess.run(self.argv(remote_argv, env=env, cwd=cwd), input=input, text=True,
                              encoding="utf-8", errors="replace",
                              capture_output=True, timeout=timeout,
                              stdin=None if input is not None else subprocess.DEVNULL)

    def popen(self, remote_argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              cwd: str | None = None, **popen_kwargs) -> subprocess.Popen:
        preamble = self.stdin_preamble(self.merged_env(env))
        if not preamble:
            return subprocess.Popen(self.argv(remote_argv, env=env, cwd=cwd), **popen_kwargs)
        keep_open = popen_kwargs.get("stdin") == subprocess.PIPE
        proc = subprocess.Popen(self.argv(remote_argv, env=env, cwd=cwd), **{**popen_kwargs, "stdin": subprocess.PIPE})
        text = any(popen_kwargs.get(k) for k in ("text", "universal_newlines", "encoding", "errors"))
        proc.stdin.write(preamble if text else preamble.encode())
        proc.stdin.flush()
        if not keep_open:  # the caller asked for no stdin: the command sees EOF after the preamble
            proc.stdin.close()
            proc.stdin = None
        return proc

    def open_job(self, job_id: str) -> CommandRunner:
        """Let every later command to this node reuse one connection kept for `job_id`
        (until `close_job`). A no-op where there is no connection to share."""
        return self

    def close_job(self) -> None:
        """End the job's shared connection, if `open_job` made one."""

    def reach_address(self) -> str:
        """The address the other nodes use for this node."""
        return self.node.reach_address

    def copy_tree(self, root: Path, files: list[str], workdir: str) -> None:
        """Copy `files` (paths relative to `root`) into `workdir` on the node: a tar stream
        through `popen`, which works for every runner; raises DtrainError."""
        listing = b"".join(os.fsencode(f) + b"\0" for f in files)
        tar = subprocess.Popen(["tar", "-C", str(root), "--null", "-T", "-", "-cf", "-"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        recv = self.popen(["sh", "-c", 'mkdir -p "$1" && exec tar -C "$1" -xf -', "sh", workdir],
                          stdin=tar.stdout, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        tar.stdout.close()
        tar.stdin.write(listing)
        tar.stdin.close()
        _, err = recv.communicate(timeout=COPY_TIMEOUT)
        tar.wait(timeout=60)
        if recv.returncode != 0 or tar.returncode != 0:
            self.copy_failed(err)

    def copy_failed(self, stderr: bytes) -> None:
        raise DtrainError(f"copying the code to {self.node.name} failed: "
                          f"{stderr.decode(errors='replace').strip()[-300:]}",
                          "check the node's disk and workdir, or set sync: never")

    def merged_env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        return {**self.node.env, **(env or {})}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.node.name})"


RUNNERS: dict[str, type[CommandRunner]] = {}


def register_runner(cls: type[CommandRunner]) -> type[CommandRunner]:
    RUNNERS[cls.name] = cls
    return cls


def runner_class(name: str) -> type[CommandRunner]:
    _load_builtin()
    try:
        return RUNNERS[name]
    except KeyError:
        close = difflib.get_close_matches(name, RUNNERS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"unknown runner {name!r}", f"{hint}valid runners: {', '.join(sorted(RUNNERS))}") from None


def runner_for(node: NodeSpec, cluster: ClusterSpec) -> CommandRunner:
    return runner_class(node.transport)(node, cluster)


def job_runners(cluster: ClusterSpec, job_id: str | None = None) -> dict[str, CommandRunner]:
    """One runner per node, by node name; with a job id every command to a node shares
    one connection until `close_job_runners`."""
    runners = {n.name: runner_for(n, cluster) for n in cluster.nodes}
    if job_id:
        for runner in runners.values():
            runner.open_job(job_id)
    return runners


def close_job_runners(runners: dict[str, CommandRunner]) -> None:
    for runner in runners.values():
        runner.close_job()


def with_addresses(cluster: ClusterSpec, runners: dict[str, CommandRunner]) -> ClusterSpec:
    """The cluster with every node's address filled in from its runner (e.g. the IP an
    `~/.ssh/config` alias stands for), so that preflight, the plan and job.json all use
    the address the other nodes will really dial."""
    nodes = [n if n.address else n.model_copy(update={"address": runners[n.name].reach_address()})
             for n in cluster.nodes]
    return cluster.model_copy(update={"nodes": nodes})


def _load_builtin() -> None:
    # The built-in runners register themselves on import.
    from dtrain.cluster import local, ssh  # noqa: F401
