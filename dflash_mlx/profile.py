"""`dflash-mlx profile`: what one speculative cycle costs against its two model passes; for a model pair,
its cost model (measured again) and the adaptive policy's own overhead.

On a random float32 Llama-style target (no download needed), it times
  * a whole cycle inside `stream_generate` (draft, verify, accept, commit; no text),
  * the verify pass alone (target over block_size tokens) and the draft step alone,
so overhead = cycle / (verify + draft) - 1 is what the runtime adds around the two passes; with the
draft step compiled and not; and plain autoregressive tokens/s with and without the BLAS preload
(the second in a subprocess, since the preload must precede the first `import mlx.core`).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import replace

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models import llama

from .cache import SpeculativeCache
from .drafters import NgramIndex
from .errors import UserError
from .models.dflash import DFlashConfig, DFlashDraftModel
from .pairing import MAX_BLOCK_SIZE, prepare
from .platform import DISABLE_ENV, blas, machine_memory
from .policy import (
    DFLASH,
    PLAIN,
    AdaptivePolicy,
    CostModel,
    costs_path,
    fastest_seconds,
    keep_costs,
    kept_costs,
    measure_costs,
    measured_passes,
    ticker,
)
from .speculative import stream_generate


def random_pair(hidden=1024, layers=8, vocab=32000, draft_layers=1, block_size=16, seed=0):
    """A random Llama-architecture target and a DFlash drafter that fits it (float32)."""
    mx.random.seed(seed)
    heads = hidden // 64
    kv_heads = next(k for k in range(max(1, heads // 4), 0, -1) if heads % k == 0)  # must divide heads
    model = llama.Model(
        llama.ModelArgs(
            model_type="llama",
            hidden_size=hidden,
            num_hidden_layers=layers,
            intermediate_size=hidden * 3,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            rms_norm_eps=1e-5,
            vocab_size=vocab,
            tie_word_embeddings=True,
        )
    )
    draft = DFlashDraftModel(
        DFlashConfig(
            hidden_size=hidden,
            num_hidden_layers=draft_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            intermediate_size=hidden * 3,
            vocab_size=vocab,
            target_layer_ids=sorted({min(1, layers - 1), layers // 2, max(layers - 2, 0)}),
            mask_token_id=vocab - 1,
            block_size=block_size,
            num_target_layers=layers,
        )
    )
    mx.eval(model.parameters(), draft.parameters())
    return model, draft


def _median_ms(fn, repeats, tick=lambda: None):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        tick()  # (outside the time)
    return 1000 * statistics.median(times)


def ar_tokens_per_s(model, prompt, n=48) -> float:
    steps = generate_step(mx.array(prompt), model, max_tokens=n + 4)
    for _ in range(4):  # warm-up
        next(steps)
    t = time.perf_counter()
    for _ in steps:
        pass
    return n / (time.perf_counter() - t)


def check_sizes(hidden: int, layers: int, vocab: int, block_size: int, cycles: int) -> None:
    """`profile`'s sizes, checked before anything is made."""
    if not 64 <= hidden <= 16384 or hidden % 64:
        raise UserError(f"hidden must be a multiple of 64 (the head size) up to 16384, got {hidden}")
    # (the most a real model has, about: past these a random model would not fit in memory)
    for name, value, least, most in (
        ("layers", layers, 1, 256),
        ("vocab", vocab, 2, 1 << 20),
        ("block size", block_size, 2, MAX_BLOCK_SIZE),
        ("cycles", cycles, 1, 10_000),
    ):
        if not least <= value <= most:
            raise UserError(f"{name} must be from {least} to {most}, got {value}")
    need = 4 * (2 * vocab * hidden + 13 * layers * hidden * hidden)  # float32: embedding, head, layers
    memory = machine_memory()
    if need > memory / 2:
        raise UserError(
            f"a random target of this size takes about {need / 2**30:.1f} GiB, more than half this machine's "
            f"{memory / 2**30:.0f}: make it smaller"
        )


