"""Target adapters: mlx-lm's own model classes, plus what speculative decoding needs from them.

mlx-lm implements every target architecture; this module only adds, for the length of one call,
(1) a record of the hidden states leaving the decoder layers in `target_layer_ids` (the drafter's
context features), and (2) exact rollback of the cache to the accepted prefix of a verify pass.
What differs between architectures, and which mlx-lm's classes leave implicit, is stated once per
family in `FAMILIES`.

Recording works by standing a thin `_Tap` in for each layer of interest in the inner model's
`layers` list during the call and putting the real layers back afterwards: no class is patched
and nothing outlives the call. Attention layers roll back by trimming their KV cache. Recurrent
layers (qwen3_5's and qwen3_next's Gated-DeltaNet, lfm2's short convolution) carry state that cannot
be trimmed, so the adapter keeps the state from before the verify pass and replays the layer's mixer
over the accepted prefix only (from the layer inputs the tap recorded), which gives exactly the state
a pass over that prefix would have left.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from ..batching import RaggedKVCache
from ..errors import UserError
from ..trees import TreePass, gather_path


def _replay_gated_delta(layer, x: mx.array, cache: ArraysCache) -> None:
    """Advance a Gated-DeltaNet layer's cache over inputs x (output discarded)."""
    layer.linear_attn(layer.input_layernorm(x), None, cache)


def _replay_short_conv(layer, x: mx.array, cache: ArraysCache) -> None:
    """Advance an lfm2 short-convolution layer's cache over inputs x (output discarded)."""
    layer.conv(layer.operator_norm(x), None, cache)


@dataclass(frozen=True)
class Family:
    """What speculative decoding reads from one mlx-lm architecture beyond its module's interface.

    embed_scale: the drafter's block embeddings are `embed_tokens(x) * embed_scale(args)`, as the
        model scales its own (gemma4: sqrt(hidden_size)).
    logit_scale, softcap: names of config fields; the model's logits are its head's output times
        `logit_scale`, then `tanh(x / softcap) * softcap`. Verify logits must be exactly these.
    tied: whether the head is the embedding (None: the config's tie_word_embeddings says).
    tuple_output: decoder layers return (hidden, ...) rather than the hidden states alone.
    recurrent: which decoder layers carry state that cannot be trimmed; `replay` advances one's
        cache over given layer inputs.
    norm_eps: the config field holding the RMSNorm epsilon (a trained drafter copies it).
    """

    embed_scale: Callable[[Any], float] | None = None
    logit_scale: str | None = None
    softcap: str | None = None
    tied: bool | None = None
    tuple_output: bool = False
    recurrent: Callable[[nn.Module], bool] = lambda layer: False
    replay: Callable[[nn.Module, mx.array, ArraysCache], None] | None = None
    norm_eps: str = "rms_norm_eps"


_GATED_DELTA = Family(recurrent=lambda layer: layer.is_linear, replay=_replay_gated_delta)
_GEMMA4 = Family(
    embed_scale=lambda args: args.hidden_size**0.5, softcap="final_logit_softcapping", tuple_output=True
)

# mlx-lm's module name for the architecture -> how to read it.
FAMILIES = {
    "llama": Family(),
    "qwen3": Family(),
    "qwen3_moe": Family(),
    "gpt_oss": Family(),
    "qwen3_5": _GATED_DELTA,
    "qwen3_5_moe": _GATED_DELTA,
    "qwen3_next": _GATED_DELTA,
    "lfm2": Family(
        tied=True,
        recurrent=lambda layer: not layer.is_attention_layer,
        replay=_replay_short_conv,
        norm_eps="norm_eps",
    ),
    "gemma4": _GEMMA4,
    "gemma4_text": _GEMMA4,
    "muse_glimmer": Family(logit_scale="output_multiplier", softcap="final_logit_softcapping"),
}
SUPPORTED_FAMILIES = tuple(FAMILIES)


def family_of(model: nn.Module) -> str:
    """mlx-lm's module name for the model (e.g. 'llama' for Llama 3 and SmolLM2)."""
    return type(model).__module__.rsplit(".", 1)[-1]


class _Tap:
    """Stands in for one decoder layer during a single call: runs it, and records its input/output."""

    def __init__(self, layer, index: int, record: dict):
        self._layer, self._index, self._record = layer, index, record

    def __call__(self, x, *args, **kwargs):
        out = self._layer(x, *args, **kwargs)
        self._record[self._index] = (x, out)
        return out

    def __getattr__(self, name):
        return getattr(self._layer, name)


@dataclass
class Undo:
    """What taking back a verify pass needs: its width, and each recurrent layer's inputs to the pass
    and state before it (the pass's own record, so several caches can share one Target). For a pass
    built but maybe never run, also each attention layer's buffers before it (`buffers`): trimming
    alone would leave the pass's writes in them, to be computed when a later pass reads them."""

    width: int
    inputs: dict[int, mx.array]
    states: dict[int, list]
    buffers: dict[int, tuple] | None = None


