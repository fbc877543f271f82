"""`evalkit report`."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Adds `evalkit report` to the command line."""
