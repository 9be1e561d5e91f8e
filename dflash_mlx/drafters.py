"""What proposes tokens for the target to verify: the DFlash drafter and prompt lookup.

Proposals come with the distributions q they were drawn from, or None where they were made with
certainty (greedy drafting; prompt lookup, whose q is one-hot). The acceptance rules in sampling.py are
exact for either, so whatever proposes, the target's output is unchanged.

`NgramIndex.match` gives lookup's proposals (from the context, else from the target's phrase table,
phrases.py); `DFlashDrafter.propose` gives the drafter's, with each
position's confidence (the largest probability of the distribution it is drawn from), from which the
policy learns to predict acceptance.
"""

from __future__ import annotations

from .models.dflash import DFlashDraftModel
from .phrases import Phrases
from .trees import candidates

# Suffix lengths tried, longest first, and the most tokens one lookup proposes (see docs/policy.md): as
# many as the widest pass priced verifies, for a copy under way.
LOOKUP_NGRAMS = (4, 3, 2)
LOOKUP_MAX = 32
# The longest agreement `match` counts: how far back the text agrees with the context before a match
# tells how long the match will hold (a copy under way holds longer than a suffix just met).
AGREEMENT_MAX = 32
LOOKUP_BUCKETS = 8  # the classes `lookup_bucket` gives: 1..8
# The "suffix length" a proposal from the phrase table is reported with: the policy learns its odds apart.
PHRASES = 1
PHRASES_MAX = 8  # (a table's chain rarely holds longer; each token costs a few dict lookups)


class NgramIndex:
    """For each n in `sizes`, where each n-gram of the context last occurred, updated token by token.

    `latest[n][gram] = i` means `tokens[i - n:i] == gram` and i is the largest such index below the
    context's end, so `tokens[i:]` is what followed the gram's latest earlier occurrence. Appending a
    token costs one dict write per n; nothing rescans the context.

    A match is followed as the text goes on (`copying`: where the text written since the match was
    found goes on copying the context), and while it holds it is what `match` gives, not the latest
    occurrence of the same suffix: an answer that copies a document (an edit) finds the document's
    next line where the latest occurrence of its last few tokens is often an earlier line of its own.
    """

    def __init__(self, sizes=LOOKUP_NGRAMS, phrases: Phrases | None = None):
        self.sizes = tuple(sorted(sizes, reverse=True))
        self.phrases = phrases
        self.tokens: list[int] = []
        # The (n - 1)-grams too: whether a match can follow the next token (`possible`).
        tracked = set(self.sizes) | {n - 1 for n in self.sizes if n > 1}
        self.latest: dict[int, dict[tuple, int]] = {n: {} for n in sorted(tracked, reverse=True)}
        self.copying: int | None = None  # the index of the token a followed match copies next

    def extend(self, tokens) -> None:
        for t in tokens:
            t = int(t)
            i = len(self.tokens)  # the new token's index: the n-gram before it is followed by it
            if self.copying is not None:
                self.copying = self.copying + 1 if self.tokens[self.copying] == t else None
            for n in self.latest:
                if i >= n:
                    self.latest[n][tuple(self.tokens[i - n : i])] = i
            self.tokens.append(t)

    def copy(self) -> NgramIndex:
        """An independent index of the same tokens, sharing the (read-only) phrase table."""
        other = NgramIndex.__new__(NgramIndex)
        other.sizes, other.phrases, other.tokens = self.sizes, self.phrases, list(self.tokens)
        other.latest = {n: dict(grams) for n, grams in self.latest.items()}
        other.copying = self.copying
        return other

    def truncate(self, length: int) -> None:
        if length < len(self.tokens):
            kept = self.tokens[:length]
            self.__init__(self.sizes, self.phrases)
            self.extend(kept)

    def possible(self) -> list[int]:
        """The suffix lengths, longest first, at which the next token, whatever it is, may give a match:
        those whose last n - 1 tokens occurred before, followed by something. (Whether the phrase table
        knows what follows the next token is a chance only a policy's odds can weigh: see plain_next.)"""
        end = len(self.tokens)
        return [
            n
            for n in self.sizes
            if 1 < n <= end + 1 and tuple(self.tokens[end - n + 1 :]) in self.latest[n - 1]
        ]

    def match(self, cap: int = LOOKUP_MAX) -> tuple[list[int], int]:
        """-> (up to `cap` tokens that follow the match found earlier, while the text since has copied
        it, or that followed the latest earlier occurrence of the longest suffix that occurred before
        (the match followed from now on), and n: how many of the text's last tokens agree with those
        before the match, at least the suffix's length, at most AGREEMENT_MAX); else what the phrase
        table expects, (tokens, PHRASES); ([], 0) when neither has anything."""
        end = len(self.tokens)
        if (i := self.copying) is not None:
            for n in self.sizes:
                if i >= n and self.tokens[i - n : i] == self.tokens[end - n :]:
                    return self.tokens[i : i + cap], self._agreement(i, n)
        for n in self.sizes:
            if end >= n:
                i = self.latest[n].get(tuple(self.tokens[end - n :]))
                if i is not None:
                    self.copying = i
                    return self.tokens[i : i + cap], self._agreement(i, n)
        if self.phrases and (found := self.phrases.follow(self.tokens, min(cap, PHRASES_MAX))):
            return found, PHRASES
        return [], 0

    def _agreement(self, i: int, n: int) -> int:
        """How many tokens before index i equal the text's last ones, knowing the last n do."""
        end, most = len(self.tokens), min(i, AGREEMENT_MAX)
        while n < most and self.tokens[i - 1 - n] == self.tokens[end - 1 - n]:
            n += 1
        return n


