"""Tiny random models in the real formats, a word-level tokenizer, and reference decoding."""

from __future__ import annotations

import dataclasses
import importlib

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.generate import generate_step
from mlx_lm.tokenizer_utils import TokenizerWrapper

import dflash_mlx  # noqa: F401  (BLAS preload before mlx.core)
from dflash_mlx.models.dflash import DFlashConfig, DFlashDraftModel
from dflash_mlx.models.dflash2 import DFlash2Config, DFlash2DraftModel

VOCAB = 96
HIDDEN = 64

_COMMON = dict(
    hidden_size=HIDDEN,
    num_hidden_layers=4,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    vocab_size=VOCAB,
    max_position_embeddings=4096,
    rope_theta=10000.0,
)

_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_GATED_DELTA = dict(
    full_attention_interval=2,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)

CONFIGS = {
    "llama": dict(_COMMON, model_type="llama", tie_word_embeddings=True),
    "qwen3": dict(_COMMON, model_type="qwen3", tie_word_embeddings=False),
    "qwen3_moe": dict(
        _COMMON,
        **_MOE,
        model_type="qwen3_moe",
        tie_word_embeddings=False,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        norm_topk_prob=True,
    ),
    "qwen3_5": dict(_COMMON, **_GATED_DELTA, model_type="qwen3_5", tie_word_embeddings=False),
    "qwen3_5_moe": dict(
        _COMMON,
        **_GATED_DELTA,
        **_MOE,
        model_type="qwen3_5_moe",
        tie_word_embeddings=False,
        shared_expert_intermediate_size=32,
    ),
    "gpt_oss": dict(
        _COMMON,
        model_type="gpt_oss",
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "qwen3_next": dict(
        _COMMON,
        **_GATED_DELTA,
        **_MOE,
        model_type="qwen3_next",
        tie_word_embeddings=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        shared_expert_intermediate_size=32,
        partial_rotary_factor=0.5,
    ),
    "lfm2": dict(
        _COMMON,
        model_type="lfm2",
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=HIDDEN,
        block_ff_dim=128,
        block_multiple_of=32,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
    ),
    # The multimodal checkpoint layout: the text model's config nested in text_config. The last two
    # layers share the keys/values of the first two; the softcap is low enough to change sampling.
    "gemma4": dict(
        model_type="gemma4",
        vocab_size=VOCAB,
        text_config=dict(
            _COMMON,
            model_type="gemma4_text",
            global_head_dim=32,
            num_kv_shared_layers=2,
            hidden_size_per_layer_input=0,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
            final_logit_softcapping=4.0,
            use_double_wide_mlp=False,
        ),
    ),
    "muse_glimmer": dict(
        _COMMON,
        model_type="muse_glimmer",
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        final_logit_softcapping=10.0,
        output_multiplier=1.5,
    ),
}
FAMILIES = list(CONFIGS)


def make_target(family: str = "llama", seed: int = 0, **overrides):
    """A float32 mlx-lm model of the family with random weights (scaled to give peaky logits)."""
    config = dict(CONFIGS[family], **overrides)
    module = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    # Default inits give near-uniform logits; widen them so greedy decoding has clear winners.
    model.update(tree_map(lambda p: p * 2.0 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    model.eval()
    return model


def successor_target(successors: dict[int, int], vocab: int = VOCAB, other: int = 2, hidden: int = 128):
    """A real mlx-lm Llama whose greedy reply is fixed: its decoder layers add nothing (zero output
    projections), so each next token is successors[this token] (else `other`), through the embedding
    and the head alone. -> (model, its config)."""
    config = dict(CONFIGS["llama"], hidden_size=hidden, vocab_size=vocab, tie_word_embeddings=False)
    model = make_target("llama", **{k: v for k, v in config.items() if k != "model_type"})
    embed, head = mx.zeros((vocab, hidden)), mx.zeros((vocab, hidden))
    for i in range(vocab):
        embed[i, i] = 1.0
        head[successors.get(i, other), i] = 1.0
    zeroed = {}
    for n, layer in enumerate(model.model.layers):
        zeroed[f"model.layers.{n}.self_attn.o_proj.weight"] = mx.zeros_like(layer.self_attn.o_proj.weight)
        zeroed[f"model.layers.{n}.mlp.down_proj.weight"] = mx.zeros_like(layer.mlp.down_proj.weight)
    model.load_weights(
        [("model.embed_tokens.weight", embed), ("lm_head.weight", head), *zeroed.items()], strict=False
    )
    mx.eval(model.parameters())
    return model, config


def draft_config(
    target_layers: int = 4,
    layer_ids=(1, 2),
    block_size: int = 16,
    vocab: int = VOCAB,
    hidden: int = HIDDEN,
    layers: int = 2,
    mask_token_id=None,
    **overrides,
) -> DFlashConfig:
    return DFlashConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=vocab,
        target_layer_ids=list(layer_ids),
        mask_token_id=vocab - 1 if mask_token_id is None else mask_token_id,
        block_size=block_size,
        num_target_layers=target_layers,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        **overrides,
    )


def make_draft(seed: int = 1, cls=DFlashDraftModel, **kwargs) -> DFlashDraftModel:
    mx.random.seed(seed)
    draft = cls(draft_config(**kwargs))
    mx.eval(draft.parameters())
    return draft


def make_dflash2(seed: int = 1, top_k: int = 5, **kwargs) -> DFlash2DraftModel:
    """A DFlash2 drafter with its own logit scale, every weight random (its convolution kernels and
    codebooks start at zero otherwise, which would hide them)."""
    base = draft_config(**kwargs)
    config = DFlash2Config(
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(DFlashConfig)},
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=8,
        selector_top_k=top_k,
        output_multiplier=0.5,
        final_logit_softcapping=10.0,
    )
    mx.random.seed(seed)
    draft = DFlash2DraftModel(config)
    draft.update(
        tree_map(lambda p: mx.random.normal(p.shape) * 0.5 if not p.any() else p, draft.parameters())
    )
    selector = draft.candidate_selector  # pair scores on the scale of the logits
    selector.predecessor_codebook = selector.predecessor_codebook * 4
    selector.hidden_projection.weight = selector.hidden_projection.weight * 8
    mx.eval(draft.parameters())
    return draft


def make_tokenizer(vocab: int = VOCAB, eos: int = 2) -> TokenizerWrapper:
    """A word-level tokenizer over tokens w0 .. w{vocab-1}; the text of a token is 'wN '."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"w{eos}", unk_token="w0")
    return TokenizerWrapper(hf)


def greedy_reference(model, prompt: list[int], n: int, eos=()) -> list[int]:
    """Plain greedy decoding with mlx-lm itself: the tokens speculative decoding must reproduce."""
    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        out.append(int(tok))
        if out[-1] in eos:
            break
    return out


def prompt_of(length: int, seed: int = 0) -> list[int]:
    mx.random.seed(1000 + seed)
    return mx.random.randint(3, VOCAB - 1, (length,)).tolist()


class OracleDraft(DFlashDraftModel):
    """Proposes the target's own greedy continuation, with one error injected per cycle at a
    position taken from `errors` in turn (None = no error), so every acceptance length occurs.
    Several sequences drafted by one drafter each `follow` their own continuation."""

    def __init__(self, config, reference: list[int] | None, errors=(None,)):
        super().__init__(config)
        self.reference = reference  # prompt + greedy continuation
        self.references = {}  # a followed sequence's, by its drafter cache
        self.errors = list(errors)
        self.cycle = 0

    def follow(self, cache, reference: list[int]) -> None:
        """Give the sequence of this SpeculativeCache its own continuation."""
        self.references[id(cache._draft_cache[0])] = reference

    def reference_for(self, cache) -> list[int]:
        """The continuation of the sequence whose drafter cache this is ([] for none: measuring costs)."""
        return self.references.get(id(cache[0]), self.reference) or []

    def propose_logits(self, last_token, cache, block_size, compiled=True, heads=None):
        start, reference = cache[0].offset, self.reference_for(cache)  # (start: position of last_token)
        guess = [reference[p] if p < len(reference) else 0 for p in range(start + 1, start + block_size)]
        err = self.errors[self.cycle % len(self.errors)]
        self.cycle += 1
        if err is not None and err < len(guess):
            guess[err] = (guess[err] + 1) % self.config.vocab_size
        logits = mx.full((1, block_size - 1, self.config.vocab_size), -30.0)
        for i, t in enumerate(guess):
            logits[0, i, t] = 30.0
        return logits[:, :heads]


def flat_params(model) -> dict:
    return dict(tree_flatten(model.parameters()))


def no_eos_tokenizer(tokens) -> TokenizerWrapper:
    """A tokenizer whose EOS id does not occur in `tokens`, so nothing ends early."""
    return make_tokenizer(eos=next(i for i in range(3, VOCAB) if i not in tokens))
