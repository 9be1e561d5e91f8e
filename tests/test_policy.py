"""The adaptive cycle: prompt lookup, the cost model and the per-cycle choice, and that no choice it can
make changes the output."""

import dataclasses
import json
import random

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from test_cache import assert_same_caches
from test_sampling import RUNS, T, V, chi_square_p, exact_joint
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
    successor_target,
)

import dflash_mlx.engine as engine
import dflash_mlx.speculative as speculative
from dflash_mlx import SpeculativeCache, generate, stream_generate
from dflash_mlx.drafters import AGREEMENT_MAX, NgramIndex
from dflash_mlx.pairing import prepare
from dflash_mlx.policy import (
    DECAY,
    DFLASH,
    LOOKUP,
    PLAIN,
    PROBE_ANSWER,
    PROBE_MAX,
    WIDTHS,
    AdaptivePolicy,
    BatchPace,
    Choice,
    CostModel,
    FixedPolicy,
    choose_batch,
    policy_for,
)


def brute_force_match(tokens, sizes, cap, found=None):
    """Lookup's match by searching the whole context: the match found earlier (`found`: the context's
    length then, and where the match's tokens started) while the text since has copied it, else the
    latest occurrence of the longest suffix -> (tokens, how many tokens before it agree with the
    text's last ones, what was found)."""
    sizes = sorted(sizes, reverse=True)
    if found is not None:
        end, i = found
        since = len(tokens) - end
        if tokens[end:] == tokens[i : i + since]:
            at = i + since
            for n in sizes:
                if at >= n and tokens[at - n : at] == tokens[len(tokens) - n :]:
                    return tokens[at : at + cap], agreement(tokens, at), found
    for n in sizes:
        if len(tokens) < n:
            continue
        suffix = tokens[len(tokens) - n :]
        for i in range(len(tokens) - 1, n - 1, -1):
            if tokens[i - n : i] == suffix:
                return tokens[i : i + cap], agreement(tokens, i), (len(tokens), i)
    return [], 0, None


def agreement(tokens, i):
    """How many tokens before index i equal the last ones (at most AGREEMENT_MAX)."""
    n = 0
    while n < min(i, AGREEMENT_MAX) and tokens[i - 1 - n] == tokens[len(tokens) - 1 - n]:
        n += 1
    return n


def brute_force_possible(tokens, sizes):
    """Suffix lengths n at which some next token would complete an n-gram that occurred before."""
    return [
        n
        for n in sorted(sizes, reverse=True)
        if n > 1
        and len(tokens) >= n - 1
        and any(tokens[i - n + 1 : i] == tokens[len(tokens) - n + 1 :] for i in range(n - 1, len(tokens)))
    ]


