"""The CPU kernels (cpu_kernels.py): the same numbers as MLX's own softmax, SwiGLU and attention up to
float32 rounding, mlx-lm's own where they don't apply, and SmolLM2's answers unchanged by them."""

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama

from dflash_mlx import cpu_kernels
from dflash_mlx.cpu_kernels import attention, softmax, swiglu


def close(ours, theirs, atol):
    np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=1e-5, atol=atol)


def test_softmax_matches_mlx_across_ranges_and_masked_scores():
    mx.random.seed(0)
    for shape, spread in (((2, 3, 5, 17), 1.0), ((1, 9, 1, 2048), 30.0), ((4, 300), 200.0)):
        scores = mx.random.normal(shape) * spread
        close(softmax(scores), mx.softmax(scores, axis=-1, precise=True), atol=1e-7)
    floor = mx.finfo(mx.float32).min
    masked = mx.array([[-mx.inf, 0.0, floor, 5.0, -87.0], [floor, floor, floor, floor, floor]])
    close(softmax(masked), mx.softmax(masked, axis=-1, precise=True), atol=1e-7)


def test_swiglu_matches_mlx_lm_and_hands_other_dtypes_back():
    mx.random.seed(1)
    gate, x = mx.random.normal((3, 7, 512)) * 20, mx.random.normal((3, 7, 512))
    assert cpu_kernels._SWIGLU[0] <= gate.size <= cpu_kernels._SWIGLU[1]
    close(swiglu(gate, x), cpu_kernels._STOCK_SWIGLU(gate, x), atol=1e-5)
    half = gate.astype(mx.float16), x.astype(mx.float16)
    assert mx.array_equal(swiglu(*half), cpu_kernels._STOCK_SWIGLU(*half))


MASKS = {
    "none": lambda L, S: None,
    "causal": lambda L, S: "causal",
    "boolean (queries, keys)": lambda L, S: mx.random.uniform(shape=(L, S)) > 0.3,
    "boolean per sequence": lambda L, S: mx.random.uniform(shape=(2, 1, L, S)) > 0.3,
    "boolean per head": lambda L, S: mx.random.uniform(shape=(2, 6, L, S)) > 0.3,
    "additive per head": lambda L, S: mx.random.normal((2, 6, L, S)),
}


@pytest.mark.parametrize("kv_heads", [6, 2])
@pytest.mark.parametrize("queries", [1, 5])
@pytest.mark.parametrize("mask", list(MASKS))
def test_attention_matches_mlx(mask, queries, kv_heads):
    mx.random.seed(2)
    S = 800  # (2 sequences x 6 heads x queries x S scores: sizes these kernels take)
    q = mx.random.normal((2, 6, queries, 32))
    k, v = mx.random.normal((2, kv_heads, S, 32)), mx.random.normal((2, kv_heads, S, 24))  # (MLA: narrower)
    m = MASKS[mask](queries, S)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=32**-0.5, mask=m)
    close(attention(q, k, v, None, 32**-0.5, m), theirs, atol=1e-6)


def test_attention_hands_what_it_does_not_cover_back_to_mlx_lm():
    mx.random.seed(3)
    q, k, v = (
        mx.random.normal((1, 4, 3, 16)),
        mx.random.normal((1, 2, 900, 16)),
        mx.random.normal((1, 2, 900, 16)),
    )
    sinks = mx.random.normal((4,))
    long = (
        mx.random.normal((1, 4, 512, 16)),
        mx.random.normal((1, 2, 512, 16)),
        mx.random.normal((1, 2, 512, 16)),
    )
    cases = [  # attention sinks (gpt_oss), float16, a mask of three dimensions, a long prompt's prefill
        ((q, k, v), dict(sinks=sinks, mask="causal")),
        ((q.astype(mx.float16), k.astype(mx.float16), v.astype(mx.float16)), dict(mask=None)),
        ((q, k, v), dict(mask=mx.random.uniform(shape=(1, 3, 900)) > 0.5)),
        (long, dict(mask="causal")),
    ]
    for arrays, kwargs in cases:
        ours = attention(*arrays, None, 0.25, kwargs["mask"], kwargs.get("sinks"))
        assert mx.array_equal(
            ours, cpu_kernels._STOCK_ATTENTION(*arrays, None, 0.25, kwargs["mask"], kwargs.get("sinks"))
        )


INSTALLED = """
import dflash_mlx
from mlx_lm.models import base, llama
from dflash_mlx import cpu_kernels
from dflash_mlx.models.targets import Target
from tiny import make_target
Target(make_target("llama"))
from mlx_lm.models import qwen3  # (imported after: takes what base holds)
ours = cpu_kernels.attention
print(llama.scaled_dot_product_attention is ours, llama.swiglu is cpu_kernels.swiglu,
      qwen3.scaled_dot_product_attention is ours, base.scaled_dot_product_attention is ours)
"""


@pytest.mark.parametrize("stock", [False, True])
def test_a_target_puts_the_kernels_in_place_unless_turned_off(stock):
    env = {k: v for k, v in os.environ.items() if k != cpu_kernels.STOCK_ENV}
    if stock:
        env[cpu_kernels.STOCK_ENV] = "1"
    env["PYTHONPATH"] = os.path.dirname(__file__) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", INSTALLED], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(not stock)] * 4


def test_smollm2_answers_and_logits_unchanged(smollm2, monkeypatch):
    """Greedy answers, and the logits over a long prompt, with MLX's kernels and with these."""
    from tiny import greedy_reference

    model, tokenizer, _ = smollm2
    text = "Summarise: " + " ".join(f"item {i} costs {i * 7 % 13} coins." for i in range(120))
    prompts = [tokenizer.encode(p) for p in ("def quicksort(xs):", "The three primary colours are")]
    long = mx.array([tokenizer.encode(text)])

    def run():
        return [greedy_reference(model, p, 40) for p in prompts], model(long)[0]

    answers, logits = run()
    monkeypatch.setattr(llama, "scaled_dot_product_attention", cpu_kernels._STOCK_ATTENTION)
    monkeypatch.setattr(llama, "swiglu", cpu_kernels._STOCK_SWIGLU)
    stock_answers, stock_logits = run()
    assert long.shape[1] > 900
    assert answers == stock_answers
    assert mx.array_equal(logits.argmax(-1), stock_logits.argmax(-1))
    assert mx.max(mx.abs(logits - stock_logits)).item() < 1e-3
