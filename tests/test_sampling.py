"""Above temperature 0 the output must follow the target's own sampling distribution exactly."""

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chisquare
from tiny import draft_config, make_dflash2, make_draft, make_target, make_tokenizer

import dflash_mlx.engine as engine
import dflash_mlx.speculative as speculative
from dflash_mlx import SpeculativeCache, generate, stream_generate
from dflash_mlx.models.dflash import DFlashDraftModel
from dflash_mlx.sampling import SamplingParams, acceptance

V, T, B, RUNS = 8, 4, 3, 1500
PROMPT = [1, 5, 3, 6]
# Drafters for the target below, one layer each: every test here runs RUNS answers.
DRAFT = dict(vocab=V, target_layers=1, layer_ids=(0,), layers=1)


def nucleus_probs(
    logits: np.ndarray, temperature: float, top_p: float, top_k: int = 0, min_p: float = 0.0
) -> np.ndarray:
    """Plain sampling's distribution, written independently: on the untempered probabilities,
    top-p keeps a token while the mass of strictly more probable tokens is < top_p, top-k keeps the
    k most probable, min-p keeps tokens with p >= min_p * max p (each keeps a most-probable prefix,
    so their order does not matter); then temperature over the kept tokens."""
    p = np.exp(logits - logits.max())
    p /= p.sum()
    more_probable = np.array([p[p > x].sum() for x in p])
    keep = (more_probable < top_p) & (p >= min_p * p.max())
    if top_k:
        keep &= np.array([(p > x).sum() < top_k for x in p])
    z = np.where(keep, logits / temperature, -np.inf)
    q = np.exp(z - z.max())
    return q / q.sum()


def exact_joint(model, temperature, top_p, prompt=PROMPT, **filters) -> dict:
    """P(first T tokens) for every sequence of T tokens after `prompt`, from the target's logits."""
    probs = {(): 1.0}
    for _ in range(T):
        seqs = list(probs)
        logits = np.array(model(mx.array([prompt + list(s) for s in seqs]))[:, -1].astype(mx.float32))
        probs = {
            s + (t,): probs[s] * pt
            for s, row in zip(seqs, logits)
            for t, pt in enumerate(nucleus_probs(row.astype(np.float64), temperature, top_p, **filters))
        }
    return probs


class TargetPathDraft(DFlashDraftModel):
    """A good drafter: at each block position it proposes from the target's own distribution
    along the drafter's greedy path (exactly right whenever the earlier proposals were greedy)."""

    def __init__(self, config, model, cache_holder):
        super().__init__(config)
        self.model, self.holder = model, cache_holder

    def propose_logits(self, last_token, cache, block_size, compiled=True, heads=None):
        seq = self.holder[0].tokens[: cache[0].offset] + [last_token]
        rows = []
        for _ in range(block_size - 1):
            row = self.model(mx.array([seq]))[0, -1]
            rows.append(row)
            seq = seq + [int(mx.argmax(row).item())]
        return mx.stack(rows)[None, :heads]


def sample_counts(model, draft, holder, temperature, top_p, sampler=None, keyed=False, **filters) -> dict:
    """RUNS answers' first T tokens. `keyed`: each answer given its own `seed` (draws keyed by position,
    proposals accepted where they equal them); else MLX's generator seeded before each answer (the
    acceptance rule of answers without a seed: rejection sampling, or a sampler's own draws)."""
    tok = make_tokenizer(vocab=V, eos=V + 5)  # no EOS inside the vocabulary
    target = speculative.prepare(model, draft)
    counts = {}
    for seed in range(RUNS):
        mx.random.seed(seed)
        holder[0] = SpeculativeCache(target, draft)
        out = sum(
            (
                r.tokens
                for r in stream_generate(
                    target,
                    draft,
                    tok,
                    PROMPT,
                    max_tokens=T,
                    block_size=None if "tree" in filters or draft is None else B,
                    temperature=temperature,
                    top_p=top_p,
                    seed=seed if keyed else None,
                    sampler=sampler,
                    prompt_cache=holder[0],
                    **filters,
                )
            ),
            [],
        )
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    return counts


def chi_square_p(counts: dict, joint: dict) -> float:
    """Pearson's test over all T-token sequences, pooling those expected fewer than 5 times."""
    assert sum(counts.values()) == RUNS and all(len(s) == T for s in counts)
    big = [s for s, p in joint.items() if p * RUNS >= 5]
    observed = [counts.get(s, 0) for s in big]
    expected = [joint[s] * RUNS for s in big]
    observed.append(RUNS - sum(observed))
    expected.append(RUNS - sum(expected))
    return chisquare(observed, expected).pvalue


