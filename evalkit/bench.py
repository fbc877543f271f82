"""`evalkit bench`."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Adds `evalkit bench` to the command line."""
