"""`dtrain run` flags -> a JobSpec (validated at the edge); the ClusterSpec comes from
`dtrain.cluster.spec.cluster_from_args`, shared with `dtrain check`."""

from __future__ import annotations

import os
from typing import Any

import typer

from dtrain.configio import load_config
from dtrain.errors import ConfigError
from dtrain.jobs import secrets


def job_from(job_file: str | None, command: list[str], **flags: Any):
    """job.yaml (if any) <- the flags that were given <- the command after `--`."""
    from dtrain.launch.spec import JobSpec

    base: dict[str, Any] = {}
    env_items = flags.pop("env", []) or []
    if env_items:
        env = {}
        for item in env_items:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ConfigError(f"bad --env {item!r}", "write it as --env NAME=value")
            env[key] = value
        base["env"] = env
    base.update({k: v for k, v in flags.items() if v is not None})
    if command:
        base["command"] = command
    if job_file is None and "command" not in base:
        raise ConfigError("no command to run", "put it after --, e.g. dtrain run -- python train.py, or use --job job.yaml")
    merged = load_config(JobSpec, job_file).model_dump() if job_file is not None else {"env": {}, "secret_env": []}
    base["env"] = {**merged["env"], **base.get("env", {})}
    base["secret_env"] = list(dict.fromkeys(merged["secret_env"] + base.get("secret_env", [])))
    base["env"].update(secrets.resolve(base["secret_env"], base["env"], os.environ))
    merged.update(base)
    return load_config(JobSpec, None, base=merged)


def print_and_exit(status: int) -> None:
    if status:
        raise typer.Exit(status)


