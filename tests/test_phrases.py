"""The target's phrase table: what it keeps, how lookup falls back to it, and that it never changes the
output, right or wrong."""

import random
from collections import Counter, defaultdict

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from test_drafter import write_zlab_checkpoint
from test_policy import CPU, ScriptedPolicy
from test_sampling import PROMPT, RUNS, T, V, chi_square_p, exact_joint
from tiny import greedy_reference, make_draft, make_target, make_tokenizer, no_eos_tokenizer, prompt_of
from typer.testing import CliRunner

import dflash_mlx.engine as engine
from dflash_mlx import SpeculativeCache, UserError, apply_chat_template, generate, load_draft
from dflash_mlx.cli.main import app
from dflash_mlx.convert import convert_draft, export_draft
from dflash_mlx.data import _write_shard, load_shards, tokenizer_fingerprint
from dflash_mlx.drafters import PHRASES, NgramIndex
from dflash_mlx.engine import Engine, Sequence
from dflash_mlx.phrases import FILE, MIN_COUNT, SHARE, SIZES, Phrases
from dflash_mlx.policy import LOOKUP, AdaptivePolicy, Choice
from dflash_mlx.settings import GenerationSettings


def brute_force_table(seqs):
    """What the table should keep, from counts of whole token tuples: context -> next token."""
    counts = defaultdict(Counter)
    for ids, prompt in seqs:
        for t in range(prompt, len(ids)):
            for n in SIZES:
                if t >= n:
                    counts[tuple(ids[t - n : t])][ids[t]] += 1
    kept = {}
    for gram, c in counts.items():
        (token, top), *_ = sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))
        if top >= MIN_COUNT and top >= SHARE * sum(c.values()):
            kept[gram] = token
    return kept


def brute_force_follow(kept, context, cap):
    out, context = [], list(context)
    while len(out) < cap:
        nxt = next((kept[g] for n in SIZES if len(context) >= n and (g := tuple(context[-n:])) in kept), None)
        if nxt is None:
            break
        out.append(nxt)
        context.append(nxt)
    return out


def test_the_table_proposes_each_contexts_commonest_next_token_from_the_longest_context_it_kept():
    rng = random.Random(0)
    # Few token values and repeated pieces: contexts that recur, some with one continuation, some split.
    pieces = [[rng.randrange(6) for _ in range(rng.randrange(2, 7))] for _ in range(12)]
    seqs = []
    for _ in range(150):
        ids = [t for _ in range(rng.randrange(2, 9)) for t in rng.choice(pieces)]
        seqs.append((ids, rng.randrange(0, min(6, len(ids)))))
    table, kept = Phrases.learn(seqs), brute_force_table(seqs)
    assert len(table) == len(kept) and 0 < len(kept) < sum(1 for ids, p in seqs for t in range(p, len(ids)))
    proposed = 0
    for _ in range(400):
        context = [rng.randrange(6) for _ in range(rng.randrange(0, 8))]
        want = brute_force_follow(kept, context, 6)
        assert table.follow(context, 6) == want
        proposed += bool(want)
    assert proposed > 100


def test_prompt_tokens_are_context_but_never_learnt_as_what_the_target_writes():
    prompt, answer = [9, 9, 9, 9, 9, 9], [1, 2]
    table = Phrases.learn([(prompt + answer, len(prompt))] * MIN_COUNT)
    assert table.follow([9, 9], 4) == [1, 2]  # (9, 9) -> 1 was the answer's first token, MIN_COUNT times
    assert table.follow([9], 4) == []  # nothing shorter than two tokens is a context
    assert Phrases.learn([(prompt + answer, len(prompt))] * (MIN_COUNT - 1)).follow([9, 9], 4) == []


def test_a_saved_table_loads_whole_and_a_broken_one_is_a_clear_error(tmp_path):
    table = Phrases.learn([([1, 2, 3, 4, 5, 6], 0)] * 3, tokenizer="abc")
    assert Phrases.load(tmp_path) is None
    table.save(tmp_path)
    back = Phrases.load(tmp_path)
    assert back.next == table.next and back.tokenizer == "abc" and back.follow([1, 2], 9) == [3, 4, 5, 6]
    assert [p.name for p in tmp_path.iterdir()] == [FILE]  # (no temporary file left beside it)
    data = (tmp_path / FILE).read_bytes()
    (tmp_path / FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="train phrases"):
        Phrases.load(tmp_path)


