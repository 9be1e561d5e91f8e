"""What holds on a GPU (MLX's CUDA or Metal backend): run where one is, skipped elsewhere
(docs/testing.md): no CPU BLAS preloaded, kernels kept across processes, a warm-up that leaves nothing to
compile mid-answer, and greedy answers that leave plain decoding only at near-ties."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import dflash_mlx.engine as engine
from dflash_mlx import apply_chat_template, generate, load_draft
from dflash_mlx.loading import draft_for
from dflash_mlx.platform import PTX_ENV, backend, blas

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(backend() == "cpu", reason="needs MLX on a GPU (docs/testing.md)"),
]
cuda = pytest.mark.skipif(backend() != "cuda", reason="the kernel cache is CUDA's (NVRTC)")

TESTS = str(Path(__file__).parent)
# A fresh process: the tiny pair, the kernel cache's file count after each stage, as JSON.
FRESH = """
import json, os, sys
sys.path.insert(0, {tests!r})
import dflash_mlx
from tiny import make_draft, make_target, no_eos_tokenizer, prompt_of
from dflash_mlx.pairing import prepare
from dflash_mlx.policy import costs_for
folder = os.environ["MLX_PTX_CACHE_DIR"]
count = lambda: sum(len(files) for _, _, files in os.walk(folder))
model, draft, prompt = make_target("llama"), make_draft(block_size=16), prompt_of(12, seed=9)
out = {{"folder": folder}}
if "costs" in sys.argv:
    costs_for(prepare(model, draft), draft)
    out["costs"] = count()
if "warm" in sys.argv:
    dflash_mlx.warm_up(model, draft)
    out["warm"] = count()
fixed = {{"block_size": 16, "lookup": False}} if "fixed" in sys.argv else {{}}
dflash_mlx.generate(model, draft, no_eos_tokenizer(prompt), prompt, max_tokens=48, **fixed)
out["answer"] = count()
print(json.dumps(out))
"""


def fresh(home: Path, *stages: str) -> dict:
    shutil.rmtree(home / "policies", ignore_errors=True)  # (from the priors: the last process's work again)
    env = {k: v for k, v in os.environ.items() if k != PTX_ENV} | {"DFLASH_MLX_HOME": str(home)}
    r = subprocess.run(
        [sys.executable, "-c", FRESH.format(tests=TESTS), *stages], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_no_cpu_blas_is_preloaded_on_a_gpu():
    assert blas["library"] is None and "not needed" in blas["status"]


@cuda
def test_kernels_compiled_in_one_process_are_read_by_the_next(tmp_path):
    # A fixed block: the adaptive policy's choices follow its timings, so two of its answers can differ
    # in the widths they verify; this is about the cache, the warm-up test below about the policy.
    first = fresh(tmp_path, "costs", "fixed")
    assert Path(first["folder"]).is_relative_to(tmp_path) and first["answer"] > 0
    assert fresh(tmp_path, "fixed")["answer"] == first["answer"]  # the same work compiles nothing new


@cuda
def test_after_the_warm_up_an_answer_compiles_nothing(tmp_path):
    home = tmp_path / "measured"
    fresh(home, "costs")  # the pair's costs on disk, as after an earlier run
    shutil.rmtree(home / "kernels")  # ... but no kernels kept: a new machine's first run
    run = fresh(home, "warm")
    assert run["warm"] > 0 and run["answer"] == run["warm"]


# Parts of the cycle to leave out, to tell which one an answer that leaves plain decoding goes through.
VARIANTS = {
    "adaptive": {},
    "without trees": {"trees": False},
    "without lookup": {"lookup": False},
    "without plain steps started ahead": {"ahead": False},
    "every pass waited for": {"wait": True},
    "block 16": {"block_size": 16},
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("weights", ["as kept", "bfloat16"])
def test_greedy_answers_leave_plain_decoding_only_at_near_ties(smollm2, weights, variant, monkeypatch):
    """A verify pass and a one-token step round differently on a GPU: where an answer leaves plain
    decoding, the step's own top-2 logits there are within a near-tie. Prints the rate per 1,000 tokens.
    The target as the GGUF keeps it (4-bit, MLX's quantized matmuls) and dequantized to bfloat16; each
    part of the cycle left out in turn. (Run with MLX_USE_CUDA_GRAPHS=1 to compare with CUDA graphs on:
    docs/performance.md#greedy-output-on-cuda-and-cuda-graphs.)"""
    from dflash_mlx.loading import load

    model, tokenizer, _ = smollm2
    if weights == "bfloat16":
        model, _ = load("smollm2-135m-instruct", dtype="bfloat16")
    draft = load_draft(draft_for("smollm2-135m-instruct", None))
    options = dict(VARIANTS[variant])
    if not options.pop("trees", True):
        monkeypatch.setattr(engine, "from_logits", lambda draft: False)
    if not options.pop("ahead", True):
        monkeypatch.setattr(engine.Engine, "_plain_next", lambda self, rows: False)
    if options.pop("wait", False):  # nothing computes while the host goes on
        monkeypatch.setattr(mx, "async_eval", mx.eval)
    questions = [
        "Write a Python function that checks whether a string is a palindrome.",
        "Explain in two sentences why the sky is blue.",
        "List five prime numbers and say what makes them prime.",
        "Rewrite this sentence in the passive voice: The cat chased the mouse.",
        "Give three tips for a first job interview.",
        "What is the difference between a list and a tuple in Python?",
        "Describe a rainy afternoon in a small town in four sentences.",
        "How does a refrigerator keep food cold?",
    ]
    tokens, gaps = 0, []
    for question in questions:
        ids = apply_chat_template(tokenizer, question)
        plain = [(int(t), lp) for t, lp in generate_step(mx.array(ids), model, max_tokens=96)]
        ours = generate(model, draft, tokenizer, ids, max_tokens=96, **options).tokens
        tokens += len(ours)
        for j, (t, logprobs) in enumerate(plain[: len(ours)]):
            if ours[j] != t:
                top = mx.sort(logprobs)[-2:]
                gaps.append((top[1] - top[0]).item())
                break
    rate = 1000 * len(gaps) / tokens
    print(
        f"\n{weights}, {variant}: {len(gaps)} of {len(questions)} differ ({rate:.1f} per 1,000 tokens), "
        f"top-2 gaps {gaps}"
    )
    assert all(g < 0.05 for g in gaps)
