"""After every cycle both caches must equal what a plain prefill of the committed tokens builds."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache
from tiny import (
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
from dflash_mlx.errors import UserError
from dflash_mlx.models.targets import Target
from dflash_mlx.pairing import prepare
from dflash_mlx.policy import costs_for


def arrays_of(cache_entry):
    """The meaningful contents of one layer's cache, as NumPy arrays."""
    if isinstance(cache_entry, ArraysCache):
        return [np.array(a) for a in cache_entry.cache]
    k, v = cache_entry.keys[..., : cache_entry.offset, :], cache_entry.values[..., : cache_entry.offset, :]
    return [np.array(k), np.array(v)]


def settled(cache: SpeculativeCache) -> list[list[np.ndarray]]:
    """Each layer's contents (target, then drafter) as they stand without the verify pass under way:
    decoding starts the next cycle before it hands out a cycle's tokens."""
    out, undo = [], cache.undo
    for i, layer in enumerate(cache.target_cache):
        if isinstance(layer, ArraysCache):
            out.append([np.array(a) for a in (undo.states[i] if undo else layer.cache)])
        else:
            assert layer.offset - (undo.width if undo else 0) == cache.processed
            out.append([np.array(a[..., : cache.processed, :]) for a in (layer.keys, layer.values)])
    for layer in cache.draft_cache:
        assert layer.offset == cache.processed
        out.append(arrays_of(layer))
    return out


def assert_same_caches(got: SpeculativeCache, want: SpeculativeCache):
    for a_layer, b_layer in zip(settled(got), settled(want)):
        for a, b in zip(a_layer, b_layer):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_caches_equal_a_fresh_prefill_after_every_cycle(family):
    model, prompt = make_target(family), prompt_of(13, seed=7)
    ref = greedy_reference(model, prompt, 80)
    draft = OracleDraft(draft_config(block_size=7), prompt + ref, [None, 0, 3, 5, 1])
    target = prepare(model, draft)
    cache = SpeculativeCache(target, draft)
    tok = no_eos_tokenizer(ref)
    cycles = 0
    for _ in stream_generate(target, draft, tok, prompt, max_tokens=60, prompt_cache=cache, block_size=7):
        committed = cache.tokens[: cache.processed]
        assert cache.tokens == prompt + ref[: len(cache.tokens) - len(prompt)]
        assert len(cache.pending) == 1
        fresh = SpeculativeCache(target, draft)
        fresh.prefill(committed)
        assert cache.draft_cache[0].offset == len(committed)
        assert_same_caches(cache, fresh)
        cycles += 1
    assert cycles > 10


def test_a_kept_cache_continues_a_conversation_without_prefilling_it_again():
    model, prompt, follow_up = make_target("qwen3_5"), prompt_of(10, seed=2), prompt_of(5, seed=9)
    first_ref = greedy_reference(model, prompt, 12)
    second_ref = greedy_reference(model, prompt + first_ref + follow_up, 12)
    # An oracle for the whole conversation, so blocks are accepted in both calls.
    draft = OracleDraft(draft_config(block_size=4), prompt + first_ref + follow_up + second_ref, [None, 1])
    tok = no_eos_tokenizer(first_ref + second_ref)
    cache = SpeculativeCache(model, draft)  # as the README shows it: the mlx-lm model itself
    first = generate(model, draft, tok, prompt, max_tokens=12, prompt_cache=cache, block_size=4)
    before = cache.processed
    second = generate(model, draft, tok, follow_up, max_tokens=12, prompt_cache=cache, block_size=4)
    # The second call prefilled only the pending token and the new prompt.
    assert cache.processed - before == 1 + len(follow_up) + len(second.tokens) - 1
    assert (first.tokens, second.tokens) == (first_ref, second_ref)
    assert max(first.acceptance_lengths) > 1 and max(second.acceptance_lengths) > 1


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_prompt_prefilled_in_chunks_builds_the_same_caches(family):
    model, prompt = make_target(family), prompt_of(40, seed=11)
    ref = greedy_reference(model, prompt, 20)
    draft = OracleDraft(draft_config(block_size=5), prompt + ref, [None, 2])
    target = prepare(model, draft)
    whole, chunked = SpeculativeCache(target, draft), SpeculativeCache(target, draft)
    np.testing.assert_allclose(
        np.array(chunked.prefill(prompt, step=7)), np.array(whole.prefill(prompt)), rtol=2e-4, atol=2e-4
    )
    assert chunked.processed == chunked.draft_cache[0].offset == len(prompt)
    assert_same_caches(chunked, whole)
    out = generate(target, draft, no_eos_tokenizer(ref), prompt, max_tokens=20, prefill_step_size=7)
    assert out.tokens == ref
    read = []  # (what a progress bar shows while a long prompt is read)
    out = generate(
        target,
        draft,
        None,
        prompt,
        max_tokens=20,
        prefill_step_size=7,
        prompt_progress_callback=lambda *a: read.append(a),
    )
    assert out.tokens == ref and read == [(n, 40) for n in (0, 7, 14, 21, 28, 35, 40)]
    with pytest.raises(UserError, match="prompt_progress_callback must be a function"):
        generate(target, draft, None, prompt, prompt_progress_callback=lambda done: None)