@pytest.fixture(scope="module")
def model():
    return make_target("llama", seed=4, vocab_size=V, num_hidden_layers=1)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
@pytest.mark.parametrize(
    "drafter,keyed",
    [("bad", False), ("good", False), ("none", False), ("dflash2", False), ("bad", True), ("good", True)],
)
def test_output_follows_the_target_distribution(model, temperature, top_p, drafter, keyed):
    holder = [None]
    if drafter == "none":  # plain decoding (what block size 1 and a missing drafter both run)
        draft = None
    elif drafter == "bad":
        draft = make_draft(seed=11, **DRAFT)
    elif drafter == "dflash2":  # proposals drawn one after another among 3 candidates (a sparse q)
        draft = make_dflash2(seed=11, top_k=3, **DRAFT)
    else:
        draft = TargetPathDraft(draft_config(**DRAFT), model, holder)
    joint = exact_joint(model, temperature, top_p)
    p = chi_square_p(sample_counts(model, draft, holder, temperature, top_p, keyed=keyed), joint)
    assert p > 1e-3, f"chi-square p-value {p:.2e}: output does not follow the target's distribution"


@pytest.mark.parametrize("family", ["gemma4", "lfm2", "muse_glimmer"])
def test_families_that_transform_their_logits_or_carry_convolution_state_sample_exactly(family):
    # gemma4 and muse_glimmer softcap (and scale) their logits, lfm2 rolls back short-convolution state.
    model = make_target(family, seed=4, vocab_size=V)
    draft = make_draft(seed=11, **dict(DRAFT, target_layers=4))
    p = chi_square_p(sample_counts(model, draft, [None], 1.0, 1.0), exact_joint(model, 1.0, 1.0))
    assert p > 1e-3, f"chi-square p-value {p:.2e}: {family}'s output does not follow its distribution"


def test_top_k_and_min_p_are_applied_exactly(model):
    """The two filters the tests above leave at their defaults: with a (random) drafter, the output
    is the target's distribution after top-k and min-p."""
    holder, filters = [None], dict(top_k=3, min_p=0.05)
    counts = sample_counts(model, make_draft(seed=11, **DRAFT), holder, 0.8, 1.0, **filters)
    assert chi_square_p(counts, exact_joint(model, 0.8, 1.0, **filters)) > 1e-3


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), "sampler"])
def test_a_seed_gives_the_same_answer_whatever_proposed_its_tokens(model, sampling):
    """The adaptive policy's choices follow the machine's measured pace, so a seed's answer must not
    depend on them: a fixed block, a tree, plain decoding, no lookup and no drafter give it too."""
    from mlx_lm.sample_utils import make_sampler

    tok = make_tokenizer(vocab=V, eos=V + 5)
    if sampling == "sampler":
        sampling = dict(sampler=make_sampler(0.8, top_k=4))

    def answer(seed, draft=True, **shape):
        drafter = make_draft(seed=11, **DRAFT) if draft else None
        return generate(model, drafter, tok, PROMPT, max_tokens=24, seed=seed, **sampling, **shape).tokens

    first = answer(3)
    shapes = [dict(block_size=4), dict(block_size=1), dict(tree=4), dict(lookup=False), dict(draft=False)]
    assert all(answer(3, **shape) == first for shape in shapes)
    assert any(answer(s) != first for s in range(4, 9))


@pytest.mark.parametrize("keyed", [False, True])
def test_a_custom_sampler_keeps_its_own_distribution(model, keyed):
    from mlx_lm.sample_utils import make_sampler

    holder = [None]
    sampler = make_sampler(0.7, top_p=0.9)
    draft = make_draft(seed=11, **DRAFT)
    counts = sample_counts(model, draft, holder, 0.0, 1.0, sampler=sampler, keyed=keyed)
    assert chi_square_p(counts, exact_joint(model, 0.7, 0.9)) > 1e-3


def test_the_check_catches_a_lossy_rule(model, monkeypatch):
    """Negative control: accepting every proposal makes the output the drafter's, and the test sees it."""

    def accept_all(params, sampler):
        def draft(logits):
            logq = params.sampling_logprobs(logits)
            return mx.random.categorical(logq), None

        def accept(x, q, logits):
            return mx.array(x.shape[0]), mx.random.categorical(params.sampling_logprobs(logits[-1]))

        return draft, accept

    monkeypatch.setattr(engine, "acceptance", accept_all)
    holder = [None]
    joint = exact_joint(model, 1.0, 1.0)
    p = chi_square_p(sample_counts(model, make_draft(seed=11, **DRAFT), holder, 1.0, 1.0), joint)
    assert p < 1e-6


