"""Bad input fails early, as a UserError, with a message that names what is wrong."""

import importlib

import mlx.core as mx
import numpy as np
import pytest
from tiny import _COMMON, make_draft, make_target, make_tokenizer, prompt_of

from dflash_mlx import SpeculativeCache, UserError, apply_chat_template, generate, stream_generate, warm_up


@pytest.fixture(scope="module")
def model():
    return make_target("llama")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(hidden=32), "drafter hidden size 32, target hidden size 64"),
        (dict(vocab=80), "drafter vocab size 80, target vocab size 96"),
        (dict(target_layers=6), "drafter num_target_layers 6, but the target has 4 layers"),
        (dict(layer_ids=(1, 4)), "target_layer_ids contains 4, but the target has 4 layers"),
    ],
)
def test_a_drafter_made_for_another_target_is_refused(model, kwargs, message):
    with pytest.raises(UserError, match=message):
        generate(model, make_draft(**kwargs), make_tokenizer(), [5, 6], max_tokens=4)


def test_a_mask_token_outside_the_vocabulary_is_refused(model):
    with pytest.raises(
        UserError, match=r"drafter mask_token_id 200 is outside the target vocabulary \(size 96\)"
    ):
        generate(model, make_draft(mask_token_id=200), make_tokenizer(), [5, 6], max_tokens=4)


def test_a_string_prompt_without_a_tokenizer_and_a_cache_of_another_pair_are_refused(model):
    with pytest.raises(UserError, match="a string prompt needs a tokenizer"):
        generate(model, make_draft(), None, "w5 w6", max_tokens=4)
    other = SpeculativeCache(model, make_draft())
    with pytest.raises(UserError, match="prompt_cache was made for another model pair"):
        generate(model, make_draft(), None, [5, 6], max_tokens=4, prompt_cache=other)


def test_an_empty_prompt_and_one_that_is_not_text_are_refused(model):
    for prompt in (
        "",
        [],
    ):
        with pytest.raises(UserError, match="prompt is empty"):
            generate(model, make_draft(), make_tokenizer(), prompt, max_tokens=4)
    with pytest.raises(UserError, match=r"^an unpaired UTF-16 surrogate \('\\ud800'\) in the prompt is"):
        generate(model, make_draft(), make_tokenizer(), "w5 \ud800", max_tokens=4)


def test_max_tokens_zero_yields_nothing(model):
    assert list(stream_generate(model, make_draft(), make_tokenizer(), prompt_of(4), max_tokens=0)) == []
    out = generate(model, make_draft(), make_tokenizer(), prompt_of(4), max_tokens=0)
    assert (out.tokens, out.prompt_tokens) == ([], 4)
    assert generate(model, make_draft(), make_tokenizer(), "w5 w6 w7", max_tokens=0).prompt_tokens == 3
    assert (
        generate(model, make_draft(), make_tokenizer(), iter(prompt_of(4)), max_tokens=0).prompt_tokens == 4
    )


def test_an_unsupported_family_names_itself_and_the_supported_ones():
    module = importlib.import_module("mlx_lm.models.qwen2")
    qwen2 = module.Model(module.ModelArgs.from_dict(dict(_COMMON, model_type="qwen2")))
    with pytest.raises(UserError, match=r"family 'qwen2' is not supported.*llama, qwen3, qwen3_moe"):
        generate(qwen2, make_draft(), make_tokenizer(), [5, 6], max_tokens=4)


def test_bad_block_size_max_tokens_and_prefill_step_are_refused(model):
    for size in (-1, 0, 257):
        with pytest.raises(UserError, match=f"block size must be between 1 and 256, got {size}"):
            generate(model, make_draft(), make_tokenizer(), [5, 6], block_size=size)
    with pytest.raises(UserError, match="max_tokens must be >= 0"):
        generate(model, make_draft(), make_tokenizer(), [5, 6], max_tokens=-3)
    for step in (0, -1):
        with pytest.raises(UserError, match=f"prefill_step_size must be >= 1, got {step}"):
            generate(model, make_draft(), make_tokenizer(), [5, 6], prefill_step_size=step)


