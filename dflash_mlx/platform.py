"""Backend facts, and the Linux CPU fast path.

MLX's Linux CPU wheel links a reference BLAS: float32 matmuls run at ~5 GFLOP/s. If a system
OpenBLAS (or MKL) is loaded with RTLD_GLOBAL *before* `mlx.core` is first imported, MLX resolves
its BLAS symbols there instead (~150-200 GFLOP/s on this project's 2-core CI machine), and a
16-row matmul then costs about what a 1-row one does, which is what speculative decoding needs.
`dflash_mlx/__init__.py` imports this module first for that reason. Nothing here imports mlx.

Set DFLASH_MLX_NO_BLAS=1 to skip the preload, or DFLASH_MLX_BLAS=/path/to/libopenblas.so to choose
the library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys

DISABLE_ENV = "DFLASH_MLX_NO_BLAS"
LIBRARY_ENV = "DFLASH_MLX_BLAS"

_CANDIDATES = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/openblas-openmp/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas*.so.0",
    "/usr/lib/*-linux-gnu/libmkl_rt.so*",
    "/opt/intel/oneapi/mkl/latest/lib/libmkl_rt.so*",
)

# What the preload did: {"library": path or None, "status": one line for humans and `doctor`}.
blas: dict = {"library": None, "status": "not attempted"}


def _find_blas() -> str | None:
    for pattern in _CANDIDATES:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    name = ctypes.util.find_library("openblas")
    return name


def preload_blas() -> dict:
    """Load a fast system BLAS into the process before MLX does, where that helps and is possible."""
    if blas["status"] != "not attempted":
        return blas
    if not sys.platform.startswith("linux"):
        blas["status"] = "not needed (MLX uses Accelerate/Metal on macOS)"
    elif os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        blas["status"] = f"disabled by {DISABLE_ENV}"
    elif "mlx.core" in sys.modules:
        blas["status"] = "too late: mlx.core was imported before dflash_mlx (import dflash_mlx first)"
    else:
        path = os.environ.get(LIBRARY_ENV) or _find_blas()
        if path is None:
            blas["status"] = (
                "no system BLAS found; MLX's CPU matmuls run ~30x slower "
                "(Debian/Ubuntu: apt install libopenblas0-pthread)"
            )
        else:
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                blas.update(library=path, status=f"loaded {path}")
            except OSError as e:
                blas["status"] = f"failed to load {path}: {e}"
    return blas


def backend() -> str:
    """'metal', 'cuda' or 'cpu': where MLX runs its default device."""
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return "cpu"
