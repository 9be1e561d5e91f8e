"""The target's cache for a batch of sequences that grow by different amounts each step.

mlx-lm's BatchKVCache advances every row by the same number of positions (right-aligned rows behind
left padding), which suits plain decoding but not a speculative step, where each row keeps as many of
its block's positions as its target accepted. `RaggedKVCache` gives each row its own span of the
buffer, `starts[b]` to `ends[b]`: rows start right-aligned behind left padding, as mlx-lm's do, so
while every row keeps the same number of positions a pass writes them all with one slice; once rows
have kept different numbers, each row's block is written at its own end. The mask lets each query see
its own row's span up to itself (and within the window, for sliding-window layers); keeping m of a
row's W new positions is setting its end. What lies past a row's end is never attended to and is
overwritten by its next block. Rotary positions are each row's length (`offset`), which mlx-lm's
attention layers already take as an array for its own batches.

`merge` lends the KV caches of several sequences to one batch (their positions copied in), and
`split` hands a row back; `align` moves rows left ragged by a speculative step back in line before a
run of plain steps. Sequences come and go while the others step on: `join` copies only the new
rows in (the buffer keeps room for a few more rows) and `leave` hands rows back and fills
their places with the batch's last rows, so a server's batch is not rebuilt whenever one answer ends.
Only plain attention caches batch: a target with recurrent layers runs its sequences one at a time.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache

STEP = 256  # positions the buffer grows by
# Positions left of every row's span that `leave` drops: each costs every pass of the batch attention
# over it, and dropping them costs one copy of the batch (figures: docs/performance.md).
UNUSED = 32


class RaggedKVCache:
    """One attention layer's keys and values for rows of their own spans (see the module's text). The
    buffer may hold more rows than the batch (room for rows that `join`): passes use the first
    len(ends)."""

    def __init__(self, keys: mx.array, values: mx.array, starts: list[int], ends: list[int]):
        self.keys, self.values = keys, values
        self.starts, self.ends = list(starts), list(ends)

    @property
    def ends(self) -> list[int]:
        return self._ends

    @ends.setter
    def ends(self, ends: list[int]) -> None:
        self._ends = ends
        self._offset = None

    @property
    def offset(self) -> mx.array:
        """Each row's next position (its length)."""
        if self._offset is None:  # (read by every attention layer's rotary embedding)
            self._offset = mx.array([e - s for s, e in zip(self.starts, self._ends)])
        return self._offset

    @offset.setter
    def offset(self, lengths) -> None:  # (Target.rollback puts back what a dropped pass changed)
        lengths = lengths.tolist() if isinstance(lengths, mx.array) else lengths
        self.ends = [s + n for s, n in zip(self.starts, lengths)]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int | list[int]) -> None:
        """Take back the last n positions of every row, or n[b] of row b."""
        ns = n if isinstance(n, list) else [n] * len(self.ends)
        self.ends = [e - k for e, k in zip(self.ends, ns)]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write each row's new positions at its end; -> the buffer up to the furthest new end (what
        lies outside a row's span is masked)."""
        width, rows = keys.shape[2], len(self.ends)
        end = max(self.ends) + width
        if self.keys is None:  # (rows with nothing processed yet: see `merge`)
            b, h, _, d = keys.shape
            size = -(-end // STEP) * STEP
            self.keys, self.values = (
                mx.zeros((b, h, size, d), keys.dtype),
                mx.zeros((b, h, size, d), keys.dtype),
            )
        if end > self.keys.shape[2]:
            grow = -(-(end - self.keys.shape[2]) // STEP) * STEP
            pad = [(0, 0), (0, 0), (0, grow), (0, 0)]
            self.keys, self.values = mx.pad(self.keys, pad), mx.pad(self.values, pad)
        first = self.ends[0]
        if all(e == first for e in self.ends):
            self.keys[:rows, :, first : first + width, :] = keys
            self.values[:rows, :, first : first + width, :] = values
        else:  # (a scatter would copy the whole buffer; row by row updates it in place)
            for b, e in enumerate(self.ends):
                self.keys[b : b + 1, :, e : e + width, :] = keys[b : b + 1]
                self.values[b : b + 1, :, e : e + width, :] = values[b : b + 1]
        self.ends = [e + width for e in self.ends]
        return self.keys[:rows, :, :end, :], self.values[:rows, :, :end, :]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """(rows, 1, n, furthest end + n): query j of row b (at buffer index ends[b] + j) sees its row's
        keys from starts[b] up to its own index (and fewer than `window_size` behind it)."""
        starts = mx.array(self.starts)[:, None, None, None]
        query = mx.array(self.ends)[:, None, None, None] + mx.arange(n)[:, None]
        key = mx.arange(max(self.ends) + n)
        mask = (key <= query) & (key >= starts)
        if window_size is not None:
            mask = mask & (key > query - window_size)
        return mask

    @property
    def state(self):
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class RowView:
    """One row of a RaggedKVCache seen as a sequence's own KV cache, for a pass over that row alone (a
    sequence whose proposals are worth a wide pass of their own: engine.py). It writes into the
    batch's buffer in place and moves the row's end."""

    def __init__(self, batch: RaggedKVCache, row: int):
        self.batch, self.row = batch, row

    @property
    def offset(self) -> int:
        return self.batch.ends[self.row] - self.batch.starts[self.row]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> None:
        self._move(-n)

    def _move(self, n: int) -> None:
        ends = list(self.batch.ends)
        ends[self.row] += n
        self.batch.ends = ends

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        c, r, width = self.batch, self.row, keys.shape[2]
        end = c.ends[r] + width
        if end > c.keys.shape[2]:
            pad = [(0, 0), (0, 0), (0, -(-(end - c.keys.shape[2]) // STEP) * STEP), (0, 0)]
            c.keys, c.values = mx.pad(c.keys, pad), mx.pad(c.values, pad)
        c.keys[r : r + 1, :, end - width : end, :] = keys
        c.values[r : r + 1, :, end - width : end, :] = values
        self._move(width)
        start = c.starts[r]
        return c.keys[r : r + 1, :, start:end, :], c.values[r : r + 1, :, start:end, :]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        """As mlx-lm's KVCache makes it over the row's own span."""
        if window_size is None and not return_array:
            return None if n == 1 else "causal"
        return create_causal_mask(n, self.offset, window_size=window_size)


def batchable(cache: list) -> bool:
    """Whether a sequence's target cache can join a batch: plain attention caches only."""
    return all(type(c) is KVCache for c in cache)


def merge(caches: list[list[KVCache]]) -> list[RaggedKVCache]:
    """One batch of the sequences' target caches (row b: caches[b]), their positions copied in,
    right-aligned (`join` to a batch of no rows). A cache with nothing processed yet joins as an empty
    row (prompts prefilled together: cache.py); while every row is empty the buffer is made by the
    first pass."""
    batch = [RaggedKVCache(None, None, [], []) for _ in caches[0]]
    join(batch, caches)
    return batch


def split(batch: list[RaggedKVCache], row: int, into: list[KVCache]) -> None:
    """Hand row `row` of the batch back to a sequence's own caches (`into`, one per layer)."""
    for c, own in zip(batch, into):
        start, end = c.starts[row], c.ends[row]
        own.keys = mx.contiguous(c.keys[row : row + 1, :, start:end, :])
        own.values = mx.contiguous(c.values[row : row + 1, :, start:end, :])
        own.offset = end - start
    mx.eval([(c.keys, c.values) for c in into])


def join(batch: list[RaggedKVCache], caches: list[list[KVCache]]) -> None:
    """Add sequences' caches (one list per sequence) to the batch as its last rows, copying only their
    positions: each new row ends where the batch's longest does (the whole batch moves right first
    for a longer one), so rows that step alike keep being written with one slice."""
    for c, layer in zip(batch, zip(*caches)):
        lengths = [own.offset if own.keys is not None else 0 for own in layer]
        shaped = next((own.keys for own in layer if own.keys is not None), c.keys)
        end = max(c.ends + lengths)
        if shaped is not None:
            _room(c, len(c.ends) + len(layer), end, shaped)
        for own, length in zip(layer, lengths):
            if length:
                row = len(c.ends)
                c.keys[row : row + 1, :, end - length : end, :] = own.keys[..., :length, :]
                c.values[row : row + 1, :, end - length : end, :] = own.values[..., :length, :]
            c.starts = c.starts + [end - length]
            c.ends = c.ends + [end]
    mx.eval([c.state for c in batch if c.keys is not None])


def _room(c: RaggedKVCache, rows: int, end: int, like: mx.array) -> None:
    """Make the buffer hold `rows` rows (room made four rows at a time) and positions up to `end`, the
    spans moved right so that the longest ends there."""
    shift = end - max(c.ends, default=end)
    c.starts, c.ends = [s + shift for s in c.starts], [e + shift for e in c.ends]
    if c.keys is None:
        _, heads, _, dims = like.shape
        size = max(-(-end // STEP) * STEP, STEP)
        c.keys, c.values = (mx.zeros((rows, heads, size, dims), like.dtype) for _ in range(2))
        return
    more = -(-rows // 4) * 4 - c.keys.shape[0] if rows > c.keys.shape[0] else 0
    if more or shift:
        pad = [(0, more), (0, 0), (shift, 0), (0, 0)]
        c.keys, c.values = mx.pad(c.keys, pad), mx.pad(c.values, pad)


def _copy(batch: list[RaggedKVCache], moves: list[list[tuple]]) -> None:
    """Copy spans within each layer's buffer: moves[i], layer i's (from row, start, end, to row, new
    start). Every span is copied out first (a slice written back in place would read a buffer that the
    write changes: see `split`)."""
    out = [
        [
            (mx.contiguous(c.keys[f : f + 1, :, s:e]), mx.contiguous(c.values[f : f + 1, :, s:e]))
            for f, s, e, *_ in m
        ]
        for c, m in zip(batch, moves)
    ]
    mx.eval(out)
    for c, m, copies in zip(batch, moves, out):
        for (_, s, e, to, new), (k, v) in zip(m, copies):
            c.keys[to : to + 1, :, new : new + e - s], c.values[to : to + 1, :, new : new + e - s] = k, v


def align(batch: list[RaggedKVCache]) -> None:
    """Move each row that ends short of the longest right, its positions copied, so that every row ends
    at the same place again: after a speculative step rows keep different numbers of positions, and
    then every later pass writes its rows one at a time and attends over the spread between them
    (measured: docs/performance.md, the server)."""
    ends = [max(c.ends, default=0) for c in batch]
    moves = [
        [(b, s, e, b, s + end - e) for b, (s, e) in enumerate(zip(c.starts, c.ends)) if e < end]
        for c, end in zip(batch, ends)
    ]
    if not any(moves):
        return
    _copy(batch, moves)
    for c, end in zip(batch, ends):
        c.starts, c.ends = [s + end - e for s, e in zip(c.starts, c.ends)], [end] * len(c.ends)
    mx.eval([c.state for c in batch])


def leave(batch: list[RaggedKVCache], gone: list[int], into: list[list[KVCache]]) -> list[int]:
    """Hand rows `gone` back (row gone[i] into the caches into[i]) and fill the places they leave
    among the rows that stay with the batch's last rows: -> the rows that stay, in their new order
    (as indices of the old). Once UNUSED positions lie left of every staying row's span, the batch is
    copied once instead, in its new order, without them (nor room for more rows)."""
    for row, own in zip(gone, into):
        split(batch, row, own)
    count = len(batch[0].ends) - len(gone)
    order = list(range(count))
    holes = [b for b in order if b in gone]
    movers = [b for b in range(count, len(batch[0].ends)) if b not in gone]
    for hole, mover in zip(holes, movers):
        order[hole] = mover
    moves = []
    for c in batch:
        unused = min((c.starts[b] for b in order), default=0)
        if c.keys is not None and unused >= UNUSED:
            index = mx.array(order)
            c.keys = mx.contiguous(c.keys[index, :, unused:, :])
            c.values = mx.contiguous(c.values[index, :, unused:, :])
            moves.append([])
        else:
            unused = 0
            spans = [(c.starts[m], c.ends[m]) for m in movers] if c.keys is not None else []
            moves.append([(m, s, e, hole, s) for hole, m, (s, e) in zip(holes, movers, spans)])
        c.starts = [c.starts[b] - unused for b in order]
        c.ends = [c.ends[b] - unused for b in order]
    _copy(batch, moves)
    mx.eval([c.state for c in batch if c.keys is not None])
    return order