def test_a_prompt_scored_in_parts_gets_the_targets_log_probabilities_and_the_caches_of_a_prefill():
    model, prompt = make_target("llama"), prompt_of(40, seed=12)
    draft = make_draft()
    target = prepare(model, draft)
    logits = model(mx.array([prompt]))[0]
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    scored, whole = SpeculativeCache(target, draft), SpeculativeCache(target, draft)
    got = []
    for start, end in ((0, 7), (7, 30), (30, 39)):
        got += scored.prefill_scored(prompt[start:end], prompt[end], 3)
    scored.prefill(prompt[39:])
    whole.prefill(prompt)
    assert_same_caches(scored, whole)
    np.testing.assert_allclose(
        [c for c, _ in got], [lp[i, t].item() for i, t in enumerate(prompt[1:])], atol=1e-4
    )
    assert [[i for i, _ in top] for _, top in got] == mx.argsort(-lp[:39], axis=-1)[:, :3].tolist()


def test_a_long_prompt_is_prefilled_in_chunks_as_short_as_the_device_needs(monkeypatch):
    """MLX's CPU backend builds each chunk's whole attention score matrix, so there the default chunk is
    short (docs/performance.md#long-prompts); on a GPU it is mlx-lm's. The answer is the same."""
    model = make_target("llama")
    prompt = prompt_of(600)
    ref = greedy_reference(model, prompt, 8)
    draft = OracleDraft(draft_config(block_size=4), prompt + ref, [None])
    target = prepare(model, draft)
    costs_for(target, draft)  # (measured first where no earlier test did: those passes are not counted)
    widths, run = [], Target.__call__

    def counted(self, x, *args, **kwargs):
        widths.append(x.shape[1])
        return run(self, x, *args, **kwargs)

    monkeypatch.setattr(Target, "__call__", counted)
    with mx.stream(mx.cpu):
        out = generate(target, draft, no_eos_tokenizer(ref), prompt, max_tokens=8)
    assert out.tokens == ref
    assert widths[:3] == [256, 256, 88]


@pytest.mark.parametrize("family", ["llama", "gpt_oss", "qwen3_5"])
def test_truncate_takes_a_conversation_back(family):
    """What chat does before each turn: drop tokens past a point, then go on from there."""
    model, prompt, more = make_target(family), prompt_of(9, seed=3), prompt_of(4, seed=12)
    ref = greedy_reference(model, prompt, 12)
    draft = OracleDraft(draft_config(block_size=4), prompt + ref, [None, 1])
    cache = SpeculativeCache(model, draft)
    first = generate(model, draft, no_eos_tokenizer(ref), prompt, max_tokens=12, prompt_cache=cache).tokens
    if family == "qwen3_5":  # recurrent state cannot be trimmed, only put back as the prompt left it
        tokens, processed = list(cache.tokens), cache.processed
        assert cache.truncate(len(prompt) - 2) is False and (cache.tokens, cache.processed) == (
            tokens,
            processed,
        )
    keep = len(prompt) + 3
    assert cache.truncate(keep) and cache.tokens == prompt + first[:3]
    want = greedy_reference(model, prompt + first[:3] + more, 10)
    second = generate(model, draft, no_eos_tokenizer(want), more, max_tokens=10, prompt_cache=cache).tokens
    assert second == want
    # Only what follows the point the caches went back to went through the target again.
    assert cache.last_prefill == (3 if family == "qwen3_5" else 0) + len(more)
    fresh = SpeculativeCache(model, draft)
    fresh.prefill(cache.tokens[: cache.processed])
    assert_same_caches(cache, fresh)