def lookup_bucket(n: int) -> int:
    """The class 1..8 a policy learns lookup's odds by, from `match`'s n: the phrase table's (1) and each
    suffix length up to 4 apart, then agreements of 5-7, 8-15, 16-31 and 32 or more tokens."""
    return n if n <= 4 else min(n.bit_length() + 2, LOOKUP_BUCKETS)


def draft_block(k: int, block_size: int) -> int:
    """The block a drafter pass proposing k tokens runs over: the smallest power of two above k, at most
    the drafter's own block. A few sizes, each compiled once; a pass over fewer masked positions costs
    less, and the first positions' proposals barely change with the block's length."""
    return min(1 << k.bit_length(), block_size)


class DFlashDrafter:
    """The block-diffusion drafter: one parallel pass over [last, MASK * (B - 1)] after its context
    cache; only the first k positions go through the (wide) output head. `temperature`: 0 where
    proposals are accepted by matching (greedy, or an mlx-lm sampler), else the sampling temperature."""

    def __init__(self, model: DFlashDraftModel, block_size: int, compiled: bool = True, temperature=0.0):
        self.model, self.block_size, self.compiled = model, block_size, compiled
        self.temperature = temperature

    def propose(self, last: int, cache, k: int, draw):
        """-> (k proposals, their q or None, confidences): see the model's `draft`."""
        block = draft_block(k, self.block_size)
        return self.model.draft(last, cache, block, k, draw, self.temperature, self.compiled)

    def candidates(self, last: int, cache, k: int):
        """-> the most likely tokens at each of the k positions and their probabilities (trees.py)."""
        block = draft_block(k, self.block_size)
        return candidates(self.model.propose_logits(last, cache, block, self.compiled, heads=k)[0])


def from_logits(model) -> bool:
    """Whether a drafter's proposals at each position come from its logits there alone (a DFlash drafter,
    not a DFlash2 one, whose proposals depend on the ones before): the condition for drafting several
    sequences in one pass and for trees of its guesses."""
    return type(model).draft is DFlashDraftModel.draft


def propose_together(drafters: list[DFlashDrafter], lasts: list[int], caches: list, ks: list[int], draws):
    """`propose` for several sequences of one drafter in one pass where the drafter can (a plain DFlash
    drafter, its logits made by the model's own pass), else one pass each."""
    model = drafters[0].model
    if (
        len(drafters) > 1
        and from_logits(model)
        and type(model).propose_logits is DFlashDraftModel.propose_logits
    ):
        block = max(draft_block(k, d.block_size) for d, k in zip(drafters, ks))
        return model.draft_rows(lasts, caches, block, ks, draws)
    return [d.propose(last, c, k, draw) for d, last, c, k, draw in zip(drafters, lasts, caches, ks, draws)]