# A pass is built with taps in the model's layer list, and a tree's with its own positions in their
# rotary embeddings (trees.py): swapped in on the shared model object while the pass is built (not run),
# so threads that share a model (the server's workers) build their passes one at a time.
_BUILDING = threading.RLock()


class Target:
    """An mlx-lm model seen as a speculative-decoding target."""

    def __init__(self, model: nn.Module, layer_ids=()):
        self.family = family_of(model)
        if self.family not in FAMILIES:
            raise UserError(
                f"target model family '{self.family}' is not supported by dflash-mlx; "
                f"supported families: {', '.join(SUPPORTED_FAMILIES)}"
            )
        self.spec = spec = FAMILIES[self.family]
        self.model = model
        lm = getattr(model, "language_model", model)  # qwen3_5 and gemma4 wrap their text model
        self.args = lm.args
        self.inner = lm.model
        tied = spec.tied if spec.tied is not None else getattr(self.args, "tie_word_embeddings", False)
        self._lm_head = None if tied else lm.lm_head
        self._embed_scale = spec.embed_scale(self.args) if spec.embed_scale else None
        self._logit_scale = getattr(self.args, spec.logit_scale) if spec.logit_scale else None
        self._softcap = getattr(self.args, spec.softcap, None) if spec.softcap else None
        self.norm_eps = getattr(self.args, spec.norm_eps)
        self.num_layers = len(self.inner.layers)
        self.hidden_size = self.args.hidden_size
        self.vocab_size = self.args.vocab_size
        self.layer_ids = list(layer_ids)
        for i in self.layer_ids:
            if not 0 <= i < self.num_layers:
                raise UserError(
                    f"target_layer_ids contains {i}, but the target has {self.num_layers} layers "
                    f"(valid ids: 0..{self.num_layers - 1})"
                )
        self._recurrent = [i for i, layer in enumerate(self.inner.layers) if spec.recurrent(layer)]

    @property
    def trimmable(self) -> bool:
        """Whether every layer's cache can take back any of a pass's positions (no recurrent layers)."""
        return not self._recurrent

    # The drafter shares these two with the target.
    def embed(self, tokens: mx.array) -> mx.array:
        h = self.inner.embed_tokens(tokens)
        return h if self._embed_scale is None else h * self._embed_scale

    def lm_head(self, h: mx.array) -> mx.array:
        """The model's logits for final hidden states h."""
        return self.finish(self.head(h))

    def head(self, h: mx.array) -> mx.array:
        """The output head alone, before the family's logit transform."""
        if self._lm_head is None:
            return self.inner.embed_tokens.as_linear(h)
        return self._lm_head(h)

    def finish(self, scores: mx.array) -> mx.array:
        """The model's logits from its head's output (also for a subset of rows, see `head_rows`)."""
        if self._logit_scale is not None:
            scores = scores * self._logit_scale
        if self._softcap is not None:
            scores = mx.tanh(scores / self._softcap) * self._softcap
        return scores

    def head_rows(self, token_ids: mx.array) -> mx.array | None:
        """The lm_head's weight rows for `token_ids` (to score a vocabulary subset: `finish(h @ rows.T)`),
        dequantized if the head is quantized; None for a head with a bias (the scores would miss it)."""
        head = self.inner.embed_tokens if self._lm_head is None else self._lm_head
        if getattr(head, "bias", None) is not None:
            return None
        if isinstance(head, (nn.QuantizedEmbedding, nn.QuantizedLinear)):
            # Quantized rows are independent (scales and biases are per row and group), so selecting
            # rows before dequantizing gives exactly the rows of the dequantized matrix.
            extra = {"mode": head.mode} if hasattr(head, "mode") else {}
            biases = head.biases[token_ids] if getattr(head, "biases", None) is not None else None
            return mx.dequantize(
                head.weight[token_ids],
                head.scales[token_ids],
                biases,
                group_size=head.group_size,
                bits=head.bits,
                **extra,
            )
        return head.weight[token_ids]

    @property
    def shared_state(self) -> list:
        return [self.inner.embed_tokens, self._lm_head or {}]

    def make_cache(self) -> list:
        """mlx-lm's cache for the model, except sliding-window layers get a plain KVCache.

        A RotatingKVCache cannot be trimmed once it has wrapped around, and rollback must be exact.
        mlx-lm builds the sliding-window mask from the window size for any cache, so attention is
        unchanged; the cost is that those layers keep their whole history in memory.
        """
        return [KVCache() if isinstance(c, RotatingKVCache) else c for c in make_prompt_cache(self.model)]

    def __call__(
        self, tokens: mx.array, cache: list | None, last_logits_only: bool = False, lengths=None
    ):
        """Run the target over tokens (shape (1, n)) -> (logits, features). cache None: no cache.

        features is (1, n, len(layer_ids) * hidden_size): the tapped layers' outputs, concatenated.
        Such a call (a prefill) cannot be rolled back; `verify` makes one that can. `lengths`: rows of a
        batch right-padded to a common width, each row's logits after its own last token only.
        """
        logits, features, _ = self._run(tokens, cache, last_logits_only, [], lengths)
        return logits, features

    def verify(
        self, tokens: mx.array, cache: list, unrun: bool = False, trees: list | None = None
    ) -> tuple[mx.array, mx.array | None, Undo]:
        """A pass that `rollback` can take back in part or whole: (logits, features, its Undo).
        `unrun`: the pass may be dropped before it runs (`rollback` to 0 then restores the buffers).
        `trees`: per row, a flattened token tree (trees.py) the row's block holds, or None."""
        if trees is not None and any(t is not None for t in trees):
            if self._recurrent:
                raise ValueError("a target with recurrent layers verifies chains only")
            with _BUILDING, TreePass(self.inner.layers, cache, trees, tokens.shape[1]) as lent:
                logits, features, _ = self._run(tokens, lent, False, [])
            return logits, features, Undo(tokens.shape[1], {}, {})
        states = {i: list(cache[i].cache) for i in self._recurrent}
        buffers = None
        if unrun:
            # stop_gradient: a second handle on each buffer as it is now, which the pass's in-place
            # writes do not change. Drop it (`Undo.buffers = None`) before the pass runs: while it lives
            # the writes copy the whole buffer instead of updating it in place.
            buffers = {
                i: (c.keys, c.values, c.offset) if c.keys is None else
                (mx.stop_gradient(c.keys), mx.stop_gradient(c.values), c.offset)
                for i, c in enumerate(cache)
                if i not in states
            }
        logits, features, record = self._run(tokens, cache, False, self._recurrent)
        inputs = {i: record[i][0] for i in self._recurrent}
        return logits, features, Undo(tokens.shape[1], inputs, states, buffers)

    def _run(self, tokens, cache, last_logits_only: bool, recurrent: list[int], lengths=None):
        record: dict[int, Any] = {}
        with _BUILDING:
            layers = self.inner.layers
            watched = set(self.layer_ids) | set(recurrent)
            self.inner.layers = [
                _Tap(layer, i, record) if i in watched else layer for i, layer in enumerate(layers)
            ]
            try:
                h = self.inner(tokens, cache)
            finally:
                self.inner.layers = layers
        if lengths is not None:
            h = h[mx.arange(h.shape[0]), mx.array(lengths) - 1][:, None]
        elif last_logits_only:
            h = h[:, -1:]
        logits = self.lm_head(h)
        outputs = [record[i][1] for i in self.layer_ids]
        if self.spec.tuple_output:
            outputs = [out[0] for out in outputs]
        features = mx.concatenate(outputs, axis=-1) if outputs else None
        return logits, features, record

    def rollback(self, cache: list, undo: Undo, keep: int | list[int], paths: dict | None = None) -> None:
        """Keep only the first `keep` positions of the verify pass `undo` belongs to (0: none of it), or
        keep[b] of row b of a batch (batching.py). It must be the last pass over this cache. `paths`:
        {row: the block indices to keep, in order} for rows that verified a tree (trees.py); the path's
        positions are moved to the front of the row's block first, unless they are there already."""
        n = undo.width
        for row, path in (paths or {}).items():
            if path != list(range(len(path))):
                for c in cache:
                    start = (c.ends[row] if isinstance(c, RaggedKVCache) else c.offset) - n
                    gather_path(c.keys, row, start, path)
                    gather_path(c.values, row, start, path)
        if isinstance(keep, list):
            if not all(0 <= k <= n for k in keep):
                raise ValueError(f"cannot keep {keep} of the {n} positions of the last call")
            if undo.buffers is not None and not any(keep):
                keep = 0  # (a pass dropped as a whole: its buffers go back as they were)
            else:
                for c in cache:
                    c.trim([n - k for k in keep])
                return
        if keep == n:
            return
        if not 0 <= keep < n:
            raise ValueError(f"cannot keep {keep} of the {n} positions of the last call")
        for i, c in enumerate(cache):
            if i in undo.inputs:
                c.cache = list(undo.states[i])
                if keep:
                    self.spec.replay(self.inner.layers[i], undo.inputs[i][:, :keep], c)
            elif undo.buffers is not None and not keep:
                c.keys, c.values, c.offset = undo.buffers[i]
            else:
                c.trim(n - keep)
