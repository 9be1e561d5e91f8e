"""Penalties, logit biases and other logits processors: every verified position's logits processed as
plain decoding processes that position's, so the answer is still exactly the target's with them."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors
from test_cache import assert_same_caches
from test_engine import drive
from test_sampling import DRAFT, PROMPT, T, TargetPathDraft, V, chi_square_p, nucleus_probs, sample_counts
from test_trees import RankedOracle
from tiny import OracleDraft, draft_config, make_draft, make_target, no_eos_tokenizer, prompt_of

from dflash_mlx import SpeculativeCache, UserError, generate, stream_generate
from dflash_mlx.engine import Engine, Sequence
from dflash_mlx.pairing import prepare
from dflash_mlx.settings import GenerationSettings

# Strong enough to move most greedy choices of the tiny targets; the windows differ so that each
# processor's own window is what is checked
PENALTIES = dict(
    repetition_penalty=1.6,
    repetition_context_size=7,
    presence_penalty=0.8,
    presence_context_size=30,
    frequency_penalty=0.5,
    logit_bias={5: -3.0, 9: 2.5},
)


def processors(settings: dict = PENALTIES) -> list:
    return make_logits_processors(
        settings["logit_bias"],
        settings["repetition_penalty"],
        settings["repetition_context_size"],
        settings["presence_penalty"],
        settings["presence_context_size"],
        settings["frequency_penalty"],
        20,
    )


def reference(model, prompt: list[int], n: int, settings: dict = PENALTIES) -> list[int]:
    """mlx-lm's own greedy decoding with the same processors."""
    steps = generate_step(mx.array(prompt), model, max_tokens=n, logits_processors=processors(settings))
    return [int(t) for t, _ in steps]


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gpt_oss"])
def test_greedy_answers_with_penalties_are_mlx_lms_with_them_whatever_proposes(family):
    model, prompt = make_target(family), prompt_of(15, seed=2)
    ref = reference(model, prompt, 40)
    assert ref[:20] != [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=20)]
    tok = no_eos_tokenizer(ref)
    for block_size in (None, 1, 4, 16):  # (None: the adaptive policy, lookup among its choices)
        draft = OracleDraft(draft_config(block_size=16), prompt + ref, [None, 0, 3, 5, 1])
        out = generate(model, draft, tok, prompt, max_tokens=40, block_size=block_size, **PENALTIES)
        assert out.tokens == ref, block_size
        if block_size == 16:  # (the proposals before each position are in its history)
            assert max(out.acceptance_lengths) == 16
    # mlx-lm's processors given as they are give the same
    draft = OracleDraft(draft_config(block_size=16), prompt + ref, [None, 0, 3])
    out = generate(model, draft, tok, prompt, max_tokens=40, block_size=8, logits_processors=processors())
    assert out.tokens == ref


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_each_node_of_a_tree_is_processed_with_its_own_path(family):
    model, prompt = make_target(family), prompt_of(11, seed=8)
    ref = reference(model, prompt, 40)
    accepted = []
    for width in (4, 13):
        draft = RankedOracle(draft_config(block_size=8), prompt + ref)
        target = prepare(model, draft)
        cache = SpeculativeCache(target, draft)
        out = generate(
            target,
            draft,
            no_eos_tokenizer(ref),
            prompt,
            max_tokens=40,
            tree=width,
            prompt_cache=cache,
            **PENALTIES,
        )
        assert out.tokens == ref
        accepted += out.acceptance_lengths
        fresh = SpeculativeCache(target, draft)
        fresh.prefill(cache.tokens[: cache.processed])
        assert_same_caches(cache, fresh)
    # (a chain accepts one proposal at most here: its first guesses are right one cycle in three)
    assert max(accepted) >= 3


def test_sequences_of_a_batch_each_get_their_own_processors():
    model = make_target("llama")
    draft = OracleDraft(draft_config(block_size=8), None, [None, 0, 4, 2])
    target = prepare(model, draft)
    plans = [  # prompt length, max tokens, joins at, settings
        (5, 30, 0, PENALTIES),
        (9, 25, 0, None),
        (12, 30, 2, dict(PENALTIES, repetition_penalty=1.2, logit_bias={3: 4.0})),
        (4, 20, 3, dict(PENALTIES, presence_penalty=-0.5)),
    ]
    joins, wants = {}, {}
    for i, (length, max_tokens, at, settings) in enumerate(plans):
        prompt = prompt_of(length, seed=50 + i)
        ref = reference(model, prompt, max_tokens, settings or dict.fromkeys(PENALTIES))
        cache = SpeculativeCache(target, draft)
        draft.follow(cache, prompt + ref)
        seq = Sequence(cache, GenerationSettings(max_tokens=max_tokens, **(settings or {})), max_tokens)
        joins.setdefault(at, []).append((seq, prompt))
        wants[seq] = ref
    out = drive(Engine(target, draft), joins)
    assert [out[s] for s in wants] == list(wants.values())


def processed_joint(model, temperature: float, top_p: float, settings: dict) -> dict:
    """P(first T tokens) after PROMPT with the processors, from the target's logits."""
    probs = {(): 1.0}
    for _ in range(T):
        seqs = list(probs)
        logits = model(mx.array([PROMPT + list(s) for s in seqs]))[:, -1].astype(mx.float32)
        rows = []
        for s, row in zip(seqs, logits):
            row = row[None]
            for p in processors(settings):
                row = p(mx.array(PROMPT + list(s)), row)
            rows.append(np.array(row[0]).astype(np.float64))
        probs = {
            s + (t,): probs[s] * pt
            for s, row in zip(seqs, rows)
            for t, pt in enumerate(nucleus_probs(row, temperature, top_p))
        }
    return probs


