"""Training: the block mask, the loss, train/inference agreement, a real tiny run, resume, errors."""

import ast
import json
import math
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from tiny import (
    _COMMON,
    FAMILIES,
    flat_params,
    greedy_reference,
    make_dflash2,
    make_draft,
    make_target,
    make_tokenizer,
    prompt_of,
)

import dflash_mlx.data as data_module
import dflash_mlx.train as train_module
from dflash_mlx.chat import apply_chat_template
from dflash_mlx.data import (
    Answers,
    answer_rows,
    check_data_tokenizer,
    draw,
    generate_data,
    jsonl_prompts,
    load_shards,
    parse_hf_spec,
    prompt_source,
)
from dflash_mlx.errors import UserError
from dflash_mlx.models.dflash import block_mask
from dflash_mlx.models.targets import Target
from dflash_mlx.pairing import prepare
from dflash_mlx.speculative import generate
from dflash_mlx.train import (
    FeatureCache,
    TrainConfig,
    acceptance_from_blocks,
    block_labels,
    block_logits,
    cross_entropy,
    loss_weights,
    pick_mask_token,
    saved_run,
    train,
    usable_sequences,
)


def block_loss(logits, labels, valid, gamma):
    """The training objective: blocks' cross-entropy weighted by position, over the weights' sum."""
    w = loss_weights(logits.shape[1] + 1, gamma)[None] * valid
    return (cross_entropy(logits, labels) * w).sum() / w.sum()


@pytest.mark.parametrize("window", [None, 3])
def test_block_mask_allows_exactly_the_rule(window):
    T, B, anchors = 7, 3, [1, 3, 6]
    mask = np.array(block_mask(mx.array(anchors), T, B, window))
    assert mask.shape == (3, 1, B if window else 1, T + B)
    for i, a in enumerate(anchors):
        for q in range(B):
            for k in range(T + B):
                context_before_anchor = k < T and k < a
                own_block = k >= T  # the block's own keys: every position, both directions
                allowed = context_before_anchor or own_block
                if window:  # a sliding-window layer: nothing `window` or more positions behind the query
                    key_position = k if k < T else a + (k - T)
                    allowed = allowed and (a + q) - key_position < window
                assert mask[i, 0, q if window else 0, k] == allowed, (i, q, k)


def test_blocks_never_see_each_other():
    model, draft = make_target("llama"), make_draft(block_size=4)
    target = prepare(model, draft)
    tokens = mx.array(prompt_of(30))
    _, features = target(tokens[None], None)
    alone = block_logits(draft, target, features, tokens, mx.array([10]))
    together = block_logits(draft, target, features, tokens, mx.array([4, 10, 20]))
    other = block_logits(draft, target, features, tokens, mx.array([2, 10, 25]))
    np.testing.assert_allclose(np.array(together[1]), np.array(alone[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(other[1]), np.array(alone[0]), rtol=1e-5, atol=1e-5)


def test_training_blocks_equal_what_inference_drafts():
    model, draft = make_target("qwen3"), make_draft(block_size=6)
    target = prepare(model, draft)
    tokens = mx.array(prompt_of(25))
    _, features = target(tokens[None], None)
    anchors = [5, 12, 24]
    train_logits = block_logits(draft, target, features, tokens, mx.array(anchors))
    for i, a in enumerate(anchors):
        cache = draft.make_cache()
        draft.absorb(features[:, :a], cache)  # inference: the committed context before the block
        infer = draft.propose_logits(int(tokens[a].item()), cache, 6)
        np.testing.assert_allclose(np.array(train_logits[i]), np.array(infer[0]), rtol=1e-4, atol=1e-4)


def test_loss_weights_and_label_alignment_by_hand():
    tokens = mx.array([10, 11, 12, 13, 14])
    labels, valid = block_labels(tokens, mx.array([1, 3]), 4)
    assert labels[0].tolist() == [12, 13, 14] and labels[1, 0].item() == 14
    assert valid.tolist() == [[True, True, True], [True, False, False]]
    assert np.allclose(np.array(loss_weights(4, 7.0)), [1, math.exp(-1 / 7), math.exp(-2 / 7)])
    logits = mx.random.normal((2, 3, 20), key=mx.random.key(0))
    lp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    w = [1, math.exp(-1 / 7), math.exp(-2 / 7)]
    ce = [-lp[0, 0, 12] * w[0], -lp[0, 1, 13] * w[1], -lp[0, 2, 14] * w[2], -lp[1, 0, 14] * w[0]]
    expected = sum(ce) / (sum(w) + w[0])
    assert abs(block_loss(logits, labels, valid, 7.0).item() - expected) < 1e-5


@pytest.mark.parametrize("family,quantized", [("llama", False), ("llama", True), ("qwen3", True)])
def test_the_data_vocabulary_loss_is_the_full_softmax_restricted_to_those_tokens(family, quantized):
    model, draft = make_target(family), make_draft(block_size=5)
    if quantized:  # a 4-bit head, as on a Mac (llama: the tied embedding; qwen3: an lm_head)
        nn.quantize(model, group_size=32, bits=4)
        head = model.model.embed_tokens if family == "llama" else model.lm_head
        assert isinstance(head, (nn.QuantizedEmbedding, nn.QuantizedLinear))
    target = prepare(model, draft)
    tokens = mx.array(prompt_of(30))
    _, features = target(tokens[None], None)
    anchors = mx.array([3, 11, 20])
    labels, valid = block_labels(tokens, anchors, 5)
    used = np.unique(np.array(tokens))  # every label is in the subset, as in training
    sub_labels = mx.array(np.searchsorted(used, np.array(labels)))
    full = block_logits(draft, target, features, tokens, anchors)
    subset = block_logits(draft, target, features, tokens, anchors, target.head_rows(mx.array(used)))
    np.testing.assert_allclose(np.array(subset), np.array(full)[..., used], rtol=1e-5, atol=1e-5)
    restricted = block_loss(subset, sub_labels, valid, 7.0).item()
    assert restricted == pytest.approx(
        block_loss(full[..., mx.array(used)], sub_labels, valid, 7.0).item(), abs=1e-5
    )
    assert restricted < block_loss(full, labels, valid, 7.0).item()  # fewer competitors, lower loss


def test_fast_cpu_cross_entropy_matches_mlx_in_value_and_gradient():
    logits = 8 * mx.random.normal((3, 5, 300), key=mx.random.key(1))  # large logits: the stable path matters
    labels = mx.random.randint(0, 300, (3, 5), key=mx.random.key(2))
    w = mx.random.uniform(shape=(3, 5), key=mx.random.key(3))
    ours = mx.value_and_grad(lambda x: (cross_entropy(x, labels) * w).sum())(logits)
    ref = mx.value_and_grad(lambda x: (nn.losses.cross_entropy(x, labels, reduction="none") * w).sum())(
        logits
    )
    assert abs(ours[0].item() - ref[0].item()) < 1e-4 * abs(ref[0].item())
    np.testing.assert_allclose(np.array(ours[1]), np.array(ref[1]), rtol=1e-4, atol=1e-6)


def tiny_config(**changes) -> TrainConfig:
    """A one-layer drafter of blocks of 8 with token 95 as the mask, 8 sequences held out; no checkpoint
    before the last step."""
    recipe = dict(block_size=8, num_layers=1, mask_token_id=95, anchors=8, holdout=8, checkpoint_every=1000)
    return TrainConfig(**{**recipe, **changes})


def self_distilled(model, n=40, prompt_len=8, response=48):
    return [
        (p + greedy_reference(model, p, response), prompt_len)
        for p in (prompt_of(prompt_len, seed=s) for s in range(n))
    ]


@pytest.fixture(scope="module")
def tiny_setup():
    model = make_target("llama")
    return model, self_distilled(model)


def real_tau(model, draft, seqs):
    """Mean acceptance of real stream_generate runs on prompts the drafter trained on (a random tiny
    target's text is only learnable by heart: what this checks is that training reaches inference)."""
    return np.mean(
        [
            generate(model, draft, None, s[:8], max_tokens=48, block_size=draft.block_size).mean_acceptance
            for s, _ in seqs[8:16]
        ]
    )


@pytest.mark.parametrize("vocab", ["full", "data"])
def test_a_tiny_run_lowers_the_loss_and_raises_real_acceptance(tiny_setup, tmp_path, vocab):
    model, seqs = tiny_setup
    cfg = tiny_config(steps=300, lr=3e-3, warmup=20, vocab=vocab)
    losses = []
    untrained = make_draft(block_size=8, layers=1, layer_ids=(2,))
    before = real_tau(model, untrained, seqs)
    draft = train(
        Target(model),
        make_tokenizer(),
        seqs,
        tmp_path / "run",
        cfg,
        on_step=lambda r: losses.append(r["loss"]),
    )
    assert np.mean(losses[-50:]) < 0.5 * np.mean(losses[:20])
    after = real_tau(model, draft, seqs)
    assert after > before + 0.7, (before, after)
    assert (tmp_path / "run" / "checkpoint" / "model.safetensors").exists()
    # The offline estimate (what training logs) is the greedy acceptance inference really gets at
    # those anchors, on self-distilled sequences: here, with a drafter that accepts blocks.
    target = prepare(model, draft)
    tokens = mx.array(seqs[9][0])
    anchors = mx.array([8, 15, 23, 31, 40])
    _, features = target(tokens[None], None)
    tau, _ = acceptance_from_blocks(
        block_logits(draft, target, features, tokens, anchors), *block_labels(tokens, anchors, 8)
    )
    real = []
    for a in anchors.tolist():
        cache = draft.make_cache()
        draft.absorb(features[:, :a], cache)
        proposals = np.array(draft.propose_logits(int(tokens[a].item()), cache, 8)[0].argmax(-1))
        real.append(1 + np.cumprod(proposals == np.array(tokens[a + 1 : a + 8])).sum())
    assert tau == pytest.approx(np.mean(real)) and tau > 2


@pytest.mark.parametrize("family", FAMILIES)
def test_every_supported_family_trains_and_its_features_match_a_cached_prefill(family, tmp_path):
    model = make_target(family)
    # Training takes the target's features from one uncached pass; drafting gets them from a cached
    # prefill and then a few positions at a time (sliding windows, recurrent state): they must agree.
    target = Target(model, [1, 2])
    tokens = mx.array(prompt_of(40))
    _, whole = target(tokens[None], None)
    cache = target.make_cache()
    parts = [target(tokens[None, a:b], cache)[1] for a, b in ((0, 17), (17, 20), (20, 33), (33, 40))]
    np.testing.assert_allclose(np.array(mx.concatenate(parts, axis=1)), np.array(whole), rtol=1e-4, atol=1e-4)
    seqs = [(p + greedy_reference(model, p, 32), 8) for p in (prompt_of(8, seed=s) for s in range(12))]
    cfg = tiny_config(steps=60, lr=3e-3, warmup=10, holdout=4)
    losses = []
    train(Target(model), make_tokenizer(), seqs, tmp_path, cfg, on_step=lambda r: losses.append(r["loss"]))
    assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:10])


