"""Token trees: one pass gives every node the target's logits for its own path, the caches keep the
accepted path only, and the output is the target's own."""

import sys
import threading

import mlx.core as mx
import numpy as np
import pytest
from test_cache import assert_same_caches
from test_engine import drive
from test_policy import CPU
from test_sampling import DRAFT, PROMPT, RUNS, T, TargetPathDraft, V, chi_square_p, exact_joint, sample_counts
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
from dflash_mlx.drafters import NgramIndex
from dflash_mlx.engine import Engine, Sequence
from dflash_mlx.models.targets import Target
from dflash_mlx.pairing import prepare
from dflash_mlx.policy import DECAY, DFLASH, TREE, AdaptivePolicy, Choice, CostModel
from dflash_mlx.settings import GenerationSettings
from dflash_mlx.trees import Tree, build, graft, path_of, walk

RECURRENT = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "lfm2")
ATTENTION = [f for f in FAMILIES if f not in RECURRENT]

# block index: 0 pending; 1, 2 children of 0; 3, 4 of 1; 5 of 3; 6 of 2; 7 of 5
PARENTS = [0, 0, 1, 1, 3, 2, 5]


def path_to(parents: list[int], i: int) -> list[int]:
    path = [i]
    while path[-1]:
        path.append(parents[path[-1] - 1])
    return path[::-1]


def logits_after(target: Target, tokens: list[int]) -> mx.array:
    cache = target.make_cache()
    logits, _ = target(mx.array([tokens]), cache)
    return logits[0, -1]


@pytest.mark.parametrize("family", ATTENTION)
def test_a_tree_pass_gives_each_node_the_logits_of_its_own_path_and_keeps_the_path_chosen(family):
    target = Target(make_target(family))
    prompt = prompt_of(13, seed=3)  # past the tiny models' sliding window of 8
    nodes = prompt_of(len(PARENTS), seed=4)
    tree = Tree(nodes, PARENTS, [len(path_to(PARENTS, i + 1)) - 1 for i in range(len(PARENTS))])
    block = [prompt[-1]] + nodes
    cache = target.make_cache()
    target(mx.array([prompt[:-1]]), cache)
    logits, _, undo = target.verify(mx.array([block]), cache, trees=[tree])
    for i in range(len(block)):
        path = [block[j] for j in path_to(PARENTS, i)]
        np.testing.assert_allclose(
            logits[0, i], logits_after(target, prompt[:-1] + path), rtol=1e-4, atol=1e-4
        )
    kept = path_to(PARENTS, 7)  # [0, 1, 3, 5, 7]: not a prefix of the block
    target.rollback(cache, undo, len(kept), paths={0: kept})
    after, _ = target(mx.array([[5]]), cache)
    want = logits_after(target, prompt[:-1] + [block[j] for j in kept] + [5])
    np.testing.assert_allclose(after[0, -1], want, rtol=1e-4, atol=1e-4)


def test_best_first_trees_hold_the_likeliest_paths_and_walks_follow_the_target():
    ids = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
    values = [[0.6, 0.25, 0.15], [0.5, 0.4, 0.1], [0.9, 0.05, 0.05]]
    tree, scores = build(ids, values, 5)
    # 10 (.6), 10-20 (.3), 10-20-30 (.27), 11 (.25), 10-21 (.24)
    assert tree.tokens == [10, 20, 30, 11, 21] and tree.parents == [0, 1, 2, 0, 1]
    assert tree.depths == [1, 2, 3, 1, 2]
    np.testing.assert_allclose(scores, [0.6, 0.3, 0.27, 0.25, 0.24])
    assert scores == sorted(scores, reverse=True)
    # The target's choice after each block index: after 0 it takes 10, after 1 (10) 21, after 5 (21) 7.
    choices = mx.array([10, 21, 0, 0, 0, 7])
    n, nxt, accepted = walk(tree, choices)
    assert (n.item(), nxt.item()) == (2, 7) and path_of(accepted.tolist()) == [0, 1, 5]
    n, nxt, accepted = walk(tree, mx.array([99, 0, 0, 0, 0, 0]))
    assert (n.item(), nxt.item()) == (0, 99) and path_of(accepted.tolist()) == [0]


