"""The `dflash-mlx` command."""

from __future__ import annotations

import typer

app = typer.Typer(help="DFlash speculative decoding for MLX.", no_args_is_help=True, add_completion=False)


@app.command()
def version():
    """Print the installed version."""
    from importlib.metadata import version as v

    typer.echo(f"dflash-mlx {v('dflash-mlx')}")


if __name__ == "__main__":
    app()
