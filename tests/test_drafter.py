"""The drafter port: its math against NumPy float64, the z-lab checkpoint layout, the compiled step."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from tiny import (
    FAMILIES,
    VOCAB,
    flat_params,
    greedy_reference,
    make_dflash2,
    make_draft,
    make_target,
    no_eos_tokenizer,
    prompt_of,
)

from dflash_mlx import DFlashConfig, SpeculativeCache, generate, load_draft
from dflash_mlx.models.dflash import DraftCache
from dflash_mlx.models.formats import GLIMMER_VOCAB
from dflash_mlx.pairing import prepare


# ---- an independent float64 NumPy version of the drafter's math ---------------------------------
def rms(x, w, eps=1e-5):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, positions, base=10000.0):
    """Rotate-half RoPE: x (heads, seq, dim) at absolute positions."""
    half = x.shape[-1] // 2
    freqs = base ** (-np.arange(half) * 2.0 / x.shape[-1])
    ang = positions[:, None] * freqs[None]
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def float64_params(draft) -> dict:
    return {k: np.array(v, dtype=np.float64) for k, v in flat_params(draft).items()}


def context_of(draft, features):
    """The drafter's cache after taking in `features`."""
    cache = draft.make_cache()
    draft.absorb(features, cache)
    return cache


def numpy_conv(h, dynamic, base, group):
    """DFlash2's convolution along the block: out[t] = sum_o (base[o] + dynamic[t, o]) * h[t - o]."""
    out = np.zeros_like(h)
    for o in range(base.shape[0]):
        shifted = np.zeros_like(h)
        shifted[o:] = h[: len(h) - o]
        out += (base[o][None] + np.repeat(dynamic[:, o], group, axis=-1)) * shifted
    return out


def numpy_conv_before(x, p, name, group):
    K = p(f"{name}.base_kernel").shape[1]
    dynamic = (x @ p(f"{name}.kernel_projection.weight").T).reshape(len(x), 2, K, -1)
    return numpy_conv(x, dynamic[:, 0], p(f"{name}.base_kernel")[0], group), dynamic[:, 1]


def numpy_select(w, hidden, logits, first, top_k):
    """DFlash2's candidate selector, greedy: the path through each position's top-k candidates."""
    projected = hidden @ w["candidate_selector.hidden_projection.weight"].T
    before, after = w["candidate_selector.predecessor_codebook"], w["candidate_selector.successor_codebook"]
    previous, path = first, []
    for j in range(len(hidden)):
        candidates = np.argsort(logits[j])[-top_k:]
        score = logits[j][candidates] + (before[previous] * projected[j] * after[candidates]).sum(-1)
        previous = int(candidates[np.argmax(score)])
        path.append(previous)
    return path


