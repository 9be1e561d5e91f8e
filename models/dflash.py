"""The DFlash drafter (z-lab, arXiv 2602.06036), ported to MLX by hand: mlx-lm has no such model.

A drafter is a few Qwen3-style decoder layers that denoise one block of `block_size` positions in
a single parallel pass. Its inputs are

* the block: the last committed token followed by `block_size - 1` copies of `mask_token_id`,
  embedded with the *target's* embedding;
* context features: the target's hidden states at `target_layer_ids`, concatenated and projected by
  `fc` + `hidden_norm`. Every layer turns them into extra keys/values (the same k_proj/v_proj and
  k_norm as the block) so the block's queries see `[context ; block]`: the whole committed context
  plus the block bidirectionally.

Output position k of the block is the proposal for block position k + 1, read out through the
target's lm_head after the drafter's own final `norm`. The checkpoint layout is z-lab's:
`config.json` with a `dflash_config` section, and safetensors keys `fc`, `hidden_norm`, `norm`,
`layers.N.self_attn.{q,k,v,o}_proj`, `layers.N.self_attn.{q,k}_norm`, `layers.N.mlp.*`,
`layers.N.{input,post_attention}_layernorm`; no embedding and no lm_head.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from ..errors import UserError


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The paper's default taps: one per draft layer, evenly spread over layers 1 .. L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def is_drafter_config(cfg: dict) -> bool:
    """Whether a config.json describes a DFlash drafter (z-lab's layout, or its keys at the top level)."""
    return (
        "dflash_config" in cfg
        or "DFlashDraftModel" in cfg.get("architectures", [])
        or ("mask_token_id" in cfg and "target_layer_ids" in cfg)
    )


# A compiled step looks up (or traces) its graph in state shared by every thread that calls it (the
# server's workers): one call at a time. The call builds the pass; running it is not held up.
_TRACING = threading.Lock()


@dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    num_target_layers: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    attention_bias: bool = False
    extra: dict = field(default_factory=dict, repr=False)  # other config.json keys, kept for export

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise UserError(
                f"drafter config: layer_types has {len(self.layer_types)} entries "
                f"for {self.num_hidden_layers} layers"
            )
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise UserError("drafter config: sliding_attention layers need a sliding_window")
        if not self.target_layer_ids:
            raise UserError("drafter config: dflash_config.target_layer_ids is empty")
        if self.block_size < 1:
            raise UserError(f"drafter config: block_size must be >= 1, got {self.block_size}")

    @classmethod
    def from_dict(cls, cfg: dict) -> DFlashConfig:
        """Read a z-lab `config.json` (the dflash keys live in `dflash_config`)."""
        dflash = cfg.get("dflash_config") or {}
        missing = [
            k
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "intermediate_size",
                "vocab_size",
            )
            if k not in cfg
        ]
        if "mask_token_id" not in dflash and "mask_token_id" not in cfg:
            missing.append("dflash_config.mask_token_id")
        if missing:
            raise UserError(f"drafter config.json lacks {', '.join(missing)}: is this a DFlash drafter?")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra", "target_layer_ids", "mask_token_id"}
        kwargs = {k: v for k, v in cfg.items() if k in known}
        rope = cfg.get("rope_parameters")  # transformers 5 keeps theta and scaling here
        if isinstance(rope, dict) and "rope_theta" not in cfg and "rope_theta" in rope:
            kwargs["rope_theta"] = rope["rope_theta"]
            if rope.get("rope_type", "default") != "default" and not cfg.get("rope_scaling"):
                kwargs["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        kwargs.setdefault("num_key_value_heads", cfg["num_attention_heads"])
        # Qwen3 configs list layer_types even with sliding windows off; only honour them when on.
        if not cfg.get("use_sliding_window", True) or not cfg.get("sliding_window"):
            kwargs.pop("layer_types", None)
            kwargs.pop("sliding_window", None)
        layer_ids = dflash.get("target_layer_ids", cfg.get("target_layer_ids"))
        if layer_ids is None:
            if cfg.get("num_target_layers") is None:
                raise UserError("drafter config.json has neither target_layer_ids nor num_target_layers")
            layer_ids = default_target_layer_ids(cfg["num_target_layers"], cfg["num_hidden_layers"])
        kwargs["block_size"] = int(dflash.get("block_size", cfg.get("block_size", 16)))
        extra = {k: v for k, v in cfg.items() if k not in known and k != "dflash_config"}
        return cls(
            target_layer_ids=list(layer_ids),
            mask_token_id=int(dflash.get("mask_token_id", cfg.get("mask_token_id"))),
            extra=extra,
            **kwargs,
        )

    def to_dict(self) -> dict:
        """The z-lab `config.json` layout, which vLLM, SGLang and transformers read."""
        out = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            **self.extra,
        }
        for f in dataclasses.fields(self):
            if f.name not in ("extra", "target_layer_ids", "mask_token_id"):
                out[f.name] = getattr(self, f.name)
        out["dflash_config"] = {
            "target_layer_ids": list(self.target_layer_ids),
            "mask_token_id": self.mask_token_id,
        }
        return out


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig, sliding: bool):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.scale = cfg.head_dim**-0.5
        self.window = cfg.sliding_window if sliding else None
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps)
        self.rope = initialize_rope(
            cfg.head_dim, cfg.rope_theta, False, cfg.rope_scaling, cfg.max_position_embeddings
        )

    def keys_values(self, x: mx.array, offset) -> tuple[mx.array, mx.array]:
        """Keys (k_norm, RoPE from `offset`) and values of x: context features or block states."""
        B, S, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, S, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, S, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(k, offset=offset), v

    def __call__(self, x, ctx_keys, ctx_values, mask, offset):
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=offset)
        k, v = self.keys_values(x, offset)
        keys = mx.concatenate([ctx_keys, k], axis=2)
        values = mx.concatenate([ctx_values, v], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, sliding: bool):
        super().__init__()
        self.self_attn = DFlashAttention(cfg, sliding)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x, ctx_keys, ctx_values, mask, offset):
        h = x + self.self_attn(self.input_layernorm(x), ctx_keys, ctx_values, mask, offset)
        return h + self.mlp(self.post_attention_layernorm(h))