def test_arguments_of_the_wrong_shape_or_kind_are_refused_by_name(model):
    import mlx.core as mx

    draft, tok = make_draft(), make_tokenizer()
    # a batch is not one prompt, nor is a single id without a length (a 0-d array), in MLX or NumPy
    for prompt in (
        mx.array([[5, 6], [7, 8]]),
        mx.array([[[5, 6]]]),
        mx.array(5),
        np.array(5),
        np.ones((2, 2), int),
    ):
        with pytest.raises(UserError, match=r"one prompt at a time: token ids of shape \(n,\) or \(1, n\)"):
            generate(model, draft, tok, prompt)
    expected = generate(model, draft, tok, [5, 6], max_tokens=3).tokens
    for prompt in (mx.array([[5, 6]]), np.array([5, 6]), np.array([[5, 6]], dtype=np.uint16)):
        assert generate(model, draft, tok, prompt, max_tokens=3).tokens == expected
    for prompt in ([True, False], mx.array([5.0, 6.0]), np.array([5.0, 6.0])):
        with pytest.raises(UserError, match="the prompt must be a string, or token ids"):
            generate(model, draft, tok, prompt)
    assert generate(model, draft, tok, [5, 6], stop=None, max_tokens=3).finish_reason == "length"
    for stop in (5, ["w5", None]):
        with pytest.raises(UserError, match="stop must be a string or a list of strings"):
            generate(model, draft, tok, [5, 6], stop=stop)
    with pytest.raises(UserError, match="block_size drafts a block: give a drafter"):
        generate(model, None, tok, [5, 6], block_size=16)
    with pytest.raises(UserError, match="prompt_cache must be a SpeculativeCache"):
        generate(model, draft, tok, [5, 6], prompt_cache=[])
    with pytest.raises(TypeError, match="^generate\\(\\) got an unexpected keyword argument 'max_token'"):
        generate(model, draft, tok, [5, 6], max_token=5)
    for sampler in (5, lambda logprobs, key: logprobs):  # (the second failed deep in the cycle)
        with pytest.raises(UserError, match="sampler must be a function of log-probabilities"):
            generate(model, draft, tok, [5, 6], sampler=sampler)
    for name in ("lookup", "compile", "continues", "verbose"):
        with pytest.raises(UserError, match=f"{name} must be True or False, got 'no'"):
            generate(model, draft, tok, [5, 6], **{name: "no"})
    with pytest.raises(UserError, match="add_generation_prompt must be True or False, got 'no'"):
        apply_chat_template(tok, "w5", add_generation_prompt="no")
    with pytest.raises(UserError, match="a sampler replaces temperature, top_p, top_k and min_p"):
        generate(model, draft, tok, [5, 6], sampler=lambda logprobs: mx.argmax(logprobs, -1), temperature=0.7)
    for swapped in (  # (each once failed on an attribute deep inside)
        lambda: generate(draft, model, tok, [5, 6]),
        lambda: SpeculativeCache(draft, model),
        lambda: warm_up(draft, model),
    ):
        with pytest.raises(UserError, match="give the target first and its DFlash drafter second"):
            swapped()
    with pytest.raises(UserError, match="model and draft must be loaded models"):
        SpeculativeCache(model, tok)
    with pytest.raises(UserError, match="stop strings are found in the answer's text: give a tokenizer"):
        generate(model, draft, None, [5, 6], stop="w5")
    for context in (0, -5, 8.5, True):
        with pytest.raises(
            UserError, match=f"context must be a whole number of tokens, 1 or more, got {context}"
        ):
            warm_up(model, draft, context=context)
    with pytest.raises(UserError, match="context leaves no room for the widest pass"):
        warm_up(model, draft, context=10**9)
    with pytest.raises(UserError, match="tokenizer must be the target's tokenizer"):
        generate(model, draft, "tokenizer", "hi")
    for window in (2.5, "x", 0, 2**31):
        with pytest.raises(UserError, match="draft_window must be"):
            SpeculativeCache(model, draft, draft_window=window)


