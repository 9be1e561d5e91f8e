"""`python -m dflash_mlx`: the `dflash-mlx` command, for an environment whose scripts are not on PATH."""

from dflash_mlx.cli import run

run()
