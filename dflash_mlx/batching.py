"""The target's cache for a batch of sequences that grow by different amounts each step.

mlx-lm's BatchKVCache advances every row by the same number of positions (right-aligned rows behind
left padding), which suits plain decoding but not a speculative step, where each row keeps as many of
its block's positions as its target accepted. `RaggedKVCache` keeps each row left-aligned at its own
length instead: a pass writes each row's block at that row's length, the mask lets each query see its
own row's positions up to itself (and within the window, for sliding-window layers), and keeping m of
a row's W new positions is setting its length. What lies past a row's length is never attended to and
is overwritten by its next block. Rotary positions come from the per-row lengths (`offset`), which
mlx-lm's attention layers already take as an array for its own batches.

`merge` lends the KV caches of several sequences to one batch (their rows copied in), and `split`
hands a row back. Only plain attention caches batch: a target with recurrent layers runs its
sequences one at a time.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

STEP = 256  # positions a row's buffer grows by


class RaggedKVCache:
    """One attention layer's keys and values for rows of their own lengths (see the module's text)."""

    def __init__(self, keys: mx.array, values: mx.array, lengths: list[int]):
        self.keys, self.values, self.lengths = keys, values, list(lengths)

    @property
    def offset(self) -> mx.array:
        """Each row's next position (its length)."""
        return mx.array(self.lengths)

    @offset.setter
    def offset(self, lengths) -> None:  # (Target.rollback puts back what a dropped pass changed)
        self.lengths = lengths.tolist() if isinstance(lengths, mx.array) else list(lengths)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int | list[int]) -> None:
        """Take back the last n positions of every row, or n[b] of row b."""
        ns = n if isinstance(n, list) else [n] * len(self.lengths)
        self.lengths = [length - k for length, k in zip(self.lengths, ns)]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write each row's new positions at its length; -> every row's keys and values up to the
        longest row's new end (a row's own positions past its length are masked)."""
        width = keys.shape[2]
        end = max(self.lengths) + width
        if end > self.keys.shape[2]:
            grow = -(-(end - self.keys.shape[2]) // STEP) * STEP
            pad = [(0, 0), (0, 0), (0, grow), (0, 0)]
            self.keys, self.values = mx.pad(self.keys, pad), mx.pad(self.values, pad)
        first = self.lengths[0]
        if all(length == first for length in self.lengths):
            self.keys[..., first : first + width, :] = keys
            self.values[..., first : first + width, :] = values
        else:
            at = (mx.array(self.lengths)[:, None] + mx.arange(width))[:, None, :, None]
            self.keys = mx.put_along_axis(self.keys, at, keys, axis=2)
            self.values = mx.put_along_axis(self.values, at, values, axis=2)
        self.lengths = [length + width for length in self.lengths]
        return self.keys[..., :end, :], self.values[..., :end, :]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """(rows, 1, n, longest + n): query j of row b (at position lengths[b] + j) sees its row's keys at
        positions up to its own (and fewer than `window_size` behind it)."""
        lengths = mx.array(self.lengths)[:, None, None, None]
        query = lengths + mx.arange(n)[:, None]
        key = mx.arange(max(self.lengths) + n)
        mask = key <= query
        if window_size is not None:
            mask = mask & (key > query - window_size)
        return mask

    @property
    def state(self):
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


def batchable(cache: list) -> bool:
    """Whether a sequence's target cache can join a batch: plain attention caches only."""
    return all(type(c) is KVCache for c in cache)


def merge(caches: list[list[KVCache]]) -> list[RaggedKVCache]:
    """One batch of the sequences' target caches (row b: caches[b]), their positions copied in."""
    out = []
    for layer in zip(*caches):
        lengths = [c.offset for c in layer]
        size = -(-max(max(lengths), 1) // STEP) * STEP
        if any(c.keys is None for c in layer):
            raise ValueError("a sequence joins a batch with its prompt processed")
        rows_k, rows_v = [], []
        for c, length in zip(layer, lengths):
            pad = [(0, 0), (0, 0), (0, size - length), (0, 0)]
            rows_k.append(mx.pad(c.keys[..., :length, :], pad))
            rows_v.append(mx.pad(c.values[..., :length, :], pad))
        out.append(RaggedKVCache(mx.concatenate(rows_k), mx.concatenate(rows_v), lengths))
    mx.eval([c.state for c in out])
    return out


def split(batch: list[RaggedKVCache], row: int, into: list[KVCache]) -> None:
    """Hand row `row` of the batch back to a sequence's own caches (`into`, one per layer)."""
    for c, own in zip(batch, into):
        length = c.lengths[row]
        own.keys = mx.contiguous(c.keys[row : row + 1, :, :length, :])
        own.values = mx.contiguous(c.values[row : row + 1, :, :length, :])
        own.offset = length
    mx.eval([(c.keys, c.values) for c in into])
