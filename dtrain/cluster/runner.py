"""How a command reaches a node: a `CommandRunner` per node, chosen by name.

A runner turns an argv meant for the node into the local argv that runs it there
(`argv`), so every launch can be printed as a dry run and tested without running it.
`run` and `popen` only execute that argv. Every argument travels as its own quoted word;
no caller ever builds a shell string.

The node's own `env` (cluster.yaml) is applied to every command; `env` given to a call
is added on top. `setup` commands are the launcher's business, not the runner's.
"""

from __future__ import annotations

import difflib
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar

from dtrain.cluster.spec import ClusterSpec, NodeSpec
from dtrain.errors import ConfigError


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

    def share_connection(self, directory: str | None) -> CommandRunner:
        """Let every later command to this node reuse one connection whose socket lives in
        `directory` (one job's private directory). A no-op where there is no connection
        to share (a local node) or `directory` is None."""
        return self

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


def _load_builtin() -> None:
    # The built-in runners register themselves on import.
    from dtrain.cluster import local, ssh  # noqa: F401