def numpy_draft_logits(w, cfg: DFlashConfig, features, block, embed, start=0, head="tied"):
    """Logits of the block after context features at positions start, start + 1, ... (`head` None: the
    final-normed hidden states)."""
    S, L, hd = features.shape[0], len(block), cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    ctx = rms(features @ w["fc.weight"].T, w["hidden_norm.weight"])
    h = embed[block]
    pos_ctx, pos_blk = np.arange(start, start + S), np.arange(start + S, start + S + L)
    for i in range(cfg.num_hidden_layers):
        layer = {k.removeprefix(f"layers.{i}."): v for k, v in w.items() if k.startswith(f"layers.{i}.")}
        p = layer.__getitem__
        x = rms(h, p("input_layernorm.weight"))

        def kv(src, pos, p=p):
            k = (src @ p("self_attn.k_proj.weight").T).reshape(len(src), nkv, hd).transpose(1, 0, 2)
            v = (src @ p("self_attn.v_proj.weight").T).reshape(len(src), nkv, hd).transpose(1, 0, 2)
            return rope(rms(k, p("self_attn.k_norm.weight")), pos), v

        conv = f"layers.{i}.attention_conv.base_kernel" in w  # DFlash2
        if conv:
            x, after = numpy_conv_before(x, p, "attention_conv", cfg.conv_group_size)
        kc, vc = kv(ctx, pos_ctx)
        kb, vb = kv(x, pos_blk)
        k, v = np.concatenate([kc, kb], 1), np.concatenate([vc, vb], 1)
        q = (x @ p("self_attn.q_proj.weight").T).reshape(L, nh, hd).transpose(1, 0, 2)
        q = rope(rms(q, p("self_attn.q_norm.weight")), pos_blk)
        k, v = np.repeat(k, nh // nkv, 0), np.repeat(v, nh // nkv, 0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hd)  # every block query sees all context + the whole block
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = (a @ v).transpose(1, 0, 2).reshape(L, nh * hd)
        o = o @ p("self_attn.o_proj.weight").T
        h = h + (numpy_conv(o, after, p("attention_conv.base_kernel")[1], cfg.conv_group_size) if conv else o)
        x = rms(h, p("post_attention_layernorm.weight"))
        if conv:
            x, after = numpy_conv_before(x, p, "mlp_conv", cfg.conv_group_size)
        g, u = x @ p("mlp.gate_proj.weight").T, x @ p("mlp.up_proj.weight").T
        m = (g / (1 + np.exp(-g)) * u) @ p("mlp.down_proj.weight").T
        h = h + (numpy_conv(m, after, p("mlp_conv.base_kernel")[1], cfg.conv_group_size) if conv else m)
    h = rms(h, w["norm.weight"])
    return h if head is None else h @ embed.T  # tied target: lm_head = embedding


def test_drafter_logits_match_a_float64_numpy_reference():
    model, draft = make_target("llama"), make_draft()
    target = prepare(model, draft)
    features = mx.random.normal((1, 23, 2 * 64), key=mx.random.key(3))
    cache = context_of(draft, features)
    ours = np.array(draft.propose_logits(17, cache, 8)[0])
    w = float64_params(draft)
    embed = np.array(target.inner.embed_tokens.weight, dtype=np.float64)
    block = [17] + [draft.mask_token_id] * 7
    ref = numpy_draft_logits(w, draft.config, np.array(features[0], dtype=np.float64), block, embed)[1:]
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_a_draft_window_drafts_from_the_latest_positions_at_their_own_positions(monkeypatch):
    monkeypatch.setattr(DraftCache, "STEP", 4)  # drops every few positions, not every 256
    model, draft = make_target("llama"), make_draft()
    target = prepare(model, draft)
    w = float64_params(draft)
    embed = np.array(target.inner.embed_tokens.weight, dtype=np.float64)
    features = mx.random.normal((1, 61, 2 * 64), key=mx.random.key(5))
    cache, at = draft.make_cache(window=10), 0
    for n in (3, 1, 7, 2, 30, 1, 1, 16):  # chunks of every kind: less than, about and past the window
        draft.absorb(features[:, at : at + n], cache)
        at += n
        rows = cache[0].rows
        assert cache[0].offset == at and min(at, 10) <= rows <= 14 and cache[0].keys.shape[2] <= 16
        ours = np.array(draft.propose_logits(17, cache, 8)[0])
        latest = np.array(features[0, at - rows : at], dtype=np.float64)
        block = [17] + [draft.mask_token_id] * 7
        ref = numpy_draft_logits(w, draft.config, latest, block, embed, start=at - rows)[1:]
        np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    assert not cache[0].can_trim(cache[0].rows + 1)
    with pytest.raises(ValueError, match="the draft window holds"):
        cache[0].trim(cache[0].rows + 1)


def test_with_a_draft_window_the_drafters_pass_stops_growing_with_the_context():
    model, draft = make_target("llama", max_position_embeddings=16384), make_draft()
    target = prepare(model, draft)
    sizes = {}
    for context in (500, 8000):
        cache = SpeculativeCache(target, draft, draft_window=256)
        cache.prefill(prompt_of(context), step=1024)
        sizes[context] = cache.draft_cache[0].keys.shape[2]  # the rows every draft pass attends over
    assert sizes[500] == sizes[8000] == 256 + DraftCache.STEP
    # a window as large as the settings allow holds only the context there is (it held 2**30 rows at once)
    for window in (2**30, 16384):  # (at least the model's context: no window)
        cache = SpeculativeCache(target, draft, draft_window=window)
        cache.prefill(prompt_of(500), step=1024)
        assert cache.draft_cache[0].keys.shape[2] == -(-500 // DraftCache.STEP) * DraftCache.STEP


def write_zlab_checkpoint(path, draft, dtype=mx.bfloat16):
    """What z-lab publishes: config.json with dflash_config, and bf16 safetensors, no embeddings."""
    cfg = draft.config
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,
        "sliding_window": None,
        "use_sliding_window": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "dflash_config": {"target_layer_ids": cfg.target_layer_ids, "mask_token_id": cfg.mask_token_id},
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(
        str(path / "model.safetensors"), {k: v.astype(dtype) for k, v in flat_params(draft).items()}
    )
    return config


def test_a_zlab_layout_checkpoint_loads_and_runs(tmp_path):
    draft = make_draft()
    write_zlab_checkpoint(tmp_path / "d", draft)
    keys = set(mx.load(str(tmp_path / "d" / "model.safetensors")))
    assert "fc.weight" in keys and "layers.1.self_attn.k_norm.weight" in keys and "hidden_norm.weight" in keys
    loaded = load_draft(str(tmp_path / "d"))
    assert loaded.config.target_layer_ids == [1, 2] and loaded.config.mask_token_id == VOCAB - 1
    assert loaded.config.block_size == 16
    assert loaded.fc.weight.dtype == mx.float32  # float32 on the CPU
    for k, v in flat_params(loaded).items():  # the bf16 values, exactly
        np.testing.assert_array_equal(
            np.array(v), np.array(flat_params(draft)[k].astype(mx.bfloat16).astype(mx.float32))
        )
    model = make_target("llama")
    prompt = prompt_of(7)
    ref = greedy_reference(model, prompt, 20)
    assert generate(model, loaded, no_eos_tokenizer(ref), prompt, max_tokens=20).tokens == ref


def write_glimmer_checkpoint(path, draft):
    """Meta's Muse-Glimmer assistant layout: flat dflash fields, no vocab_size, rope_parameters, every
    layer sliding, `encoder.fc` / `encoder.output_norm_enc` for fc / hidden_norm, bf16."""
    cfg = draft.config
    config = {
        "architectures": ["MuseGlimmerAssistantModel"],
        "model_type": "muse_glimmer_assistant",
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": cfg.target_layer_ids,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "layer_types": ["sliding_attention"] * cfg.num_hidden_layers,
        "sliding_window": 64,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "max_position_embeddings": cfg.max_position_embeddings,
        "torch_dtype": "bfloat16",
    }
    names = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
    weights = {names.get(k, k): v.astype(mx.bfloat16) for k, v in flat_params(draft).items()}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), weights)