def test_offline_acceptance_by_hand():
    logits = mx.zeros((2, 3, 4))
    logits[0, :, 1] = 1  # proposes 1, 1, 1
    logits[1, :, 2] = 1  # proposes 2, 2, 2
    labels = mx.array([[1, 1, 3], [0, 2, 2]])
    valid = mx.array([[True, True, True], [True, True, False]])
    tau, accuracy = acceptance_from_blocks(logits, labels, valid)
    assert tau == 1 + (2 + 0) / 2  # leading correct proposals: 2, then 0
    np.testing.assert_allclose(accuracy, [0.5, 1.0, 0.0])  # per position, over valid labels only


def test_the_data_vocabulary_option_is_used(tiny_setup, tmp_path):
    """One identical step each on answers that use 6 of the 96 tokens: the loss over only those is
    lower (fewer competitors)."""
    model, _ = tiny_setup
    seqs = [(prompt_of(8, seed=s) + [3 + (s * k) % 6 for k in range(40)], 8) for s in range(16)]
    first = {}
    for vocab in ("full", "data"):
        cfg = tiny_config(steps=1, warmup=1, vocab=vocab)
        train(
            Target(model),
            make_tokenizer(),
            seqs,
            tmp_path / vocab,
            cfg,
            on_step=lambda r, vocab=vocab: first.setdefault(vocab, r["loss"]),
        )
    assert first["data"] < first["full"] - 1


def test_the_mask_token_is_a_spare_special_token():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(10)}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0")),
        unk_token="w0",
        bos_token="w1",
        eos_token="w2",
    )
    with pytest.raises(ValueError, match="no spare special token to use as the mask: pass --mask-token-id"):
        pick_mask_token(tok)
    tok.add_special_tokens({"additional_special_tokens": ["<a>", "<b>"], "pad_token": "<pad>"})
    ids = tok.convert_tokens_to_ids(["<a>", "<b>", "<pad>"])
    assert pick_mask_token(tok) == max(ids[:2])  # the last spare one, never BOS/EOS/PAD/UNK
    tok.add_special_tokens({"mask_token": "<mask>"})
    assert pick_mask_token(tok) == tok.mask_token_id


def test_a_run_whose_loss_is_no_longer_a_number_stops_and_keeps_the_last_good_checkpoint(
    tiny_setup, tmp_path
):
    model, seqs = tiny_setup
    logged = []
    with pytest.raises(UserError, match="training diverged and stopped, keeping the checkpoint of step") as e:
        train(
            Target(model),
            make_tokenizer(),
            seqs,
            tmp_path / "run",
            tiny_config(steps=40, lr=1e30, warmup=0, checkpoint_every=1),
            on_step=lambda r: logged.append(r["loss"]),
        )
    saved = json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())["step"]
    assert f"step {saved + 1}" in str(e.value) and len(logged) == saved and all(map(math.isfinite, logged))
    weights = mx.load(str(tmp_path / "run" / "checkpoint" / "model.safetensors"))
    assert all(bool(mx.isfinite(w).all()) for w in weights.values())


def test_a_check_of_acceptance_cut_short_keeps_the_step_it_checked(tiny_setup, tmp_path):
    """The held-out check takes minutes on a CPU after steps of seconds: a Ctrl-C there (a signal's
    KeyboardInterrupt) must not cost the steps trained since the last checkpoint."""
    model, seqs = tiny_setup
    cfg = tiny_config(steps=12, eval_every=6, checkpoint_every=4)
    logged = []

    def check(draft):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(Target(model), make_tokenizer(), seqs, tmp_path, cfg, on_step=logged.append, evaluate=check)
    assert [r["step"] for r in logged] == list(range(1, 7)) and logged[-1]["eval_error"] == "interrupted"
    assert json.loads((tmp_path / "checkpoint" / "state.json").read_text())["step"] == 6
    # A stop asked for before the check skips it: the step is checkpointed, the run ends there.
    checked, logged = [], []
    train(
        Target(model),
        make_tokenizer(),
        seqs,
        tmp_path,
        replace(cfg, eval_every=1),
        on_step=logged.append,
        evaluate=lambda draft: checked.append(1) or {},
        stop=lambda: True,
    )
    assert not checked and [r["step"] for r in logged] == [7] and "offline_tau" not in logged[0]
    assert json.loads((tmp_path / "checkpoint" / "state.json").read_text())["step"] == 7
    # Cut short at the last step: the run is done all the same (nothing raised, the last step kept).
    train(Target(model), make_tokenizer(), seqs, tmp_path / "last", replace(cfg, steps=3), evaluate=check)
    assert json.loads((tmp_path / "last" / "checkpoint" / "state.json").read_text())["step"] == 3