def test_sampled_answers_with_penalties_follow_the_processed_distribution():
    """χ² over the first T tokens; the drafter proposes from the target's unprocessed distributions, so
    its proposals are rejected where the processors moved the target's. (A tree's nodes are processed
    as a chain's rows are, each with its own path: checked greedily above, where paths leave the chain.)"""
    model = make_target("llama", seed=4, vocab_size=V, num_hidden_layers=1)
    holder = [None]
    draft = TargetPathDraft(draft_config(**DRAFT), model, holder)
    settings = dict(PENALTIES, repetition_context_size=3, logit_bias={2: 1.5, 4: -1.0})
    counts = sample_counts(model, draft, holder, 0.7, 0.9, **settings)
    p = chi_square_p(counts, processed_joint(model, 0.7, 0.9, settings))
    assert p > 1e-3, f"chi-square p-value {p:.2e}: penalties do not sample the processed distribution"


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(repetition_penalty=0), "repetition_penalty must be from 0.01 to 100 (1: none), got 0"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty must be from 0.01 to 100"),
        (dict(presence_penalty=float("inf")), "presence_penalty must be from -100 to 100 (0: none), got inf"),
        (
            dict(frequency_context_size=0),
            "frequency_context_size must be from 1 to 1,073,741,824 (the latest tokens",
        ),
        (dict(repetition_context_size=2**32), "repetition_context_size must be from 1 to 1,073,741,824"),
        (dict(repetition_penalty="1.2"), "repetition_penalty must be a number, got '1.2'"),
        (dict(logit_bias={"5": 1.0}), "logit_bias must map token ids (whole numbers >= 0) to numbers"),
        (dict(logit_bias={5: True}), "logit_bias must map token ids (whole numbers >= 0) to numbers"),
        (dict(logit_bias={5: float("-inf")}), "logit_bias values must be from -100 to 100 (-100 bans"),
        (dict(logit_bias=[5]), "logit_bias must map token ids"),
        (dict(logit_bias={4000: 1.0}), "logit_bias token id 4000 is past the vocabulary (0..95)"),
        (
            dict(logit_bias={2**63: 1.0}),
            f"logit_bias token id {2**63} is past the vocabulary",
        ),  # (MLX's bad_cast)
        (
            dict(logits_processors=[3]),
            "logits_processors must be a list of functions (tokens, logits)",
        ),
        (
            dict(logits_processors=[lambda tokens, logits, step: logits]),
            "logits_processors must be a list of functions (tokens, logits)",
        ),
        # what a processor returns: the logits it was given, changed (a forgotten `return` gives None)
        (dict(logits_processors=[lambda t, lg: None]), "must return an mx.array of logits shaped as it"),
        (dict(logits_processors=[lambda t, lg: np.array(lg)]), "(1, 96); it returned ndarray"),
        (dict(logits_processors=[lambda t, lg: lg[0]]), "(1, 96); it returned float32 (96,)"),
        (dict(logits_processors=[lambda t, lg: lg.argmax(-1)]), "it returned uint32 (1,)"),
    ],
)
def test_bad_processor_settings_are_refused_by_name(settings, message):
    model = make_target("llama")
    with pytest.raises(UserError) as e:
        generate(model, make_draft(), no_eos_tokenizer([]), [1, 2, 3], max_tokens=4, **settings)
    assert message in str(e.value)


@pytest.mark.parametrize("penalties", [{}, PENALTIES])
def test_each_tokens_log_probabilities_are_mlx_lms_whatever_proposed_it(penalties):
    model, prompt = make_target("llama"), prompt_of(15, seed=2)
    given = processors() if penalties else None
    steps = generate_step(mx.array(prompt), model, max_tokens=40, logits_processors=given)
    ref, rows = zip(*((int(t), np.array(lp)) for t, lp in steps))
    tok = no_eos_tokenizer(ref)
    for how in (dict(block_size=None), dict(block_size=1), dict(block_size=8), dict(tree=6)):
        draft = RankedOracle(draft_config(block_size=16), prompt + list(ref))
        tokens, logprobs, tops = [], [], []
        for r in stream_generate(model, draft, tok, prompt, max_tokens=40, logprobs=3, **how, **penalties):
            assert len(r.logprobs) == len(r.top_logprobs) == len(r.tokens)
            tokens += r.tokens
            logprobs += r.logprobs
            tops += r.top_logprobs
        assert tokens == list(ref)
        np.testing.assert_allclose(logprobs, [row[t] for row, t in zip(rows, ref)], atol=1e-4)
        assert [[i for i, _ in top] for top in tops] == [list(np.argsort(-row)[:3]) for row in rows]
        best = np.concatenate([np.sort(row)[::-1][:3] for row in rows])
        np.testing.assert_allclose([v for top in tops for _, v in top], best, atol=1e-4)
    assert all(r.logprobs is None for r in stream_generate(model, None, tok, prompt, max_tokens=4))
    out = generate(model, None, tok, prompt, max_tokens=40, logprobs=0, **penalties)
    np.testing.assert_allclose(out.logprobs, [row[t] for row, t in zip(rows, ref)], atol=1e-4)
    assert out.top_logprobs == [[]] * 40 and generate(model, None, tok, prompt, max_tokens=4).logprobs is None