def test_lookups_chain_joins_a_tree_sharing_the_nodes_it_matches_best_first():
    ids = [[10, 11], [20, 21], [30, 31]]
    tree, scores = build(ids, [[0.6, 0.3], [0.5, 0.4], [0.9, 0.1]], 4)  # 10, 10-20, 10-20-30, 11
    joined, values = graft(tree, scores, [10, 21, 40], [0.9, 0.8, 0.35])
    paths = joined.paths()[1:]
    assert sorted(map(tuple, paths)) == [(10,), (10, 20), (10, 20, 30), (10, 21), (10, 21, 40), (11,)]
    assert paths[0] == [10] and values[0] == 0.9  # shared: the higher value
    assert values[paths.index([10, 20])] == pytest.approx(0.3 * 0.9 / 0.6)  # (below it: risen with it)
    assert [paths[i - 1] for i in joined.lookup] == [[10], [10, 21], [10, 21, 40]]
    assert [joined.ranks[i - 1] for i in joined.lookup] == [0, -1, -1]
    assert values == sorted(values, reverse=True)
    for n in range(joined.size + 1):  # every prefix is a tree: parents first
        first = joined.first(n)
        assert all(p < i + 1 for i, p in enumerate(first.parents))
        assert first.lookup == [i for i in joined.lookup if i <= n]
    assert not joined.first_guesses and tree.first(1).first_guesses
    assert not graft(tree, scores, [10, 20], [0.9, 0.8])[0].first(2).first_guesses  # (lookup learns)


def test_a_grafted_tree_keeps_parents_first_where_the_drafter_is_certain():
    # The drafter sure of its guesses after 10: their values equal 10's, and 10's rising with lookup's
    # odds must not lift them above it by a rounding (0.891 * (1.0 / 0.891) is a hair over 0.891).
    tree, scores = build(
        [[10, 11], [20, 21], [30, 31]], [[0.8018768429756165, 0.2], [1.0, 0.0], [1.0, 0.0]], 4
    )
    joined, values = graft(tree, scores, [10, 20, 30], [0.891, 0.4455, 0.22275])
    assert joined.paths()[1:4] == [[10], [10, 20], [10, 20, 30]]
    assert all(p <= i for i, p in enumerate(joined.parents)) and values == sorted(values, reverse=True)
    joined.ancestors()  # (what a tree pass builds its mask from: raised IndexError)


class WrongDraft(OracleDraft):
    """Guesses the target's continuation wrong at the first position of every block."""

    def __init__(self, config, reference):
        super().__init__(config, reference, errors=(0,))


class OracleLookup(NgramIndex):
    """Prompt lookup that finds the target's own next `right` tokens, then a wrong one."""

    def __init__(self, reference: list[int], right: int):
        super().__init__()
        self.reference, self.right = reference, right

    def match(self, cap=16):
        end = len(self.tokens)
        found = self.reference[end : end + self.right]
        if end + len(found) < len(self.reference):
            found.append((self.reference[end + len(found)] + 1) % 96)
        return found, 3


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_a_tree_verifies_lookups_match_beside_the_drafters_guesses_and_gives_mlx_lms_tokens(family):
    model, prompt = make_target(family), prompt_of(11, seed=9)
    ref = greedy_reference(model, prompt, 30)
    draft = WrongDraft(draft_config(block_size=8), prompt + ref)
    target = prepare(model, draft)
    cache = SpeculativeCache(target, draft)
    cache.index = OracleLookup(prompt + ref, right=3)
    out, accepted = [], []
    for r in stream_generate(
        target, draft, no_eos_tokenizer(ref), prompt, max_tokens=30, tree=8, prompt_cache=cache
    ):
        out += r.tokens
        accepted.append(r.accepted)
        fresh = SpeculativeCache(target, draft)
        fresh.prefill(cache.tokens[: cache.processed])
        assert_same_caches(cache, fresh)
    assert out == ref
    # each cycle: lookup's 3 right tokens and the target's own (the drafter's first guess is wrong)
    assert accepted[1:-1] and set(accepted[1:-1]) == {4}


