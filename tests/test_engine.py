"""The engine: many sequences in one step, each getting exactly what it gets alone, whatever its
neighbours choose, whenever they join, end or are stopped."""

import mlx.core as mx
import numpy as np
import pytest
from test_cache import assert_same_caches
from test_policy import SCRIPT, OracleIndex, ScriptedPolicy
from test_sampling import RUNS, T, V, chi_square_p, exact_joint
from tiny import FAMILIES, OracleDraft, draft_config, greedy_reference, make_draft, make_target, prompt_of

import dflash_mlx.engine as engine
from dflash_mlx import SpeculativeCache
from dflash_mlx.batching import RaggedKVCache
from dflash_mlx.engine import Engine, Sequence
from dflash_mlx.pairing import prepare
from dflash_mlx.policy import DFLASH, LOOKUP, PLAIN, Choice
from dflash_mlx.settings import GenerationSettings


def drive(engine_, joins: dict[int, list], until=None) -> dict:
    """Step the engine, starting `joins[step]` = [(sequence, prompt), ...] before that step, until nothing
    is left (or `until(step, outputs)` says stop): -> {sequence: its tokens}."""
    out, step = {}, 0
    while True:
        for seq, prompt in joins.pop(step, []):
            out[seq] = seq.start(prompt)
            if seq.finish is None:
                engine_.add(seq)
        if not engine_.active and not joins:
            break
        engine_.launch()
        for r in engine_.collect():
            out[r.seq] += r.tokens
        step += 1
        if until is not None and until(step, out):
            break
    return out


@pytest.fixture
def per_row_scripts(monkeypatch):
    """Each sequence gets its own scripted policy, the script rotated so rows choose differently."""
    made = []

    def make(*args, **kwargs):
        made.append(ScriptedPolicy(SCRIPT[len(made) % len(SCRIPT) :] + SCRIPT[: len(made) % len(SCRIPT)]))
        return made[-1]

    monkeypatch.setattr(engine, "policy_for", make)
    return made


@pytest.fixture(params=["together", "some alone"])
def passes(request, monkeypatch):
    """How a batch's choices are verified: all in the shared pass, or (every other step) each sequence
    that proposes something in a pass of its own beside it."""
    if request.param == "some alone":
        steps = []

        def choose(policies, contexts, lookups, pace=None):
            steps.append(None)
            choices = [p.choose(c, f) for p, c, f in zip(policies, contexts, lookups)]
            return choices, [c.k > 0 and len(steps) % 2 == 0 for c in choices]

        monkeypatch.setattr(engine, "choose_batch", choose)
    return request.param


@pytest.mark.parametrize("family", FAMILIES)
def test_each_sequence_of_a_batch_gets_what_it_gets_alone(family, per_row_scripts, passes):
    model = make_target(family)
    draft = OracleDraft(draft_config(block_size=16), None, [None, 0, 4, 2, 9])
    target = prepare(model, draft)
    plans = [(1, 30, 0), (5, 45, 0), (37, 60, 0), (12, 20, 3), (9, 25, 6)]  # prompt, max tokens, joins at
    joins, wants = {}, {}
    for i, (length, max_tokens, at) in enumerate(plans):
        prompt = prompt_of(length, seed=20 + i)
        ref = greedy_reference(model, prompt, max_tokens)
        cache = SpeculativeCache(target, draft)
        cache.index = OracleIndex(prompt + ref, [None, 1, 0, 5])
        draft.follow(cache, prompt + ref)
        seq = Sequence(cache, GenerationSettings(max_tokens=max_tokens), max_tokens)
        joins.setdefault(at, []).append((seq, prompt))
        wants[seq] = (prompt, ref)
    e = Engine(target, draft)
    batched = []
    original = e.launch

    def launch():
        original()
        batched.append(e.batch is not None)

    e.launch = launch
    out = drive(e, joins)
    for seq, (prompt, ref) in wants.items():
        assert out[seq] == ref
        assert seq.cache.tokens == prompt + ref and seq.finish == "length"
        fresh = SpeculativeCache(target, draft)
        fresh.prefill(seq.cache.tokens[: seq.cache.processed])
        assert_same_caches(seq.cache, fresh)
    # (a target with recurrent layers steps its sequences in turn)
    assert any(batched) == (family not in ("qwen3_5", "qwen3_5_moe", "qwen3_next", "lfm2"))
    sources = {c.source for p in per_row_scripts for c in p.script}
    assert sources == {PLAIN, LOOKUP, DFLASH}


