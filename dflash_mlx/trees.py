"""Token trees: several of the drafter's guesses at each position, verified in one target pass.

A DFlash pass gives a distribution for every position of its block. The chain verifies the most likely
token at each; where that first guess is wrong the cycle ends there, even when the second guess was
right. A tree keeps the likely alternatives too:

    block index   0        1     2      3     4      5
    token         pending  the   a      cat   dog    sat
    parent        -        0     0      1     1      3        depth = 1 + the parent's depth

Nodes are chosen best-first by the product of their path's values (the drafter's probabilities, or the
policy's calibrated odds of acceptance) under a node budget: a node's value never exceeds its
parent's, so the first N chosen are a tree, and the one whose expected accepted tokens is highest.
Parents come before their children, so the flattened block is in the order the nodes were chosen.
Where prompt lookup has a match as well, its chain joins the tree as one more branch from the root
(`graft`), sharing the nodes where the drafter guessed the same: one pass verifies both sources.

The target verifies the flattened block in one pass: each node at position context + depth, seeing the
context and its own ancestors only (`TreePass` lends each layer's cache a mask that says so, and each
attention layer's rotary embedding the nodes' positions). The walk from the root follows the target's
own choice at each node (its greedy token, or its draw above temperature 0) while a child holds it:
the accepted path, and the target's choice after it, is then exactly what the target gives alone.
Afterwards the caches keep the accepted path's positions only (`Target.rollback` with `paths`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from .batching import RaggedKVCache

ALTERNATIVES = 8  # candidates per position a tree chooses from
TREE_MAX = 32  # the widest tree pass: the pending token and up to 31 nodes


@dataclass
class Tree:
    """A flattened token tree: block index 0 is the pending token, 1.. the drafted nodes."""

    tokens: list[int]  # the nodes' tokens (block indices 1..)
    parents: list[int]  # each node's parent's block index (0: the pending token)
    depths: list[int]  # each node's depth (1: a child of the pending token)
    ranks: list[int] | None = None  # each node's rank among its position's candidates (0: the first guess)
    lookup: list[int] = field(default_factory=list)  # the block indices of lookup's chain (`graft`)

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i for i, p in enumerate(self.parents))

    def first(self, n: int) -> Tree:
        """The first n nodes (a tree too: parents come first)."""
        ranks = None if self.ranks is None else self.ranks[:n]
        lookup = [i for i in self.lookup if i <= n]
        return Tree(self.tokens[:n], self.parents[:n], self.depths[:n], ranks, lookup)

    @property
    def first_guesses(self) -> bool:
        """Whether it is a chain of the drafter's first guesses, with no lookup in it (one verified as a
        chain, from which lookup would learn nothing)."""
        return self.is_chain and not any(self.ranks or []) and not self.lookup

    def paths(self) -> list[list[int]]:
        """Each block index's path: the nodes' tokens from the root to it (none for the pending token),
        what the target has seen after the context where it predicts that index's child."""
        paths = [[]]
        for token, parent in zip(self.tokens, self.parents):
            paths.append(paths[parent] + [token])
        return paths

    def ancestors(self) -> mx.array:
        """(W, W) bool, W = size + 1: block index i sees block index j (j is i or one of its ancestors)."""
        rows = [[True]]
        for p in self.parents:
            row = list(rows[p]) + [False] * (len(rows) - len(rows[p]))
            rows.append(row + [True])
        width = len(rows)
        return mx.array([r + [False] * (width - len(r)) for r in rows])


