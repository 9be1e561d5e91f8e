"""Imported by pytest before any test module: load dflash_mlx first so its BLAS preload happens before
anything imports mlx.core (a module that imports mlx_lm first would otherwise get the slow BLAS)."""

import dflash_mlx  # noqa: F401