def test_block_size_one_keeps_a_drafter_cache_in_step():
    """Plain decoding (block 1) with a drafter's cache, then drafting again: both stay lossless."""
    model, prompt = make_target("llama"), prompt_of(7, seed=4)
    ref = greedy_reference(model, prompt, 30)
    draft = OracleDraft(draft_config(block_size=5), prompt + ref, [None, 1])
    target = prepare(model, draft)
    cache = SpeculativeCache(target, draft)
    tok = no_eos_tokenizer(ref)
    out = sum(
        (
            p.tokens
            for p in stream_generate(
                target, draft, tok, prompt, max_tokens=10, block_size=1, prompt_cache=cache
            )
        ),
        [],
    )
    assert cache.draft_cache[0].offset == cache.processed
    out += sum(
        (p.tokens for p in stream_generate(target, draft, tok, [], max_tokens=20, prompt_cache=cache)), []
    )
    assert out == ref


def test_max_tokens_zero_keeps_the_prompt_in_a_kept_cache():
    """A call that generates nothing still adds its prompt to the conversation."""
    model, prompt = make_target("llama"), prompt_of(8, seed=6)
    more = prompt_of(4, seed=10)
    draft = OracleDraft(draft_config(block_size=4), [], [None])
    tok = make_tokenizer(eos=95)
    cache = SpeculativeCache(model, draft)
    assert list(stream_generate(model, draft, tok, prompt, max_tokens=0, prompt_cache=cache)) == []
    out = sum(
        (p.tokens for p in stream_generate(model, draft, tok, more, max_tokens=10, prompt_cache=cache)), []
    )
    assert out == greedy_reference(model, prompt + more, 10)


@pytest.mark.parametrize("where", ["verify", "prefill"])
def test_a_cache_an_interrupted_pass_left_half_updated_is_refused(where, monkeypatch):
    """Ctrl-C (or any error) inside a model pass leaves the models' caches ahead of the committed
    tokens: reusing that cache is an error, not silently wrong text. A stop between cycles is clean."""
    model, prompt, more = make_target("llama"), prompt_of(8, seed=6), prompt_of(4, seed=10)
    ref = greedy_reference(model, prompt, 20)
    draft = OracleDraft(draft_config(block_size=4), prompt + ref, [None, 1])
    target = prepare(model, draft)
    tok = no_eos_tokenizer(ref)
    costs_for(target, draft)  # (measured first where no earlier test did: those passes are not counted)
    passes, run = 0, Target._run

    def interrupted(
        self, *args, **kwargs
    ):  # the target's pass runs, then Ctrl-C arrives before the cycle ends
        nonlocal passes
        out = run(self, *args, **kwargs)
        passes += 1
        if passes == (3 if where == "verify" else 2):
            raise KeyboardInterrupt
        return out

    cache = SpeculativeCache(target, draft)
    monkeypatch.setattr(Target, "_run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        for _ in stream_generate(
            target,
            draft,
            tok,
            prompt if where == "verify" else prompt + more,
            max_tokens=20,
            prompt_cache=cache,
            prefill_step_size=4 if where == "prefill" else 2048,
        ):
            pass
    monkeypatch.undo()
    assert cache.broken and cache.truncate(len(prompt)) is False  # chat then starts a new cache
    with pytest.raises(
        ValueError, match=r"left half-updated \(by an interrupted call, .*\): make a new SpeculativeCache"
    ):
        next(stream_generate(target, draft, tok, more, max_tokens=5, prompt_cache=cache))

    clean = SpeculativeCache(target, draft)  # a stop between two cycles leaves a cache to go on from
    stream = stream_generate(target, draft, tok, prompt, max_tokens=20, prompt_cache=clean)
    next(stream), next(stream)
    # a second call while it is still suspended (a `break` out of a loop over a generator kept in a
    # variable) is told to close it, not to throw the conversation away; once closed, it goes on
    for second in (prompt, []):  # (a second answer, or going on from its pending token)
        with pytest.raises(ValueError, match=r"in use by an answer that has not finished .* \(.close\(\)\)"):
            next(stream_generate(target, draft, tok, second, max_tokens=5, prompt_cache=clean))
    stream.close()
    assert not clean.broken
    want = greedy_reference(model, clean.tokens + more, 6)
    assert (
        generate(target, draft, no_eos_tokenizer(want), more, max_tokens=6, prompt_cache=clean).tokens == want
    )
    first = SpeculativeCache(target, draft)  # a stop at the first token: its next step under way
    stream = stream_generate(target, draft, tok, prompt, max_tokens=20, prompt_cache=first)
    next(stream)
    stream.close()
    assert not first.broken and len(first.tokens) == len(prompt) + 1
    want = greedy_reference(model, first.tokens + more, 6)
    assert (
        generate(target, draft, no_eos_tokenizer(want), more, max_tokens=6, prompt_cache=first).tokens == want
    )
    gone = SpeculativeCache(target, draft)  # a generator dropped unfinished gives the cache back
    stream = stream_generate(target, draft, tok, prompt, max_tokens=20, prompt_cache=gone)
    next(stream)
    del stream
    assert generate(target, draft, tok, more, max_tokens=3, prompt_cache=gone).generation_tokens == 3


