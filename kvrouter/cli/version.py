"""``kvrouter version``: what is installed, for bug reports."""

from __future__ import annotations

import platform
from importlib import metadata

import typer

COMPONENTS = ("kvrouter", "numba", "numpy", "pyzmq", "msgpack", "xxhash")


def version() -> None:
    """Print kvrouter's version and those of the libraries its hot paths depend on."""
    for name in COMPONENTS:
        try:
            typer.echo(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            typer.echo(f"{name} not installed")
    typer.echo(f"python {platform.python_version()} ({platform.machine()})")