def test_a_sequence_ends_at_its_eos_and_one_stopped_mid_batch_leaves_its_cache_as_it_was(per_row_scripts):
    model = make_target("llama")
    draft = OracleDraft(draft_config(block_size=8), None, [None, 2])
    target = prepare(model, draft)
    prompts = [prompt_of(n, seed=40 + n) for n in (6, 11, 4)]
    refs = [greedy_reference(model, p, 40) for p in prompts]
    cut = next(i for i in range(5, 30) if refs[0][i] not in refs[0][:i])
    seqs = []
    for i, (prompt, ref) in enumerate(zip(prompts, refs)):
        cache = SpeculativeCache(target, draft)
        cache.index = OracleIndex(prompt + ref, [None, 3])
        draft.follow(cache, prompt + ref)
        eos = frozenset([ref[cut]]) if i == 0 else frozenset()
        seqs.append(Sequence(cache, GenerationSettings(max_tokens=40), 40, eos))
    e = Engine(target, draft)
    stopped = []

    def stop_the_second(step, out):
        if step == 4:
            e.launch()  # a step under way when it is stopped
            e.remove(seqs[1])
            stopped.append(out[seqs[1]][:])
            for r in e.collect():
                out[r.seq] += r.tokens
        return False

    out = drive(e, {0: [(s, p) for s, p in zip(seqs, prompts)]}, until=stop_the_second)
    assert out[seqs[0]] == refs[0][: cut + 1] and seqs[0].finish == "stop"
    assert out[seqs[1]] == stopped[0] == refs[1][: len(stopped[0])] and seqs[1].finish is None
    assert out[seqs[2]] == refs[2]
    for s in seqs:
        assert not s.cache.broken and not s.cache.in_flight
        fresh = SpeculativeCache(target, draft)
        fresh.prefill(s.cache.tokens[: s.cache.processed])
        assert_same_caches(s.cache, fresh)
    # The stopped one goes on from where it was, alone, as if nothing had happened.
    s = seqs[1]
    more = Sequence(s.cache, GenerationSettings(max_tokens=10), 10)
    e = Engine(target, draft)
    assert drive(e, {0: [(more, prompt_of(3, seed=9))]})[more] == greedy_reference(
        model, s.cache.tokens[: len(prompts[1]) + len(stopped[0])] + prompt_of(3, seed=9), 10
    )


def test_the_adaptive_policy_chooses_one_width_for_the_batch_and_stays_lossless():
    model = make_target("llama")
    draft = make_draft()
    target = prepare(model, draft)
    part = prompt_of(7, seed=5)
    prompts = [part + prompt_of(3, seed=6) + part, prompt_of(9, seed=2), prompt_of(20, seed=3)]
    seqs = [Sequence(SpeculativeCache(target, draft), GenerationSettings(max_tokens=50), 50) for _ in prompts]
    e = Engine(target, draft)
    out = drive(e, {0: list(zip(seqs, prompts))})
    for seq, prompt in zip(seqs, prompts):
        assert out[seq] == greedy_reference(model, prompt, 50)