@pytest.mark.parametrize("family", FAMILIES)
def test_prompts_prefilled_together_leave_each_cache_as_its_own_prefill_would(family):
    """One pass over several short prompts (rows right-padded, one of them after a kept conversation
    with a pending token): each cache, and each first token's logits, as a prefill of its own gives.
    Targets whose caches cannot batch prefill in turn."""
    from dflash_mlx.cache import prefill_together

    model, draft = make_target(family), make_draft(block_size=8)
    prompts = [prompt_of(n, seed=n) for n in (5, 17, 1, 40)]
    caches = [SpeculativeCache(model, draft) for _ in prompts]
    caches[1].prefill(prompt_of(9, seed=99))
    caches[1].add([3])
    for cache, prompt, logits in zip(caches, prompts, prefill_together(caches, prompts)):
        fresh = SpeculativeCache(model, draft)
        want = fresh.prefill(cache.tokens)
        assert_same_caches(cache, fresh)
        assert np.allclose(np.array(logits), np.array(want), atol=1e-4)
        assert cache.last_prefill == len(prompt) + (cache is caches[1])


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("step_ends_answer", [False, True])
@pytest.mark.parametrize("goes_on_with", ["follow_up", "nothing"])
def test_after_a_stop_string_a_kept_cache_goes_on_from_the_stops_token(
    family, step_ends_answer, goes_on_with
):
    """A step can commit tokens after the one that completes a stop string: the answer ends there, and
    so does the conversation the cache goes on with (its next call as if the answer had ended there),
    also where that step reached max_tokens too, and also with an empty prompt (going on from it)."""
    model, prompt = make_target(family), prompt_of(10, seed=3)
    follow_up = prompt_of(4, seed=8) if goes_on_with == "follow_up" else []
    ref = greedy_reference(model, prompt, 16)
    at = next(i for i in range(3, 7) if ref[i] not in ref[:i])  # a token whose text comes first there
    second_ref = greedy_reference(model, prompt + ref[: at + 1] + follow_up, 8)
    tok = no_eos_tokenizer(ref + second_ref)
    draft = OracleDraft(draft_config(block_size=8), prompt + ref, [None])  # every block accepted whole
    cache = SpeculativeCache(model, draft)
    stop = [tok.decode([ref[at]])]
    max_tokens = at + 2 if step_ends_answer else 16  # (the first step's tokens are ref[1:9])
    first = generate(
        model, draft, tok, prompt, max_tokens=max_tokens, prompt_cache=cache, block_size=8, stop=stop
    )
    assert first.finish_reason == "stop" and first.tokens == ref[: at + 1]
    assert first.acceptance_lengths[0] == 8  # the step went past the stop
    assert cache.tokens == prompt + ref[: at + 1]
    second = generate(model, draft, tok, follow_up, max_tokens=8, prompt_cache=cache, block_size=8)
    assert second.tokens == second_ref
