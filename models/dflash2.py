"""The DFlash2 drafter (z-lab and Inco AI's successor to DFlash), in MLX, written from its published
description and checkpoint layout.

It is the DFlash drafter with two additions:

* every decoder layer wraps its attention and its MLP in a grouped dynamic causal convolution: along
  the block, position t mixes the inputs at t, t - 1, ..., t - K + 1 (zeros before the block's start)
  with a kernel that is a learnt base plus a part predicted from the sublayer's input at t, one per
  group of `conv_group_size` channels; the kernel for after the sublayer is predicted from its input;
* a candidate selector: each position's proposal is chosen among the drafter's top `selector_top_k`
  tokens there by their logit plus a low-rank score of (previous proposal, this position's hidden
  state, candidate), walking left to right from the block's first token. Greedy at temperature 0; at
  temperature T the proposal is drawn from softmax(score / T) over the candidates, which is the q that
  rejection sampling uses, so acceptance stays exact.

Checkpoint layout: config.json `architectures: ["DFlash2DraftModel"]`, the DFlash fields plus
`dflash_config.{conv_kernel_size, conv_group_size, selector_rank, selector_top_k, output_multiplier,
final_logit_softcapping}`; extra weights `layers.N.{attention,mlp}_conv.{base_kernel,
kernel_projection.weight}` and `candidate_selector.{predecessor_codebook, successor_codebook,
hidden_projection.weight}`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..errors import UserError
from .dflash import DFlashConfig, DFlashDraftModel, DFlashLayer

_FIELDS = (
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "output_multiplier",
    "final_logit_softcapping",
    "input_embedding_scale",
)


@dataclass
class DFlash2Config(DFlashConfig):
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        if self.conv_kernel_size < 1 or self.hidden_size % max(self.conv_group_size, 1):
            raise UserError("DFlash2 config: conv_kernel_size must be >= 1 and conv_group_size divide hidden_size")
        if not 1 <= self.selector_top_k <= self.vocab_size:
            raise UserError(f"DFlash2 config: selector_top_k must be in 1..vocab_size, got {self.selector_top_k}")
        if self.extra.get("is_causal"):
            raise UserError("DFlash2 config: a causal block (is_causal: true) is not supported")

    @classmethod
    def from_dict(cls, cfg: dict) -> DFlash2Config:
        dflash = cfg.get("dflash_config") or {}
        rest = {k: v for k, v in cfg.items() if k not in _FIELDS}
        base = DFlashConfig.from_dict(rest)
        own = {k: dflash.get(k, cfg.get(k)) for k in _FIELDS}
        own = {k: v for k, v in own.items() if v is not None}
        base.extra.pop("architectures", None)
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(DFlashConfig)}, **own)

    def to_dict(self) -> dict:
        out = super().to_dict()
        out["architectures"] = ["DFlash2DraftModel"]
        for k in _FIELDS:
            out["dflash_config"][k] = out.pop(k)
        out["dflash_config"]["block_size"] = self.block_size
        return out


def dynamic_convolve(h: mx.array, dynamic: mx.array, base: mx.array, group_size: int) -> mx.array:
    """out[t] = sum_o (base[o] + dynamic[t, o]) * h[t - o] along the block (h[t - o] = 0 before its
    start); base (K, hidden) per channel, dynamic (B, L, K, groups) per group of group_size channels."""
    B, L, H = h.shape
    blocks = h.reshape(B, L, H // group_size, group_size)
    out = mx.zeros_like(blocks)
    for o in range(base.shape[0]):
        shifted = blocks if o == 0 else mx.pad(blocks[:, : max(L - o, 0)], [(0, 0), (min(o, L), 0), (0, 0), (0, 0)])
        kernel = base[o].reshape(1, 1, -1, group_size).astype(h.dtype) + dynamic[:, :, o, :, None]
        out = out + kernel * shifted
    return out.reshape(B, L, H)


class DynamicConv(nn.Module):
    """The convolution around one sublayer: `before` it on its input, `after` it on its output, both
    with kernels predicted from the input."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int):
        super().__init__()
        self.group_size = group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * (hidden // group_size), bias=False)

    def before(self, h: mx.array) -> tuple[mx.array, mx.array]:
        K = self.base_kernel.shape[1]
        dynamic = self.kernel_projection(h).reshape(*h.shape[:2], 2, K, -1)
        return dynamic_convolve(h, dynamic[:, :, 0], self.base_kernel[0], self.group_size), dynamic[:, :, 1]

    def after(self, h: mx.array, dynamic: mx.array) -> mx.array:
        return dynamic_convolve(h, dynamic, self.base_kernel[1], self.group_size)


class DFlash2Layer(DFlashLayer):
    def __init__(self, cfg: DFlash2Config, sliding: bool):
        super().__init__(cfg, sliding)
        self.attention_conv = DynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = DynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def __call__(self, x, ctx_keys, ctx_values, mask, offset):
        a, kernel = self.attention_conv.before(self.input_layernorm(x))
        h = x + self.attention_conv.after(self.self_attn(a, ctx_keys, ctx_values, mask, offset), kernel)
        m, kernel = self.mlp_conv.before(self.post_attention_layernorm(h))
        return h + self.mlp_conv.after(self.mlp(m), kernel)


class CandidateSelector(nn.Module):
    def __init__(self, cfg: DFlash2Config):
        super().__init__()
        self.top_k = cfg.selector_top_k
        # Plain arrays under the checkpoint's own names (not nn.Embedding, which would add ".weight").
        self.predecessor_codebook = mx.zeros((cfg.vocab_size, cfg.selector_rank))
        self.successor_codebook = mx.zeros((cfg.vocab_size, cfg.selector_rank))
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def select(self, hidden: mx.array, logits: mx.array, first: int, temperature: float):
        """hidden, logits (k, ...) of the proposal positions -> (proposals (k,), the float32 probabilities
        (k, top_k) over the candidates that each was drawn from (above temperature 0; at 0, the untempered
        ones of the scores it was the argmax of), the candidates (k, top_k))."""
        candidates = mx.argpartition(logits, -self.top_k, axis=-1)[:, -self.top_k :]
        unary = mx.take_along_axis(logits, candidates, axis=-1)
        projected = self.hidden_projection(hidden)
        previous = mx.array(first)
        chosen, rows = [], []
        for j in range(hidden.shape[0]):
            edges = (self.predecessor_codebook[previous] * projected[j] * self.successor_codebook[candidates[j]]).sum(-1)
            # (in float32: the division rounded in a bfloat16 drafter's dtype moves the draw away from
            # the probabilities rejection sampling is given)
            score = (unary[j] + edges).astype(mx.float32) / (temperature or 1.0)
            pick = mx.argmax(score) if temperature == 0 else mx.random.categorical(score)
            previous = candidates[j, pick]
            chosen.append(previous)
            rows.append(score)
        return mx.stack(chosen), mx.softmax(mx.stack(rows), axis=-1), candidates


class DFlash2DraftModel(DFlashDraftModel):
    layer_class = DFlash2Layer

    def __init__(self, config: DFlash2Config):
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config)

    def embedding(self, target):
        scale = self.config.input_embedding_scale
        return target.embed if scale == 1.0 else lambda tokens: target.embed(tokens) * scale

    def head(self, target):
        """Its own logit scale on the target's raw head; with none, the target's own logits."""
        c = self.config
        if c.output_multiplier == 1.0 and not c.final_logit_softcapping:
            return target.lm_head

        def head(h):
            x = target.head(h) * c.output_multiplier
            cap = c.final_logit_softcapping
            return mx.tanh(x / cap) * cap if cap else x

        return head

    def draft(self, last: int, cache, block: int, k: int, draw, temperature: float, compiled: bool = True):
        """-> (k proposals, their q over the vocabulary or None, confidences). At temperature T > 0 each
        proposal depends on the one before, and its q row is exactly the distribution it was drawn from
        given that one. Confidences come from the drafter's own logits there, which no draw changes: a
        width chosen from them keeps rejection sampling exact."""
        hidden = self.propose_hidden(last, cache, block, compiled, heads=k)[0]
        logits = self._lm_head(hidden)
        x, probs, candidates = self.candidate_selector.select(hidden, logits, last, temperature)
        if temperature == 0:
            return x.astype(mx.int32), None, probs.max(axis=-1)
        q = mx.put_along_axis(mx.zeros(logits.shape, dtype=mx.float32), candidates, probs, axis=-1)
        return x.astype(mx.int32), q, mx.softmax(logits.astype(mx.float32), axis=-1).max(axis=-1)