def test_a_batch_samples_each_sequence_from_its_own_distribution(monkeypatch):
    """χ² over the first T tokens of RUNS answers drawn six at a time in one batch, with a random
    drafter verified at full width every step."""
    model = make_target("llama", seed=4, vocab_size=V, num_hidden_layers=1)
    draft = make_draft(seed=11, vocab=V, target_layers=1, layer_ids=(0,), layers=1)
    monkeypatch.setattr(engine, "policy_for", lambda *a, **k: ScriptedPolicy([Choice(DFLASH, 3)]))
    target = prepare(model, draft)
    counts, prompt = {}, [1, 5, 3, 6]
    import mlx.core as mx

    mx.random.seed(0)
    for _ in range(RUNS // 6):
        seqs = [
            Sequence(SpeculativeCache(target, draft), GenerationSettings(temperature=1.0, max_tokens=T), T)
            for _ in range(6)
        ]
        out = drive(Engine(target, draft), {0: [(s, prompt) for s in seqs]})
        for s in seqs:
            counts[tuple(out[s])] = counts.get(tuple(out[s]), 0) + 1
    p = chi_square_p(counts, exact_joint(model, 1.0, 1.0))
    assert p > 1e-3, f"chi-square p-value {p:.2e}: a batch does not sample from the target's distribution"


def test_rows_come_and_go_without_the_batch_being_rebuilt(per_row_scripts, monkeypatch):
    """A longer prompt joining moves the batch right, rows ending leave holes that the last rows fill,
    the room for rows grows, positions left of every row's span go (and, STEP made small, the buffer
    grows): every answer and cache stays what it is alone, and the batch is made once."""
    import dflash_mlx.batching as batching

    monkeypatch.setattr(batching, "STEP", 16)
    merges = []
    monkeypatch.setattr(engine, "merge", lambda caches: merges.append(len(caches)) or batching.merge(caches))
    model = make_target("llama")
    draft = OracleDraft(draft_config(block_size=8), None, [None, 0, 3])
    target = prepare(model, draft)
    plans = [(40, 6, 0), (3, 40, 0), (4, 30, 0), (60, 12, 4), (6, 30, 5), (1, 12, 5), (5, 9, 6)]
    joins, wants = {}, {}
    for i, (length, max_tokens, at) in enumerate(plans):
        prompt = prompt_of(length, seed=70 + i)
        ref = greedy_reference(model, prompt, max_tokens)
        cache = SpeculativeCache(target, draft)
        cache.index = OracleIndex(prompt + ref, [None, 2])
        draft.follow(cache, prompt + ref)
        seq = Sequence(cache, GenerationSettings(max_tokens=max_tokens), max_tokens)
        joins.setdefault(at, []).append((seq, prompt))
        wants[seq] = ref
    e = Engine(target, draft)
    out = drive(e, joins)
    assert merges == [3]
    for seq, ref in wants.items():
        assert out[seq] == ref
        fresh = SpeculativeCache(target, draft)
        fresh.prefill(seq.cache.tokens[: seq.cache.processed])
        assert_same_caches(seq.cache, fresh)


def test_join_and_leave_keep_each_rows_positions():
    import dflash_mlx.batching as batching

    def own(length, seed):
        c = batching.KVCache()
        if length:
            k = mx.random.normal((1, 2, length, 4), key=mx.random.key(seed))
            c.update_and_fetch(k, -k)
        return c

    caches = [[own(n, n)] for n in (5, 9)]
    batch = batching.merge(caches)
    batch[0].trim([0, 2])  # ragged rows
    batching.join(batch, [[own(12, 1)], [own(0, 2)], [own(3, 3)]])  # 12 > 7: the batch moves right
    c = batch[0]
    assert c.keys.shape[0] == 8 and c.offset.tolist() == [5, 7, 12, 0, 3] and max(c.ends) == 12
    order = batching.leave(batch, [0, 3], [[batching.KVCache()], [batching.KVCache()]])
    assert order == [4, 1, 2] and c.offset.tolist() == [3, 7, 12] and c.keys.shape[0] == 8
    want = [own(3, 3), own(9, 9), own(12, 1)]
    want[1].trim(2)
    for row, w in enumerate(want):
        back = batching.KVCache()
        batching.split(batch, row, [back])
        assert mx.array_equal(back.keys, w.keys[..., : w.offset, :]).item()
        assert mx.array_equal(back.values, w.values[..., : w.offset, :]).item()


def test_align_puts_ragged_rows_back_in_line_keeping_their_positions():
    import dflash_mlx.batching as batching

    def own(length, seed):
        c = batching.KVCache()
        k = mx.random.normal((1, 2, length, 4), key=mx.random.key(seed))
        c.update_and_fetch(k, -k)
        return c

    batch = batching.merge([[own(n, n)] for n in (5, 9, 7)])
    batch[0].trim([0, 3, 1])  # as a speculative step leaves them: lengths 5, 6, 6, ends apart
    c = batch[0]
    assert c.ends == [9, 6, 8]
    before = []
    for row in range(3):
        before.append(batching.KVCache())
        batching.split(batch, row, [before[-1]])
    batching.align(batch)
    assert c.ends == [9, 9, 9] and c.offset.tolist() == [5, 6, 6]
    mask = c.make_mask(1)[:, 0, 0]  # each row sees its own span, nothing a move left behind
    assert mask.sum(axis=-1).tolist() == [6, 7, 7] and mask[:, 9].tolist() == [True] * 3
    new = mx.random.normal((3, 2, 1, 4), key=mx.random.key(9))
    c.update_and_fetch(new, -new)  # (one slice for every row now)
    for row, want in enumerate(before):
        back = batching.KVCache()
        batching.split(batch, row, [back])
        assert mx.array_equal(back.keys, mx.concatenate([want.keys, new[row : row + 1]], axis=2)).item()
        assert mx.array_equal(back.values, mx.concatenate([want.values, -new[row : row + 1]], axis=2)).item()


def test_a_ragged_batch_attends_each_row_to_its_own_span():
    import mlx.core as mx

    c = RaggedKVCache(mx.zeros((2, 1, 4, 1)), mx.zeros((2, 1, 4, 1)), [0, 1], [1, 3])  # lengths 1 and 2
    assert c.offset.tolist() == [1, 2]
    mask = c.make_mask(2)
    assert mask.shape == (2, 1, 2, 5)
    assert mask[0, 0].tolist() == [[True, True, False, False, False], [True, True, True, False, False]]
    assert mask[1, 0].tolist() == [[False, True, True, True, False], [False, True, True, True, True]]
    windowed = c.make_mask(2, window_size=2)
    assert windowed[1, 0].tolist() == [[False, False, True, True, False], [False, False, False, True, True]]
    keys = mx.array([[[[1.0], [2.0]]], [[[3.0], [4.0]]]])
    k, _ = c.update_and_fetch(keys, keys)  # each row's block at its own end
    assert c.ends == [3, 5] and c.offset.tolist() == [3, 4] and k.shape == (2, 1, 5, 1)
    assert k[0, 0, :3, 0].tolist() == [0.0, 1.0, 2.0] and k[1, 0, 3:, 0].tolist() == [3.0, 4.0]
    c.trim([1, 2])
    assert c.offset.tolist() == [2, 2]


@pytest.mark.parametrize("window", [None, 16])
def test_sequences_that_draft_together_get_the_proposals_each_gets_alone(window):
    import mlx.core as mx

    from dflash_mlx.drafters import DFlashDrafter, propose_together

    model, draft = make_target("llama"), make_draft()
    target = prepare(model, draft)
    caches = []
    for n in (3, 21, 40):
        cache = SpeculativeCache(target, draft, window)
        cache.prefill(prompt_of(n, seed=n))
        caches.append(cache)
    drafters = [DFlashDrafter(draft, 16, compiled=False) for _ in caches]
    greedy = lambda logits: (mx.argmax(logits, axis=-1), None)  # noqa: E731
    ks = [3, 15, 7]
    lasts = [c.tokens[-1] for c in caches]
    together = propose_together(drafters, lasts, [c.draft_cache for c in caches], ks, [greedy] * 3)
    for (x, _, confidence), d, last, c, k in zip(together, drafters, lasts, caches, ks):
        alone_x, _, alone_confidence = d.model.draft(last, c.draft_cache, 16, k, greedy, 0.0, compiled=False)
        assert x.tolist() == alone_x.tolist()
        assert mx.allclose(confidence, alone_confidence, atol=1e-5).item()


def test_a_batch_that_drafts_together_stays_lossless(monkeypatch):
    monkeypatch.setattr(
        engine, "policy_for", lambda *a, **k: ScriptedPolicy([Choice(DFLASH, 7), Choice(PLAIN, 0)])
    )
    model, draft = make_target("qwen3"), make_draft()
    target = prepare(model, draft)
    prompts = [prompt_of(n, seed=60 + n) for n in (4, 17, 9)]
    seqs = [Sequence(SpeculativeCache(target, draft), GenerationSettings(max_tokens=40), 40) for _ in prompts]
    out = drive(Engine(target, draft), {0: list(zip(seqs, prompts))})
    for seq, prompt in zip(seqs, prompts):
        assert out[seq] == greedy_reference(model, prompt, 40)


def test_a_seeded_draw_does_not_move_with_the_float_noise_of_a_batched_pass():
    """A seeded answer is the same whatever runs beside it: a pass over a batch computes the logits with
    other rounding (about 1e-5 apart), which must not change a keyed draw except at a true tie. A wide,
    flat-tailed vocabulary is where mx.random.categorical's keyed draw moved (6 of 400 positions here)."""
    rng = np.random.default_rng(0)
    vocab = 49152
    seq = Sequence(
        SpeculativeCache(make_target("llama"), None),
        GenerationSettings(temperature=1.0, seed=7, max_tokens=8),
        8,
    )
    logits = (rng.standard_normal((400, vocab)) * 3).astype(np.float32)
    noisy = logits + rng.normal(0, 1e-5, logits.shape).astype(np.float32)
    alone = seq.pick_at(mx.array(logits), 100).tolist()
    assert seq.pick_at(mx.array(noisy), 100).tolist() == alone
    assert len(set(alone)) > 300  # (draws, not the most likely token every time)
