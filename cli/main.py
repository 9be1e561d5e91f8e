"""The `dflash-mlx` command: the app and its commands, one module each."""

from __future__ import annotations

import inspect
import io
import signal
import sys
from importlib.metadata import version as installed

import typer

from dflash_mlx.platform import stop_signals

from . import bench, chat, convert, doctor, generate, models, profile, serve, train

app = typer.Typer(
    help="DFlash speculative decoding for MLX.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    # Plain help (click's): rich's tables cut flag names short at 80 columns ("--repetition-pena…")
    rich_markup_mode=None,
    # (every command's, as they inherit them; help as wide as the terminal, up to 120 columns)
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120},
)


def _version(asked: bool) -> None:
    if asked:
        version()
        raise typer.Exit()


@app.callback()
def main(
    _: bool = typer.Option(
        False, "--version", "-V", callback=_version, is_eager=True, help="Print the installed version."
    ),
):
    """DFlash block-diffusion speculative decoding for MLX."""
    for sig in stop_signals():  # (not where a handler is set already)
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _terminated)
    # Bytes on stdin that are not UTF-8 arrive as lone surrogates, which the commands name in one line
    # (check_utf8), in every locale: most UTF-8 locales would raise on them instead, the C one does not.
    if isinstance(sys.stdin, io.TextIOWrapper) and _utf8(sys.stdin):
        sys.stdin.reconfigure(errors="surrogateescape")
    # A terminal in another character set (ISO-8859-1, PYTHONIOENCODING=ascii) shows what it cannot
    # show as "?": the answer goes on, where Python would raise in the middle of it.
    if isinstance(sys.stdout, io.TextIOWrapper) and not _utf8(sys.stdout):
        sys.stdout.reconfigure(errors="replace")


def _utf8(stream: io.TextIOWrapper) -> bool:
    return stream.encoding.lower().replace("-", "").replace("_", "") == "utf8"


def _terminated(signum, frame):
    """SIGTERM (`kill`, `timeout`) and SIGHUP (a closing terminal) unwind as Ctrl-C does, so that what
    was being written is removed rather than left as a hidden partial folder the size of a model."""
    raise SystemExit(128 + signum)


def version():
    """Print the installed version."""
    typer.echo(f"dflash-mlx {installed('dflash-mlx')}")


def _unwrapped(command):
    """The command with its docstring's lines joined within paragraphs: typer's rich help keeps a
    docstring's line breaks, which then break sentences wherever the source wrapped them."""
    paragraphs = inspect.cleandoc(command.__doc__ or "").split("\n\n")
    command.__doc__ = "\n\n".join(p.replace("\n", " ") for p in paragraphs)
    return command


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
    app.command()(_unwrapped(command))
for info in train.app.registered_commands:
    _unwrapped(info.callback)
app.add_typer(train.app, name="train")

if __name__ == "__main__":
    app()