def test_a_muse_glimmer_assistant_loads_drafts_exactly_and_exports_to_its_own_layout(tmp_path):
    from dflash_mlx.convert import export_draft

    model = make_target("muse_glimmer", vocab_size=GLIMMER_VOCAB, num_hidden_layers=3)
    draft = make_draft(vocab=GLIMMER_VOCAB, target_layers=3, mask_token_id=GLIMMER_VOCAB - 7)
    write_glimmer_checkpoint(tmp_path / "assistant", draft)
    loaded = load_draft(str(tmp_path / "assistant"))
    assert loaded.config.sliding_window == 64 and loaded.config.vocab_size == GLIMMER_VOCAB
    target = prepare(model, loaded)
    features = mx.random.normal((1, 23, 2 * 64), key=mx.random.key(3))
    cache = context_of(loaded, features)
    ours = np.array(loaded.propose_logits(17, cache, 8)[0])
    w = float64_params(loaded)
    head = np.array(model.lm_head.weight, dtype=np.float64)
    embed = np.array(target.inner.embed_tokens.weight, dtype=np.float64)
    block = [17] + [loaded.mask_token_id] * 7
    # The raw embeddings in (the assistant skips Muse-Glimmer's embedding norm); the target's head, output
    # multiplier and softcap out, as for the target's own logits.
    hidden = numpy_draft_logits(
        w, loaded.config, np.array(features[0], dtype=np.float64), block, embed, head=None
    )
    scores = hidden[1:] @ head.T * model.args.output_multiplier
    cap = model.args.final_logit_softcapping
    np.testing.assert_allclose(ours, np.tanh(scores / cap) * cap, rtol=1e-4, atol=1e-4)
    export_draft(str(tmp_path / "assistant"), tmp_path / "exported")
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert config["architectures"] == ["MuseGlimmerAssistantModel"] and "dflash_config" not in config
    assert "encoder.fc.weight" in mx.load(str(tmp_path / "exported" / "model.safetensors"))
    again = load_draft(str(tmp_path / "exported"))
    prepare(model, again)
    cache = context_of(again, features)
    np.testing.assert_array_equal(np.array(again.propose_logits(17, cache, 8)[0]), ours)


def test_dflash2_states_logits_and_greedy_proposals_match_the_numpy_reference():
    model, draft = make_target("llama"), make_dflash2()
    target = prepare(model, draft)
    features = mx.random.normal((1, 23, 2 * 64), key=mx.random.key(3))
    cache = context_of(draft, features)
    w = float64_params(draft)
    embed = np.array(target.inner.embed_tokens.weight, dtype=np.float64)
    block = [17] + [draft.mask_token_id] * 7
    hidden = numpy_draft_logits(
        w, draft.config, np.array(features[0], dtype=np.float64), block, embed, head=None
    )
    hidden = hidden[1:]
    np.testing.assert_allclose(np.array(draft.propose_hidden(17, cache, 8)[0]), hidden, rtol=1e-4, atol=1e-4)
    logits = np.tanh(hidden @ embed.T * 0.5 / 10.0) * 10.0  # its own multiplier and softcap
    np.testing.assert_allclose(np.array(draft.propose_logits(17, cache, 8)[0]), logits, rtol=1e-4, atol=1e-4)
    x, q, confidence = draft.draft(17, cache, 8, 7, None, 0.0)
    assert q is None and x.tolist() == numpy_select(w, hidden, logits, 17, top_k=5)
    assert x.tolist() != np.argmax(logits, axis=-1).tolist()  # the selector, not the per-position argmax
    for compiled in (True, False):  # the compiled step equals the eager one
        np.testing.assert_allclose(
            np.array(draft.propose_hidden(17, cache, 8, compiled=compiled)[0]), hidden, rtol=1e-4, atol=1e-4
        )


