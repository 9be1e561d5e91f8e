"""The `dflash-mlx` command (main.py); `run` is its entry point."""

import sys


def run() -> None:
    try:
        from .main import app
    except KeyboardInterrupt:  # Ctrl-C while MLX and mlx-lm load: nothing had started
        sys.exit(130)
    app()
