"""Greedy speculative decoding must reproduce mlx-lm's own greedy decoding token for token."""

import os
import subprocess
import sys

import pytest
from tiny import (
    CONFIGS,
    FAMILIES,
    OracleDraft,
    draft_config,
    greedy_reference,
    make_draft,
    make_target,
    make_tokenizer,
    no_eos_tokenizer,
    prompt_of,
)

from dflash_mlx import SpeculativeCache, generate, stream_generate
from dflash_mlx.models.dflash import DraftCache


@pytest.fixture(scope="module")
def targets():
    return {f: make_target(f) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [1, 2, 7, 16])
@pytest.mark.parametrize("prompt_len", [1, 5, 37])
def test_random_drafter_matches_plain_greedy(targets, family, block_size, prompt_len):
    model = targets[family]
    prompt = prompt_of(prompt_len, seed=prompt_len)
    ref = greedy_reference(model, prompt, 24)
    out = generate(model, make_draft(), no_eos_tokenizer(ref), prompt, max_tokens=24, block_size=block_size)
    assert out.tokens == ref
    assert out.finish_reason == "length"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [2, 7, 16])
def test_every_acceptance_length_stays_lossless(targets, family, block_size):
    model = targets[family]
    prompt = prompt_of(11, seed=3)
    n = block_size * (block_size + 1) // 2 + 10
    ref = greedy_reference(model, prompt, n + block_size)
    # Cycle i injects an error at block position errors[i]: acceptance lengths 1..B all occur.
    draft = OracleDraft(draft_config(block_size=block_size), prompt + ref, [None, *range(block_size - 1)])
    out = generate(model, draft, no_eos_tokenizer(ref), prompt, max_tokens=n, block_size=block_size)
    assert out.tokens == ref[:n]
    assert set(out.acceptance_lengths) == set(range(1, block_size + 1))


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_draft_window_stays_lossless(targets, family, monkeypatch):
    monkeypatch.setattr(DraftCache, "STEP", 4)  # the window drops positions every few cycles
    model = targets[family]
    prompt = prompt_of(29, seed=4)
    ref = greedy_reference(model, prompt, 60)
    draft = OracleDraft(draft_config(block_size=7), prompt + ref, [None, 0, 3, 5, 1])
    cache = SpeculativeCache(model, draft, draft_window=6)
    out = generate(model, draft, no_eos_tokenizer(ref), prompt, max_tokens=60, prompt_cache=cache)
    assert out.tokens == ref and cache.draft_cache[0].rows <= 10
    out = generate(model, make_draft(), no_eos_tokenizer(ref), prompt, max_tokens=60, draft_window=6)
    assert out.tokens == ref


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize("family", ["llama3.1", "gpt_oss", "gemma4"])
def test_an_answer_asked_for_in_another_thread_than_the_pairs_load(family, tmp_path):
    """mlx-lm's scaled RoPEs (Llama 3.1's, YaRN's, Gemma 4's) keep a lazy `_freqs` of the loading
    thread's stream: the first pass in another thread (a server's worker) failed, "There is no
    Stream(cpu, 0) in current thread"."""
    import threading

    import mlx.core as mx
    from mlx_lm.utils import save_config, save_model
    from test_drafter import write_zlab_checkpoint

    from dflash_mlx import load, load_draft

    config = dict(CONFIGS["llama"], rope_scaling=LLAMA3_ROPE) if family == "llama3.1" else CONFIGS[family]
    built = make_target("llama", rope_scaling=LLAMA3_ROPE) if family == "llama3.1" else make_target(family)
    save_model(tmp_path / "target", built)
    save_config(dict(config), tmp_path / "target" / "config.json")
    make_tokenizer()._tokenizer.save_pretrained(tmp_path / "target")
    write_zlab_checkpoint(tmp_path / "draft", make_draft())
    prompt, got = prompt_of(9), []
    ref = greedy_reference(built, prompt, 8)
    model, _ = load(str(tmp_path / "target"))
    draft = load_draft(str(tmp_path / "draft"))

    def answer():
        try:
            got.append(generate(model, draft, no_eos_tokenizer(ref), prompt, max_tokens=8).tokens)
        except RuntimeError as e:
            got.append(e)
        mx.clear_streams()

    thread = threading.Thread(target=answer)
    thread.start()
    thread.join()
    assert got == [ref]


THREAD_THEN_EXIT = """
import sys, threading
from pathlib import Path
import dflash_mlx
from mlx_lm.utils import save_config, save_model
from test_drafter import write_zlab_checkpoint
from tiny import CONFIGS, make_draft, make_target, make_tokenizer
root = Path(sys.argv[1])
save_model(root / "target", make_target("qwen3"))
save_config(dict(CONFIGS["qwen3"]), root / "target" / "config.json")
make_tokenizer()._tokenizer.save_pretrained(root / "target")
write_zlab_checkpoint(root / "draft", make_draft())
model, draft, tok = dflash_mlx.load_pair(str(root / "target"), str(root / "draft"))
answer = lambda: print(dflash_mlx.generate(model, draft, tok, [10, 11, 12], max_tokens=4).tokens)
thread = threading.Thread(target=answer)
thread.start()
thread.join()
"""


