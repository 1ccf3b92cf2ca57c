"""Commands of this module are registered on the root app by `register`."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    pass
