"""The `dflash-mlx` command: the app and its commands, one module each."""

from __future__ import annotations

from importlib.metadata import version as installed

import typer

from . import bench, chat, convert, doctor, generate, models, profile, serve, train

app = typer.Typer(
    help="DFlash speculative decoding for MLX.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


@app.callback()
def main():
    """DFlash block-diffusion speculative decoding for MLX."""


def version():
    """Print the installed version."""
    typer.echo(f"dflash-mlx {installed('dflash-mlx')}")


for command in (
    convert.convert,
    generate.generate,
    chat.chat,
    models.models,
    doctor.doctor,
    bench.bench,
    version,
    profile.profile,
    serve.serve,
):
    app.command()(command)
app.add_typer(train.app, name="train")

if __name__ == "__main__":
    app()
