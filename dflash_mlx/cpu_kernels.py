"""Faster attention softmax and SwiGLU for targets on MLX's CPU backend.

MLX's CPU backend has no SIMD on x86 yet (ml-explore/mlx#3019): `exp` and `sigmoid` cost ~25 ns an
element there, so in a 16-token verify pass over 2,000 tokens of context the attention softmax costs
more than all the matmuls. The polynomial MLX itself uses for `exp`, written as array operations and
compiled, runs several times faster (the C++ compiler vectorizes the fused loop) and agrees with
`mx.exp` to an ulp. Nothing in mlx-lm or MLX offers a faster path, hence this module.

`install()` (run when a target is loaded or wrapped) puts these functions in place of mlx-lm's
`scaled_dot_product_attention` and `swiglu` (mlx-lm has no hook for either), for the whole process:
mlx-lm's own decoding runs on them too, so ours and plain decoding share their arithmetic. They hand
back to mlx-lm's where they don't apply (attention sinks, quantized caches, masks of other shapes,
dtypes other than float32, sizes where they are not faster). DFLASH_MLX_STOCK_KERNELS=1 keeps MLX's.
"""

from __future__ import annotations

import os
import sys
from functools import partial

import mlx.core as mx
from mlx_lm.models import activations, base

STOCK_ENV = "DFLASH_MLX_STOCK_KERNELS"
_STOCK_ATTENTION = base.scaled_dot_product_attention
_STOCK_SWIGLU = activations.swiglu
# Sizes (elements) where these measured faster than MLX's (2-core x86-64): below, their few more
# operations cost more than they save; above (a long prompt's prefill), their unfused passes over
# memory do.
_SCORES = (1 << 13, 1 << 19)
_SWIGLU = (1 << 13, 1 << 20)

# MLX's own exp polynomial for 2**f, |f| <= 1/2 (mlx/backend/cpu/simd/math.h), highest power first.
_POLY = (
    1.535336188319500e-4,
    1.339887440266574e-3,
    9.618437357674640e-3,
    5.550332471162809e-2,
    2.402264791363012e-1,
    6.931472028550421e-1,
    1.0,
)


@partial(mx.compile, shapeless=True)  # (the context grows a token a step: no new compile for each)
def _exp_parts(x: mx.array) -> tuple[mx.array, mx.array]:
    """exp(x) = 2**i * 2**f: the polynomial for 2**f and the float32 bits of 2**i (0 below -88)."""
    t = mx.clip(x, -88.0, 88.0) * 1.4426950408889634
    whole = mx.floor(t + 0.5)
    frac = t - whole
    poly = _POLY[0]
    for c in _POLY[1:]:
        poly = poly * frac + c
    return poly, mx.left_shift(whole.astype(mx.int32) + 127, 23)


def _exp(x: mx.array) -> mx.array:
    poly, bits = _exp_parts(x)
    return bits.view(mx.float32) * poly  # (a view cannot be compiled shapeless)


def softmax(scores: mx.array) -> mx.array:
    """Softmax over the last axis of float32 scores."""
    e = _exp(scores - mx.max(scores, axis=-1, keepdims=True))
    return e / mx.sum(e, axis=-1, keepdims=True)


@partial(mx.compile, shapeless=True)
def _silu_times(gate: mx.array, x: mx.array, exp_minus_gate: mx.array) -> mx.array:
    return gate / (1.0 + exp_minus_gate) * x


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    if gate.dtype != mx.float32 or not _SWIGLU[0] <= gate.size <= _SWIGLU[1]:
        return _STOCK_SWIGLU(gate, x)
    return _silu_times(gate, x, _exp(-gate))


def attention(queries, keys, values, cache, scale: float, mask, sinks=None) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention` with this module's softmax: grouped query heads
    folded into rows of one matmul, a mask (None, "causal", or boolean or additive, broadcast over
    (batch, heads, queries, keys)) applied to the scores."""
    B, heads, L, D = queries.shape
    kv_heads, S = keys.shape[1], keys.shape[2]
    fits = sinks is None and not hasattr(cache, "bits") and queries.dtype == mx.float32
    fits = fits and _SCORES[0] <= B * heads * L * S <= _SCORES[1]
    if not fits or (isinstance(mask, mx.array) and mask.ndim not in (2, 4)):
        return _STOCK_ATTENTION(queries, keys, values, cache, scale, mask, sinks)
    group = heads // kv_heads
    q = (queries * scale).reshape(B, kv_heads, group * L, D)
    scores = (q @ keys.swapaxes(-1, -2)).reshape(B, kv_heads, group, L, S)
    if isinstance(mask, str):  # "causal": query i is position S - L + i
        mask = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    elif isinstance(mask, mx.array) and mask.ndim == 4:
        mask = mask.reshape(mask.shape[0], -1, 1, *mask.shape[2:])
        if mask.shape[1] == heads and heads > 1:
            mask = mask.reshape(mask.shape[0], kv_heads, group, *mask.shape[3:])
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(mx.float32).min)
        else:
            scores = scores + mask
    out = softmax(scores).reshape(B, kv_heads, group * L, S) @ values
    return out.reshape(B, heads, L, values.shape[-1])  # (values may be narrower: DeepSeek's MLA)


def in_use() -> bool:
    """Whether `install` puts these kernels in place in this process (MLX on the CPU, not turned off)."""
    return not os.environ.get(STOCK_ENV) and mx.default_device() == mx.cpu


def install() -> None:
    """Put this module's attention and SwiGLU in place of mlx-lm's when `in_use()`: in its `base` and
    `activations` (for model modules imported later) and in every model module imported already."""
    if not in_use():
        return
    swaps = ((_STOCK_ATTENTION, attention), (_STOCK_SWIGLU, swiglu))
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and module is not None:
            for attr, value in list(vars(module).items()):
                for stock, ours in swaps:
                    if value is stock:
                        setattr(module, attr, ours)