@pytest.mark.parametrize("damaged", ["state.json", "model.safetensors", "optimizer.safetensors", "lr"])
def test_a_damaged_checkpoint_is_named_in_one_line(tiny_setup, tmp_path, damaged):
    model, seqs = tiny_setup
    cfg = tiny_config(steps=2, checkpoint_every=1)
    train(Target(model), make_tokenizer(), seqs, tmp_path, cfg)
    file = tmp_path / "checkpoint" / damaged
    if damaged == "lr":  # a setting of another kind (a hand edit): TrainConfig's TypeError came through
        file, state = file.with_name("state.json"), json.loads(file.with_name("state.json").read_text())
        file.write_text(json.dumps({**state, "train_config": {**state["train_config"], "lr": "x"}}))
    else:
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])  # (a copy cut short)
    with pytest.raises(UserError, match=f"checkpoint/{file.name} is damaged .*: this run cannot go on"):
        train(Target(model), make_tokenizer(), seqs, tmp_path, replace(cfg, steps=3))


def test_a_checkpoint_that_cannot_be_read_is_not_called_damaged(tiny_setup, tmp_path, monkeypatch):
    """A permission or a failing disk is no reason to give up the run: not "start a new run"."""
    model, seqs = tiny_setup
    cfg = tiny_config(steps=2, checkpoint_every=1)
    train(Target(model), make_tokenizer(), seqs, tmp_path, cfg)

    def refused(path, *a, **k):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(mx, "load", refused)
    with pytest.raises(
        UserError, match=r"^cannot read .*checkpoint/model.safetensors \(Permission denied\)$"
    ):
        train(Target(model), make_tokenizer(), seqs, tmp_path, replace(cfg, steps=3))


def test_resume_continues_the_same_run(tiny_setup, tmp_path):
    model, seqs = tiny_setup
    cfg = tiny_config(steps=60, lr=3e-3, warmup=10, checkpoint_every=20)
    straight = []
    train(
        Target(model),
        make_tokenizer(),
        seqs,
        tmp_path / "a",
        cfg,
        on_step=lambda r: straight.append(r["loss"]),
    )

    first, second = [], []

    def crash_at_45(record):
        first.append(record["loss"])
        if record["step"] == 45:
            raise KeyboardInterrupt  # Ctrl-C between two checkpoints

    with pytest.raises(KeyboardInterrupt):
        train(Target(model), make_tokenizer(), seqs, tmp_path / "b", cfg, on_step=crash_at_45)
    assert json.loads((tmp_path / "b" / "checkpoint" / "state.json").read_text())["step"] == 40
    train(
        Target(model), make_tokenizer(), seqs, tmp_path / "b", cfg, on_step=lambda r: second.append(r["loss"])
    )
    assert len(second) == 20  # steps 41..60: only the 5 steps after the last checkpoint were redone
    np.testing.assert_allclose(first[:40] + second, straight, rtol=2e-3, atol=2e-3)
    # Resuming on other data would change the order of sequences and the held-out set: refused.
    with pytest.raises(
        ValueError, match="the run trained on other data .40 usable sequences, these have 39."
    ):
        train(Target(model), make_tokenizer(), seqs[:-1], tmp_path / "b", replace(cfg, steps=80))
    with pytest.raises(ValueError, match="the same number of sequences, not the same ones"):
        train(Target(model), make_tokenizer(), seqs[1:] + seqs[:1], tmp_path / "b", replace(cfg, steps=80))
    # Or against another target: other weights of the same shape, or another shape.
    with pytest.raises(
        ValueError, match=r"another target \(other weights of the same shape\): resume it with the -m"
    ):
        train(
            Target(make_target("llama", seed=1)),
            make_tokenizer(),
            seqs,
            tmp_path / "b",
            replace(cfg, steps=80),
        )
    with pytest.raises(
        ValueError,
        match=r"another target \(llama, 4 layers, vocabulary 96; this one: qwen3, 4 layers, vocabulary 96\)",
    ):
        train(Target(make_target("qwen3")), make_tokenizer(), seqs, tmp_path / "b", replace(cfg, steps=80))
    # Killed while writing a checkpoint: the half-written copy is cleared away when the run resumes.
    (tmp_path / "b" / ".checkpoint.partial-x1y2").mkdir()
    (tmp_path / "b" / ".checkpoint.partial-x1y2" / "model.safetensors").write_bytes(b"half")
    train(
        Target(model), make_tokenizer(), seqs, tmp_path / "b", cfg
    )  # nothing left to train: it just returns
    assert not list((tmp_path / "b").glob(".checkpoint.partial-*"))
    # Stopped between the two renames that swap a checkpoint in: the previous one is found and put back.
    (tmp_path / "b" / "checkpoint").rename(tmp_path / "b" / ".checkpoint.old")
    assert (
        saved_run(tmp_path / "b")["step"] == 60
        and (tmp_path / "b" / "checkpoint" / "model.safetensors").exists()
    )


def test_a_failing_tau_check_is_logged_and_the_run_goes_on(tiny_setup, tmp_path):
    model, seqs = tiny_setup
    cfg = tiny_config(steps=12, anchors=4, warmup=2, checkpoint_every=6, eval_every=6)
    records = []

    def evaluate(draft):
        raise ValueError("the prompt is 327 tokens and the model's context holds 128: shorten the prompt")

    train(
        Target(model), make_tokenizer(), seqs, tmp_path / "r", cfg, on_step=records.append, evaluate=evaluate
    )
    assert [r["step"] for r in records if "eval_error" in r] == [6, 12]
    assert (
        records[-1]["eval_error"].startswith("ValueError: the prompt is 327 tokens")
        and "offline_tau" in records[-1]
    )
    assert saved_run(tmp_path / "r")["step"] == 12  # the last interval was kept


def test_sequences_with_no_response_inside_max_seq_len_are_not_used(tiny_setup, tmp_path):
    model, seqs = tiny_setup  # 8 prompt + 48 answer tokens each
    cfg = tiny_config(anchors=4, steps=6, holdout=2, max_seq_len=40, vocab="data")
    # Read as prompts of 39 tokens, 10 of them leave one response token inside the first 40: no anchor.
    mixed = [(s, 39) for s, _ in seqs[:10]] + [(s, 37) for s, _ in seqs[10:13]]
    assert usable_sequences(mixed, cfg) == mixed[10:]
    steps = []
    train(
        Target(model), make_tokenizer(), mixed, tmp_path / "r", cfg, on_step=lambda r: steps.append(r["step"])
    )
    assert (
        steps == [1, 2, 3, 4, 5, 6] and saved_run(tmp_path / "r")["step"] == 6
    )  # no step skipped, none lost


def test_features_past_the_float16_range_stay_finite(tiny_setup):
    model, seqs = tiny_setup
    tokens = mx.array(seqs[0][0])
    assert (
        FeatureCache(Target(model, [1, 3]))(0, tokens).dtype == mx.float16
    )  # as before: half the RAM of float32
    loud = make_target("llama")  # a target with massive activations, as some real ones have
    loud.model.embed_tokens.weight = loud.model.embed_tokens.weight * 1e6
    _, exact = Target(loud, [1, 3])(tokens[None], None)
    assert mx.abs(exact).max().item() > 65504  # float16 would make these inf
    kept = FeatureCache(Target(loud, [1, 3]))(0, tokens)
    assert kept.dtype == mx.bfloat16 and mx.isfinite(kept).all().item()
    np.testing.assert_allclose(np.array(kept.astype(mx.float32)), np.array(exact), rtol=1e-2)


