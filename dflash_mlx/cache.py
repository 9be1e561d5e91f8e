"""The target's and the drafter's caches, which grow, commit and roll back together.

Invariant between cycles: both caches hold exactly the committed tokens except the newest one
(`pending`), which the next verify pass feeds to the target as the first position of its block.
Decoding runs one pass ahead of what it has yielded: the next cycle's verify pass is under way
(`in_flight`) while a cycle's tokens are handed out, and `cancel` takes it back if they end the
answer. A plain step's successor is even built before its token is read (`keep` the step, `verify`
the lazy token with `unrun`, `add` the token once read), and then either run (`launch`) or dropped.
The target cache holds its usual KV (and recurrent) state; the drafter's cache holds keys/values
made from the target's hidden features at those same positions, so drafter and target always see
the same context. Keeping this object alive between calls continues a conversation without
prefilling it again.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache

from .batching import batchable, merge, split
from .drafters import NgramIndex
from .errors import UserError
from .models.dflash import DFlashDraftModel
from .models.targets import Target
from .pairing import prepare
from .sampling import log_probabilities
from .settings import GenerationSettings

ABSORB_BATCH = 64
# Prompt tokens a prefill pass takes at most. On a GPU, mlx-lm's default. MLX's CPU backend has no
# fused attention: it builds each chunk's full score matrix, and past a few hundred queries its
# softmax leaves the caches and costs more than the layers' matmuls, so shorter chunks prefill long
# prompts faster there (docs/performance.md#long-prompts).
GPU_PREFILL_STEP = 2048
CPU_PREFILL_STEP = 256


def prefill_step() -> int:
    """The chunk a prefill takes where none is given, by the device MLX computes on."""
    return CPU_PREFILL_STEP if mx.default_device().type == mx.cpu else GPU_PREFILL_STEP


def _layer_copy(c):
    """One layer's cache, separately writable: a KV cache's buffers behind new handles, a recurrent
    layer's list of arrays anew (its arrays are replaced, never written to)."""
    other = copy.copy(c)
    if isinstance(c, ArraysCache):
        other.cache = list(c.cache)
    elif c.keys is not None:
        other.keys, other.values = mx.stop_gradient(c.keys), mx.stop_gradient(c.values)
    return other


