"""The `dflash-mlx` command (main.py); `run` is its entry point."""

import os
import signal
import sys

from dflash_mlx.files import is_write_error  # (the standard library alone: no MLX yet)


def _open_standard_streams() -> None:
    """A standard stream the caller closed (`>&-`) reads and writes /dev/null instead: else Python has
    none (printing to it fails), and the next file opened would take its number, to be written into."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # (it takes the lowest free number: this one)
            setattr(sys, name, open(fd, mode, closefd=False))


def run() -> None:
    _open_standard_streams()
    # Ctrl-C while MLX and mlx-lm load (a second or two): nothing had started, so no traceback. The
    # KeyboardInterrupt can surface as another error where it lands in an extension's initialisation,
    # hence the flag.
    interrupted, previous = [], signal.getsignal(signal.SIGINT)

    def on_sigint(signum, frame):
        interrupted.append(signum)
        raise KeyboardInterrupt

    if previous is signal.default_int_handler:  # (not where Ctrl-C is ignored: a background job)
        signal.signal(signal.SIGINT, on_sigint)
    try:
        from .main import app
    except BaseException:
        if interrupted:
            sys.exit(130)
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        app()
    except SystemExit as e:
        hub = sys.modules.get("dflash_mlx.hub")
        if hub is not None and hub.abandoned:  # (a stopped download: Python would wait for its threads)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(e.code if isinstance(e.code, int) else 1)
        raise
    except OSError as e:  # the output could not be written (a full disk; > /dev/full): not a bug
        if not is_write_error(e):
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (nothing left to flush at exit)
        print(f"error: cannot write the output: {e.strerror}", file=sys.stderr)
        sys.exit(1)
