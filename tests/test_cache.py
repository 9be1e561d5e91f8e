"""After every cycle both caches must equal what a plain prefill of the committed tokens builds."""

import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache
from tiny import FAMILIES, OracleDraft, draft_config, greedy_reference, make_target, make_tokenizer, no_eos_tokenizer, prompt_of

from dflash_mlx import SpeculativeCache, stream_generate
from dflash_mlx.speculative import prepare


def arrays_of(cache_entry):
    """The meaningful contents of one layer's cache, as NumPy arrays."""
    if isinstance(cache_entry, ArraysCache):
        return [np.array(a) for a in cache_entry.cache]
    k, v = cache_entry.keys[..., :cache_entry.offset, :], cache_entry.values[..., :cache_entry.offset, :]
    return [np.array(k), np.array(v)]


@pytest.mark.parametrize("family", FAMILIES)
def test_caches_equal_a_fresh_prefill_after_every_cycle(family):
    model, prompt = make_target(family), prompt_of(13, seed=7)
    ref = greedy_reference(model, prompt, 80)
    draft = OracleDraft(draft_config(block_size=7), prompt + ref, [None, 0, 3, 5, 1])
    target = prepare(model, draft)
    cache = SpeculativeCache(target, draft)
    tok = no_eos_tokenizer(ref)
    cycles = 0
    for piece in stream_generate(target, draft, tok, prompt, max_tokens=60, prompt_cache=cache):
        committed = cache.tokens[:cache.processed]
        assert cache.tokens == prompt + ref[:len(cache.tokens) - len(prompt)]
        assert len(cache.pending) == 1
        fresh = SpeculativeCache(target, draft)
        fresh.prefill(committed)
        for got, want in zip(cache.target_cache, fresh.target_cache):
            if not isinstance(got, ArraysCache):
                assert got.offset == len(committed)
            for a, b in zip(arrays_of(got), arrays_of(want)):
                np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4)
        for got, want in zip(cache.draft_cache, fresh.draft_cache):
            assert got.offset == len(committed)
            for a, b in zip(arrays_of(got), arrays_of(want)):
                np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4)
        cycles += 1
    assert cycles > 10


def test_a_kept_cache_continues_a_conversation_without_prefilling_it_again():
    model, prompt = make_target("qwen3_5"), prompt_of(10, seed=2)
    draft = OracleDraft(draft_config(block_size=4), [], [None])  # oracle with no reference: wrong guesses
    tok = make_tokenizer(eos=95)
    cache = SpeculativeCache(model, draft)  # as the README shows it: the mlx-lm model itself
    first = sum((p.tokens for p in stream_generate(model, draft, tok, prompt, max_tokens=12, prompt_cache=cache)), [])
    follow_up = prompt_of(5, seed=9)
    before = cache.processed
    second = sum((p.tokens for p in stream_generate(model, draft, tok, follow_up, max_tokens=12,
                                                     prompt_cache=cache)), [])
    # The second call prefilled only the pending token and the new prompt.
    assert cache.processed - before == 1 + len(follow_up) + len(second) - 1
    assert second == greedy_reference(model, prompt + first + follow_up, 12)


def test_block_size_one_keeps_a_drafter_cache_in_step():
    """Plain decoding (block 1) with a drafter's cache, then drafting again: both stay lossless."""
    model, prompt = make_target("llama"), prompt_of(7, seed=4)
    ref = greedy_reference(model, prompt, 30)
    draft = OracleDraft(draft_config(block_size=5), prompt + ref, [None, 1])
    target = prepare(model, draft)
    cache = SpeculativeCache(target, draft)
    tok = no_eos_tokenizer(ref)
    out = sum((p.tokens for p in stream_generate(target, draft, tok, prompt, max_tokens=10, block_size=1,
                                                  prompt_cache=cache)), [])
    assert cache.draft_cache[0].offset == cache.processed
    out += sum((p.tokens for p in stream_generate(target, draft, tok, [], max_tokens=20, prompt_cache=cache)), [])
    assert out == ref


def test_max_tokens_zero_keeps_the_prompt_in_a_kept_cache():
    """A call that generates nothing still adds its prompt to the conversation."""
    model, prompt = make_target("llama"), prompt_of(8, seed=6)
    more = prompt_of(4, seed=10)
    draft = OracleDraft(draft_config(block_size=4), [], [None])
    tok = make_tokenizer(eos=95)
    cache = SpeculativeCache(model, draft)
    assert list(stream_generate(model, draft, tok, prompt, max_tokens=0, prompt_cache=cache)) == []
    out = sum((p.tokens for p in stream_generate(model, draft, tok, more, max_tokens=10, prompt_cache=cache)), [])
    assert out == greedy_reference(model, prompt + more, 10)