def test_a_process_that_answered_in_a_thread_exits_cleanly(tmp_path):
    """A thread's MLX streams, left for the process's exit, aborted it (exit status 134, "terminate
    called without an active exception"), often, where the thread had not called mx.clear_streams()."""
    from pathlib import Path

    for run in range(3):  # (it did not abort every time)
        (tmp_path / str(run)).mkdir()
        r = subprocess.run(
            [sys.executable, "-c", THREAD_THEN_EXIT, str(tmp_path / str(run))],
            cwd=Path(__file__).parent,
            env={**os.environ, "DFLASH_MLX_HOME": str(tmp_path / "home")},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0 and r.stdout.count(",") == 3, r.stderr[-2000:]


def test_the_answer_stops_where_the_context_ends():
    from dflash_mlx.cache import SpeculativeCache

    model = make_target("llama", max_position_embeddings=64)
    prompt = prompt_of(40)
    ref = greedy_reference(model, prompt, 24)
    cache = SpeculativeCache(model, make_draft())
    out = generate(model, cache.draft, no_eos_tokenizer(ref), prompt, max_tokens=100, prompt_cache=cache)
    assert out.tokens == ref and out.finish_reason == "length"  # 40 + 24 = the 64 the context holds
    with pytest.raises(
        ValueError, match="is 64 tokens and fills the model's context of 64: start a new cache"
    ):
        generate(model, cache.draft, None, [], max_tokens=5, prompt_cache=cache)
    with pytest.raises(ValueError, match="the prompt is 64 tokens and the model's context holds 64"):
        generate(model, make_draft(), None, prompt_of(64), max_tokens=5)


def test_max_tokens_cuts_inside_a_block(targets):
    model, prompt = targets["llama"], prompt_of(9)
    ref = greedy_reference(model, prompt, 40)
    draft = OracleDraft(draft_config(block_size=16), prompt + ref, [None])
    pieces = list(stream_generate(model, draft, no_eos_tokenizer(ref), prompt, max_tokens=21, block_size=16))
    assert [len(p.tokens) for p in pieces] == [1, 16, 4]
    assert sum((p.tokens for p in pieces), []) == ref[:21]
    assert pieces[-1].finish_reason == "length" and pieces[-1].generation_tokens == 21


def test_eos_inside_an_accepted_block_ends_there(targets):
    model, prompt = targets["qwen3"], prompt_of(9, seed=5)
    ref = greedy_reference(model, prompt, 60)
    # Pick as EOS a token whose first occurrence falls inside the second or third block.
    eos_at = next(i for i in range(5, 40) if ref[i] not in ref[:i])
    draft = OracleDraft(draft_config(block_size=16), prompt + ref, [None])
    out = generate(model, draft, make_tokenizer(eos=ref[eos_at]), prompt, max_tokens=60, block_size=16)
    assert out.tokens == ref[: eos_at + 1]
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("limit_offset", [-3, -1, 0])
def test_max_tokens_wins_over_an_eos_later_in_the_same_block(targets, limit_offset):
    # The block holding EOS is accepted whole; with max_tokens before (or at) the EOS, the answer is
    # mlx-lm's: max_tokens tokens and "length", or the EOS and "stop" when it is the last one allowed.
    model, prompt = targets["qwen3"], prompt_of(9, seed=5)
    ref = greedy_reference(model, prompt, 60)
    eos_at = next(i for i in range(5, 40) if ref[i] not in ref[:i])
    max_tokens = eos_at + 1 + limit_offset
    draft = OracleDraft(draft_config(block_size=16), prompt + ref, [None])
    out = generate(
        model, draft, make_tokenizer(eos=ref[eos_at]), prompt, max_tokens=max_tokens, block_size=16
    )
    assert out.tokens == ref[:max_tokens]
    assert out.finish_reason == ("stop" if limit_offset == 0 else "length")


def test_stop_string_ends_generation_and_is_not_shown(targets):
    model, prompt = targets["llama"], prompt_of(9)
    ref = greedy_reference(model, prompt, 30)
    tok = no_eos_tokenizer(ref)
    full = generate(model, make_draft(), tok, prompt, max_tokens=30).text
    stop = full.split()[6]  # the text of the 7th token
    out = generate(model, make_draft(), tok, prompt, max_tokens=30, stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]


def test_stop_strings_across_tokens_are_held_back_then_flushed(targets):
    model, prompt = targets["llama"], prompt_of(9)
    ref = greedy_reference(model, prompt, 30)
    tok = no_eos_tokenizer(ref)
    oracle = lambda: OracleDraft(draft_config(block_size=6), prompt + ref, [None, 2])  # noqa: E731
    full = generate(model, oracle(), tok, prompt, max_tokens=30).text
    stop = " ".join(full.split()[6:8])  # the text of two tokens
    pieces = list(stream_generate(model, oracle(), tok, prompt, max_tokens=30, stop=[stop]))
    shown = [p.text for p in pieces]
    assert pieces[-1].finish_reason == "stop" and "".join(shown) == full[: full.index(stop)]
    # A stop string that never occurs: everything held back is shown at the end.
    out = generate(model, oracle(), tok, prompt, max_tokens=30, stop=[" w999"])
    assert out.text == full and out.finish_reason == "length"


def test_of_two_overlapping_stop_strings_the_one_completed_first_ends_the_answer(targets):
    # Token by token (plain decoding), a stop string that starts later but ends sooner is met first;
    # a cycle that brings both at once must end where plain decoding does.
    model, prompt = targets["llama"], prompt_of(9)
    ref = greedy_reference(model, prompt, 30)
    tok = no_eos_tokenizer(ref)
    full = generate(model, make_draft(), tok, prompt, max_tokens=30, block_size=1).text
    words = full.split()
    i = next(i for i in range(4, 20) if full.index(words[i][1:]) == full.index(words[i]) + 1)
    early = " ".join(words[i : i + 2])  # starts first, completed a token later
    late = words[i][1:]  # starts inside it, completed with its first token
    oracle = OracleDraft(draft_config(block_size=16), prompt + ref, [None])
    out = generate(model, oracle, tok, prompt, max_tokens=30, block_size=16, stop=[early, late])
    plain = generate(model, make_draft(), tok, prompt, max_tokens=30, block_size=1, stop=[early, late])
    assert max(out.acceptance_lengths) > 2
    assert out.text == plain.text == full[: full.index(late)]
    assert out.tokens == plain.tokens and out.finish_reason == plain.finish_reason == "stop"


def test_array_prompt_and_a_custom_greedy_sampler(targets):
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    model, prompt = targets["qwen3_moe"], prompt_of(6, seed=8)
    ref = greedy_reference(model, prompt, 20)
    draft = OracleDraft(draft_config(block_size=5), prompt + ref, [None, 0, 2])
    out = generate(
        model,
        draft,
        no_eos_tokenizer(ref),
        mx.array(prompt),
        max_tokens=20,
        block_size=5,
        sampler=make_sampler(0.0),
    )
    assert out.tokens == ref and max(out.acceptance_lengths) > 1


def test_bench_names_where_an_answer_left_plain_decoding_and_the_targets_margin_there():
    import mlx.core as mx

    from dflash_mlx.bench import first_difference

    model, prompt = make_target("llama"), prompt_of(12)
    plain = greedy_reference(model, prompt, 10)
    assert first_difference(model, prompt, plain, list(plain)) is None
    ours = plain[:6] + [(plain[6] + 1) % 50] + plain[7:]
    d = first_difference(model, prompt, plain, ours)
    row = model(mx.array([prompt + plain]))[0, len(prompt) + 5]  # (one pass over all, the row before 6)
    top = sorted(row.tolist())[-2:]
    assert d["at"] == 6 and abs(d["gap"] - (top[1] - top[0])) < 1e-4
    assert first_difference(model, prompt, plain, plain[:4])["at"] == 4  # one stopped early


# In a process of its own: on an H200 (MLX 0.32.4, CUDA graphs on) this crashed its process, which
# would take the rest of a test run with it.
QUANTIZED_ROWS = """
import sys
import dflash_mlx
import mlx.core as mx
from dflash_mlx.policy import WIDTHS
bits, dtype, k, n = int(sys.argv[1]), getattr(mx, sys.argv[2]), 576, 1536
w = mx.random.normal((n, k), key=mx.random.key(1)).astype(dtype)
q = mx.quantize(w, group_size=32, bits=bits)
x = mx.random.normal((max(WIDTHS), k), key=mx.random.key(2)).astype(dtype)
mul = lambda rows: mx.quantized_matmul(rows, *q, transpose=True, group_size=32, bits=bits)
alone = mx.concatenate([mul(x[i : i + 1]) for i in range(x.shape[0])]).astype(mx.float32)
scale = mx.abs(alone).max().item()
for m in WIDTHS[1:]:
    rows = mul(x[:m])
    assert mx.array_equal(rows, mul(x[:m])), f"{m} rows: two runs differ"
    error = mx.abs(rows.astype(mx.float32) - alone[:m]).max().item()
    assert error <= 2e-2 * scale, f"{m} rows: off by {error:.3g} (results up to {scale:.3g})"
"""


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_quantized_matmul_gives_each_row_what_it_gives_the_row_alone(bits, dtype):
    """A verify pass multiplies w rows by each quantized weight where a step multiplies one: at every
    width the policy verifies, each row's result is the row's alone up to rounding, and the same again
    when run again. (Backends pick kernels by row count; a kernel that got a row count wrong, or
    raced, would break exactness at those widths only.) A shape of the demo target's."""
    r = subprocess.run(
        [sys.executable, "-c", QUANTIZED_ROWS, str(bits), dtype], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, f"exit status {r.returncode}: {r.stderr[-2000:]}"