class RankedOracle(OracleDraft):
    """Knows the target's greedy continuation and ranks it first, second or third at each position (in
    turn), behind decoys: chains stop at its first miss, trees go on along its second guesses."""

    def propose_logits(self, last_token, cache, block_size, compiled=True, heads=None):
        start, vocab, reference = cache[0].offset, self.config.vocab_size, self.reference_for(cache)
        logits = mx.full((1, block_size - 1, vocab), -30.0)
        self.cycle += 1
        for i, p in enumerate(range(start + 1, start + block_size)):
            right = reference[p] if p < len(reference) else 0
            rank = (self.cycle + i) % 3
            for j in range(rank):
                logits[0, i, (right + 1 + j) % vocab] = 10.0 - j
            logits[0, i, right] = 10.0 - rank
        return logits[:, :heads]


@pytest.mark.parametrize("family", ATTENTION)
def test_greedy_trees_give_mlx_lms_tokens_and_leave_caches_as_a_fresh_prefill(family):
    model, prompt = make_target(family), prompt_of(11, seed=8)
    ref = greedy_reference(model, prompt, 40)
    draft = RankedOracle(draft_config(block_size=8), prompt + ref)
    target = prepare(model, draft)
    tok = no_eos_tokenizer(ref)
    for width in (4, 13):
        cache = SpeculativeCache(target, draft)
        out, depths = [], []
        for r in stream_generate(target, draft, tok, prompt, max_tokens=40, tree=width, prompt_cache=cache):
            out += r.tokens
            assert r.source in (None, TREE)
            depths.append(r.accepted)
            fresh = SpeculativeCache(target, draft)
            fresh.prefill(cache.tokens[: cache.processed])
            assert_same_caches(cache, fresh)
        assert out == ref
    assert max(depths[1:]) >= 3  # (a chain accepts one proposal at most here: ranks 0, 1, 2 in turn)


@pytest.mark.parametrize("lookup", [False, True])
def test_sequences_of_a_batch_verify_trees_in_the_shared_pass_and_each_gets_its_own_tokens(lookup):
    model = make_target("gpt_oss")  # (sliding-window layers: the window is masked by tree positions)
    draft = RankedOracle(draft_config(block_size=8), None)
    target = prepare(model, draft)
    plans = [(3, 30, 0, 6), (14, 25, 0, None), (9, 30, 2, 10), (20, 12, 4, 4)]  # prompt, max, joins, tree
    joins, wants = {}, {}
    for i, (length, max_tokens, at, tree) in enumerate(plans):
        prompt = prompt_of(length, seed=30 + i)
        ref = greedy_reference(model, prompt, max_tokens)
        cache = SpeculativeCache(target, draft)
        draft.follow(cache, prompt + ref)
        if lookup:  # (each row's trees hold a branch of its own lookup's, right for i + 1 tokens)
            cache.index = OracleLookup(prompt + ref, right=i + 1)
        seq = Sequence(cache, GenerationSettings(max_tokens=max_tokens, tree=tree, lookup=lookup), max_tokens)
        joins.setdefault(at, []).append((seq, prompt))
        wants[seq] = (prompt, ref)
    e = Engine(target, draft)
    shared = []
    original = e._verify

    def verify(rows, blocks, solo, trees):
        shared.append(e.batch is not None and sum(t is not None for t in trees) >= 2)
        return original(rows, blocks, solo, trees)

    e._verify = verify
    out = drive(e, joins)
    assert any(shared)
    for seq, (_, ref) in wants.items():
        assert out[seq] == ref
        fresh = SpeculativeCache(target, draft)
        fresh.prefill(seq.cache.tokens[: seq.cache.processed])
        assert_same_caches(seq.cache, fresh)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_trees_follow_the_target_distribution(temperature, top_p):
    """Each node's token is the target's own draw there, and the walk follows the draws: χ² over the
    first T tokens, with a drafter that proposes from the target's own distributions."""
    model = make_target("llama", seed=4, vocab_size=V, num_hidden_layers=1)
    holder = [None]
    draft = TargetPathDraft(draft_config(**DRAFT), model, holder)
    counts = sample_counts(model, draft, holder, temperature, top_p, tree=4)
    p = chi_square_p(counts, exact_joint(model, temperature, top_p))
    assert p > 1e-3, f"chi-square p-value {p:.2e}: trees do not sample from the target's distribution"