def test_probabilities_match_the_independent_reference():
    logits = mx.random.normal((5, 50), key=mx.random.key(0)) * 3
    for temperature, top_p, top_k, min_p in [
        (1.0, 1.0, 0, 0.0),
        (0.7, 0.9, 0, 0.0),
        (1.3, 0.5, 0, 0.0),
        (0.8, 1.0, 3, 0.0),
        (1.0, 1.0, 0, 0.05),
        (0.9, 0.95, 7, 0.02),
    ]:
        ours = np.array(SamplingParams(temperature, top_p, top_k, min_p).probs(logits))
        ref = np.stack(
            [nucleus_probs(np.array(r, dtype=np.float64), temperature, top_p, top_k, min_p) for r in logits]
        )
        np.testing.assert_allclose(ours, ref, atol=1e-5)
        if top_k or min_p:  # the filter really removed tokens in every row
            assert ((ref > 0).sum(axis=1) < 50).all()


def test_bfloat16_logits_follow_the_distribution_mlx_lm_samples_from():
    """With bfloat16 logits mlx-lm filters the log-probabilities in bfloat16, which decides which tokens
    sit on a filter's threshold: draws of its own sampler must all be possible for us, and as frequent."""
    from mlx_lm.sample_utils import make_sampler

    logits = (mx.random.normal((6, 4096), key=mx.random.key(0)) * 2.0).astype(mx.bfloat16)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # what generate_step hands its sampler
    mx.random.seed(3)
    for temperature, top_p, min_p in [(1.0, 1.0, 0.1), (0.7, 0.9, 0.0)]:
        plain = make_sampler(temperature, top_p=top_p, min_p=min_p)
        ours = np.array(SamplingParams(temperature, top_p, 0, min_p).probs(logits), dtype=np.float64)
        for row in range(logits.shape[0]):
            draws = np.array(plain(mx.broadcast_to(logprobs[row : row + 1], (4000, 4096))))
            counts = np.bincount(draws, minlength=4096)
            assert ours[row][counts > 0].min() > 0, (
                temperature,
                top_p,
                min_p,
                row,
            )  # no draw we call impossible
            big = ours[row] * 4000 >= 5  # chi-square over the tokens expected 5+ times, the rest pooled
            observed = np.append(counts[big], counts[~big].sum())
            expected = np.append(ours[row][big], ours[row][~big].sum()) * 4000
            keep = expected > 0
            assert (
                chisquare(observed[keep], expected[keep] * observed.sum() / expected[keep].sum()).pvalue
                > 1e-4
            )


def test_bad_sampling_settings_are_refused():
    for kwargs, message in [
        (dict(temperature=-1), "temperature must be a number from 0 to 10000, got -1"),
        (dict(temperature=float("nan")), "temperature must be a number from 0 to 10000, got nan"),
        (dict(temperature=float("inf")), "temperature must be a number from 0 to 10000, got inf"),
        (dict(temperature=1e5), "temperature must be a number from 0 to 10000, got 100000"),
        (dict(top_p=float("nan")), r"top_p must be from 0 to 1, got nan"),
        (dict(min_p=float("nan")), r"min_p must be from 0 to 1, got nan"),
        (dict(top_p=-0.1), r"top_p must be from 0 to 1, got -0.1"),
        (dict(top_p=1.5), r"top_p must be from 0 to 1, got 1.5"),
        (dict(top_k=-2), "top_k must be >= 0, got -2"),
        (dict(min_p=2), r"min_p must be from 0 to 1, got 2"),
    ]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)
    from dflash_mlx.sampling import MIN_TOP_P

    assert SamplingParams(temperature=1, top_p=0).top_p == MIN_TOP_P  # (the most likely token alone)


@pytest.mark.parametrize(
    "sampling", [dict(temperature=1e-300), dict(temperature=5e-324), dict(temperature=0.7, top_p=1e-300)]
)
def test_settings_past_what_float32_can_compute_decode_greedily(model, sampling):
    """A temperature too small to divide by, or a top_p below any token's probability, is greedy decoding
    (tiny, but not zero: this is the limit the distribution tends to)."""
    draft, tok = make_draft(seed=11, **DRAFT), make_tokenizer(vocab=V, eos=V + 5)
    greedy = generate(model, draft, tok, PROMPT, max_tokens=24)
    assert generate(model, draft, tok, PROMPT, max_tokens=24, seed=1, **sampling).tokens == greedy.tokens
    with_draws = generate(model, draft, tok, PROMPT, max_tokens=24, seed=1, temperature=0.7)
    assert with_draws.tokens != greedy.tokens  # (at a temperature that samples, the answer differs)