def test_fc_learns_on_standardised_features_and_checkpoints_hold_the_plain_drafter(tiny_setup, tmp_path):
    model, seqs = tiny_setup
    loud = make_target("llama")  # features of very different scales, as real targets' tapped layers have
    mlp = loud.model.layers[1].mlp
    mlp.down_proj.weight = mlp.down_proj.weight * mx.linspace(0.1, 30, loud.args.hidden_size)[:, None]
    draft = make_draft(block_size=4, layers=1, layer_ids=(1, 3), mask_token_id=95)
    before = np.array(draft.fc.weight)
    cfg = TrainConfig(block_size=4, anchors=8, steps=1, warmup=0, weight_decay=0.0, holdout=8)
    trained = train(Target(loud), make_tokenizer(), seqs, tmp_path / "run", cfg, draft=draft)
    # The scale: each feature dimension's RMS over the first 16 training sequences, position 0 left out.
    target = Target(loud, [1, 3])
    first = [train_module.sequence_for_step(0, k, np.arange(8, len(seqs))) for k in range(16)]
    x = np.concatenate([np.array(target(mx.array(seqs[i][0])[None], None)[1][0, 1:]) for i in first])
    rms = np.sqrt((x.astype(np.float64) ** 2).mean(0))
    saved = mx.load(str(tmp_path / "run" / "checkpoint" / "feature_scale.safetensors"))["scale"]
    np.testing.assert_allclose(np.array(saved), rms, rtol=2e-3)  # (features are kept as float16)
    assert rms.max() / rms.min() > 10
    # Adam's first step moves every weight by the same amount in the standardised space: in fc's own
    # space a weight moves inversely to its input's scale (without standardising, all alike).
    step = np.abs(np.array(trained.fc.weight) - before) * rms
    assert np.mean(np.abs(step / np.median(step) - 1) < 0.1) > 0.9
    # The run's drafter and its checkpoint are the plain drafter (fc a Linear, no extra weights).
    assert isinstance(trained.fc, nn.Linear)
    ckpt = mx.load(str(tmp_path / "run" / "checkpoint" / "model.safetensors"))
    assert sorted(ckpt) == sorted(flat_params(trained)) and mx.array_equal(
        ckpt["fc.weight"], trained.fc.weight
    )
    tokens = mx.array(seqs[3][0])
    _, features = target(tokens[None], None)
    prepare(loud, trained)
    logits = trained.propose_logits(int(tokens[20].item()), _absorbed(trained, features[:, :20]), 4)
    np.testing.assert_allclose(
        np.array(logits[0]),
        np.array(block_logits(trained, target, features, tokens, mx.array([20]))[0]),
        rtol=1e-4,
        atol=1e-4,
    )


def _absorbed(draft, features):
    cache = draft.make_cache()
    draft.absorb(features, cache)
    return cache


def test_each_epoch_trains_on_every_sequence_once(tiny_setup, tmp_path):
    model, seqs = tiny_setup
    cfg = tiny_config(steps=64, anchors=2)
    drawn = []
    train(
        Target(model),
        make_tokenizer(),
        seqs,
        tmp_path / "run",
        cfg,
        on_step=lambda r: drawn.extend(r["sequences"]),
    )
    train_idx = list(range(8, len(seqs)))  # the first `holdout` sequences are never trained on
    assert sorted(drawn[:32]) == train_idx and sorted(drawn[32:]) == train_idx
    assert drawn[:32] != drawn[32:]  # each epoch in its own order


def test_target_features_are_kept_only_up_to_the_budget_and_never_change_training(
    tiny_setup, tmp_path, monkeypatch
):
    model, seqs = tiny_setup
    target = Target(model, [1, 2])
    tokens = [mx.array(s) for s, _ in seqs[:4]]
    sizes = [FeatureCache(target)(i, t).nbytes for i, t in enumerate(tokens)]
    cache = FeatureCache(target, max_bytes=sizes[0] + sizes[1] + sizes[2] // 2)
    first = [cache(i, t) for i, t in enumerate(tokens)]
    assert sorted(cache.store) == [0, 1] and cache.nbytes == sizes[0] + sizes[1]
    for i, t in enumerate(tokens):  # kept or recomputed, a sequence's features are the same
        assert mx.array_equal(cache(i, t), first[i])
    # 40 steps over 32 training sequences: the second epoch reuses kept features, or recomputes them.
    cfg = tiny_config(steps=40, anchors=4, lr=3e-3, warmup=5)
    caches = []

    class Watched(FeatureCache):
        def __init__(self, *args):
            super().__init__(*args)
            caches.append(self)

    monkeypatch.setattr(train_module, "FeatureCache", Watched)
    kept, recomputed = [], []
    train(
        Target(model), make_tokenizer(), seqs, tmp_path / "a", cfg, on_step=lambda r: kept.append(r["loss"])
    )
    train(
        Target(model),
        make_tokenizer(),
        seqs,
        tmp_path / "b",
        cfg,
        on_step=lambda r: recomputed.append(r["loss"]),
        feature_cache_gb=0,
    )
    assert len(caches[0].store) == len(seqs) and caches[1].store == {}  # all kept (default 4 GB), none kept
    np.testing.assert_allclose(recomputed, kept, rtol=1e-5, atol=1e-6)


def test_drafter_depth_and_mlp_width_are_the_runs_choice(tiny_setup, tmp_path):
    model, seqs = tiny_setup
    cfg = tiny_config(block_size=4, num_layers=3, intermediate_size=40, anchors=4, steps=2, warmup=1)
    draft = train(Target(model), make_tokenizer(), seqs, tmp_path / "run", cfg)
    assert len(draft.layers) == 3 and draft.layers[0].mlp.gate_proj.weight.shape == (
        40,
        model.args.hidden_size,
    )
    saved = json.loads((tmp_path / "run" / "checkpoint" / "config.json").read_text())
    assert saved["intermediate_size"] == 40 and saved["num_hidden_layers"] == 3
    assert saved["hidden_size"] == model.args.hidden_size  # the width that meets the shared embedding


def test_a_starting_drafter_keeps_its_architecture(tiny_setup, tmp_path):
    model, seqs = tiny_setup
    start = make_draft(block_size=8, layers=3, layer_ids=(0, 2))
    weights = {k: np.array(v) for k, v in flat_params(start).items()}
    cfg = TrainConfig(block_size=8, anchors=4, steps=2, warmup=1, holdout=8)  # says 2 layers, the default
    trained = flat_params(train(Target(model), make_tokenizer(), seqs, tmp_path / "run", cfg, draft=start))
    # ... and its weights: two AdamW steps at lr 6e-4 move no weight by more than ~2 * lr.
    assert trained.keys() == weights.keys()
    assert max(np.abs(np.array(trained[k]) - w).max() for k, w in weights.items()) < 3e-3
    saved = json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())["train_config"]
    c = start.config
    assert (saved["num_layers"], saved["target_layer_ids"], saved["mask_token_id"]) == (
        3,
        [0, 2],
        c.mask_token_id,
    )
    with pytest.raises(ValueError, match="block size 16 does not match the starting drafter's 8"):
        train(Target(model), make_tokenizer(), seqs, tmp_path / "b16", TrainConfig(holdout=8), draft=start)
    with pytest.raises(ValueError, match="training starts from a DFlash drafter, not a DFlash2DraftModel"):
        train(
            Target(model),
            make_tokenizer(),
            seqs,
            tmp_path / "d2",
            TrainConfig(holdout=8),
            draft=make_dflash2(),
        )


