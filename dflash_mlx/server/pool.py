"""Speculative caches of finished requests, kept for later requests that start with the same tokens.

A request takes the cache sharing the longest prefix with its prompt and prefills only the rest. When
the prompt goes on from all of a cache's tokens (the next turn of that conversation), the request takes
the cache itself; when it branches off earlier, it takes a copy cut back to where they part, and the
cache stays for its own conversation. A cache of a target with recurrent layers can only go back to
where its recurrent state was kept (the end of its last prompt). A cache is kept only if it holds
something the pool does not: one whose tokens a kept cache already starts with is dropped, and one that
goes on from a kept cache replaces it. Kept caches hold their target buffers at the size of their
tokens, not of the blocks they grew in, and the least recently used go when the pool holds more than
its budget of bytes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..cache import SpeculativeCache
from ..chat import common_prefix

# A cache whose tokens go on past the shared prefix by at most this many is taken rather than copied: a
# conversation's next turn renders the last answer through the template, which may end it a little
# differently than it was generated.
SAME_CONVERSATION = 16


@dataclass
class Taken:
    cache: SpeculativeCache
    reused: int  # prompt tokens the cache holds already (processed: nothing to prefill for them)


class PromptCachePool:
    def __init__(self, target, draft, max_bytes: int, draft_window: int | None = None):
        self.target, self.draft, self.max_bytes = target, draft, max_bytes
        self.draft_window = draft_window
        self.caches: list[SpeculativeCache] = []  # least recently used first
        self.hits = self.misses = self.evictions = self.duplicates = 0
        self.lock = threading.Lock()  # (the server's workers take and keep caches from their threads)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def held(self, prompt: list[int]) -> int:
        """The most of `prompt`'s first tokens a kept cache holds."""
        with self.lock:
            return max((common_prefix(cache.tokens, prompt) for cache in self.caches), default=0)

    def take(self, prompt: list[int], reuse: bool = True) -> Taken:
        """A cache to answer `prompt` with: its tokens are a prefix of the prompt, leaving at least one
        token of the prompt to prefill (`reuse` False: a new one)."""
        with self.lock:
            return self._take(prompt, reuse)

    def _take(self, prompt: list[int], reuse: bool) -> Taken:
        best, shared = None, 0
        for cache in self.caches if reuse else []:
            n = min(common_prefix(cache.tokens, prompt), len(prompt) - 1)
            if n > shared:
                best, shared = cache, n
        if best is not None:
            if len(best.tokens) - shared <= SAME_CONVERSATION:
                self.caches.remove(best)
            else:
                best = best.copy()
            if best.truncate(shared) and best.processed > 0:
                self.hits += 1
                return Taken(best, best.processed)
        self.misses += 1
        return Taken(SpeculativeCache(self.target, self.draft, self.draft_window), 0)

    def put(self, cache: SpeculativeCache) -> None:
        """Keep a request's cache, if it is consistent and holds what no kept cache holds."""
        if cache.broken or cache.in_flight or not cache.tokens or self.max_bytes <= 0:
            return  # (--cache-gb 0 keeps none: not one evicted per request)
        cache.settle()
        with self.lock:
            self._put(cache)

    def _put(self, cache: SpeculativeCache) -> None:
        n = len(cache.tokens)
        for kept in self.caches:
            if len(kept.tokens) >= n and common_prefix(kept.tokens, cache.tokens) == n:
                self.duplicates += 1  # all of it is in `kept` already, which counts as used now
                self.caches.remove(kept)
                self.caches.append(kept)
                return
        for kept in [k for k in self.caches if common_prefix(k.tokens, cache.tokens) == len(k.tokens)]:
            self.caches.remove(kept)  # it goes on from there: `cache` holds all of `kept`
        cache.compact()
        self.caches.append(cache)
        while self.caches and self.nbytes > self.max_bytes:
            self.caches.pop(0)
            self.evictions += 1