def test_a_batch_of_seeded_answers_through_trees_samples_each_from_its_own_distribution():
    model = make_target("llama", seed=4, vocab_size=V, num_hidden_layers=1)
    draft = make_draft(seed=11, **DRAFT)
    target = prepare(model, draft)
    counts = {}
    for run in range(RUNS // 6):
        settings = [
            GenerationSettings(temperature=1.0, max_tokens=T, tree=3, seed=6 * run + i) for i in range(6)
        ]
        seqs = [Sequence(SpeculativeCache(target, draft), s, T) for s in settings]
        out = drive(Engine(target, draft), {0: [(s, PROMPT) for s in seqs]})
        for s in seqs:
            counts[tuple(out[s])] = counts.get(tuple(out[s]), 0) + 1
    p = chi_square_p(counts, exact_joint(model, 1.0, 1.0))
    assert p > 1e-3, f"chi-square p-value {p:.2e}: a batch of trees does not sample exactly"


def run_tree_trace(policy, ranks, values, cycles, rng):
    """Drive the policy with a drafter whose candidates have `values` at every position and a target whose
    token is the drafter's r-th guess with probability ranks[r] (else none of them): -> per cycle (the
    tree or None, proposals verified, proposals accepted)."""
    made = []
    for _ in range(cycles):
        choice = policy.choose(500, ([], 0))
        if choice.source != DFLASH:
            policy.observe(choice, 0, 0, [], 0)
            made.append((None, 0, 0))
            continue
        depth = choice.k
        ids = mx.array([[10 * d + r for r in range(len(values))] for d in range(depth)])
        k, confidence, tree = policy.shape(choice, ids, mx.array([values] * depth), 500, 32, ([], 0))
        none = -1  # the target took none of the candidates
        truth = rng.choices([*range(len(ranks)), none], weights=[*ranks, 1 - sum(ranks)], k=depth)
        if tree is None:
            accepted = next((i for i in range(k) if truth[i] != 0), k)
            policy.observe(choice, k, accepted, confidence, 0)
        else:
            path = [0]
            while True:
                d = len(path) - 1
                child = (
                    next(
                        (
                            i + 1
                            for i, (p, r) in enumerate(zip(tree.parents, tree.ranks))
                            if p == path[-1] and r == truth[d]
                        ),
                        None,
                    )
                    if d < depth
                    else None
                )
                if child is None:
                    break
                path.append(child)
            accepted = len(path) - 1
            policy.observe_tree(tree, [values] * depth, path, 0)
        made.append((tree, k, accepted))
    return made


WIDE_MAC = CostModel(
    [64],
    [1, 2, 4, 8, 16, 32],
    [[1.0, 1.01, 1.03, 1.06, 1.1, 1.15]],
    [1, 3, 7, 15],
    [[0.1] * 4],
    [0.9],
    [0.95],
)


def test_where_width_is_nearly_free_the_policy_verifies_trees_that_accept_more_than_chains():
    import random

    rng = random.Random(3)
    policy = AdaptivePolicy(WIDE_MAC, 15, lookup=False, trees=True)
    made = run_tree_trace(policy, [0.85, 0.1, 0.03], [0.85, 0.1, 0.03, 0.02], 300, rng)  # a chain's tau ~ 6
    late = made[100:]
    assert sum(t is not None for t, _, _ in late) / len(late) > 0.9
    assert sum(k for _, k, _ in late) / len(late) > 16  # wider than a block of 16
    chains = AdaptivePolicy(WIDE_MAC, 15, lookup=False)
    chained = run_tree_trace(chains, [0.85, 0.1, 0.03], [0.85, 0.1, 0.03, 0.02], 300, random.Random(3))[100:]
    assert sum(a for _, _, a in late) / len(late) > 1.2 * sum(a for _, _, a in chained) / len(chained)


def test_where_width_is_dear_and_the_drafter_weak_the_policy_leaves_trees_and_blocks_alone():
    import random

    policy = AdaptivePolicy(CPU, 15, lookup=False, trees=True)
    made = run_tree_trace(policy, [0.25, 0.1, 0.05], [0.3, 0.15, 0.1, 0.05], 400, random.Random(4))
    late = made[200:]
    assert sum(k == 0 for _, k, _ in late) / len(late) > 0.9


def test_answers_generated_in_threads_at_once_are_each_what_it_gives_alone():
    # A pass lends the shared model's layers taps (and, for a tree, masks and positions) while its graph
    # is built, and MLX evaluates from one thread at a time: answers in threads at once crashed, took
    # each other's features or hung. They now take turns.
    model, draft, tok = make_target("llama"), make_draft(), make_tokenizer()
    jobs = [(prompt_of(9 + i, seed=i), {"tree": 8} if i % 2 else {"block_size": 8}) for i in range(6)]
    alone = [generate(model, draft, tok, p, max_tokens=24, **kw).tokens for p, kw in jobs]
    together, failed = [None] * len(jobs), []

    def answer(i):
        try:
            p, kw = jobs[i]
            together[i] = generate(model, draft, tok, p, max_tokens=24, **kw).tokens
        except Exception as e:  # noqa: BLE001  (reported below)
            failed.append(repr(e))
        finally:
            mx.clear_streams()  # (MLX's rule for a thread that ran MLX: else an abort at exit)

    threads = [threading.Thread(target=answer, args=(i,), daemon=True) for i in range(len(jobs))]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (threads take turns within a pass's building, as on a loaded machine)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads), "hung"
    assert not failed and together == alone


def test_the_adaptive_policy_joins_lookups_match_to_a_drafted_tree_and_learns_its_odds_from_it():
    policy = AdaptivePolicy(WIDE_MAC, 15, lookup=True, trees=True)
    for _ in range(20):  # lookup's matches after 3 tokens have been right
        policy.lookup[3].observe(4, 4)
    ids = mx.array([[10 * (d + 1) + r for r in range(4)] for d in range(7)])
    values = mx.array([[0.5, 0.2, 0.1, 0.05]] * 7)
    _, _, tree = policy.shape(Choice(DFLASH, 7), ids, values, 500, 32, ([1, 2, 3, 4], 3))
    paths = tree.paths()
    assert [paths[i] for i in tree.lookup] == [[1], [1, 2], [1, 2, 3], [1, 2, 3, 4]]
    assert [10, 20] in paths  # and the drafter's guesses beside them
    before = [list(policy.lookup[3].hits), list(policy.lookup[3].trials)]
    policy.observe_tree(tree, values.tolist(), [0, *tree.lookup[:2]], 3)  # 2 of lookup's 4 taken
    hits, trials = (
        np.array(x) - np.array(b) * DECAY
        for x, b in zip([policy.lookup[3].hits, policy.lookup[3].trials], before)
    )
    np.testing.assert_allclose(hits[1:5], [1, 1, 0, 0], atol=1e-9)
    np.testing.assert_allclose(trials[1:5], [1, 1, 1, 0], atol=1e-9)