def test_lookup_matches_the_context_first_and_falls_back_to_the_table():
    table = Phrases.learn([([5, 6, 7, 8, 1], 0)] * 3)
    index = NgramIndex(phrases=table)
    index.extend([5, 6, 40, 41, 5, 6])
    assert index.match() == ([40, 41, 5, 6], 2)  # the context's own match wins
    index.extend([99])
    assert index.match() == ([], 0) and index.possible() == []  # (a batch never waits on the table)
    index.extend([5, 6, 7])
    assert index.match() == ([8, 1], PHRASES)  # from (5, 6, 7), then (5, 6, 7, 8)
    other = NgramIndex(phrases=table)
    other.extend([1, 6, 7])
    assert other.match() == ([8, 1], PHRASES)
    copied = other.copy()
    copied.extend([8])
    assert copied.phrases is table and other.tokens == [1, 6, 7] and copied.match() == ([1], PHRASES)
    other.truncate(2)
    other.extend([5, 6])
    assert other.phrases is table and other.match() == ([7, 8, 1], PHRASES)


@pytest.mark.parametrize("right", [True, False])
def test_greedy_output_is_the_targets_with_a_phrase_table_right_or_wrong(right, monkeypatch):
    model, prompt = make_target("llama"), prompt_of(9, seed=2)
    ref = greedy_reference(model, prompt, 40)
    rng = random.Random(3)
    # Right: the target's own answer, so the table's proposals are accepted; wrong: random token runs.
    seqs = (
        [(prompt + ref, len(prompt))] * MIN_COUNT
        if right
        else [([rng.randrange(64) for _ in range(60)], 0)] * 3
    )
    draft = make_draft()
    draft.phrases = Phrases.learn(seqs)
    monkeypatch.setattr(engine, "policy_for", lambda *a, **k: ScriptedPolicy([Choice(LOOKUP, 8)]))
    out = generate(model, draft, no_eos_tokenizer(ref), prompt, max_tokens=40)
    assert out.tokens == ref
    looked_up = [a for s, a in zip(out.sources, out.acceptance_lengths) if s == LOOKUP]
    assert looked_up  # (the tiny target's answer does not repeat itself: these came from the table)
    if right:
        assert max(looked_up) == 9  # 8 proposals, all right, and the target's own token


def test_sampled_output_follows_the_target_distribution_with_the_phrase_tables_proposals(monkeypatch):
    model = make_target("llama", seed=4, vocab_size=V)
    draft = make_draft(seed=11, vocab=V, block_size=3)
    draft.phrases = Phrases.learn([([1, 5, 3, 6, 2, 7, 4, 0], 0)] * MIN_COUNT)  # after PROMPT: 2, 7, 4, 0
    proposed, follow = [], draft.phrases.follow

    def counted(tokens, cap):
        found = follow(tokens, cap)
        proposed.extend([found] if found else [])
        return found

    draft.phrases.follow = counted
    monkeypatch.setattr(engine, "policy_for", lambda *a, **k: ScriptedPolicy([Choice(LOOKUP, 4)]))
    tok = make_tokenizer(vocab=V, eos=V + 5)  # (no EOS inside the vocabulary)
    counts = {}
    for seed in range(RUNS):  # (no `seed=`: rejection sampling, as answers without one)
        mx.random.seed(seed)
        out = generate(model, draft, tok, PROMPT, max_tokens=T, temperature=0.7, top_p=0.9)
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
    assert len(proposed) > RUNS // 10  # (where the first token, the target's own draw, is a context it knows)
    assert chi_square_p(counts, exact_joint(model, 0.7, 0.9, PROMPT)) > 1e-3


def test_a_batch_starts_plain_steps_ahead_with_a_table_and_one_answer_weighs_waiting_for_it():
    """In a batch nothing weighs the table's odds, so only a context match that may follow keeps a plain
    step from starting ahead; one answer's policy weighs waiting for the table's proposals too."""

    model, draft = make_target("llama"), make_draft()
    draft.phrases = Phrases.learn([([1, 2, 3, 4], 0)] * MIN_COUNT)
    seqs = [Sequence(SpeculativeCache(model, draft), GenerationSettings(max_tokens=8), 8) for _ in range(2)]
    for s, tokens in zip(seqs, ([7, 8, 9], [10, 11, 12])):  # (no suffix that occurred before)
        s.cache.index.extend(tokens)
    assert Engine(model, draft)._plain_next(seqs)
    policy = AdaptivePolicy(CPU, 0, lookup=True)
    for _ in range(20):  # the table's proposals always right, and one always follows
        choice = policy.choose(500, ([1] * 8, PHRASES))
        policy.observe(choice, choice.k, choice.k, [], PHRASES)
    assert not policy.plain_next(500, seqs[0].cache.index)
    seqs[0].cache.index.phrases = None
    assert policy.plain_next(500, seqs[0].cache.index)