def candidates(logits: mx.array, k: int = ALTERNATIVES) -> tuple[mx.array, mx.array]:
    """The k most likely tokens at each position, best first, and their probabilities: ((n, k), (n, k))
    for drafter logits (n, vocab). Only these small arrays go to the host."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ids = mx.argpartition(-logprobs, k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    ids = mx.take_along_axis(ids, order, axis=-1).astype(mx.int32)
    return ids, mx.exp(mx.take_along_axis(values, order, axis=-1))


def build(ids: list[list[int]], values: list[list[float]], budget: int) -> tuple[Tree, list[float]]:
    """The best tree of at most `budget` nodes from per-depth candidates (ids[d][r]: the r-th choice at
    depth d + 1, values[d][r] its value): best-first by the product of the values along the path ->
    (the tree, each node's path product). Each chosen node offers its best child and its next sibling,
    so a candidate is only ever a child of a chosen node."""
    tokens, parents, depths, ranks, scores = [], [], [], [], []
    heap = (
        [(-values[0][0], 0, 0, 0, 1.0)] if ids and budget > 0 else []
    )  # (-score, depth, rank, parent, base)
    while heap and len(tokens) < budget:
        neg, d, r, parent, base = heapq.heappop(heap)
        tokens.append(ids[d][r])
        parents.append(parent)
        depths.append(d + 1)
        ranks.append(r)
        scores.append(-neg)
        node = len(tokens)  # its block index
        if d + 1 < len(ids):
            heapq.heappush(heap, (neg * values[d + 1][0], d + 1, 0, node, -neg))
        if r + 1 < len(ids[d]):
            heapq.heappush(heap, (-base * values[d][r + 1], d, r + 1, parent, base))
    return Tree(tokens, parents, depths, ranks), scores


def graft(tree: Tree, scores: list[float], chain: list[int], values: list[float]) -> tuple[Tree, list[float]]:
    """The tree joined with another source's chain of proposals from the root (lookup's, each with its
    value: the chance it is accepted) -> (the tree of both, each node's value). Where the chain's tokens
    follow the tree's nodes it shares them: a shared node holds the higher of its two values, and the
    drafter's nodes below it rise with it (their odds given it are the same). Past that the chain's
    nodes are its own (rank -1). Best first again, so `first(n)` is still the best tree of n nodes: a
    node's value never exceeds its parent's in either source, and a shallower node goes first on a tie."""
    tokens, parents, depths = list(tree.tokens), list(tree.parents), list(tree.depths)
    ranks, base = list(tree.ranks or [0] * tree.size), list(scores)
    chained, on, node = {}, [], 0  # chained: block index -> the chain's value there
    for token, value in zip(chain, values):
        child = next((i + 1 for i, (p, t) in enumerate(zip(parents, tokens)) if p == node and t == token), 0)
        if not child:
            tokens.append(token)
            parents.append(node)
            depths.append(depths[node - 1] + 1 if node else 1)
            ranks.append(-1)
            base.append(value)
            child = len(tokens)
        chained[child] = value
        on.append(child)
        node = child
    rise, values_of = {0: 1.0}, []  # rise: by how much a node's value rose (parents come first)
    for i, (parent, value, rank) in enumerate(zip(parents, base, ranks)):
        v = max(value * rise[parent] if rank >= 0 else 0.0, chained.get(i + 1, 0.0))
        if parent:  # (a certain child's value * rise can round a hair above its parent's)
            v = min(v, values_of[parent - 1])
        rise[i + 1] = v / value if value > 0 else rise[parent]
        values_of.append(v)
    order = sorted(range(len(tokens)), key=lambda i: (-values_of[i], depths[i]))
    at = {0: 0} | {i + 1: j + 1 for j, i in enumerate(order)}
    joined = Tree(
        [tokens[i] for i in order],
        [at[parents[i]] for i in order],
        [depths[i] for i in order],
        [ranks[i] for i in order],
        [at[c] for c in on],
    )
    return joined, [values_of[i] for i in order]


def walk(tree: Tree, choices: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Follow the target's choices (choices[i]: its token after block index i) from the root: -> (the
    number of nodes accepted, the target's token after the last, which block indices were accepted),
    all on the device. A node is accepted when its parent was and its token is the parent's choice."""
    tokens = mx.array([-1] + tree.tokens)
    parents = mx.array([0] + tree.parents)
    holds = tokens == choices[parents]
    accepted = mx.arange(tokens.size) == 0
    for _ in range(max(tree.depths, default=0)):
        accepted = accepted | (holds & accepted[parents])
    depths = mx.array([0] + tree.depths)
    last = mx.argmax(mx.where(accepted, depths, -1))
    return accepted.sum() - 1, choices[last], accepted


def path_of(accepted: list[bool]) -> list[int]:
    """The accepted path's block indices, root first (parents precede children)."""
    return [i for i, a in enumerate(accepted) if a]


class _TreeCache:
    """A layer's cache during a tree pass: the cache itself, except that the mask it makes is the tree's."""

    def __init__(self, cache, mask):
        self._cache, self._mask = cache, mask

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        return self._mask(n, window_size)

    def __getattr__(self, name):
        return getattr(self._cache, name)


class _TreePositions(nn.Module):
    """An attention layer's rotary embedding during a tree pass: each position of the block rotated by
    its own position (context + depth). mlx-lm's rotary embeddings take one offset per row of a batch,
    so the block's positions become rows of one token each."""

    def __init__(self, rope, positions: mx.array):
        super().__init__()
        self.inner, self.positions = rope, positions  # positions: (rows, width)

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        b, h, n, d = x.shape
        y = x.transpose(0, 2, 1, 3).reshape(b * n, h, 1, d)
        y = self.inner(y, offset=self.positions.reshape(-1))
        return y.reshape(b, n, h, d).transpose(0, 2, 1, 3)


class TreePass:
    """Lends a target's layers what a pass over flattened trees needs, for one call (see the module's
    text): `with TreePass(model, cache, trees) as lent: model(tokens, lent)`. `trees`: one per row of the
    pass (None: a plain causal block), each padded to the pass's width with causal positions.

    mlx-lm's attention layers take neither a mask nor positions from outside: they ask their cache for
    the mask and rotate by the cache's offset. So the caches are lent behind a mask of the trees, and
    each layer's rotary embedding is swapped for one that rotates by the nodes' positions, inside
    try/finally, as the target's taps are."""

    def __init__(self, layers: list, cache: list, trees: list[Tree | None], width: int):
        self.layers, self.cache = layers, cache
        c = cache[0]  # per row: where its own positions start in the buffer, and where the block goes
        starts, ends = (c.starts, c.ends) if isinstance(c, RaggedKVCache) else ([0], [c.offset])
        ancestors, depths = [], []
        for tree in trees:
            a = mx.tril(mx.ones((width, width), dtype=mx.bool_))
            d = list(range(width))
            if tree is not None:
                w = tree.size + 1
                a[:w, :w] = tree.ancestors()
                d[1:w] = tree.depths
            ancestors.append(a)
            depths.append(d)
        self.ancestors = mx.stack(ancestors)
        lengths = mx.array([e - s for s, e in zip(starts, ends)])
        self.positions = lengths[:, None] + mx.array(depths)
        self.starts, self.ends = list(starts), list(ends)

    def mask(self, n: int, window: int | None) -> mx.array:
        """(rows, 1, n, furthest end + n): block index j of row b sees its row's context and its own
        ancestors (within `window` positions, for sliding-window layers)."""
        starts = mx.array(self.starts)[:, None]
        ends = mx.array(self.ends)[:, None]
        key = mx.arange(max(self.ends) + n)[None]
        rel = key - ends  # a key's index in the row's block
        in_block = (rel >= 0) & (rel < n)
        index = mx.broadcast_to(mx.clip(rel, 0, n - 1)[:, None, :], (len(self.ends), n, key.size))
        sees = mx.where(in_block[:, None], mx.take_along_axis(self.ancestors, index, axis=2), False)
        sees = sees | ((key >= starts) & (key < ends))[:, None]
        if window is not None:
            block_pos = mx.take_along_axis(self.positions, mx.clip(rel, 0, n - 1), axis=1)
            key_pos = mx.where(in_block, block_pos, key - starts)
            sees = sees & (self.positions[:, :, None] - key_pos[:, None] < window)
        return sees[:, None]

    def __enter__(self) -> list:
        self.swapped = []
        for layer in self.layers:
            for _, m in layer.named_modules():
                rope = m.get("rope") if isinstance(m, dict) else None
                if rope is not None:
                    self.swapped.append((m, rope))
                    m.rope = _TreePositions(rope, self.positions)
        return [_TreeCache(c, self.mask) for c in self.cache]

    def __exit__(self, *exc) -> None:
        for m, rope in self.swapped:
            m.rope = rope


def gather_path(keys: mx.array, row: int, start: int, path: list[int]) -> None:
    """Move a row's accepted path (block indices `path`, from buffer index `start`) to the front of its
    block, in place, so that keeping len(path) positions keeps exactly the path."""
    index = mx.array([start + i for i in path])
    keys[row : row + 1, :, start : start + len(path), :] = keys[row : row + 1, :, index, :]
