"""`dflash-mlx doctor`."""

from __future__ import annotations

import json

import typer

from dflash_mlx.platform import report

from .options import Json, reader_gone


def doctor(as_json: Json = False):
    """What this machine runs MLX with, and what would make it faster."""
    with reader_gone():
        r = report()
        if as_json:
            typer.echo(json.dumps(r, indent=2))
            return
        width = max(map(len, r["facts"]))
        for key, value in r["facts"].items():
            typer.echo(f"{key:>{width}}: {value}")
        for line in r["advice"]:
            typer.secho(f"advice: {line}", fg="yellow")
        if not r["advice"]:
            typer.secho("all good", fg="green")