def write_dflash2_checkpoint(path, draft):
    """The published DFlash2 layout: its fields in dflash_config, bf16 weights, codebooks without .weight."""
    config = draft.config.to_dict()
    config["is_causal"] = False
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(
        str(path / "model.safetensors"), {k: v.astype(mx.bfloat16) for k, v in flat_params(draft).items()}
    )
    return config


def test_a_dflash2_checkpoint_loads_converts_exports_and_decodes_losslessly(tmp_path):
    from dflash_mlx.convert import convert_draft, export_draft

    model = make_target("llama")
    config = write_dflash2_checkpoint(tmp_path / "hf", make_dflash2())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["dflash_config"]["selector_top_k"] == 5
    assert "candidate_selector.predecessor_codebook" in mx.load(str(tmp_path / "hf" / "model.safetensors"))
    loaded = load_draft(str(tmp_path / "hf"))
    assert type(loaded).__name__ == "DFlash2DraftModel" and loaded.config.output_multiplier == 0.5
    features = mx.random.normal((1, 23, 2 * 64), key=mx.random.key(3))

    def logits_of(draft):
        prepare(model, draft)
        cache = context_of(draft, features)
        return np.array(draft.propose_logits(17, cache, 8)[0])

    ours = logits_of(loaded)
    convert_draft(str(tmp_path / "hf"), tmp_path / "mlx", dtype="float32")
    export_draft(str(tmp_path / "mlx"), tmp_path / "back")
    for folder in ("mlx", "back"):
        np.testing.assert_array_equal(logits_of(load_draft(str(tmp_path / folder))), ours)
    prompt = prompt_of(9)
    ref = greedy_reference(model, prompt, 30)
    for block_size in (2, 7, 16, None):
        out = generate(model, loaded, no_eos_tokenizer(ref), prompt, max_tokens=30, block_size=block_size)
        assert out.tokens == ref


def test_config_round_trip_and_default_layer_ids():
    cfg = make_draft().config
    again = DFlashConfig.from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()
    d = cfg.to_dict()
    del d["dflash_config"]["target_layer_ids"]
    d["num_target_layers"], d["num_hidden_layers"] = 36, 5
    d["layer_types"] = None
    assert DFlashConfig.from_dict(d).target_layer_ids == [1, 9, 17, 25, 33]  # z-lab's Qwen3-4B taps


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_step_equals_eager_and_is_not_retraced_per_cycle(family):
    model, draft = make_target(family), make_draft(block_size=4)
    target = prepare(model, draft)
    cache = SpeculativeCache(target, draft)
    cache.prefill(prompt_of(30))
    traces = draft.traces
    for step in range(40):  # grow the context one cycle at a time, 1..4 positions per cycle
        a = draft.propose_logits(5, cache.draft_cache, 4, compiled=True)
        b = draft.propose_logits(5, cache.draft_cache, 4, compiled=False)
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)
        draft.absorb(mx.random.normal((1, 1 + step % 4, 128)), cache.draft_cache)
    # 40 cycles took the context from 30 to ~130 positions inside one 256-row cache buffer:
    # one trace for that buffer size at most, never one per cycle.
    assert draft.traces - traces <= 1
    # The compiled step's inputs are the drafter's own arrays: binding added none of the target's.
    assert {k for k, _ in tree_flatten(draft.state)} == {k for k, _ in tree_flatten(draft.parameters())}
    # New weights (a training step, or loading a checkpoint) reach the compiled step without a rebind:
    # first the drafter's own, then the target's shared embedding / lm_head.
    before = np.array(draft.propose_logits(5, cache.draft_cache, 4, compiled=True))
    for module in (draft, model):
        module.update(tree_map(lambda p: p * 1.5 if p.dtype == mx.float32 else p, module.parameters()))
        a = np.array(draft.propose_logits(5, cache.draft_cache, 4, compiled=True))
        b = np.array(draft.propose_logits(5, cache.draft_cache, 4, compiled=False))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        assert np.abs(a - before).max() > 1e-2
        before = a
