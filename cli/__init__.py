"""The `dflash-mlx` command (main.py); `run` is its entry point."""

import signal
import sys


def run() -> None:
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
    app()
