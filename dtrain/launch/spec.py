"""What to run: the typed job description (`job.yaml` or `dtrain run` flags).

A JobSpec knows nothing of where it runs; `dtrain.launch.plan` turns it plus a
ClusterSpec into one torchrun command line and environment per node.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from dtrain.configio import StrictModel
from dtrain.errors import ConfigError
from dtrain.printable import printable

_NNODES = re.compile(r"^(\d+)(?::(\d+))?$")
_PYTHON = re.compile(r"^(.*/)?python(\d+(\.\d+)?)?$")


class JobSpec(StrictModel):
    name: str | None = None
    # `python script.py args`, `python -m module args`, `-m module args`, `script.py args`,
    # `dtrain train CONFIG args`, or any other executable (run with torchrun --no-python).
    command: list[str] = Field(min_length=1)
    nproc_per_node: int | None = Field(None, ge=1)  # None: the node's GPUs, else 1
    rdzv: Literal["static", "elastic"] = "static"
    nnodes: str | None = None  # elastic "MIN:MAX"; default: every node of the cluster
    max_restarts: int = Field(0, ge=0)
    port: int = Field(29500, ge=1, le=65535)
    env: dict[str, str] = {}
    # Names whose values are secret (besides names that look it): taken from the head's
    # environment when not in `env`, never written in clear (dtrain.jobs.secrets).
    secret_env: list[str] = []
    # auto: copy the working directory to nodes that do not already see it (shared storage).
    sync: Literal["auto", "never"] = "auto"
    tf_config: bool = False
    hang_timeout: float = Field(600.0, gt=0)  # seconds without heartbeat or output
    grace: float = Field(5.0, ge=0)  # SIGTERM -> SIGKILL on the nodes when stopping
    # The monitor's node agent on every node (+ the head collector); port per node, +rank
    # for several local nodes on one machine.
    monitor: bool = True
    monitor_port: int = Field(9464, ge=1, le=65535)

    @field_validator("nnodes")
    @classmethod
    def _nnodes_form(cls, v: str | None) -> str | None:
        if v is not None and not _NNODES.match(v):
            raise ValueError("write it as N or MIN:MAX, e.g. 1:2")
        return v

    @model_validator(mode="after")
    def _static_has_no_restarts(self) -> JobSpec:
        if self.rdzv == "static" and self.max_restarts:
            raise ValueError("max_restarts needs rdzv: elastic (a static rendezvous cannot re-form)")
        return self

    def nnodes_range(self, n_nodes: int) -> tuple[int, int]:
        if self.nnodes is None:
            return n_nodes, n_nodes
        m = _NNODES.match(self.nnodes)
        lo = int(m.group(1))
        hi = int(m.group(2) or lo)
        if not 1 <= lo <= hi or hi > n_nodes:
            raise ConfigError(
                f"nnodes {self.nnodes} does not fit a cluster of {n_nodes} node(s)",
                f"use MIN:MAX with 1 <= MIN <= MAX <= {n_nodes}",
            )
        if self.rdzv == "static" and lo != n_nodes:
            raise ConfigError("a static rendezvous runs on every node", "drop --nnodes or use --rdzv elastic")
        return lo, hi

    def display_name(self) -> str:
        """The job's name in the registry, `dtrain jobs`, `dtrain top` and reports: text, so a
        script or --name in bytes that are not UTF-8 (a Windows zip's), or holding a newline or
        an escape, is shown with those written out (dtrain.printable; SQLite refuses the bytes)."""
        if self.name:
            return printable(self.name)
        target = torchrun_target(self.command)
        word = target[1] if target[0] in ("-m", "--no-python") else target[0]
        return printable(Path(word).stem) or "job"


def torchrun_target(command: list[str]) -> list[str]:
    """The part of a torchrun command line after its own options.

    >>> torchrun_target(["python", "train.py", "--epochs", "3"])
    ['train.py', '--epochs', '3']
    >>> torchrun_target(["dtrain", "train", "cfg.yaml"])
    ['-m', 'dtrain.train', 'cfg.yaml']
    """
    if not command:
        raise ConfigError("no command to run", "put it after --, e.g. dtrain run -- python train.py")
    head, rest = command[0], list(command[1:])
    if _PYTHON.match(head):
        if not rest:
            raise ConfigError("`python` needs a script or -m MODULE", "e.g. -- python train.py")
        if rest[0] == "-m":
            if len(rest) < 2:
                raise ConfigError("`-m` needs a module name", "e.g. -- python -m mypkg.train")
            return rest
        if rest[0].startswith("-"):
            raise ConfigError(
                f"python option {rest[0]} is not supported by torchrun",
                "run a script or -m MODULE; set PYTHON* options through env",
            )
        return rest
    if head == "-m":
        if not rest:
            raise ConfigError("`-m` needs a module name", "e.g. -- -m mypkg.train")
        return command
    if os.path.basename(head) == "dtrain" and rest[:1] == ["train"]:
        return ["-m", "dtrain.train", *rest[1:]]
    if head.endswith(".py"):
        return command
    return ["--no-python", *command]


def uses_dtrain_trainer(command: list[str]) -> bool:
    return torchrun_target(command)[:2] == ["-m", "dtrain.train"]
