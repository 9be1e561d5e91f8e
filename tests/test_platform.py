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


def test_importing_mlx_first_warns():
    r = python("import mlx.core, dflash_mlx")
    assert r.returncode == 0
    assert "mlx.core was imported before dflash_mlx" in r.stderr and "import dflash_mlx first" in r.stderr
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