def test_bad_training_input_is_refused(tiny_setup, tmp_path, monkeypatch):
    model, seqs = tiny_setup
    with pytest.raises(ValueError, match="usable sequences"):
        train(
            Target(model),
            make_tokenizer(),
            [(s[:9], 8) for s, _ in seqs],
            tmp_path / "x",
            TrainConfig(holdout=2),
        )
    for size in (1, 257):  # one proposal at least, and no more than decoding accepts
        with pytest.raises(ValueError, match=f"block size must be between 2 and 256, got {size}"):
            train(
                Target(model),
                make_tokenizer(),
                seqs,
                tmp_path / "y",
                TrainConfig(block_size=size, mask_token_id=95),
            )
    with pytest.raises(ValueError, match="vocab must be 'full' or 'data'"):
        train(
            Target(model),
            make_tokenizer(),
            seqs,
            tmp_path / "v",
            TrainConfig(vocab="small", mask_token_id=95),
        )
    with pytest.raises(ValueError, match="num_layers must be at least 1, got 0"):
        train(
            Target(model), make_tokenizer(), seqs, tmp_path / "z", TrainConfig(num_layers=0, mask_token_id=95)
        )
    huge = TrainConfig(num_layers=999, intermediate_size=1 << 22, mask_token_id=95)  # (a typo's size)
    with pytest.raises(ValueError, match=r"needs about \d+ GiB to train, more than half this machine's"):
        train(Target(model), make_tokenizer(), seqs, tmp_path / "huge", huge)
    assert not (tmp_path / "huge").exists()
    for bad, message in (
        ({"steps": 0}, "steps must be at least 1"),
        ({"checkpoint_every": 0}, "checkpoint-every"),
        ({"anchors": -1}, "anchors must be at least 1"),
        ({"lr": 0.0}, "learning rate must be"),
        ({"lr": float("inf")}, "learning rate must be"),
        ({"lr": float("nan")}, "learning rate must be"),
        ({"grad_clip": float("inf")}, "grad-clip must be a number"),
        ({"weight_decay": float("nan")}, "weight-decay must be a number"),
        ({"warmup": -5}, "warmup cannot be negative"),
        ({"micro_batch": 0}, "micro-batch must be from 1 to the batch size"),
        ({"batch_size": 2, "micro_batch": 3}, "micro-batch must be from 1 to the batch size, 2, got 3"),
    ):
        with pytest.raises(ValueError, match=message):
            TrainConfig(**bad)
    (tmp_path / "empty.jsonl").write_text('{"conversations": [{"from": "gpt", "value": "hi"}]}\n\n')
    with pytest.raises(ValueError, match="no prompts \\(its conversations have no human turn\\)"):
        jsonl_prompts(tmp_path / "empty.jsonl")
    (tmp_path / "nothing.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="nothing.jsonl: no prompts: the file is empty"):
        jsonl_prompts(tmp_path / "nothing.jsonl")
    (tmp_path / "latin1.jsonl").write_bytes('{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.jsonl, line 2: not UTF-8 text"):
        jsonl_prompts(tmp_path / "latin1.jsonl")
    (tmp_path / "bom.jsonl").write_text('{"prompt": "from notepad"}\n', encoding="utf-8-sig")  # (a BOM)
    assert jsonl_prompts(tmp_path / "bom.jsonl") == [[{"role": "user", "content": "from notepad"}]]
    # a line without an end (/dev/zero) is refused at MOST_TEXT, not read until memory runs out
    monkeypatch.setattr(data_module, "MOST_TEXT", 20)
    (tmp_path / "long.jsonl").write_text('{"prompt": "fine"}\n' * 3 + '{"prompt": "past twenty"}\n')
    with pytest.raises(ValueError, match=r"long.jsonl, line 4: over .* without a line end: not JSONL"):
        jsonl_prompts(tmp_path / "long.jsonl")
    monkeypatch.undo()
    (tmp_path / "broken.jsonl").write_text('{"prompt": "fine"}\n{"prompt": "cut off\n')
    with pytest.raises(ValueError, match=r"broken.jsonl, line 2: not JSON"):
        jsonl_prompts(tmp_path / "broken.jsonl")
    for row, message in (
        (
            '{"messages": ["hi"]}',
            '"messages" must be a list, each message with a "role" and a "content" string',
        ),
        (
            '{"messages": [{"role": "user"}]}',
            '"messages" must be a list, each message with a "role" and a "content" string',
        ),
        ('{"messages": []}', '"messages" must be a list'),
        ('{"text": "no prompt field"}', 'expected a "prompt", "messages" or "conversations" field'),
        ('{"prompt": 5}', '"prompt" must be a string with some text'),
        ('{"prompt": "  "}', '"prompt" must be a string with some text'),
        ('{"conversations": "hi"}', '"conversations" must be a list of turns'),
        ('{"messages": [{"role": "assistant", "content": "hi"}]}', "no user message to answer"),
        ('{"conversations": [{"from": "human"}]}', 'the first "human" turn needs a "value" string'),
    ):
        (tmp_path / "odd.jsonl").write_text('{"prompt": "fine"}\n' + row + "\n")
        with pytest.raises(ValueError, match=rf"odd.jsonl, line 2: {message}"):
            jsonl_prompts(tmp_path / "odd.jsonl")
    (tmp_path / "chat.jsonl").write_text(
        '{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", '
        '"content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
    )
    assert jsonl_prompts(tmp_path / "chat.jsonl") == [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ]
    import importlib

    qwen2 = importlib.import_module("mlx_lm.models.qwen2")
    unsupported = qwen2.Model(qwen2.ModelArgs.from_dict(dict(_COMMON, model_type="qwen2")))
    with pytest.raises(ValueError, match="family 'qwen2' is not supported"):
        Target(unsupported)


def test_sharegpt_splits_keep_the_held_out_conversations_out_of_training():
    train, heldout, followup = (
        prompt_source(s) for s in ("sharegpt", "sharegpt-heldout", "sharegpt-followup")
    )
    assert len(train) > 10000 and len(followup) > 5000
    firsts = {m[0]["content"] for m in train}
    # ShareGPT repeats some first turns ("hi"): held out means no copy of the text is in training.
    assert len({m[0]["content"] for m in heldout}) == len(heldout) == 84
    assert not firsts & {m[0]["content"] for m in heldout}
    # A follow-up is a second user turn after a training conversation's first turn and its answer.
    assert all([t["role"] for t in m] == ["user", "assistant", "user"] for m in followup)
    assert all(m[0]["content"] in firsts and m[1]["content"] and m[2]["content"] for m in followup)


def test_python_stdlib_prompts_are_humaneval_style_code_questions():
    prompts = prompt_source("python-stdlib")
    assert len(prompts) > 1000  # every public documented function of the standard library
    assert prompts == prompt_source("python-stdlib")  # a fixed order, so `train data` can resume
    for messages in prompts[:50]:
        text = messages[0]["content"]
        assert text.startswith("Complete this Python function.\n\n```python\ndef ") and text.endswith("\n```")
        code = text.split("```python\n", 1)[1][:-4]
        fn = ast.parse(code).body[0]  # a signature and docstring, nothing of the body
        assert isinstance(fn, ast.FunctionDef) and ast.get_docstring(fn) and len(fn.body) == 1


def test_hugging_face_dataset_specs_name_config_split_and_field():
    assert parse_hf_spec("openai/gsm8k/main:test:question") == ("openai/gsm8k", "main", "test", "question")
    assert parse_hf_spec("tatsu-lab/alpaca") == ("tatsu-lab/alpaca", None, "train", None)
    assert parse_hf_spec("org/name::text") == ("org/name", None, "train", "text")
    for bad in ("gsm8k", "a/b/c/d:test", "org/name:test:q:extra", "org//x"):
        with pytest.raises(ValueError, match=r"expected hf:org/name\[/config\]\[:split\[:field\]\]"):
            prompt_source("hf:" + bad)


def test_a_hugging_face_dataset_gives_prompts_and_a_misspelt_column_is_named(tmp_path, monkeypatch):
    """The real `datasets` loader, pointed at a local folder named like a Hub dataset (as on a user's
    machine after a download)."""
    pytest.importorskip("datasets")
    folder = tmp_path / "acme" / "prompts"
    folder.mkdir(parents=True)
    (folder / "train.jsonl").write_text(
        '{"question": "What is 2+2?", "answer": "4"}\n'
        '{"question": "  ", "answer": "-"}\n{"question": "Name a colour.", "answer": "red"}\n'
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert prompt_source("hf:acme/prompts") == [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "user", "content": "Name a colour."}],
    ]
    assert prompt_source("hf:acme/prompts:train:answer")[0] == [{"role": "user", "content": "4"}]
    with pytest.raises(
        ValueError, match="acme/prompts \\(train\\) has no column 'questoin'; its columns: question, answer"
    ):
        prompt_source("hf:acme/prompts:train:questoin")


def test_data_generation_stops_at_the_limit_and_resumes_without_repeats(tmp_path):
    model, tok = make_target("llama"), make_tokenizer(eos=95)
    prompts = [[{"role": "user", "content": f"w{i} w{i + 3}"}] for i in range(5, 17)]
    kw = dict(max_new_tokens=4, batch_size=4)
    assert generate_data(model, tok, prompts, tmp_path, shard_size=8, limit=3, **kw) == 3
    assert len(load_shards(tmp_path)) == 3  # not the whole first shard of 8
    # Resumed with another shard size: continues at prompt 3, no prompt twice, none skipped.
    assert generate_data(model, tok, prompts, tmp_path, shard_size=2, limit=7, **kw) == 7
    seqs = load_shards(tmp_path)
    assert [s[:p] for s, p in seqs] == [apply_chat_template(tok, m) for m in prompts[:7]]
    assert all(len(s) > p for s, p in seqs)  # each has its answer


def test_data_answers_are_the_targets_greedy_ones_ending_on_the_stop_token_it_wrote(tmp_path):
    model, tok = make_target("llama"), make_tokenizer(eos=95)
    prompts = [[{"role": "user", "content": f"w{i} w{i + 3}"}] for i in range(5, 9)]
    encoded = [apply_chat_template(tok, m) for m in prompts]
    ref = [greedy_reference(model, p, 12) for p in encoded]
    second = ref[1][3]  # a second EOS id (as Qwen3 and Llama 3 have), which the second answer writes
    tok.eos_token_ids = {95, second}
    assert generate_data(model, tok, prompts, tmp_path, max_new_tokens=12, batch_size=3) == 4
    for (seq, plen), p, r in zip(load_shards(tmp_path), encoded, ref):
        stop = next((i for i, t in enumerate(r) if t in (95, second)), len(r) - 1)
        assert (seq[:plen], seq[plen:]) == (p, r[: stop + 1])
    assert load_shards(tmp_path)[1][0][-1] == second


@pytest.mark.parametrize("prefill_tokens", [8192, 24])
@pytest.mark.parametrize("family", ["llama", "gpt_oss", "qwen3_5", "lfm2"])
def test_answers_are_each_prompts_own_greedy_ones_while_rows_leave_and_join(
    family, prefill_tokens, monkeypatch
):
    """Attention, sliding-window, gated-delta and convolution caches: seven prompts of different
    lengths through three rows, answers ending at a stop token or the limit, so that rows leave and
    prompts join mid-way (together, or in prefill passes of one to three prompts); each answer is the
    one the target gives that prompt alone."""
    monkeypatch.setattr(Answers, "PREFILL_TOKENS", prefill_tokens)
    model = make_target(family)
    prompts = [prompt_of(n, seed=n) for n in (5, 12, 3, 9, 17, 7, 11)]
    refs = [greedy_reference(model, p, 10) for p in prompts]
    stop = {refs[0][2], refs[3][5]}  # two answers end early on a stop token
    gen = Answers(model, stop, 3)
    uids = gen.insert(prompts, 10)
    answers = {u: [] for u in uids}
    while out := gen.next_generated():
        for uid, token, ended in out:
            assert answers[uid] == [] or not answers[uid][-1][1]  # nothing after an answer's end
            answers[uid].append((token, ended))
    for uid, ref in zip(uids, refs):
        end = next((i for i, t in enumerate(ref) if t in stop), len(ref) - 1)
        assert [t for t, _ in answers[uid]] == ref[: end + 1]
        assert [e for _, e in answers[uid]] == [False] * end + [True]


def test_answer_rows_default_to_64_on_a_cpu_and_to_a_quarter_of_a_gpus_memory(monkeypatch):
    model = make_target("llama")
    assert answer_rows(model, 640) == 64  # (this machine)
    # One row's caches for 640 positions, allocated 256 at a time: 768 positions of keys and values,
    # float32, in each of the 4 layers.
    row = 4 * 2 * _COMMON["num_key_value_heads"] * _COMMON["head_dim"] * 4 * 768
    monkeypatch.setattr(data_module, "device_memory", lambda: 4 * row * 100 + 5)
    assert answer_rows(model, 640) == 100
    monkeypatch.setattr(data_module, "device_memory", lambda: 2**40)
    assert answer_rows(model, 640) == 512


def test_greedy_data_keeps_the_batch_full_across_shards(tmp_path):
    class Counted:  # the target, counting its passes
        def __init__(self, model):
            self.model, self.passes = model, 0

        def __call__(self, *args, **kwargs):
            self.passes += 1
            return self.model(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.model, name)

    model, tok = Counted(make_target("llama")), make_tokenizer(eos=95)
    prompts = [[{"role": "user", "content": f"w{i} w{i + 3}"}] for i in range(5, 13)]
    encoded = [apply_chat_template(tok, m) for m in prompts]
    assert generate_data(model, tok, prompts, tmp_path, max_new_tokens=8, batch_size=4, shard_size=1) == 8
    seqs = load_shards(tmp_path)
    assert len(list(tmp_path.glob("shard-*.npz"))) == 8  # one shard per prompt, in order
    for (seq, plen), p in zip(seqs, encoded):
        ref = greedy_reference(model.model, p, 8)
        stop = next((i for i, t in enumerate(ref) if t == 95), len(ref) - 1)
        assert (seq[:plen], seq[plen:]) == (p, ref[: stop + 1])
    # Each shard drained alone would take a prefill and up to 8 steps: 72 passes. Four at a time, with
    # the next prompt joining as one ends: 8 prefills and about 16 steps.
    assert model.passes <= 32, model.passes


def test_a_full_disk_names_the_data_folder_keeps_the_shards_before_and_leaves_no_partial_one(
    tmp_path, monkeypatch
):
    import errno

    model, tok = make_target("llama"), make_tokenizer(eos=95)
    prompts = [[{"role": "user", "content": f"w{i} w{i + 3}"}] for i in range(5, 9)]
    real, written = np.savez_compressed, []

    def fills_up(path, **arrays):
        if written:  # (the second shard: half of it, then the error)
            path.write_bytes(b"PK" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(path)
        return real(path, **arrays)

    monkeypatch.setattr(np, "savez_compressed", fills_up)
    with pytest.raises(
        UserError, match=f"^cannot write a shard into {tmp_path} \\(No space left on device\\): is"
    ):
        generate_data(model, tok, prompts, tmp_path, max_new_tokens=8, batch_size=2, shard_size=2)
    assert (
        sorted(p.name for p in tmp_path.iterdir()) == ["shard-00000.npz"] and len(load_shards(tmp_path)) == 2
    )


def test_a_stop_during_a_shard_write_comes_after_the_shard_is_whole_on_disk(tmp_path, monkeypatch):
    import signal

    model, tok = make_target("llama"), make_tokenizer(eos=95)
    prompts = [[{"role": "user", "content": f"w{i} w{i + 3}"}] for i in range(5, 11)]
    options = dict(max_new_tokens=8, batch_size=2, shard_size=2)
    generate_data(model, tok, prompts, tmp_path / "whole", **options)
    whole = load_shards(tmp_path / "whole")
    real = np.savez_compressed

    def ctrl_c_midway(path, **arrays):  # (a Ctrl-C cutting zipfile short raised its own ValueError)
        signal.raise_signal(signal.SIGINT)
        return real(path, **arrays)

    monkeypatch.setattr(np, "savez_compressed", ctrl_c_midway)
    with pytest.raises(KeyboardInterrupt):
        generate_data(model, tok, prompts, tmp_path / "stopped", **options)
    monkeypatch.undo()
    kept = load_shards(tmp_path / "stopped")
    assert kept[:2] == whole[:2] and not list((tmp_path / "stopped").glob(".*"))
    generate_data(model, tok, prompts, tmp_path / "stopped", **options)
    assert sorted(load_shards(tmp_path / "stopped")) == sorted(whole)


def test_greedy_answers_finished_before_a_stop_are_kept_and_not_generated_again(tmp_path):
    model, tok = make_target("llama"), make_tokenizer(eos=95)
    prompts = [[{"role": "user", "content": f"w{i} w{i + 3}"}] for i in range(5, 13)]
    options = dict(max_new_tokens=12, batch_size=4, shard_size=8)
    generate_data(model, tok, prompts, tmp_path / "whole", **options)
    whole = sorted(map(tuple, (ids for ids, _ in load_shards(tmp_path / "whole"))))

    def stop(finished, _, tokens):
        assert tokens > 0
        if finished:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # (one shard of eight prompts: none would be written whole)
        generate_data(model, tok, prompts, tmp_path / "stopped", progress=stop, **options)
    kept = [tuple(ids) for ids, _ in load_shards(tmp_path / "stopped")]
    assert 0 < len(kept) < len(prompts) and set(kept) <= set(whole)
    seen = []
    generate_data(model, tok, prompts, tmp_path / "stopped", progress=lambda k, *_: seen.append(k), **options)
    assert sorted(map(tuple, (ids for ids, _ in load_shards(tmp_path / "stopped")))) == whole
    assert seen[0] >= len(kept)  # the kept answers count as done, and are not answered twice


def test_sampled_answers_follow_their_seed_alone_through_a_resume_and_any_batch(tmp_path):
    model, tok = make_target("llama"), make_tokenizer(eos=95)
    prompts = [[{"role": "user", "content": f"w{i} w{i + 3}"}] for i in range(5, 11)]

    def answers(folder, **options):
        sizes = dict(batch_size=options.pop("batch_size", 3), shard_size=options.pop("shard_size", 3))
        generate_data(model, tok, prompts, tmp_path / folder, max_new_tokens=12, **sizes, **options)
        return [ids[plen:] for ids, plen in load_shards(tmp_path / folder)]

    greedy = answers("greedy")
    sampled = answers("a", temperature=1.0, seed=1)
    assert answers("b", temperature=1.0, seed=1) == sampled
    assert answers("c", temperature=1.0, seed=2) != sampled and sampled != greedy
    answers("d", temperature=1.0, seed=1, limit=3)  # stopped after its first shard, then resumed
    assert answers("d", temperature=1.0, seed=1) == sampled
    # Each answer draws from its seed and its prompt's place only: other batches and shards alike.
    assert answers("f", temperature=1.0, seed=1, batch_size=2, shard_size=4) == sampled
    assert answers("g", temperature=1.0, seed=1, batch_size=6, shard_size=1) == sampled
    with pytest.raises(ValueError, match="temperature must be a number from 0 to 10000, got -1"):
        answers("e", temperature=-1)


def test_each_rows_draw_follows_the_distribution_at_the_temperature():
    from scipy.stats import chisquare

    logits = mx.array([2.0, 1.0, 0.5, 0.0, -1.0, 0.3])
    rows = 20_000
    keys = mx.array([[i, 7] for i in range(rows)], dtype=mx.uint32)
    tokens = draw(mx.broadcast_to(logits, (rows, 6)), keys, 0.7)
    expected = np.exp(np.array(logits, dtype=np.float64) / 0.7)
    expected = expected / expected.sum() * rows
    counts = np.bincount(np.array(tokens), minlength=6)
    assert chisquare(counts, expected).pvalue > 1e-3
    assert draw(logits[None], keys[123:124], 0.7).item() == tokens[123].item()  # a row alone: the same
    assert draw(mx.broadcast_to(logits, (3, 6)), keys[:3], 0).tolist() == [0, 0, 0]


def test_a_repeated_prompt_is_answered_once_also_across_a_resume(tmp_path):
    model, tok = make_target("llama"), make_tokenizer(eos=95)
    prompts = [[{"role": "user", "content": f"w{i}"}] for i in (5, 6, 5, 7, 6, 8)]
    kw = dict(max_new_tokens=2, batch_size=2, shard_size=2)
    generate_data(model, tok, prompts, tmp_path, limit=1, **kw)
    assert generate_data(model, tok, prompts, tmp_path, **kw) == 4
    assert [ids[:plen] for ids, plen in load_shards(tmp_path)] == [
        apply_chat_template(tok, prompts[i]) for i in (0, 1, 3, 5)
    ]


def test_a_damaged_shard_removed_as_told_has_its_prompts_answered_again_and_nothing_written_over(tmp_path):
    from dflash_mlx.data import resume_point

    model, tok = make_target("llama"), make_tokenizer(eos=95)
    prompts = [[{"role": "user", "content": f"w{i} w{i + 2}"}] for i in range(5, 15)]
    kw = dict(max_new_tokens=3, batch_size=3, shard_size=2)
    assert generate_data(model, tok, prompts, tmp_path, limit=8, **kw) == 8
    whole = {tuple(ids) for ids, _ in load_shards(tmp_path)}
    (tmp_path / "shard-00001.npz").write_bytes(b"")  # (a disk that filled up)
    (tmp_path / ".shard-00004.tmp.npz").write_bytes(b"x")  # (a write a kill cut short)
    (tmp_path / ".DS_Store").write_bytes(b"")  # (what a Mac's Finder leaves)
    told = r"shard-00001.npz is not a shard .*: remove it \(`train data` answers its prompts again"
    with pytest.raises(UserError, match=told):
        generate_data(model, tok, prompts, tmp_path, **kw)
    last = (tmp_path / "shard-00003.npz").read_bytes()
    (tmp_path / "shard-00001.npz").unlink()
    assert generate_data(model, tok, prompts, tmp_path, **kw) == 10
    assert (tmp_path / "shard-00003.npz").read_bytes() == last  # (not written over by the next shard)
    assert not list(tmp_path.glob(".shard-*"))
    assert resume_point(tmp_path, "", 2, prompts) == (10, 10)  # (the gap answered: nothing left)
    seqs = load_shards(tmp_path)
    assert sorted(ids[:plen] for ids, plen in seqs) == sorted(apply_chat_template(tok, m) for m in prompts)
    assert whole <= {tuple(ids) for ids, _ in seqs}  # prompts 2 and 3 answered again, as they were


def test_a_finished_folder_with_a_chunk_of_skipped_prompts_is_finished(tmp_path):
    """A chunk whose prompts were all skipped (too long) writes no shard: that is no removed shard."""
    from dflash_mlx.data import resume_point

    model, tok = make_target("llama"), make_tokenizer(eos=95)
    prompts = [
        [{"role": "user", "content": " ".join(f"w{i}" for i in range(5, n))}] for n in (7, 8, 40, 41, 9, 10)
    ]
    kw = dict(max_new_tokens=2, batch_size=2, shard_size=2, max_prompt_tokens=20)
    assert generate_data(model, tok, prompts, tmp_path, **kw) == 4
    assert resume_point(tmp_path, "", 2, prompts) == (4, 6)


def test_data_generation_resumes_only_the_same_prompts_answered_alike(tmp_path):
    model, tok = make_target("llama"), make_tokenizer(eos=95)
    prompts = [[{"role": "user", "content": f"w{i}"}] for i in range(5, 9)]
    kw = dict(max_new_tokens=2, batch_size=4, shard_size=2)
    assert generate_data(model, tok, prompts, tmp_path, limit=2, source="a.jsonl", **kw) == 2
    # The resume point counts a.jsonl's prompts: another list would silently skip its first ones.
    other = prompts[1:] + prompts[:1]
    with pytest.raises(ValueError, match=r"another list of prompts than 'a.jsonl' gives .* new --out folder"):
        generate_data(model, tok, other, tmp_path, source="a.jsonl", **kw)
    for changed, message in (
        (dict(max_new_tokens=3), r"max-new-tokens 2 \(not 3\)"),
        (dict(temperature=0.7), r"temp 0.0 \(not 0.7\)"),  # (no seed: a greedy run has none)
        (
            dict(template_kwargs={"enable_thinking": False}),
            r"the chat template's defaults \(not --no-think\)",
        ),
    ):
        with pytest.raises(ValueError, match=rf"holds answers made with {message}: give the same to go on"):
            generate_data(model, tok, prompts, tmp_path, source="a.jsonl", **{**kw, **changed})
    # The same prompts, by whatever name (./a.jsonl, its full path), with the same settings: going on.
    assert generate_data(model, tok, prompts, tmp_path, source="./a.jsonl", **kw) == 4


def test_data_made_with_another_vocabulary_is_refused(tmp_path):
    model, tok = make_target("llama"), make_tokenizer(eos=95)
    prompts = [[{"role": "user", "content": f"w{i}"}] for i in range(5, 9)]
    kw = dict(max_new_tokens=2, batch_size=4, shard_size=2)
    assert generate_data(model, tok, prompts, tmp_path, limit=2, **kw) == 2
    seqs = load_shards(tmp_path)
    check_data_tokenizer([(tmp_path, seqs)], tok, 96, "tiny")  # the tokenizer that made it: fine
    other = make_tokenizer(eos=95)
    other._tokenizer.add_tokens(["<extra>"])  # another model's vocabulary
    with pytest.raises(ValueError, match="was made by a model with another vocabulary than tiny's"):
        check_data_tokenizer([(tmp_path, seqs)], other, 96, "tiny")
    with pytest.raises(ValueError, match="holds answers written by a model with another vocabulary"):
        generate_data(model, other, prompts, tmp_path, **kw)
    # Another target of the same vocabulary (another size of a family, a fine-tune): not mixed in.
    with pytest.raises(ValueError, match="holds answers of another target .* to a new --out folder"):
        generate_data(make_target("llama", seed=1), tok, prompts, tmp_path, **kw)
    assert generate_data(model, tok, prompts, tmp_path, **kw) == 4  # (its own target goes on)
    # Shards from before the tokenizer was recorded (the shipped data): an id past the vocabulary still is.
    old = tmp_path / "old"
    old.mkdir()
    for shard in tmp_path.glob("shard-*.npz"):
        d = dict(np.load(shard))
        d.pop("tokenizer")
        np.savez(old / shard.name, **d)
    check_data_tokenizer([(old, load_shards(old))], other, 96, "tiny")
    with pytest.raises(ValueError, match="another vocabulary than tiny's"):
        check_data_tokenizer([(old, load_shards(old))], tok, 90, "tiny")


def varied_lengths(seqs):
    """The tiny sequences cut to lengths from 16 to 56, so that a batch holds right-padded rows."""
    return [(ids[: 16 + (k * 7) % 41], plen) for k, (ids, plen) in enumerate(seqs)]


def test_a_batched_pass_is_the_sequences_passes_weighted_by_their_block_tokens(tiny_setup):
    model, seqs = tiny_setup
    draft = make_draft(block_size=8, layers=2, layer_ids=(1, 3))
    target = prepare(model, draft)
    picked = varied_lengths(seqs)[8:13]
    tokens = [mx.array(ids) for ids, _ in picked]
    rng = np.random.default_rng(0)
    anchors = [train_module.sample_anchors(rng, plen, len(ids), 8) for ids, plen in picked]
    # Features of a padded batch are each sequence's own.
    features = FeatureCache(target).many(list(range(5)), tokens)
    for f, t in zip(features, tokens):
        _, alone = target(t[None], None)
        assert f.shape == alone.shape
        np.testing.assert_allclose(np.array(f.astype(mx.float32)), np.array(alone), rtol=2e-3, atol=2e-3)

    def batched(m):
        f, t, a, rows, lengths = train_module.batch_arrays(features, tokens, anchors)
        logits = block_logits(m, target, f, t, a, rows=rows)
        return block_loss(logits, *block_labels(t, a, 8, rows, lengths), 7.0)

    def one_by_one(m):
        total = sum(train_module.block_weight_sum(a, t.shape[0], 8, 7.0) for a, t in zip(anchors, tokens))
        loss = 0.0
        for f, t, a in zip(features, tokens, anchors):
            a = mx.array(a)
            each = block_loss(block_logits(m, target, f, t, a), *block_labels(t, a, 8), 7.0)
            loss = loss + each * train_module.block_weight_sum(np.array(a), t.shape[0], 8, 7.0) / total
        return loss

    together, g_together = nn.value_and_grad(draft, batched)(draft)
    alone, g_alone = nn.value_and_grad(draft, one_by_one)(draft)
    assert together.item() == pytest.approx(alone.item(), rel=1e-5)
    for (name, x), (_, y) in zip(tree_flatten(g_together), tree_flatten(g_alone)):
        np.testing.assert_allclose(np.array(x), np.array(y), rtol=1e-4, atol=1e-6, err_msg=name)


def test_batched_runs_accumulate_passes_and_resume_on_the_same_curve(tiny_setup, tmp_path):
    model, seqs = tiny_setup
    seqs = varied_lengths(seqs)
    # One padded pass of 4, passes of 3 and 1, and (resumed) the CPU's default of one sequence a pass.
    cfg = tiny_config(steps=12, lr=3e-3, warmup=2, batch_size=4, micro_batch=4, checkpoint_every=5)

    def run(folder, cfg, stop_at=None):
        losses = []

        def on_step(r):
            losses.append(r["loss"])
            assert len(r["sequences"]) == 4
            if r["step"] == stop_at:
                raise KeyboardInterrupt

        try:
            train(Target(model), make_tokenizer(), seqs, tmp_path / folder, cfg, on_step=on_step)
        except KeyboardInterrupt:
            pass
        return losses

    whole = run("whole", cfg)
    in_passes = run("passes", replace(cfg, micro_batch=3))  # passes of 3 and 1 sequences
    np.testing.assert_allclose(in_passes, whole, rtol=1e-4)
    first = run("resumed", replace(cfg, micro_batch=None), stop_at=8)
    second = run("resumed", replace(cfg, micro_batch=None))
    assert len(second) == 7  # steps 6..12: those after the checkpoint of step 5
    np.testing.assert_allclose(first[:5] + second, whole, rtol=2e-3, atol=2e-3)


def test_bf16_training_learns_and_checkpoints_float32_weights(tiny_setup, tmp_path):
    model, seqs = tiny_setup
    losses = []
    draft = train(
        Target(model),
        make_tokenizer(),
        seqs,
        tmp_path / "run",
        tiny_config(steps=120, lr=3e-3, warmup=10, batch_size=2, precision="bf16"),
        on_step=lambda r: losses.append(r["loss"]),
    )
    assert np.mean(losses[-20:]) < 0.6 * np.mean(losses[:10])
    saved = mx.load(str(tmp_path / "run" / "checkpoint" / "model.safetensors"))
    assert all(v.dtype == mx.float32 for v in saved.values())
    assert all(v.dtype == mx.float32 for v in flat_params(draft).values())
    with pytest.raises(ValueError, match="precision must be 'float32' or 'bf16', got 'fp8'"):
        tiny_config(precision="fp8")


def test_a_shard_that_is_not_one_is_named_with_what_to_do(tmp_path):
    from dflash_mlx.data import load_shards

    (tmp_path / "shard-00000.npz").write_text("not a shard")
    with pytest.raises(UserError, match="shard-00000.npz is not a shard `dflash-mlx train data` wrote"):
        load_shards(tmp_path)
    np.savez(tmp_path / "shard-00000.npz", tokens=np.arange(4))  # an npz without the shard's arrays
    with pytest.raises(UserError, match="shard-00000.npz is not a shard"):
        load_shards(tmp_path)