def profile(
    hidden=1024, layers=8, vocab=32000, block_size=16, cycles=24, prompt_len=128, progress=None
) -> dict:
    """Time one cycle against its two passes alone, on a random pair; `progress(done, total)` after each
    cycle or pass timed."""
    check_sizes(hidden, layers, vocab, block_size, cycles)
    tick = ticker(progress, 2 * (cycles + 4) + 3 * (cycles + 1))
    model, draft = random_pair(hidden, layers, vocab, block_size=block_size)
    target = prepare(model, draft)
    prompt = mx.random.randint(0, vocab - 1, (prompt_len,)).tolist()
    result = {
        "config": dict(
            hidden=hidden,
            layers=layers,
            vocab=vocab,
            block_size=block_size,
            prompt_len=prompt_len,
            cycles=cycles,
        ),
        "blas": blas["status"],
    }

    for compiled in (True, False):
        stamps = []
        gen = stream_generate(
            target, draft, None, prompt, max_tokens=10**6, block_size=block_size, compile=compiled
        )
        for _ in range(cycles + 4):
            next(gen)
            stamps.append(time.perf_counter())
            tick()
        gen.close()
        result[f"cycle_ms_{'compiled' if compiled else 'eager'}"] = 1000 * statistics.median(
            b - a for a, b in zip(stamps[3:], stamps[4:])
        )

    # The parts alone, at the same context length.
    cache = SpeculativeCache(target, draft)
    cache.prefill(prompt)
    block = mx.random.randint(0, vocab - 1, (1, block_size))  # as wide as the cycle's verify pass

    def verify():
        logits, features = cache.verify(block)
        mx.eval(logits, features)
        cache.keep(None, 1)

    def draft_step(compiled):
        mx.eval(draft.propose_logits(prompt[0], cache.draft_cache, block_size, compiled))

    for first in (verify, lambda: draft_step(True), lambda: draft_step(False)):  # (traced and warmed)
        first()
        tick()
    result["verify_ms"] = _median_ms(verify, cycles, tick)
    result["draft_ms_compiled"] = _median_ms(lambda: draft_step(True), cycles, tick)
    result["draft_ms_eager"] = _median_ms(lambda: draft_step(False), cycles, tick)
    result["overhead_compiled"] = (
        result["cycle_ms_compiled"] / (result["verify_ms"] + result["draft_ms_compiled"]) - 1
    )
    result["overhead_eager"] = result["cycle_ms_eager"] / (result["verify_ms"] + result["draft_ms_eager"]) - 1
    result["draft_traces"] = draft.traces
    result["ar_tokens_per_s"] = ar_tokens_per_s(model, prompt)
    if blas["library"]:
        env = dict(os.environ, **{DISABLE_ENV: "1"})
        code = (
            "import json, dflash_mlx.profile as p, mlx.core as mx;"
            f"m, _ = p.random_pair({hidden}, {layers}, {vocab});"
            f"print(json.dumps(p.ar_tokens_per_s(m, {prompt}, n=8)))"
        )
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        if out.returncode:
            last = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
            raise OSError(f"the run without the BLAS preload failed: {last}")
        result["ar_tokens_per_s_without_blas_preload"] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def policy_overhead_s(costs: CostModel, max_dflash: int, context: int = 1000, cycles: int = 2000) -> float:
    """Seconds the adaptive policy itself spends per cycle (lookup match, choice, width, learning), on a
    text with frequent matches and a drafter whose odds make it draft."""
    rng = random.Random(0)
    index = NgramIndex()
    index.extend(rng.randrange(50) for _ in range(context))
    policy = AdaptivePolicy(costs, max_dflash, lookup=True)
    confidence = mx.array([0.9] * max_dflash)
    mx.eval(confidence)
    tic = time.perf_counter()
    for _ in range(cycles):
        found = index.match()
        choice = policy.choose(context, found)
        k, conf = choice.k, []
        if choice.source == DFLASH:
            k, conf = policy.narrow(choice, confidence[:k], context)
        elif choice.source == PLAIN:
            policy.plain_next(context + 1, index)
        policy.observe(choice, k, rng.randrange(k + 1), conf, found[1])
        index.extend([rng.randrange(50)])
    return (time.perf_counter() - tic) / cycles


def profile_pair(model, draft, progress=None) -> dict:
    """Measure this pair's cost model again (and keep it for the adaptive policy; `progress(done, total)`
    of the passes timed), and the policy's own overhead against the cheapest cycle, a plain step."""
    target = prepare(model, draft)
    costs = measure_costs(target, draft, tick=ticker(progress, measured_passes(target, draft)))
    path = costs_path(target, draft)
    old = kept_costs(path)
    if old is not None and (old.contexts, old.widths) == (costs.contexts, costs.widths):
        costs = replace(costs, batches=old.batches)  # (batched passes are not measured here: kept)
    kept = keep_costs(path, costs)
    context = costs.contexts[0]
    overhead = policy_overhead_s(costs, draft.block_size - 1 if draft is not None else 0, context)
    step = costs.target_time(1, context)
    return {
        "costs": costs.to_dict(),
        "costs_file": str(path) if kept else None,  # (None: the home folder cannot be written)
        "policy_s": overhead,
        "plain_step_s": step,
        "policy_share_of_a_step": overhead / step,
    }


def draft_window_profile(
    model, draft, window: int, contexts=(500, 2000, 8000), repeats: int = 5
) -> list[dict]:
    """Seconds of a full draft pass (block_size - 1 proposals) after random contexts of these lengths,
    over the whole context and over a draft window of `window` positions."""
    target = prepare(model, draft)
    k = draft.block_size - 1
    rows = []
    for context in contexts:
        cache = SpeculativeCache(target, draft)
        windowed = draft.make_cache(window)
        tokens = mx.random.randint(0, target.vocab_size, (1, context), key=mx.random.key(context))
        for start in range(0, context, 1024):
            _, features = target(tokens[:, start : start + 1024], cache.target_cache, last_logits_only=True)
            draft.absorb(features, cache.draft_cache)
            draft.absorb(features, windowed)
            mx.eval([c.state for c in cache.target_cache + cache.draft_cache + windowed])
        times = [
            fastest_seconds(
                lambda c=c: mx.eval(draft.propose_logits(1, c, draft.block_size, heads=k)), repeats
            )
            for c in (cache.draft_cache, windowed)
        ]
        rows.append({"context": context, "whole_s": times[0], "window_s": times[1]})
    return rows