def test_the_lookup_index_finds_what_a_search_of_the_whole_context_finds():
    rng = random.Random(0)
    for _ in range(300):
        vocab = rng.choice([2, 3, 5, 20])
        sizes = rng.choice([(4, 3, 2), (3, 2, 1), (2,), (5, 1)])
        cap = rng.choice([1, 4, 16])
        index, tokens, found = NgramIndex(sizes), [], None
        for _ in range(rng.randrange(1, 60)):
            if found is not None and rng.random() < 0.7:  # the text goes on copying the match
                new = tokens[found[1] + len(tokens) - found[0] :][: rng.randrange(1, 6)]
            else:
                new = [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
            index.extend(new)
            tokens += new
            *expected, found = brute_force_match(tokens, sizes, cap, found)
            assert index.match(cap) == tuple(expected)
            assert index.possible() == brute_force_possible(tokens, sizes)
            if rng.random() < 0.1:
                index = index.copy()
        cut = rng.randrange(len(tokens) + 1)
        index.truncate(cut)  # (a context cut short is searched afresh)
        kept = found if cut == len(tokens) else None
        assert index.match(cap) == tuple(brute_force_match(tokens[:cut], sizes, cap, kept)[:2])


def test_lookup_follows_the_match_it_is_copying_rather_than_the_latest_occurrence_of_its_suffix():
    """An answer copying a document: its last tokens occur later too (a line of its own that ends the
    same way), but the document's next tokens are where the copy goes on."""
    document = [10, 11, 12, 13, 20, 21, 22, 23, 14, 15, 16]
    index = NgramIndex()
    index.extend(document + [50, 20, 21, 22, 23, 99, 50])  # (a line of its own: [20, 21, 22, 23, 99])
    index.extend([10, 11])
    assert index.match(4) == ([12, 13, 20, 21], 2)  # found in the document, and followed
    index.extend([12, 13, 20, 21, 22, 23])
    # not [99, 50, 10, 11], after the latest [20, 21, 22, 23]; the text agrees with the document's 8
    assert index.match(4) == ([14, 15, 16, 50], 8)
    index.extend([14, 77])  # a token the document does not have: the copy ends
    assert index.copying is None
    index.extend([20, 21, 22, 23])
    assert index.match(4) == ([14, 77, 20, 21], 4)  # the latest occurrence again (the answer's own)


class ScriptedPolicy(FixedPolicy):
    """Makes the choices of a script in turn (lookup falls back to a plain step without a match)."""

    def __init__(self, script):
        self.script, self.cycle = script, 0

    def choose(self, context, lookup, built=False):
        choice = self.script[self.cycle % len(self.script)]
        self.cycle += 1
        if choice.source == LOOKUP and not lookup[0]:
            return Choice(PLAIN, 0)
        return choice

    def plain_next(self, context, index):
        """Start every other plain step the script has next before the step before it is read; the others
        are built and then launched, and a plain step followed by something else is built and dropped:
        every path a plain step can take."""
        self.early = not getattr(self, "early", False)
        plain = self.script[self.cycle % len(self.script)].source == PLAIN
        self.paths = getattr(self, "paths", set()) | {(plain, self.early)}
        return plain and self.early


SCRIPT = [
    Choice(DFLASH, 15),
    Choice(LOOKUP, 3),
    Choice(PLAIN, 0),
    Choice(PLAIN, 0),
    Choice(PLAIN, 0),
    Choice(DFLASH, 1),
    Choice(LOOKUP, 16),
    Choice(DFLASH, 6),
    Choice(LOOKUP, 1),
    Choice(DFLASH, 15),
    Choice(LOOKUP, 8),
]


class OracleIndex(NgramIndex):
    """Lookup that proposes the reference continuation of the context, wrong at one position in turn, so
    lookup cycles happen whatever the text (the real index is tested against a brute-force search above)."""

    def __init__(self, reference, errors):
        super().__init__()
        self.reference, self.errors, self.calls = reference, errors, 0

    def match(self, cap=16):
        guess = self.reference[len(self.tokens) : len(self.tokens) + cap]
        err = self.errors[self.calls % len(self.errors)]
        self.calls += 1
        if err is not None and err < len(guess):
            guess[err] = (guess[err] + 1) % 96
        return guess, 3


@pytest.fixture
def scripted(monkeypatch):
    def use(script):
        policy = ScriptedPolicy(script)
        monkeypatch.setattr(engine, "policy_for", lambda *a, **k: policy)

    return use


@pytest.mark.parametrize("family", FAMILIES)
def test_every_choice_and_every_switch_between_them_is_lossless(family, scripted):
    scripted(SCRIPT)
    model, prompt = make_target(family), prompt_of(12, seed=3)
    ref = greedy_reference(model, prompt, 70)
    draft = OracleDraft(draft_config(block_size=16), prompt + ref, [None, 0, 4, 2, 9])
    target = speculative.prepare(model, draft)
    cache = SpeculativeCache(target, draft)
    cache.index = OracleIndex(prompt + ref, [None, 1, 0, 5])
    tok = make_tokenizer(eos=next(i for i in range(3, 96) if i not in ref))
    sources = []
    for piece in stream_generate(target, draft, tok, prompt, max_tokens=60, prompt_cache=cache):
        assert cache.tokens == prompt + ref[: len(cache.tokens) - len(prompt)]
        fresh = SpeculativeCache(target, draft)
        fresh.prefill(cache.tokens[: cache.processed])
        assert_same_caches(cache, fresh)
        sources.append((piece.source, piece.proposed))
    assert cache.tokens[len(prompt) :] == ref[:60]
    assert engine.policy_for().paths == {(True, True), (True, False), (False, True), (False, False)}
    assert {s for s, _ in sources[1:]} == {PLAIN, LOOKUP, DFLASH}
    assert len({k for s, k in sources if s == DFLASH}) > 1 and len({k for s, k in sources if s == LOOKUP}) > 1


@pytest.mark.parametrize("end", ["eos", "stop", "max_tokens"])
def test_an_answer_that_ends_with_the_next_cycle_under_way_leaves_a_cache_to_go_on_from(end, scripted):
    """Decoding starts the next cycle before it hands out a cycle's tokens: when those end the answer,
    that cycle is taken back, and the conversation goes on as if it had never started."""
    scripted([Choice(PLAIN, 0), Choice(PLAIN, 0), Choice(DFLASH, 3)])
    model, prompt, more = make_target("qwen3_5"), prompt_of(9, seed=8), prompt_of(5, seed=12)
    ref = greedy_reference(model, prompt, 40)
    draft = make_draft(block_size=4)
    cut = next(i for i in range(12, 30) if ref[i] not in ref[:i])
    no_eos = no_eos_tokenizer(ref)
    tok, kwargs = {
        "eos": (make_tokenizer(eos=ref[cut]), dict(max_tokens=40)),
        "stop": (no_eos, dict(max_tokens=40, stop=[f"w{ref[cut]} "])),  # (the text of that token)
        "max_tokens": (no_eos, dict(max_tokens=cut + 1)),
    }[end]
    cache = SpeculativeCache(model, draft)
    out = generate(model, draft, tok, prompt, prompt_cache=cache, **kwargs)
    assert out.tokens[: cut + 1] == ref[: cut + 1] and out.finish_reason in ("stop", "length")
    assert not cache.in_flight and not cache.broken
    fresh = SpeculativeCache(model, draft)
    fresh.prefill(cache.tokens[: cache.processed])
    assert_same_caches(cache, fresh)
    want = greedy_reference(model, cache.tokens + more, 12)
    assert (
        generate(model, draft, no_eos_tokenizer(want), more, max_tokens=12, prompt_cache=cache).tokens == want
    )


def repeating(n: int) -> tuple:
    """-> (target, a prompt that repeats itself, mlx-lm's first n greedy tokens after it, a tokenizer whose
    EOS is none of them)."""
    part = prompt_of(7, seed=5)
    model, prompt = make_target("llama"), part + prompt_of(3, seed=6) + part
    ref = greedy_reference(model, prompt, n)
    return model, prompt, ref, make_tokenizer(eos=next(i for i in range(3, 96) if i not in ref))


def test_lookup_proposals_cut_by_eos_stop_strings_and_max_tokens(scripted):
    scripted([Choice(LOOKUP, 16)])
    model, prompt, ref, no_eos = repeating(80)
    full = generate(model, None, no_eos, prompt, max_tokens=80)
    assert full.tokens == ref and full.mix.get(LOOKUP, 0) > 0
    for limit in (1, 7, 23):
        assert generate(model, None, no_eos, prompt, max_tokens=limit).tokens == ref[:limit]
    eos_at = next(i for i in range(10, 70) if ref[i] not in ref[:i])
    out = generate(model, None, make_tokenizer(eos=ref[eos_at]), prompt, max_tokens=80)
    assert out.tokens == ref[: eos_at + 1] and out.finish_reason == "stop"
    stop = " ".join(full.text.split()[20:22])
    out = generate(model, None, no_eos, prompt, max_tokens=80, stop=[stop])
    assert out.text == full.text[: full.text.index(stop)] and out.finish_reason == "stop"


def test_a_copy_under_way_is_verified_in_the_widest_pass_and_stays_mlx_lms_answer(scripted):
    """A target whose answer goes on copying its prompt: lookup's matches run as long as the widest pass
    priced, and a cycle verifies 31 proposals and takes them all; the answer is mlx-lm's, cut where
    asked."""
    loop = list(range(3, 43))
    model, _ = successor_target({t: loop[(i + 1) % len(loop)] for i, t in enumerate(loop)})
    prompt = loop + loop[:6]
    ref = greedy_reference(model, prompt, 100)
    assert ref[:40] == loop[6:] + loop[:6]
    scripted([Choice(LOOKUP, 31)])
    out = generate(model, None, make_tokenizer(), prompt, max_tokens=100)
    assert out.tokens == ref and max(out.acceptance_lengths) == 32 and set(out.sources[1:]) == {LOOKUP}
    assert generate(model, None, make_tokenizer(), prompt, max_tokens=45).tokens == ref[:45]


# Costs in units of one plain step: a Mac-like target (a wide verify pass costs little more than a step)
# and this project's CPU (measured with SmolLM2-135M float32; see docs/policy.md).
MAC = CostModel(
    [64],
    [1, 2, 4, 8, 16],
    [[1.0, 1.01, 1.03, 1.06, 1.1]],
    [1, 3, 7, 15],
    [[0.1, 0.1, 0.11, 0.12]],
    [0.9],
    [0.95],
)
CPU = CostModel(
    [64],
    [1, 2, 4, 8, 16],
    [[1.0, 1.12, 1.40, 1.56, 1.98]],
    [1, 3, 7, 15],
    [[0.27, 0.3, 0.32, 0.42]],
    [0.9],
    [0.95],
)

DEMO_CPU = CostModel(  # the demo pair's costs measured on a 2-core CPU, a step = 1
    [64],
    [1, 2, 4, 8, 16],
    [[1.0, 1.0, 1.66, 2.05, 2.84]],
    [1, 3, 7, 15],
    [[0.21, 0.46, 0.61, 0.82]],
    [0.92],
    [0.93],
)


def run_trace(policy, accept, cycles, confidence=0.5):
    """Drive the policy with DFlash acceptance drawn by accept(k) -> accepted; -> the choices made."""
    import mlx.core as mx

    made = []
    for _ in range(cycles):
        choice = policy.choose(500, ([], 0))
        k, conf = choice.k, []
        if choice.source == DFLASH:
            k, conf = policy.narrow(choice, mx.array([confidence] * choice.k), 500)
        policy.observe(choice, k, accept(k) if k else 0, conf, 0)
        made.append((choice.source if k else PLAIN, k))
    return made


def geometric(rate, rng):
    def accept(k):
        n = 0
        while n < k and rng.random() < rate:
            n += 1
        return n

    return accept


def test_on_a_mac_with_a_good_drafter_the_policy_keeps_full_blocks():
    rng = random.Random(1)
    made = run_trace(
        AdaptivePolicy(MAC, 15, lookup=False), geometric(0.85, rng), 300, confidence=0.9
    )  # tau ~ 6
    late = made[100:]
    assert all(s == DFLASH for s, _ in late)
    assert sum(k for _, k in late) / len(late) >= 12


def test_on_this_cpu_with_a_weak_drafter_the_policy_parks_dflash_and_comes_back_when_it_improves():
    rng = random.Random(2)
    policy = AdaptivePolicy(CPU, 15, lookup=False)
    made = run_trace(policy, geometric(0.3, rng), 400, confidence=0.3)  # tau ~ 1.4
    late = made[200:]
    assert sum(s == PLAIN for s, _ in late) / len(late) > 0.95  # parked: probed now and then
    assert any(s == DFLASH for s, _ in late)
    made = run_trace(policy, geometric(0.95, rng), 600, confidence=0.95)  # the text turns predictable
    assert sum(s == DFLASH for s, _ in made[-100:]) > 90


def run_timed(policy, accept, cycles, real: CostModel, load=lambda i: 1.0):
    """run_trace, with each cycle timed as `real` costs it (a plain step after a plain step started
    ahead), times load(cycle) (a busy machine) -> (the choices made, tokens per unit of real time, as
    `real` costs it, over the last half)."""
    import mlx.core as mx

    made, last, tokens, seconds = [], None, 0, 0.0
    for i in range(cycles):
        choice = policy.choose(500, ([], 0))
        k = 0
        if choice.source == DFLASH:
            k, conf = policy.narrow(choice, mx.array([0.35] * choice.k), 500)
        n = accept(k) if k else 0
        policy.observe(choice, k, n, conf if k else [], 0)
        if choice.source == PLAIN:
            after = "ahead" if last == PLAIN else None
            cost = real.step_time(500, after)
        else:
            after, cost = None, real.target_time(k + 1, 500) + real.draft_time(choice.k, 500)
        policy.timed(choice, k, 500, after, cost * load(i))
        last = choice.source if k or choice.source == PLAIN else PLAIN
        made.append(last)
        if i >= cycles // 2:
            tokens, seconds = tokens + n + 1, seconds + cost
    return made, tokens / seconds


def test_a_policy_whose_plain_steps_were_priced_too_high_learns_their_real_pace():
    # The CPU costs as measured at a busy moment: plain steps and narrow passes 60% dearer than they are.
    busy = dataclasses.replace(CPU, target=[[1.6, 1.65, 1.7, 1.8, 2.0]], ahead=[1.6], built=[1.6])
    plain_rate = 1 / CPU.step_time(500, "ahead")
    rng = random.Random(3)
    made = run_trace(AdaptivePolicy(busy, 15, lookup=False), geometric(0.35, rng), 200)
    assert sum(s == DFLASH for s, _ in made[100:]) > 90  # untimed, it drafts at a loss
    made, rate = run_timed(AdaptivePolicy(busy, 15, lookup=False), geometric(0.35, rng), 200, CPU)
    assert sum(s == PLAIN for s in made[100:]) > 90
    assert rate > 0.95 * plain_rate
    # ... and a drafter that pays is kept where the prices are right.
    made, rate = run_timed(AdaptivePolicy(CPU, 15, lookup=False), geometric(0.9, rng), 200, CPU)
    assert sum(s == DFLASH for s in made[100:]) > 90 and rate > 1.5 * plain_rate


def test_a_busy_moment_while_plain_steps_run_does_not_leave_the_policy_drafting_at_a_loss():
    """Plain steps timed while the machine is busy (every cycle 30% slower for 40 cycles) must not look
    slow for as long as the drafter, drafting since, keeps them parked: paces are measured against the
    runs beside them, and a busy moment slows both."""
    costs = DEMO_CPU  # (a drafted block of 1 costs 1.2 steps: τ 1.25 loses)
    plain_rate = 1 / costs.step_time(500, "ahead")
    made, rate = run_timed(
        AdaptivePolicy(costs, 15, lookup=False),
        geometric(0.25, random.Random(5)),
        1000,
        costs,
        load=lambda i: 1.3 if 400 <= i < 440 else 1.0,
    )
    assert made[300:400].count(DFLASH) < 5  # quiet: plain steps
    assert made[-300:].count(DFLASH) < 30 and rate > 0.98 * plain_rate


def test_a_longer_context_starts_from_the_paces_learnt_at_the_nearest_one():
    """Drafts that really take three times their price are parked at 1,500 tokens; at 3,000 (a context
    range where nothing was timed yet, whose costs are extrapolated) the policy starts from that pace
    rather than from the price, and does not draft at a loss again while it learns."""
    import mlx.core as mx

    rng = random.Random(4)
    policy = AdaptivePolicy(MAC, 15, lookup=False)

    def cycles(context, n):
        made, last = [], None
        for _ in range(n):
            choice = policy.choose(context, ([], 0))
            k, conf = 0, []
            if choice.source == DFLASH:
                k, conf = policy.narrow(choice, mx.array([0.6] * choice.k), context)
            policy.observe(choice, k, geometric(0.6, rng)(k) if k else 0, conf, 0)
            if choice.source == PLAIN:
                after = "ahead" if last == PLAIN else None
                cost = MAC.step_time(context, after)
            else:
                after, cost = None, 3 * (MAC.target_time(k + 1, context) + MAC.draft_time(choice.k, context))
            policy.timed(choice, k, context, after, cost)
            last = choice.source if k or choice.source == PLAIN else PLAIN
            made.append(last)
        return made

    made = cycles(1500, 200)
    assert DFLASH in made[:20] and made[-50:].count(DFLASH) < 5  # priced as measured it pays; timed, not
    policy.idle[DFLASH] = 0  # (no probe due)
    assert cycles(3000, 20).count(DFLASH) <= 1  # (a probe at most; priced from the costs alone: 9)


def test_an_answer_times_its_cycles_for_its_policy(cheap_width):
    model, draft = make_target("llama"), make_draft()
    prompt = prompt_of(24)
    generate(model, draft, no_eos_tokenizer(prompt), prompt, max_tokens=48)
    learnt = policy_for(prepare(model, draft), draft, block_size=None, lookup=True, trees=True)
    assert any(learnt.pace.values()) and all(r > 0 for ratios in learnt.pace.values() for r in ratios)
    assert {source for source, _ in learnt.pace} <= {LOOKUP, DFLASH}  # (plain steps: the reference)


def test_a_plain_step_started_ahead_is_timed_with_its_start_not_with_the_cycle_that_started_it(monkeypatch):
    # Starting a step on MLX's CPU backend waits for most of it to run; here starting one waits 0.1 s.
    # Each plain step built in advance pays for its own start, wherever that happened: else a plain
    # step after any other cycle would carry two steps' time.
    import time

    started = SpeculativeCache.launch

    def slow(self, *arrays):
        time.sleep(0.1)
        started(self, *arrays)

    monkeypatch.setattr(SpeculativeCache, "launch", slow)
    timed = []
    monkeypatch.setattr(
        AdaptivePolicy,
        "timed",
        lambda self, choice, k, context, after, seconds: timed.append((after, seconds)),
    )
    model, draft = make_target("llama"), make_draft()
    prompt = prompt_of(24)
    generate(model, draft, no_eos_tokenizer(prompt), prompt, max_tokens=48, temperature=1.0)
    assert any(after == "ahead" for after, _ in timed)
    for after, seconds in timed:
        assert (seconds >= 0.1) == (after in ("ahead", "built")), (after, seconds)


def test_leaving_a_run_of_plain_steps_costs_the_step_started_late_after_it():
    # A step started ahead costs 0.8 here, one started late 1.0: a lookup cycle of odds 0.5 (1.5 tokens
    # in 1.1) beats a run of plain steps (1.25 a second) only where no run is going.
    costs = CostModel([64], [1, 2], [[1.0, 1.1]], [], [], [0.8], [0.9])
    policy = AdaptivePolicy(costs, 0, lookup=True)
    policy.plain_probed.add((500).bit_length())  # (plain steps' pace known: no probe of them due)
    match = ([7, 8], 4)
    assert policy.choose(500, match) == Choice(LOOKUP, 1)
    assert policy.choose(500, match) == Choice(LOOKUP, 1)
    assert policy.choose(500, ([], 0)) == Choice(PLAIN, 0)
    assert policy.choose(500, match) == Choice(PLAIN, 0)  # (1.5 tokens in 1.1 + 0.2)


def test_plain_steps_that_win_again_are_probed_soon_at_the_next_close_call():
    policy = AdaptivePolicy(CPU, 15, lookup=False)
    policy.wait[PLAIN] = 1024  # (they lost close calls for a long time)
    assert policy.choose(500, ([], 0)) == Choice(PLAIN, 0)  # the priors' odds do not pay a draft here
    assert policy.wait[PLAIN] == AdaptivePolicy(CPU, 15, lookup=False).wait[PLAIN]


@pytest.mark.parametrize("gain, plain", [(1.5, False), (1.0, True), (1.03, True)])
def test_a_batch_steps_plain_unless_speculating_gives_clearly_more(gain, plain):
    # Every step takes its unit (a plain step's price, here growing with the context); a plain step
    # gives each of 8 sequences a token, a speculating one `gain` tokens on average. A 3% gain is within
    # the margin by which plain steps, never slower than mlx-lm's batching, are kept.
    pace, ways = BatchPace(), []
    for step in range(600):
        unit = 0.1 * (1 + step / 100)
        way = pace.start(8, unit)
        ways.append(way)
        pace.timed(8 if way else 8 * gain, unit)
    later = ways[100:]
    assert later.count(plain) > 0.8 * len(later)
    assert later.count(not plain) > 0  # (the other way is tried now and then)
    assert pace.plain(12) == pace.plain(8) and BatchPace().plain(8)  # (by size; plain until timed)


def test_in_a_batch_a_parked_drafter_is_still_probed_now_and_then():
    policies = [AdaptivePolicy(MAC, 15, lookup=True) for _ in range(3)]  # (wide passes cost little)
    for p in policies:
        run_trace(p, lambda k: 0, 200, confidence=0.05)  # parks a drafter that is never right
    match = ([7] * 16, 4)  # the first sequence's lookup match, always right: the step is wide
    for p in policies:
        for _ in range(20):
            p.observe(Choice(LOOKUP, 8), 8, 8, [], 4)
    made = []
    for _ in range(300):
        choices, solo = choose_batch(policies, [500] * 3, [match, ([], 0), ([], 0)])
        for p, c in zip(policies, choices):
            p.observe(c, c.k, c.k if c.source == LOOKUP else 0, [0.3] * c.k if c.source == DFLASH else [], 4)
        assert choices[0].source == LOOKUP and not any(solo)
        made += [c.source for c in choices[1:]]
    assert 3 <= made.count(DFLASH) < 0.1 * len(made)  # (tried within the step's width, now and then)


def test_a_later_answer_starts_from_what_the_policy_learnt_in_an_earlier_one():
    rng = random.Random(2)
    costs = dataclasses.replace(CPU, ahead=[1.0], built=[1.0])  # (the priors' odds pay a draft here)
    first = AdaptivePolicy(costs, 15, lookup=False)
    run_trace(first, geometric(0.3, rng), 300, confidence=0.3)  # parks the weak drafter
    later, fresh = AdaptivePolicy(costs, 15, lookup=False), AdaptivePolicy(costs, 15, lookup=False)
    first.idle[DFLASH] = 0  # (no probe due)
    later.learn_from(first)
    assert all(s == PLAIN for s, _ in run_trace(later, geometric(0.3, rng), 10, confidence=0.3))
    assert any(s == DFLASH for s, _ in run_trace(fresh, geometric(0.3, rng), 10, confidence=0.3))
    # policy_for hands each call of the same pair and kind of acceptance the last one's learning.
    model, draft = make_target("llama"), make_draft()
    target = prepare(model, draft)
    one = policy_for(target, draft, block_size=None, lookup=True)
    one.dflash.observe(15, 0)
    two = policy_for(target, draft, block_size=None, lookup=True)
    assert two.dflash.trials == one.dflash.trials and two.dflash is not one.dflash
    policy_for(target, draft, block_size=None, lookup=True, sampled=True).dflash.observe(15, 15)
    assert policy_for(target, draft, block_size=None, lookup=True).dflash.trials == one.dflash.trials
    # Seeded answers accept by matching keyed draws, not by rejection sampling: learnt apart too.
    sampled = policy_for(target, draft, block_size=None, lookup=True, sampled=True).dflash.trials
    policy_for(target, draft, block_size=None, lookup=True, sampled=True, keyed=True).dflash.observe(15, 0)
    assert policy_for(target, draft, block_size=None, lookup=True, sampled=True).dflash.trials == sampled


@pytest.fixture
def cheap_width(monkeypatch):
    """A machine where width is cheap (the costs the policy starts from, whatever this one measures)."""
    import dflash_mlx.policy as policy

    steps = [1.0, 1.05, 1.1, 1.2, 1.45, 1.9]
    cheap = CostModel([64], list(WIDTHS), [steps], [1, 3, 7, 15], [[0.2] * 4], [1], [1])
    monkeypatch.setattr(policy, "costs_for", lambda *args, **kwargs: cheap)


@pytest.fixture
def as_priced(cheap_width, monkeypatch):
    """... whose cycles take what they are priced at: the policy's choices then depend on what it
    learns of acceptance alone, not on how busy this machine is."""
    import dflash_mlx.policy as policy

    timed = policy.AdaptivePolicy.timed

    def priced(self, choice, verified, context, after, seconds):
        timed(self, choice, verified, context, after, self.price(choice, verified, context, after))

    monkeypatch.setattr(policy.AdaptivePolicy, "timed", priced)


def test_the_next_process_starts_from_what_the_last_one_learnt(as_priced):
    """What an answer's policy learnt is kept in the home when the answer ends, and a new process (here:
    the in-process record cleared) starts from it; a seeded answer, or a drafter with other weights,
    starts from the priors; a record that is not this policy's, or a broken file, leaves the priors."""
    from dflash_mlx.policy import _LEARNT, learnt_path

    model, draft = make_target("llama"), make_draft()
    target, prompt = prepare(model, draft), prompt_of(24)
    out = generate(model, draft, no_eos_tokenizer(prompt), prompt, max_tokens=48)
    assert out.tokens == greedy_reference(model, prompt, 48)

    def policy(**kw):
        return policy_for(target, draft, block_size=None, lookup=True, trees=True, **kw)

    last = policy()  # (in this process: from the answer's)
    priors = AdaptivePolicy(last.costs, 15, lookup=True, trees=True).learnt()
    assert any(last.pace.values()) and last.learnt() != priors
    _LEARNT.clear()  # a new process
    assert policy().learnt() == last.learnt()
    retrained = make_draft()  # the same shapes, other weights: its acceptance is its own to learn
    retrained.update(tree_map(lambda p: p + 0.01, retrained.parameters()))
    kept = policy_for(prepare(model, retrained), retrained, block_size=None, lookup=True, trees=True)
    assert kept.costs == last.costs and kept.learnt() == priors
    other = AdaptivePolicy(last.costs, 7, lookup=True)  # (a drafter with another block)
    with pytest.raises(ValueError):
        other.restore(last.learnt())
    assert other.learnt() == AdaptivePolicy(last.costs, 7, lookup=True).learnt()  # (unchanged)
    learnt_path(last.key).write_text('{"dflash": [[1.0], [')
    _LEARNT.clear()
    assert policy().learnt() == priors
    # A folder where the files go (the costs', the policy's): neither read nor written, and answers whole.
    from dflash_mlx.policy import costs_path

    folders = [learnt_path(last.key), costs_path(target, draft)]
    try:
        for path in folders:
            path.unlink(missing_ok=True)
            path.mkdir(parents=True)
        _LEARNT.clear()
        assert generate(model, draft, no_eos_tokenizer(prompt), prompt, max_tokens=48).tokens == out.tokens
        _LEARNT.clear()  # (a new process: nothing was kept)
        assert policy().learnt() == priors
    finally:  # (the home is the session's: other tests read these pairs' costs)
        for path in folders:
            path.rmdir()


def test_what_cycles_timed_another_way_learnt_is_not_read(monkeypatch):
    import dflash_mlx.policy as policies

    model, draft = make_target("llama"), make_draft()
    target = prepare(model, draft)
    policy = policy_for(target, draft, block_size=None, lookup=True)
    policy.dflash.observe(15, 15)
    monkeypatch.setattr(policies, "LEARNT_METHOD", policies.LEARNT_METHOD - 1)
    policies.keep_learnt(policy)
    policies._LEARNT.clear()
    assert policy_for(target, draft, block_size=None, lookup=True).learnt() == policy.learnt()
    monkeypatch.undo()
    policies._LEARNT.clear()
    fresh = policy_for(target, draft, block_size=None, lookup=True)
    assert fresh.learnt() == AdaptivePolicy(policy.costs, 15, lookup=True).learnt()


def test_the_drafter_parked_for_long_by_earlier_answers_is_probed_early_in_the_next(monkeypatch):
    """Answers where the drafter lost (edits) left it parked for up to PROBE_MAX cycles; the next
    answer, in this process or the next, may be one where it pays (a chat): it is probed within
    PROBE_ANSWER cycles, and where its proposals are taken it comes back."""
    import dflash_mlx.policy as policies

    model, draft = make_target("llama"), make_draft()
    target = prepare(model, draft)
    monkeypatch.setattr(policies, "costs_for", lambda *_: CPU)  # (a pair where the drafter can pay)
    policies._LEARNT.clear()
    last = policy_for(target, draft, block_size=None, lookup=False)
    for _ in range(12):  # each probe lost: the waits doubled up to the most
        last.dflash.observe(15, 0)
        last.wait[DFLASH] = min(2 * last.wait[DFLASH], PROBE_MAX)
    assert last.wait[DFLASH] == PROBE_MAX and last.choose(100, ([], 0)).source == PLAIN
    policies.keep_learnt(last)
    for new_process in (False, True):
        if new_process:
            policies._LEARNT.clear()
        policy = policy_for(target, draft, block_size=None, lookup=False)
        chosen = []
        for _ in range(4 * PROBE_ANSWER):  # the drafter's proposals now always taken
            choice = policy.choose(100, ([], 0))
            if choice.source == DFLASH:
                policy.observe(choice, choice.k, choice.k, [0.9] * choice.k, 0)
            chosen.append(choice.source)
        # (not at once: where it still loses, each answer's probe costs)
        assert PROBE_ANSWER // 2 < chosen.index(DFLASH) < PROBE_ANSWER
        assert chosen[-PROBE_ANSWER:] == [DFLASH] * PROBE_ANSWER
    policies._LEARNT.clear()


def test_lookup_is_chosen_where_it_pays_and_left_where_it_does_not():
    policy = AdaptivePolicy(CPU, 0, lookup=True)
    for _ in range(60):  # a match whose continuations are always right
        choice = policy.choose(500, ([7] * 16, 4))
        policy.observe(choice, choice.k, choice.k, [], 4)
    choice = policy.choose(500, ([7] * 16, 4))
    assert choice.source == LOOKUP and choice.k >= 12
    for _ in range(60):  # two-token matches that are always wrong
        choice = policy.choose(500, ([7] * 16, 2))
        policy.observe(choice, choice.k, 0, [], 2)
    assert policy.choose(500, ([7] * 16, 2)).source == PLAIN


def test_lookup_learns_a_copy_under_way_apart_from_a_suffix_just_met():
    """An edit: where the answer has copied the document for a while its match holds; where it has just
    changed something, a match of its last two tokens is often wrong. Odds learnt by how far the text
    agrees before the match verify the first widely and leave the second to plain steps."""
    policy = AdaptivePolicy(CPU, 0, lookup=True)
    for _ in range(60):
        for n, right in ((AGREEMENT_MAX, 15), (2, 0)):
            choice = policy.choose(500, ([7] * 16, n))
            policy.observe(choice, choice.k, min(choice.k, right), [], n)
    copying = policy.choose(500, ([7] * 16, AGREEMENT_MAX))
    assert copying.source == LOOKUP and copying.k >= 12
    assert policy.choose(500, ([7] * 16, 2)).source == PLAIN


# The demo target's passes measured on a 2-core CPU, a step = 1: a 32-wide pass costs 4 steps, a
# 16-wide one 2.5.
WIDE_CPU = CostModel([64], [1, 2, 4, 8, 16, 32], [[1.0, 1.0, 1.72, 1.89, 2.51, 3.99]], [], [], [0.9], [0.95])


def test_a_copy_is_verified_31_at_a_time_where_its_matches_hold_that_long_and_15_where_they_break_sooner():
    """A copy whose matches hold for 32 tokens pays verified whole; one whose matches break after 16
    does not."""
    text = list(range(1000, 1032))
    for holds, k in ((32, 31), (16, 15)):
        policy = AdaptivePolicy(WIDE_CPU, 0, lookup=True)
        for _ in range(60):
            choice = policy.choose(100, (text, AGREEMENT_MAX))
            policy.observe(choice, choice.k, min(choice.k, holds), [], AGREEMENT_MAX)
        assert policy.choose(100, (text, AGREEMENT_MAX)) == Choice(LOOKUP, k)


@pytest.mark.parametrize("yielding", [True, False])
def test_an_answer_whose_matches_break_sooner_than_the_last_ones_stops_verifying_them_widely(
    yielding, monkeypatch
):
    """Edits copy their document: once a match's first token holds, the rest does, and lookup's odds
    say so. A summary of the same code quotes a name now and then and goes its own way a token or two
    later. Its misses reach the positions past the first one at a time, so the odds alone would keep
    verifying 31 proposals (4 steps) for 1-3 tokens; what its matches held past their first token
    against what the odds promised prices them down after one such pass, and lookup goes on in
    passes of one proposal, which pay. A copy under way (a match of another class) is still verified
    whole."""
    import dflash_mlx.policy as policies

    if not yielding:  # (the odds alone: a yield that never moves from 1)
        monkeypatch.setattr(policies, "YIELD_PRIOR", 1e12)
    text = list(range(1000, 1032))
    edits = AdaptivePolicy(WIDE_CPU, 0, lookup=True)
    for _ in range(40):
        for n in (3, AGREEMENT_MAX):
            choice = edits.choose(100, (text, n))
            edits.observe(choice, choice.k, choice.k, [], n)
    summary = AdaptivePolicy(WIDE_CPU, 0, lookup=True)
    summary.learn_from(edits)
    widths = []
    for i in range(24):
        choice = summary.choose(100, (text, 3))
        summary.observe(choice, choice.k, min(choice.k, i % 3), [], 3)
        widths.append(choice.k if choice.source == LOOKUP else 0)
    if yielding:
        assert widths[0] == 31 and widths[1:] == [1] * 23
        assert summary.choose(100, (text, AGREEMENT_MAX)) == Choice(LOOKUP, 31)
    else:
        assert widths == [31] * 24


def test_a_plain_step_that_waited_for_a_match_learns_whether_one_followed_at_the_suffix_it_followed_at():
    """A copy under way: the next token gives a match whose agreement is far longer than any suffix
    length; the policy that waited for it learns that a match followed at the longest one."""
    index = NgramIndex()
    index.extend([1, 2, 3, 4, 5, 9, 2, 3, 4])  # (the next token may complete a 4-, 3- or 2-gram seen before)
    assert index.possible() == [4, 3, 2]
    policy = AdaptivePolicy(CPU, 0, lookup=True)
    for _ in range(40):  # long matches always right: worth waiting for
        choice = policy.choose(500, ([7] * 16, 4))
        policy.observe(choice, choice.k, choice.k, [], 4)
    assert not policy.plain_next(500, index)
    policy.choose(500, ([7] * 16, 20))
    assert (policy.follows[4].hits[1], policy.follows[4].trials[1]) == (1, 1)
    assert policy.follows[3].trials[1] == policy.follows[2].trials[1] == 0
    assert not policy.plain_next(500, index)
    policy.choose(500, ([7] * 16, 3))  # (the 4-gram did not follow; the 3-gram did)
    assert (policy.follows[4].hits[1], policy.follows[3].hits[1]) == (DECAY, 1)
    assert policy.follows[4].trials[1] == DECAY + 1


def test_lookup_learns_how_far_a_match_held_past_the_proposals_it_verified():
    """Matches that, early on, were wrong past their 7th token, then hold for long stretches (an answer
    copying its prompt): verified 7 proposals at a time and all taken, the positions past 7 would never
    be tried again. Compared with the tokens written after them, they learn that the matches hold, and
    the policy verifies 15."""
    text = list(range(1000, 1400))

    def copy(policy, followed: bool) -> list[int]:
        for _ in range(3):  # the early misses
            policy.lookup[4].observe(15, 7)
        chosen, at = [], 0
        while at < 300:
            found = (text[at : at + 16], 4)
            choice = policy.choose(500, found)
            assert choice.source == LOOKUP
            policy.observe(choice, choice.k, choice.k, [], 4, found[0] if followed else None)
            written = text[at : at + choice.k + 1]
            policy.wrote(written)
            chosen.append(choice.k)
            at += len(written)
        return chosen

    assert set(copy(AdaptivePolicy(CPU, 0, lookup=True), followed=False)) == {7}  # (each pass verified)
    followed = copy(AdaptivePolicy(CPU, 0, lookup=True), followed=True)
    assert followed[0] == 7 and followed[-5:] == [15] * 5
    # A match that differs from what was written is learnt from up to its first difference.
    policy = AdaptivePolicy(CPU, 0, lookup=True)
    policy.observe(Choice(LOOKUP, 3), 3, 3, [], 2, [1, 2, 3, 4, 5, 6])
    policy.wrote([1, 2, 3, 4])
    assert policy.lookup[2].trials[1:7] == [0] * 6 and policy.matches  # (still held)
    policy.wrote([5, 9])
    assert policy.lookup[2].hits[1:7] == [1, 1, 1, 1, 1, 0] and policy.lookup[2].trials[1:7] == [1] * 6
    assert not policy.matches


def test_the_policy_is_told_each_lookup_match_and_every_token_an_answer_writes_after_its_first(monkeypatch):
    class Told(ScriptedPolicy):
        """Records what the engine tells it: lookup's matches (with the tokens written before each) and
        the tokens written."""

        def __init__(self, script):
            super().__init__(script)
            self.matches, self.written = [], []

        def observe(self, choice, k, accepted, confidence, ngram, match=None):
            if choice.source == LOOKUP:
                self.matches.append((len(self.written), match))

        def wrote(self, tokens):
            self.written += tokens

    policy = Told([Choice(LOOKUP, 3), Choice(PLAIN, 0), Choice(LOOKUP, 7)])
    monkeypatch.setattr(engine, "policy_for", lambda *a, **k: policy)
    model, prompt, ref, tok = repeating(60)
    out = generate(model, None, tok, prompt, max_tokens=60)
    assert out.tokens == ref and out.mix.get(LOOKUP, 0) > 0
    assert policy.written == out.tokens[1:]  # (the first comes from the prompt's pass)
    # each match as lookup found it where its cycle began: the tokens that followed the latest earlier
    # occurrence of the text's last few tokens
    for at, match in policy.matches:
        text = prompt + out.tokens[: at + 1]
        assert match and any(
            text[i - n : i] == text[-n:] and text[i : i + len(match)] == match
            for n in (2, 3, 4)
            for i in range(n, len(text))
        )


def test_a_plain_step_starts_early_unless_a_lookup_match_worth_waiting_for_may_follow():
    index = NgramIndex()
    index.extend([5, 6, 7, 8, 9, 5, 6, 7])  # a match of 4 may follow: [5, 6, 7] + 8 occurred
    fresh = NgramIndex()
    fresh.extend([1, 2, 3])
    policy = AdaptivePolicy(CPU, 15, lookup=True)
    for _ in range(40):  # the drafter loses, so it is parked
        choice = policy.choose(500, ([], 0))
        policy.observe(choice, choice.k, 0, [], 0)
    for _ in range(20):  # four-token matches whose first proposal is right, and no more
        choice = policy.choose(500, ([7] * 16, 4))
        policy.observe(choice, choice.k, min(choice.k, 1), [], 4)
    policy.idle[DFLASH] = 0  # (no probe due)
    assert policy.plain_next(500, fresh)  # nothing to wait for
    assert not policy.plain_next(500, index)  # a match may follow, and it would pay
    for _ in range(60):  # ... but none ever does
        assert policy.choose(500, ([], 0)) == Choice(PLAIN, 0)
        policy.idle[DFLASH] = 0
        if policy.plain_next(500, index):
            break
    else:
        pytest.fail("plain steps never started early where the matches waited for never came")


def test_costs_are_interpolated_over_width_and_context():
    costs = CostModel([100, 1100], [1, 16], [[1.0, 2.0], [2.0, 4.0]], [], [], [0.9, 1.8], [0.95, 1.9])
    assert costs.target_time(1, 100) == 1.0 and costs.target_time(16, 1100) == 4.0
    assert costs.target_time(8.5, 600) == pytest.approx(2.25)
    assert costs.target_time(1, 2100) == pytest.approx(3.0)  # extended past the longest context measured
    assert costs.draft_time(5, 100) == 0.0
    assert costs.step_time(600) == pytest.approx(1.5) and costs.step_time(600, "ahead") == pytest.approx(1.35)


def test_prices_kept_between_choices_never_change_one():
    """The policy keeps what it worked out until the odds or paces it came from change: over a long
    history of lookups, drafts and timings it chooses exactly as one that works everything out afresh."""
    costs = CostModel(
        [64, 512, 2048],
        [1, 2, 4, 8, 16],
        [[1, 1.3, 1.6, 2.2, 3.5], [1.2, 1.5, 1.9, 2.6, 4.0], [2, 2.4, 3, 4, 6]],
        [1, 3, 7, 15],
        [[0.5, 0.55, 0.6, 0.7]] * 3,
        [0.8, 1.0, 1.7],
        [0.9, 1.1, 1.8],
    )
    rng = random.Random(0)
    kept, fresh = AdaptivePolicy(costs, 15, True), AdaptivePolicy(costs, 15, True)
    index, made = NgramIndex(), set()
    for step in range(4000):
        context = 100 + step // 3
        index.extend([rng.randrange(40)])
        found = (list(range(rng.randrange(12))), rng.randrange(1, 9)) if rng.random() < 0.4 else ([], 0)
        fresh._bests, fresh._paces_at = {}, {}
        choice = kept.choose(context, found)
        assert fresh.choose(context, found) == choice
        fresh._bests, fresh._paces_at = {}, {}
        ahead = kept.plain_next(context + 1, index)
        assert fresh.plain_next(context + 1, index) == ahead
        made.add((choice.source, ahead))
        accepted = (
            (0 if rng.random() < 0.9 else choice.k)
            if choice.source == DFLASH
            else rng.randrange(choice.k + 1)
        )
        confidence, seconds = [rng.random() for _ in range(choice.k)], rng.uniform(0.5, 3.0)
        for policy in (kept, fresh):
            if choice.source != PLAIN:
                policy.observe(choice, choice.k, accepted, confidence, found[1] or 1)
            policy.timed(choice, choice.k, context, "ahead" if ahead else None, seconds)
    assert {source for source, _ in made} == {PLAIN, LOOKUP, DFLASH} and {a for _, a in made} == {True, False}


@pytest.mark.parametrize("mode", ["lookup", "adaptive"])
def test_sampled_output_follows_the_target_distribution_with_lookup_and_the_adaptive_policy(
    mode, monkeypatch
):
    model = make_target("llama", seed=4, vocab_size=V)
    prompt = [1, 5, 3, 6, 1, 5]  # lookup proposes [3, 6, 1, 5] at once
    if mode == "lookup":
        monkeypatch.setattr(engine, "policy_for", lambda *a, **k: ScriptedPolicy([Choice(LOOKUP, 4)]))
        draft = None
    else:
        policy = AdaptivePolicy(MAC, 2, lookup=True)
        policy.timed = lambda *a: None  # (priced as MAC, not as the tiny model's Python-bound cycles)
        monkeypatch.setattr(engine, "policy_for", lambda *a, **k: policy)
        draft = make_draft(seed=11, vocab=V, block_size=3)
    tok = make_tokenizer(vocab=V, eos=V + 5)
    counts, sources = {}, set()
    for seed in range(RUNS):  # (no `seed=`: rejection sampling, as answers without one)
        mx.random.seed(seed)
        out = generate(model, draft, tok, prompt, max_tokens=T, temperature=0.7, top_p=0.9)
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
        sources |= set(out.sources)
    assert LOOKUP in sources and (mode == "lookup" or DFLASH in sources)
    assert chi_square_p(counts, exact_joint(model, 0.7, 0.9, prompt)) > 1e-3


def test_drafting_at_every_width_does_not_compile_the_draft_step_again(scripted):
    scripted([Choice(DFLASH, k) for k in range(1, 16)])
    model, prompt = make_target("llama"), prompt_of(12, seed=4)
    draft = make_draft(block_size=16)
    generate(model, draft, None, prompt, max_tokens=600)
    # One trace per drafting block (2, 4, 8, 16) and size of the cache buffer (256 rows at a time).
    assert draft.traces <= 4 * 3


@pytest.fixture
def pass_widths(monkeypatch):
    """Every target verify pass's (width, whether it holds a tree), as the engine runs them."""
    from dflash_mlx.models.targets import Target

    seen, verify = [], Target.verify

    def spy(self, tokens, cache, unrun=False, trees=None):
        seen.append((tokens.shape[1], trees is not None and any(t is not None for t in trees)))
        return verify(self, tokens, cache, unrun, trees)

    monkeypatch.setattr(Target, "verify", spy)
    return seen


def test_the_adaptive_policy_verifies_only_the_widths_its_costs_were_measured_at(pass_widths, as_priced):
    """A few pass shapes, each warmed up at load (GPUs compile kernels on first use): lookup's matches
    and the drafter's blocks are cut to a measured width, never verified at a width in between. (On a
    machine where width is cheap, and timed as priced: what a busy machine measures is not the point.)"""
    model, prompt = make_target("llama"), prompt_of(24, seed=8)
    prompt = prompt + prompt[:20]  # lookup finds matches of every length
    ref = greedy_reference(model, prompt, 120)
    draft = OracleDraft(draft_config(block_size=16), prompt + ref, [None, 0, 3, 5, 1, 9, 2])
    out = generate(model, draft, no_eos_tokenizer(ref), prompt, max_tokens=120)
    assert out.tokens == ref
    widths = policy_for(prepare(model, draft), draft, block_size=None, lookup=True).costs.widths
    verified = {w for w, _ in pass_widths}
    assert verified <= set(widths), verified
    assert len(verified) >= 3 and max(verified) >= 8  # (several widths, wide ones among them)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_warm_up_runs_every_pass_shape_the_policy_may_choose_and_changes_no_answer(family, pass_widths):
    """In a process whose costs were measured earlier (read from disk), the warm-up meets every verify
    width, as a chain and as a tree, and every drafter block the policy may use: an answer after it
    meets no new shape, and is the target's own."""
    from dflash_mlx.policy import warm_up

    model, prompt = make_target(family), prompt_of(12, seed=9)
    widths = policy_for(
        prepare(model, make_draft(block_size=16)), make_draft(block_size=16), block_size=None, lookup=True
    ).costs.widths
    draft = make_draft(block_size=16)  # a new process's drafter: nothing compiled
    pass_widths.clear()
    warm_up(model, draft)
    trees = family == "llama"  # (a recurrent target verifies chains only)
    assert pass_widths == [
        (w, tree) for w in widths for tree in ((False, True) if trees and w > 2 else (False,))
    ]
    assert draft.traces == 4  # the drafter's blocks of 2, 4, 8 and 16
    out = generate(model, draft, no_eos_tokenizer(prompt), prompt, max_tokens=40)
    assert out.tokens == greedy_reference(model, prompt, 40)
    assert draft.traces == 4  # nothing new to compile mid-answer


def test_the_offline_bench_sets_build_in_a_fixed_order():
    from dflash_mlx.benchsets import SETS
    from dflash_mlx.data import prompt_source

    for name in SETS:
        prompts = prompt_source(name)
        assert prompts and prompts == prompt_source(name)  # the same prompts every run, so runs compare
        assert all(len(p) == 1 and p[0]["role"] == "user" and p[0]["content"].strip() for p in prompts)
    assert all("```python\n" in p[0]["content"] for p in prompt_source("edit"))
    assert all(
        len(p[0]["content"]) > len(q[0]["content"])
        for p, q in zip(prompt_source("long-6k"), prompt_source("long-2k"))
    )


def test_a_measurement_of_costs_reports_each_pass_it_times_against_the_passes_it_will_time(
    tmp_path, monkeypatch
):
    """The progress bar's counts: every pass timed, out of a total known before the first, for the
    measurement and for batch sizes priced later; nothing where nothing is measured."""
    from dflash_mlx.policy import costs_for, measured_passes

    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path))
    draft = make_draft()
    target = prepare(make_target("llama"), draft)

    def reports(batches) -> list:
        seen = []
        costs = costs_for(target, draft, batches, progress=lambda done, total: seen.append((done, total)))
        totals = {total for _, total in seen}
        assert [done for done, _ in seen] == list(range(1, len(seen) + 1)) and totals <= {len(seen)}
        return costs, len(seen)

    costs, first = reports((2,))
    grid = len(costs.contexts) * len(costs.widths)
    assert first == measured_passes(target, draft) + grid
    assert measured_passes(target, draft) == len(costs.contexts) * (
        len(costs.widths) + 2 + len(costs.proposals)
    )
    assert reports((2, 4, 8))[1] == 2 * grid  # (batch 2 priced already)
    assert reports((2, 4, 8))[1] == 0


