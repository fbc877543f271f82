"""`evalkit sweep`."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Adds `evalkit sweep` to the command line."""