class SpeculativeCache:
    def __init__(
        self, model: nn.Module | Target, draft: DFlashDraftModel | None, draft_window: int | None = None
    ):
        """`model`: the mlx-lm target as `load` returns it (or a Target); `draft`: its drafter, or None;
        `draft_window`: how many of the latest context positions the drafter keeps (None: all)."""
        self.target = target = prepare(model, draft)
        self.draft = draft
        self.draft_window = draft_window = GenerationSettings(draft_window=draft_window).draft_window
        self.target_cache = target.make_cache()
        self._draft_cache = draft.make_cache(draft_window) if draft is not None else None
        self.unabsorbed: list[mx.array] = []  # committed positions' features the drafter has yet to take in
        self.tokens: list[int] = []  # every committed token, processed or pending
        # where each short n-gram of `tokens` last occurred (prompt lookup), and the target's phrases
        self.index = NgramIndex(phrases=getattr(draft, "phrases", None))
        self.processed = 0  # how many of them the target (and drafter) have seen
        self.last_prefill = 0  # tokens the last prefill ran through the target
        self.snapshot = None  # (position, recurrent states) at the end of the last prefill, if any
        self.undo = None  # how to take back the last verify pass, until it is kept
        # True from the start of a model pass until the cache is consistent again: a pass interrupted
        # in between (Ctrl-C, an exception) leaves the models' caches ahead of `processed`.
        self.broken = False
        self.in_use = False  # while an answer goes on from it (stream_generate)

    @property
    def draft_cache(self) -> list | None:
        """The drafter's cache, holding every processed position (or the latest, under a draft window).
        The drafter takes in the features of
        committed positions only when it next drafts (or every ABSORB_BATCH positions): cycles that do
        not draft pay nothing for it, and a batch of positions costs about what one does."""
        self._absorb()
        return self._draft_cache

    def _absorb(self) -> None:
        if self.unabsorbed:
            self.draft.absorb(mx.concatenate(self.unabsorbed, axis=1), self._draft_cache)
            self.unabsorbed = []

    @property
    def pending(self) -> list[int]:
        return self.tokens[self.processed :]

    def add(self, tokens: list[int]) -> None:
        """Commit tokens without processing them (they become pending)."""
        self.tokens.extend(tokens)
        self.index.extend(tokens)

    def prefill(self, tokens: list[int], step: int | None = None, progress=None) -> mx.array:
        """Process pending + new tokens; return the target's logits (1, vocab) after the last one.

        Long prompts go through in chunks of `step` (None: `prefill_step()`), each chunk's features
        going straight into the drafter's cache, so the whole prompt's features never sit in memory at
        once. `progress(done, total)` is called before the first chunk and after each (tokens processed
        of this prefill's), as mlx-lm calls its prompt_progress_callback.
        """
        step = step or prefill_step()
        self.add(tokens)
        todo = self.pending
        self.last_prefill = len(todo)
        if not todo:
            raise UserError("nothing to prefill: the prompt is empty")
        self.broken = True
        logits = None
        if progress is not None:
            progress(0, len(todo))
        for start in range(0, len(todo), step):
            logits = self._run(todo[start : start + step], last_logits_only=True)
            if progress is not None:
                progress(min(start + step, len(todo)), len(todo))
        if not all(c.is_trimmable() for c in self.target_cache):
            # Recurrent state cannot be trimmed: keep it as it stands at the end of this prompt (the
            # arrays are immutable, so this copies nothing), so a conversation can go back there.
            self.snapshot = (
                self.processed,
                [None if c.is_trimmable() else list(c.cache) for c in self.target_cache],
            )
        self.broken = False
        return logits[:, -1]

    def prefill_scored(self, tokens: list[int], following: int, k: int) -> list[tuple]:
        """Process tokens (no pending ones, a part of a prompt short of its last token) in one pass,
        scoring the prompt's tokens they predict, tokens[1:] and `following`: -> `log_probabilities`
        of each (a server's echo)."""
        if self.pending or not tokens:
            raise ValueError("prefill_scored takes a prompt's next part, with nothing pending")
        self.add(tokens)
        self.broken = True
        logits = self._run(tokens, last_logits_only=False)
        self.broken = False
        return log_probabilities(logits[0], tokens[1:] + [following], k)

    def _run(self, tokens: list[int], last_logits_only: bool) -> mx.array:
        """One prefill pass over the next pending tokens: the target's logits; the drafter takes in
        their features."""
        chunk = mx.array([tokens])
        logits, features = self.target(chunk, self.target_cache, last_logits_only=last_logits_only)
        if self.draft is not None:
            self.draft.absorb(features, self.draft_cache)
        mx.eval(logits, [c.state for c in self.target_cache], [c.state for c in self.draft_cache or []])
        self.processed += len(tokens)
        return logits

    def verify(self, block: mx.array, unrun: bool = False, trees: list | None = None):
        """Run the target over a block whose first token is the pending one: (logits, features).
        `unrun`: the pass is only built; `launch` runs it, `cancel` drops it. `trees`: [the block's
        token tree] where it holds one (trees.py)."""
        self.broken = True  # until commit
        logits, features, self.undo = self.target.verify(block, self.target_cache, unrun, trees)
        return logits, features

    def launch(self, *arrays) -> None:
        """Start computing a pass built with `unrun` (the arrays it yields) without waiting for it."""
        self.undo.buffers = None  # (see Target.verify)
        mx.async_eval(*arrays)

    def keep(self, features: mx.array | None, m: int, path: list[int] | None = None) -> None:
        """After a verify pass over [pending, x_1, ...] that accepted x_1 .. x_{m-1}: keep its first m
        positions (of a tree pass, those of its accepted `path`). The m tokens committed (the accepted
        ones and the target's, the new pending token) follow with `add`, which may come after the next
        pass is launched."""
        self.target.rollback(self.target_cache, self.undo, m, None if path is None else {0: path})
        self.undo = None
        self.kept(features, m, path)

    def kept(self, features: mx.array | None, m: int, path: list[int] | None = None) -> None:
        """`keep`'s bookkeeping: the target kept m positions of a pass it made over a batch this cache's
        target caches were lent to (engine.py); the drafter's context takes their features (those of
        the accepted `path` of a tree pass)."""
        if path is not None and features is not None:
            features = features[:, mx.array(path)]
        if self.draft is not None and features is not None and m:
            self.unabsorbed.append(features[:, :m])
            if sum(f.shape[1] for f in self.unabsorbed) >= ABSORB_BATCH:
                self._absorb()
        self.processed += m
        self.broken = False

    @property
    def in_flight(self) -> bool:
        """Whether a verify pass is under way (or built) that is neither kept nor cancelled yet."""
        return self.undo is not None

    def cancel(self) -> None:
        """Take back the last verify pass as a whole: a cycle that is not wanted after all."""
        self.target.rollback(self.target_cache, self.undo, 0)
        self.undo = None
        self.broken = False

    @property
    def nbytes(self) -> int:
        """Memory the cache holds (its buffers as allocated, not just the positions in use)."""
        layers = self.target_cache + (self._draft_cache or [])
        return sum(c.nbytes for c in layers) + sum(f.nbytes for f in self.unabsorbed)

    def settle(self) -> None:
        """Compute whatever it holds that is still lazy: MLX computes an array only in the thread whose
        stream built it, and a kept cache may go on in another thread (the server's workers)."""
        layers = self.target_cache + (self._draft_cache or [])
        mx.eval([c.state for c in layers], self.unabsorbed, self.snapshot and self.snapshot[1])

    def compact(self) -> None:
        """Hold each plain KV layer's buffers at the size of its positions rather than of the blocks
        they grew in (for a cache kept for later: it grows again when it is used)."""
        if self.broken or self.undo is not None:
            raise ValueError("only a cache between two calls can be compacted")
        for c in self.target_cache:
            if type(c) is KVCache and c.keys is not None and c.offset < c.keys.shape[2]:
                c.keys = mx.contiguous(c.keys[..., : c.offset, :])
                c.values = mx.contiguous(c.values[..., : c.offset, :])
                mx.eval(c.keys, c.values)

    def copy(self) -> SpeculativeCache:
        """A cache holding the same tokens, to go on from separately (a conversation that branches).
        The arrays are shared until one of the two writes to them: MLX then copies what is written to,
        because a second handle on an array (stop_gradient) keeps it from being updated in place."""
        if self.broken or self.undo is not None:
            raise ValueError("only a cache between two calls can be copied")
        other = copy.copy(self)
        other.target_cache = [_layer_copy(c) for c in self.target_cache]
        other._draft_cache = (
            None if self._draft_cache is None else [_layer_copy(c) for c in self._draft_cache]
        )
        other.unabsorbed = list(self.unabsorbed)
        other.tokens = list(self.tokens)
        other.index = self.index.copy()
        other.in_use = False
        return other

    def truncate(self, n: int) -> bool:
        """Keep only the first n committed tokens (what chat does before each turn). Recurrent state
        cannot be trimmed, only put back as it was at the end of the last prefill; the tokens between
        there and n are then prefilled again by the next call. Returns False (and changes nothing) when n
        is before that point or before the draft window, or when an interrupted pass left the cache broken:
        start a new cache then."""
        if self.broken:
            return False
        if n >= self.processed:
            del self.tokens[n:]
            self.index.truncate(n)
            return True
        if all(c.is_trimmable() for c in self.target_cache):
            back, states = n, [None] * len(self.target_cache)
        elif self.snapshot is not None and self.snapshot[0] <= n:
            back, states = self.snapshot
        else:
            return False
        if not all(c.can_trim(self.processed - back) for c in self.draft_cache or []):
            return False  # back before the draft window
        for c, state in zip(self.target_cache, states):
            if state is None:
                c.trim(self.processed - back)
            else:
                c.cache = list(state)
        for c in self.draft_cache or []:
            c.trim(self.processed - back)
        self.processed = back
        del self.tokens[n:]
        self.index.truncate(n)
        return True