def test_numpy_numbers_are_taken_as_the_numbers_they_are(model):
    """A seed, top_k or block size from NumPy (a common source of them) gives what the Python number does."""
    draft, tok = make_draft(), make_tokenizer()
    python = dict(max_tokens=6, temperature=1.0, top_k=5, seed=2**63 + 5, lookup=False)
    numpy = dict(
        max_tokens=np.int64(6),
        temperature=np.float32(1.0),
        top_k=np.int64(5),
        seed=np.uint64(2**63 + 5),
        lookup=np.bool_(False),
    )
    want = generate(model, draft, tok, [5, 6], **python).tokens
    assert generate(model, draft, tok, [5, 6], **numpy).tokens == want
    fixed = generate(model, draft, tok, [5, 6], max_tokens=6, block_size=np.int32(4))
    assert fixed.tokens == generate(model, draft, tok, [5, 6], max_tokens=6, block_size=4).tokens


def test_a_samplers_narrow_integer_ids_are_read_as_ids():
    """Ids in a type too narrow for the vocabulary's size are compared as ids, not in their own type."""
    from dflash_mlx.sampling import guarded

    draw = guarded(lambda logprobs: mx.argmax(logprobs, axis=-1).astype(mx.uint8))
    logprobs = mx.where(mx.arange(300) == 7, 0.0, -10.0)[None]
    assert draw(logprobs).tolist() == [7]


def test_models_named_by_something_else_than_a_string_and_bad_dtypes_are_refused_before_loading():
    from dflash_mlx import load, load_draft, load_pair

    for call in (lambda: load(None), lambda: load_draft(5), lambda: load_pair(None)):
        with pytest.raises(UserError, match="with a string \\(a registry name"):
            call()
    for dtype in (5, mx.int32, mx.bool_):  # (an integer model would be written, then fail in its norms)
        with pytest.raises(UserError, match="dtype must be 'auto', None, one of .* or a floating mx.Dtype"):
            load_pair("smollm2-135m-instruct", dtype=dtype)


def test_a_sampler_failing_at_the_first_token_leaves_the_cache_refused(model):
    """Its prompt went in and its answer did not: going on with it would hold the prompt twice."""
    draft, tok = make_draft(), make_tokenizer()
    cache = SpeculativeCache(model, draft)

    def failing(logprobs):
        raise RuntimeError("a sampler bug")

    with pytest.raises(RuntimeError, match="a sampler bug"):
        generate(model, draft, tok, prompt_of(6), sampler=failing, prompt_cache=cache)
    for prompt in (prompt_of(6), []):  # (an empty prompt too: it is the cache that is wrong)
        with pytest.raises(UserError, match="left half-updated"):
            generate(model, draft, tok, prompt, prompt_cache=cache)


@pytest.mark.parametrize("first_bad", [0, 5])
@pytest.mark.parametrize("bad", [96, 10**8])
def test_a_sampler_drawing_outside_the_vocabulary_is_refused_not_read(model, first_bad, bad):
    """An id past the embedding table would be read from whatever memory lies there (or crash the
    process) by a pass that starts before the host sees it: it is refused, and the cache with it."""
    draft, tok = make_draft(), make_tokenizer()
    cache, calls = SpeculativeCache(model, draft), []

    def buggy(logprobs):
        calls.append(1)
        best = mx.argmax(logprobs, axis=-1)
        return best + bad if len(calls) > first_bad else best

    with pytest.raises(UserError, match="sampler returned a token id outside the vocabulary"):
        generate(model, draft, tok, prompt_of(6), sampler=buggy, prompt_cache=cache, max_tokens=40)
    assert len(calls) > first_bad
    with pytest.raises(UserError, match="left half-updated"):
        generate(model, draft, tok, prompt_of(6), prompt_cache=cache)


@pytest.mark.parametrize(
    "returns,got",
    [
        (lambda lp: mx.argmax(lp, axis=-1).astype(mx.float32), r"float32 \(1,\)"),
        (lambda lp: mx.zeros((2,), dtype=mx.int32), r"int32 \(2,\)"),
        (lambda lp: 3, "int"),
    ],
)
def test_a_sampler_returning_the_wrong_kind_of_answer_is_refused_by_name(model, returns, got):
    with pytest.raises(UserError, match=rf"one token id per row of its logits \(1\); it returned {got}"):
        generate(model, make_draft(), make_tokenizer(), prompt_of(6), sampler=returns, max_tokens=8)