def block_mask(ctx_len, capacity: int, block: int, window: int | None) -> mx.array:
    """Which of `[context (capacity rows) ; block]` keys each block query may attend to.

    A block starting at position `ctx_len` sees the context rows before it (rows from `ctx_len` on
    are unused cache capacity, or, in training, positions at or after its anchor) and its whole own
    block (bidirectional). A sliding-window layer also drops keys `window` or more positions behind
    the query. `ctx_len` is a scalar (inference; an mx.array inside mx.compile) or one value per
    block of a batch (training): the mask then has shape (N, 1, block, capacity + block).
    """
    ctx_len = mx.array(ctx_len).reshape(-1, 1, 1, 1)
    ctx_pos = mx.arange(capacity)
    visible = mx.concatenate(
        [
            mx.broadcast_to(ctx_pos < ctx_len, (ctx_len.shape[0], 1, 1, capacity)),
            mx.ones((ctx_len.shape[0], 1, 1, block), dtype=mx.bool_),
        ],
        axis=-1,
    )
    if window is not None:
        q_pos = ctx_len + mx.arange(block)[:, None]
        k_pos = mx.concatenate(
            [mx.broadcast_to(ctx_pos, (ctx_len.shape[0], 1, 1, capacity)), ctx_len + mx.arange(block)],
            axis=-1,
        )
        visible = visible & (q_pos - k_pos < window)
    return visible


