"""The target's phrases: what it usually writes next after a few tokens, learnt from its own answers.

Prompt lookup copies from the context, so it proposes nothing where the answer says something new. Yet
a model says much the same things in many answers ("Here is", a list's markup, an import line): a
table of which token followed each 2-, 3- and 4-token context in the target's own answers (`train data`
makes them), kept where one token followed at least SHARE of the time, proposes those at no cost. Lookup
falls back to it where the context has no match, and the adaptive policy learns how well it does on
its own (docs/policy.md). The table is a file beside the drafter's weights (`phrases.npz`); proposals
are verified like any other, so a poor table costs speed, never tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import UserError
from .files import atomic_file
from .platform import signals_held

FILE = "phrases.npz"
SIZES = (4, 3, 2)  # context lengths, longest (most specific) first
SHARE, MIN_COUNT = 0.6, 3  # a context is kept if its commonest next token followed it this often
_MIX = 0x100000001B3  # FNV-1a's 64-bit prime: contexts are kept as 64-bit hashes, not token tuples
_MASK = 2**64 - 1


def _hash(gram) -> int:
    h = len(gram)
    for t in gram:
        h = ((h * _MIX) & _MASK) ^ (int(t) + 1)
    return h


def _hashes(ids: np.ndarray, n: int) -> np.ndarray:
    """`_hash` of every n tokens of `ids` ending before positions n .. len(ids) - 1, vectorised."""
    h = np.full(len(ids) - n, n, dtype=np.uint64)
    for j in range(n):
        h = (h * np.uint64(_MIX)) ^ (ids[j : len(ids) - n + j].astype(np.uint64) + np.uint64(1))
    return h


class Phrases:
    """Context hash -> the token that most often followed it; `follow` chains them."""

    def __init__(self, keys: np.ndarray, tokens: np.ndarray, tokenizer: str = ""):
        self.next = dict(zip(keys.tolist(), tokens.tolist()))
        self.tokenizer = tokenizer

    def __len__(self) -> int:
        return len(self.next)

    @classmethod
    def learn(cls, seqs: list[tuple[list[int], int]], tokenizer: str = "") -> Phrases:
        """From sequences (token ids, prompt length): each answer token, keyed by the tokens before it
        (the prompt's last ones included)."""
        keys, nexts = [], []
        for ids, prompt in seqs:
            ids = np.asarray(ids, dtype=np.int64)
            for n in SIZES:
                start = max(prompt, n)  # the first answer position with n tokens before it
                if start < len(ids):
                    keys.append(_hashes(ids[start - n :], n))
                    nexts.append(ids[start:])
        if not keys:
            return cls(np.zeros(0, np.uint64), np.zeros(0, np.int32), tokenizer)
        pairs = np.stack([np.concatenate(keys), np.concatenate(nexts).astype(np.uint64)], axis=1)
        pairs, count = np.unique(pairs, axis=0, return_counts=True)
        order = np.lexsort((-count, pairs[:, 0]))  # by context, its commonest next token first
        key, token, count = pairs[order, 0], pairs[order, 1], count[order]
        first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])  # each context's commonest
        total = np.add.reduceat(count, first)
        keep = (count[first] >= MIN_COUNT) & (count[first] >= SHARE * total)
        return cls(key[first][keep], token[first][keep].astype(np.int32), tokenizer)

    def follow(self, tokens: list[int], cap: int) -> list[int]:
        """Up to `cap` tokens the table expects after `tokens`, each from the longest context it knows."""
        context, out = list(tokens[-SIZES[0] :]), []
        while len(out) < cap:
            for n in SIZES:
                nxt = self.next.get(_hash(context[-n:])) if len(context) >= n else None
                if nxt is not None:
                    break
            if nxt is None:
                break
            out.append(nxt)
            context.append(nxt)
        return out

    def save(self, folder: str | Path) -> Path:
        dest = Path(folder) / FILE
        with signals_held(), atomic_file(dest) as tmp:  # (a stop waits for the whole file)
            with open(tmp, "wb") as f:  # (a file object: savez would add .npz to the temporary name)
                keys = np.fromiter(self.next, np.uint64, len(self.next))
                tokens = np.fromiter(self.next.values(), np.int32, len(self.next))
                np.savez_compressed(f, keys=keys, tokens=tokens, tokenizer=np.array(self.tokenizer))
        return dest

    @classmethod
    def load(cls, folder: str | Path) -> Phrases | None:
        """The table in a drafter's folder, or None if it has none."""
        path = Path(folder) / FILE
        if not path.exists():
            return None
        try:
            with np.load(path, allow_pickle=False) as d:
                keys, tokens, tokenizer = d["keys"], d["tokens"], str(d["tokenizer"])
        except Exception as e:  # (a truncated or foreign file: zipfile, KeyError, ValueError)
            raise UserError(
                f"cannot read {path}: {e} (remove it, or make it again with `dflash-mlx train phrases`)"
            ) from None
        if keys.dtype != np.uint64 or tokens.dtype != np.int32 or keys.shape != tokens.shape:
            raise UserError(f"{path} is not a phrase table: make it again with `dflash-mlx train phrases`")
        return cls(keys, tokens, tokenizer)