def write_data(folder, seqs, tokenizer="fp"):
    folder.mkdir(parents=True)
    _write_shard(folder, 0, seqs, 0, len(seqs), "test", tokenizer)


def test_train_phrases_writes_the_table_beside_the_drafter_and_refuses_what_cannot_work(tmp_path):
    write_zlab_checkpoint(tmp_path / "draft", make_draft())
    write_data(tmp_path / "data", [([1, 2, 3, 4, 5], 1)] * 3)
    runner = CliRunner()
    done = runner.invoke(
        app, ["train", "phrases", "--data", str(tmp_path / "data"), "-o", str(tmp_path / "draft")]
    )
    assert done.exit_code == 0, done.output
    assert "phrases from 3 answers (12 tokens)" in done.output
    assert (
        Phrases.load(tmp_path / "draft").follow([2, 3], 4) == [4, 5]
        and Phrases.load(tmp_path / "draft").tokenizer == "fp"
    )
    assert load_draft(str(tmp_path / "draft")).phrases.next == Phrases.load(tmp_path / "draft").next

    again = runner.invoke(
        app, ["train", "phrases", "--data", str(tmp_path / "data"), "-o", str(tmp_path / "draft")]
    )
    assert again.exit_code == 1 and "holds a phrase table already (pass --force" in again.output
    write_data(tmp_path / "few", [([1, 2, 3, 4, 5], 1)] * 2)  # (each context twice: no phrase)
    few = ["train", "phrases", "--data", str(tmp_path / "few"), "-o", str(tmp_path / "draft"), "--force"]
    failed = runner.invoke(app, few)
    assert failed.exit_code == 1 and "give more" in failed.output
    assert Phrases.load(tmp_path / "draft").next == Phrases.learn(load_shards(tmp_path / "data")).next  # kept
    write_data(tmp_path / "other", [([1, 2, 3], 1)], tokenizer="another")
    (tmp_path / "empty").mkdir()
    for args, message in [
        (["--data", str(tmp_path / "data"), "-o", str(tmp_path / "data")], "not a drafter's folder"),
        (["--data", str(tmp_path / "empty"), "-o", str(tmp_path / "draft")], "holds no training sequences"),
        (["--data", str(tmp_path / "nowhere"), "-o", str(tmp_path / "draft")], "no folder"),
        (["--data", "", "-o", str(tmp_path / "draft")], "--data is empty"),
        (
            ["--data", str(tmp_path / "draft"), "-o", str(tmp_path / "draft")],  # (a drafter's folder)
            "holds no training sequences but other files (config.json",
        ),
        (
            [
                "--data",
                str(tmp_path / "data"),
                "--data",
                f"{tmp_path}/./data/",
                "-o",
                str(tmp_path / "draft"),
            ],
            f"--data {tmp_path}/./data/ is {tmp_path / 'data'} again: give each folder once",
        ),
        (
            ["--data", str(tmp_path / "draft" / "config.json"), "-o", str(tmp_path / "draft")],
            "is a file: --data",
        ),
        (
            [
                "--data",
                str(tmp_path / "data"),
                "--data",
                str(tmp_path / "other"),
                "-o",
                str(tmp_path / "draft"),
            ],
            "other vocabularies",
        ),
    ]:
        failed = runner.invoke(app, ["train", "phrases", *args, "--force"])
        assert failed.exit_code == 1 and message in failed.output, failed.output


def test_the_shipped_table_fits_the_demo_target_and_its_answers_stay_the_targets(smollm2):
    model, tokenizer, _ = smollm2
    draft = load_draft("smollm2-135m-instruct-dflash")
    assert len(draft.phrases) > 100_000
    assert draft.phrases.tokenizer == tokenizer_fingerprint(tokenizer)
    ids = apply_chat_template(tokenizer, "Give me three tips for a job interview.")
    want = []
    for tok, _ in generate_step(mx.array(ids), model, max_tokens=64):
        want.append(int(tok))
        if want[-1] in tokenizer.eos_token_ids:
            break
    out = generate(model, draft, tokenizer, ids, max_tokens=64)
    assert out.tokens == want


def test_converting_or_exporting_a_drafter_carries_its_phrase_table(tmp_path):
    write_zlab_checkpoint(tmp_path / "draft", make_draft())
    table = Phrases.learn([([1, 2, 3, 4, 5], 1)] * 3)
    table.save(tmp_path / "draft")
    convert_draft(str(tmp_path / "draft"), tmp_path / "mlx", dtype="float32", quantize=True)
    export_draft(str(tmp_path / "draft"), tmp_path / "hf")
    for folder in ("mlx", "hf"):
        assert load_draft(str(tmp_path / folder)).phrases.next == table.next