def test_kept_costs_are_read_while_another_process_measures_more(tmp_path, monkeypatch, capfd):
    """`generate` waited, "waiting for another process that is measuring ...", while a `serve` started
    on the same home priced its batched passes (a minute), though all it needed was kept."""
    import fcntl
    import threading

    from dflash_mlx.policy import costs_for, costs_path

    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path))
    draft = make_draft()
    target = prepare(make_target("llama"), draft)
    kept = costs_for(target, draft)
    measuring = open(tmp_path / "locks" / f"costs-{costs_path(target, draft).stem}", "a")
    fcntl.flock(measuring, fcntl.LOCK_EX)  # (its own open file: as another process holds it)
    read = []
    thread = threading.Thread(target=lambda: read.append(costs_for(target, draft)), daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert read == [kept] and "waiting" not in capfd.readouterr().err
    measuring.close()


def test_profile_measures_the_costs_again_and_keeps_the_batched_passes_priced(tmp_path, monkeypatch):
    """`profile -m` times the single passes again; the batched ones `serve` priced stay, so the next
    `serve` does not spend a minute pricing them again."""
    from dflash_mlx.policy import costs_for, costs_path, kept_costs
    from dflash_mlx.profile import profile_pair

    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path))
    draft = make_draft()
    target = prepare(make_target("llama"), draft)
    costs_for(target, draft, (2,))
    before = kept_costs(costs_path(target, draft))
    kept = json.loads(costs_path(target, draft).read_text())
    costs_path(target, draft).write_text(json.dumps({**kept, "batches": []}))  # (a hand edit: measured again)
    assert kept_costs(costs_path(target, draft)) is None
    costs_path(target, draft).write_text(json.dumps(kept))
    timed = []
    profile_pair(target, draft, progress=lambda done, total: timed.append(done))
    after = kept_costs(costs_path(target, draft))
    assert timed and after.batches == before.batches and set(after.batches) == {2}
    costs_for(target, draft, (2,), progress=lambda done, total: timed.append(-done))
    assert min(timed) > 0  # (nothing measured again)