class DraftCache:
    """One drafter layer's keys/values of committed context. `offset` counts every position taken in
    (the next one's RoPE position); `rows` of them are held, the latest. With a `window`, positions
    more than `window` back are dropped, STEP at a time: the drafter's pass then attends over at most
    window + STEP rows however long the context grows (the buffer keeps one shape, so the compiled
    step is traced once). mlx-lm's caches have no such window that also reports absolute positions."""

    STEP = 256

    def __init__(self, window: int | None = None):
        self.window = window
        self.keys = self.values = None
        self.offset = self.rows = 0

    def append(self, keys: mx.array, values: mx.array) -> None:
        n = keys.shape[2]
        if self.window is not None and self.rows + n > self.window + self.STEP:
            drop = self.rows + n - self.window
            if drop >= self.rows:  # the new positions alone fill the window
                keys, values = keys[..., n - self.window :, :], values[..., n - self.window :, :]
                self.keys = self.values = None
                self.offset += n - self.window
                self.rows, n = 0, self.window
            else:
                self.keys = self.keys[..., drop : self.rows, :]
                self.values = self.values[..., drop : self.rows, :]
                self.rows -= drop
        need = self.rows + n
        if self.keys is None or need > self.keys.shape[2]:
            size = -(-need // self.STEP) * self.STEP
            # (a buffer the window's size once the context nears it: a window past the context, which
            # the settings allow up to 2**30, never allocates one)
            if self.window is not None and need > self.window // 2:
                size = max(size, self.window + self.STEP)
            grown = []
            for old, new in ((self.keys, keys), (self.values, values)):
                buffer = mx.zeros((*new.shape[:2], size, new.shape[3]), new.dtype)
                if old is not None:
                    buffer[..., : self.rows, :] = old[..., : self.rows, :]
                grown.append(buffer)
            self.keys, self.values = grown
        self.keys[..., self.rows : need, :] = keys
        self.values[..., self.rows : need, :] = values
        self.rows, self.offset = need, self.offset + n

    def can_trim(self, n: int) -> bool:
        """Whether the last n positions can be taken back (not if that reaches before the window)."""
        return n <= self.rows

    def trim(self, n: int) -> None:
        if not self.can_trim(n):
            raise ValueError(f"cannot take back {n} positions: the draft window holds {self.rows}")
        self.rows -= n
        self.offset -= n

    @property
    def state(self):
        if self.keys is None:
            return []
        return self.keys[..., : self.rows, :], self.values[..., : self.rows, :]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class DFlashDraftModel(nn.Module):
    layer_class = DFlashLayer

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = [self.layer_class(config, t == "sliding_attention") for t in config.layer_types]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.traces = 0  # how often the compiled draft step was traced (a recompile counter)
        self.unbind()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def dtype(self) -> mx.Dtype:
        """The dtype the drafter computes in: its norms' (a quantized layer's weight is packed uint32)."""
        return self.norm.weight.dtype

    def make_cache(self, window: int | None = None) -> list[DraftCache]:
        """One cache per layer, holding the keys/values of committed context only (with a `window`,
        of about its last `window` positions)."""
        if window is not None and window < 1:
            raise UserError(f"the draft window must be at least 1 position, got {window}")
        return [DraftCache(window) for _ in self.layers]

    def context(self, features: mx.array) -> mx.array:
        """fc + hidden_norm over concatenated target hidden states: the drafter's context."""
        return self.hidden_norm(self.fc(features))

    def absorb(self, features: mx.array, cache: list[DraftCache]) -> None:
        """Append committed positions' target features to the drafter's cache as keys/values."""
        ctx = self.context(features.astype(self.dtype))
        offset = cache[0].offset
        for layer, c in zip(self.layers, cache):
            c.append(*layer.self_attn.keys_values(ctx, offset))

    def denoise(self, block_embeddings, ctx_keys, ctx_values, ctx_len, position=None) -> mx.array:
        """One parallel pass over the block(s); returns the final-normed hidden states.

        Inference passes one block, the cache buffers (`ctx_len` rows of them in use) and the block's
        `position` (more than ctx_len under a draft window); training passes N blocks (batch axis) with
        the whole sequence's context keys and one `ctx_len` (the anchor position) per block.
        """
        L = block_embeddings.shape[1]
        capacity = ctx_keys[0].shape[2]
        masks = {
            w: block_mask(ctx_len, capacity, L, w) for w in {layer.self_attn.window for layer in self.layers}
        }
        h = block_embeddings
        for layer, k, v in zip(self.layers, ctx_keys, ctx_values):
            h = layer(h, k, v, masks[layer.self_attn.window], ctx_len if position is None else position)
        return self.norm(h)

    def bind(self, target) -> None:
        """Share the target's embedding and lm_head (`target`: a models.targets.Target), and compile the
        draft step around them.

        The target's `shared_state` is the tree of arrays behind them; passing it (and our own
        parameters) as compile inputs keeps the compiled step correct if weights change later.
        """
        embed = self.embedding(target)

        def step(block_tokens, ctx_keys, ctx_values, ctx_len, position):
            emb = embed(block_tokens).astype(self.dtype)
            return self.denoise(emb, ctx_keys, ctx_values, ctx_len, position)

        def traced_step(*args):
            self.traces += 1  # runs only while mx.compile traces, never on a cached call
            return step(*args)

        # The output head stays outside the compiled step: it runs at however many positions a cycle
        # proposes, and one wide matmul gains nothing from compiling.
        self._lm_head = self.head(target)
        self._eager_step = step
        self._compiled_step = mx.compile(traced_step, inputs=[self.state, target.shared_state])
        # Set past nn.Module's __setattr__, which would make the target's model one of our submodules:
        # its weights must be neither our state nor inputs of the compiled step.
        object.__setattr__(self, "_bound_to", target.model)

    def embedding(self, target):
        """The block's embeddings: the target's (as its model scales them)."""
        return target.embed

    def head(self, target):
        """Logits of the drafter's final states: the target's lm_head and logit transform."""
        return target.lm_head

    def unbind(self) -> None:
        """Forget the target (after swapping a layer, so that the next `bind` compiles around it)."""
        self._compiled_step = self._eager_step = self._lm_head = None
        object.__setattr__(self, "_bound_to", None)

    @property
    def bound_to(self):
        """The mlx-lm model whose embedding and lm_head the draft step uses, or None."""
        return self._bound_to

    def propose_hidden(
        self,
        last_token: int,
        cache: list[DraftCache],
        block_size: int,
        compiled: bool = True,
        heads: int | None = None,
    ):
        """Final states (1, heads, hidden) of the first `heads` proposals (default all block_size - 1) for
        the block [last_token, MASK, ...] after the cache."""
        if self._compiled_step is None:
            raise RuntimeError("drafter is not bound to a target: call bind() (load_pair does this)")
        heads = block_size - 1 if heads is None else heads
        block = mx.array([[last_token] + [self.config.mask_token_id] * (block_size - 1)])
        keys = [c.keys for c in cache]
        values = [c.values for c in cache]
        step = self._compiled_step if compiled else self._eager_step
        with _TRACING:
            h = step(block, keys, values, mx.array(cache[0].rows), mx.array(cache[0].offset))
        return h[:, 1 : 1 + heads]

    def propose_logits(self, last_token, cache, block_size, compiled=True, heads=None):
        """Logits (1, heads, vocab) of the first `heads` proposals: the output head only where proposals
        will be read."""
        return self._lm_head(self.propose_hidden(last_token, cache, block_size, compiled, heads))

    def draft(self, last: int, cache, block: int, k: int, draw, temperature: float, compiled: bool = True):
        """-> (k proposals, their q or None, confidences). Each position is drawn from its own logits
        (`draw`); its confidence is the largest probability of the distribution it is drawn from, which
        never depends on the draw itself, so a width chosen from it keeps rejection sampling exact."""
        return _proposals(self.propose_logits(last, cache, block, compiled, heads=k)[0], draw)

    def draft_rows(self, lasts: list[int], caches: list[list[DraftCache]], block: int, ks: list[int], draws):
        """`draft` for several sequences in one pass, each with its own context cache (contexts padded to
        the longest buffer; the pass is eager, as its shapes change with the rows): -> one (proposals,
        q or None, confidences) per sequence."""
        if self._compiled_step is None:
            raise RuntimeError("drafter is not bound to a target: call bind() (load_pair does this)")
        tokens = mx.array([[t] + [self.config.mask_token_id] * (block - 1) for t in lasts])
        size = max(c[0].keys.shape[2] for c in caches)

        def stacked(name, i):
            rows = [getattr(c[i], name) for c in caches]
            return mx.concatenate([mx.pad(r, [(0, 0), (0, 0), (0, size - r.shape[2]), (0, 0)]) for r in rows])

        keys = [stacked("keys", i) for i in range(len(self.layers))]
        values = [stacked("values", i) for i in range(len(self.layers))]
        rows, offsets = mx.array([c[0].rows for c in caches]), mx.array([c[0].offset for c in caches])
        h = self._eager_step(tokens, keys, values, rows, offsets)
        logits = self._lm_head(h[:, 1 : 1 + max(ks)])
        return [_proposals(logits[r, :k], draw) for r, (k, draw) in enumerate(zip(ks, draws))]


def _proposals(logits: mx.array, draw):
    """Proposals drawn from the drafter's logits, their q (None: drawn with certainty), confidences."""
    x, q = draw(logits)
    confidence = mx.exp(logits.max(axis=-1) - mx.logsumexp(logits, axis=-1)) if q is None else q.max(axis=-1)
    return x.astype(mx.int32), q, confidence
