"""The launch side of the cluster commands (run, jobs, status, logs, stop).

Owner: launch. Registered from cluster_cmd.register so that the cluster and launch
commands stay together in `dtrain --help` while living in separate files.
"""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    pass