def test_two_processes_needing_a_pairs_costs_at_once_measure_them_once(tmp_path):
    """Measured at once, each process would time passes slowed by the other's: the second waits for
    the first's measurement and reads it."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, time\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "import dflash_mlx.policy as policy\n"
        "from tiny import make_draft, make_target\n"
        "from dflash_mlx.pairing import prepare\n"
        "measure = policy.measure_costs\n"
        "def slow(*args, **kwargs):\n"
        "    print('measured', flush=True)\n"
        "    time.sleep(3)  # (long enough for the other process to ask meanwhile)\n"
        "    return measure(*args, **kwargs)\n"
        "policy.measure_costs = slow\n"
        "draft = make_draft()\n"
        "costs = policy.costs_for(prepare(make_target('llama'), draft), draft)\n"
        "print(costs.widths, flush=True)\n"
    )
    env = dict(os.environ, DFLASH_MLX_HOME=str(tmp_path))
    tests = os.path.dirname(__file__)
    runs = [
        subprocess.Popen([sys.executable, "-c", code, tests], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in runs]
    assert all(p.returncode == 0 for p in runs)
    assert sum(out.count("measured") for out in outs) == 1, outs
    assert outs[0].splitlines()[-1] == outs[1].splitlines()[-1]  # (the same costs)
