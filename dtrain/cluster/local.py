"""The `local` runner: the node is this machine; commands are plain child processes."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from dtrain.cluster.runner import CommandRunner, register_runner


@register_runner
class LocalRunner(CommandRunner):
    name = "local"

    def argv(self, remote_argv: Sequence[str], *, env: Mapping[str, str] | None = None,
             cwd: str | None = None) -> list[str]:
        if not remote_argv:
            raise ValueError("empty command")
        env = self.merged_env(env)
        if not env and cwd is None:
            return list(remote_argv)
        # env(1) keeps the argv inspectable (dry run) and identical in shape to ssh's;
        # `-S` is never used, so each word stays one argument. A command word holding
        # "=" would be read as an assignment: run it through `command` then.
        out = ["env"]
        if cwd is not None:
            out += ["-C", os.path.expanduser(cwd)]
        out += [f"{k}={v}" for k, v in env.items()]
        first = remote_argv[0]
        if "=" in first or first.startswith("-"):
            out += ["sh", "-c", 'exec "$@"', "sh"]
        return out + list(remote_argv)