def test_any_integer_is_a_seed_taken_modulo_2_to_the_64(model):
    draft, tok = make_draft(seed=11, **DRAFT), make_tokenizer(vocab=V, eos=V + 5)

    def answer(seed):
        return generate(model, draft, tok, PROMPT, max_tokens=12, temperature=1.0, seed=seed).tokens

    assert answer(-1) == answer(2**64 - 1) and answer(10**30) == answer(10**30 % 2**64)


def test_greedy_picks_what_plain_mlx_lm_picks_where_rounding_ties_two_logits():
    from mlx_lm.sample_utils import make_sampler

    # In bfloat16 the log-probabilities of 3.0 and 3.015625 round to one value: mlx-lm's greedy sampler
    # then takes the lower id (0), while the argmax of the logits is 1.
    logits = mx.array([[3.0, 3.015625] + [2.0] * 20000]).astype(mx.bfloat16)
    plain = make_sampler(temp=0.0)(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    assert plain.item() == 0 and mx.argmax(logits, axis=-1).item() == 1
    assert SamplingParams().sample(logits).item() == 0  # the first token of an answer
    _, accept = acceptance(SamplingParams(), None)
    verify = mx.concatenate([logits, logits], axis=0)  # a verify pass over [last, x_1]
    n, token = accept(mx.array([1]), None, verify)
    assert n.item() == 0 and token.item() == 0  # proposal 1 is rejected; the target's own token is 0


def test_a_sampler_that_flips_one_coin_per_call_stays_exact(model):
    """mlx-lm's XTC flips one coin per call, for the whole batch: a verify pass's positions must not
    share it. Here the coin picks the argmax or the argmin of every row, with a drafter that is right
    whenever the coin says argmax."""

    def coin(logprobs):
        return mx.where(mx.random.uniform() < 0.5, mx.argmax(logprobs, axis=-1), mx.argmin(logprobs, axis=-1))

    joint = {(): 1.0}  # plain decoding: one coin per token
    for _ in range(T):
        seqs = list(joint)
        logits = np.array(model(mx.array([PROMPT + list(s) for s in seqs]))[:, -1].astype(mx.float32))
        joint = {
            s + (t,): joint[s] * 0.5
            for s, row in zip(seqs, logits)
            for t in (int(row.argmax()), int(row.argmin()))
        }
    holder = [None]
    counts = sample_counts(
        model, TargetPathDraft(draft_config(**DRAFT), model, holder), holder, 0.0, 1.0, sampler=coin
    )
    assert sum(counts.get(s, 0) for s in joint) == RUNS  # nothing plain decoding could not write
    p = chisquare([counts.get(s, 0) for s in joint], [q * RUNS for q in joint.values()]).pvalue
    assert p > 1e-3, f"chi-square p-value {p:.2e}: the verify pass shared one coin"


def test_a_dflash2_drafter_in_bfloat16_draws_its_proposals_from_the_q_it_reports():
    """Rejection sampling is exact only if each proposal was drawn from the q handed to it. A bfloat16
    drafter's scores divided by a temperature round in bfloat16, where q is float32: at logits of an
    LLM's size (about 30) and close candidates, that moved the draws by up to 20% of their share."""
    selector = make_dflash2(seed=11, top_k=3).candidate_selector
    selector.set_dtype(mx.bfloat16)
    selector.predecessor_codebook = mx.zeros_like(selector.predecessor_codebook)  # (scores: the logits)
    logits = mx.array([[30.0, 30.25, 29.75] + [-5.0] * (V - 3)], dtype=mx.bfloat16)
    hidden = mx.zeros((1, selector.hidden_projection.weight.shape[1]), dtype=mx.bfloat16)
    runs = 4000
    for temperature in (0.3, 0.7):
        mx.random.seed(0)
        picks = [selector.select(hidden, logits, 6, temperature) for _ in range(runs)]
        _, probs, candidates = picks[0]
        counts = dict.fromkeys(candidates[0].tolist(), 0)
        for x, _, _ in picks:
            counts[x.item()] += 1
        q = np.array(probs[0], dtype=np.float64)
        p = chisquare(list(counts.values()), q / q.sum() * runs).pvalue
        assert p > 1e-3, f"chi-square p-value {p:.2e} at T={temperature}: proposals not drawn from their q"