def prefill_together(caches: list[SpeculativeCache], prompts: list[list[int]]) -> list[mx.array]:
    """`prefill` for several caches of one target in one pass over their rows (each cache's pending and
    new tokens, right-padded to the longest): -> each one's logits after its last token, (1, vocab).
    The caches end as their own prefills would leave them. Where a pass over many rows costs little
    more than one over a single row (a GPU), short prompts that arrive together start sooner. Meant
    for short prompts (one pass, no chunks); a target whose caches cannot batch runs them in turn."""
    if len(caches) == 1 or not batchable(caches[0].target_cache):
        return [c.prefill(p) for c, p in zip(caches, prompts)]
    if not all(c.pending or p for c, p in zip(caches, prompts)):
        raise UserError("nothing to prefill: the prompt is empty")
    for c, p in zip(caches, prompts):
        c.add(p)
        c.broken = True
    rows = [c.pending for c in caches]
    lengths, width = [len(r) for r in rows], max(len(r) for r in rows)
    batch = merge([c.target_cache for c in caches])
    tokens = mx.array([r + [0] * (width - len(r)) for r in rows])
    logits, features = caches[0].target(tokens, batch, lengths=lengths)
    for layer in batch:  # (the padding goes)
        layer.trim([width - n for n in lengths])
    for b, (c, n) in enumerate(zip(caches, lengths)):
        split(batch, b, c.target_cache)
        if c.draft is not None:
            c.draft.absorb(features[b : b + 1, :n], c.draft_cache)
    mx.eval(logits, [layer.state for c in caches for layer in c.draft_cache or []])
    for c, n in zip(caches, lengths):
        c.processed += n
        c.last_prefill = n
        c.broken = False
    return [logits[b] for b in range(len(caches))]
