"""The speculative cycle: draft a block in one parallel pass, verify it in one target pass, commit.

    prefill   target(prompt) -> first token; the tapped hidden states fill the drafter's cache
    cycle     draft : drafter([last, MASK * (B-1)] | context)   -> B-1 proposals (+ their q)
              verify: target([last, proposals])                  -> B logits + hidden states
              accept: greedy match, or rejection sampling        -> n proposals + 1 target token
              commit: roll the target's cache back to the n+1 kept positions; the drafter's cache
                      takes in their features (it never holds the block itself)
              yield the n+1 tokens (cut at EOS, a stop string or max_tokens)

Every cycle yields at least one token, and every yielded token is one the target itself would have
produced: the same tokens as plain greedy decoding at temperature 0, the same distribution above.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .cache import SpeculativeCache
from .drafters import DFlashDrafter
from .errors import UserError
from .models.dflash import DFlashDraftModel
from .models.targets import Target
from .pairing import context_room, prepare
from .policy import DFLASH, LOOKUP, PLAIN, policy_for
from .sampling import acceptance
from .settings import GenerationSettings


@dataclass
class GenerationResponse:
    """One streamed piece, field-compatible with z-lab's MLX `stream_generate`."""

    text: str  # new text since the previous response
    tokens: list[int]  # new tokens since the previous response
    accepted: int | None  # this cycle's acceptance length (proposals kept + 1, counted before a cut at
    #                          EOS or max_tokens); None for the first token
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int  # generated so far
    generation_tps: float  # tokens after the first, per second since the first (0 until there is a second)
    peak_memory: float  # GB
    finish_reason: str | None = None  # "stop" (EOS or stop string), "length", or None while running
    source: str | None = None  # what proposed this cycle's tokens: "plain", "lookup" or "dflash"
    proposed: int = 0  # how many proposals this cycle's verify pass checked
    stop: str | None = None  # the stop string that ended the text, if one did


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: str | None
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    acceptance_lengths: list[int] = field(default_factory=list)  # one per cycle
    sources: list[str] = field(default_factory=list)  # one per cycle: "plain", "lookup" or "dflash"

    @property
    def cycles(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def mean_acceptance(self) -> float:
        """tau: tokens the target accepts per verify pass (the paper's acceptance length; a last
        cycle cut at EOS or max_tokens still counts what it accepted, so tau measures the drafter)."""
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else 0.0

    @property
    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.acceptance_lengths).items()))

    @property
    def mix(self) -> dict[str, int]:
        """Cycles per source."""
        return dict(Counter(self.sources))


def encode_prompt(tokenizer: TokenizerWrapper, prompt) -> list[int]:
    """A prompt as token ids: a string tokenised as is (with BOS unless it starts with one), ids as given."""
    if isinstance(prompt, mx.array):
        return prompt.reshape(-1).tolist()
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        return tokenizer.encode(
            prompt, add_special_tokens=bos is None or not prompt.startswith(bos), verbose=False
        )  # our context check, not transformers' warning, says the limit
    return [int(t) for t in prompt]


class _NoText:
    """The detokenizer of a run without a tokenizer (token ids only)."""

    last_segment = ""

    def reset(self):
        pass

    def add_token(self, token):
        pass

    def finalize(self):
        pass


class _StopText:
    """Holds back just enough streamed text to never show the start of a stop string."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """-> (text safe to show now, the stop string hit or None)."""
        text = self.held + text
        hits = [(i, s) for i, s in ((text.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            at, stop = min(hits)
            return text[:at], stop
        keep = max((len(s) - 1 for s in self.stops), default=0)
        cut = len(text) - keep if keep else len(text)
        self.held = text[cut:]
        return text[:cut], None

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


def stream_generate(
    model: nn.Module | Target,
    draft: DFlashDraftModel | None,
    tokenizer,
    prompt: str | Sequence[int] | mx.array,
    *,
    block_size: int | None = None,
    lookup: bool = True,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    sampler: Callable[[mx.array], mx.array] | None = None,
    stop: Sequence[str] = (),
    prompt_cache: SpeculativeCache | None = None,
    prefill_step_size: int = 2048,
    draft_window: int | None = None,
    compile: bool = True,
) -> Iterator[GenerationResponse]:
    """Generate from `model` (an mlx-lm model) with DFlash drafting by `draft`, streaming.

    The prompt is a string (tokenised as is: apply a chat template first, see `apply_chat_template`),
    a list of token ids or an mx.array. With `prompt_cache` (a SpeculativeCache from an earlier call)
    the prompt holds only the new tokens. `sampler`, if given, is an mlx-lm style sampler
    (log-probabilities -> token) that replaces temperature/top-p/top-k/min-p; proposals are then
    accepted where they equal its draws.

    By default each cycle chooses among a plain step, prompt lookup and the drafter, and how many
    proposals to verify, by what pays on this machine (see policy.py); `lookup=False` leaves lookup
    out, `draft=None` the drafter. `block_size=N` pins a fixed DFlash block of N every cycle (no
    lookup); `block_size=1` is plain decoding. `draft_window=N` keeps only the drafter's latest N
    context positions, so its pass stops growing with the context (a `prompt_cache` keeps its own).
    `tokenizer=None` works on token ids alone: no text, no EOS. A stop string ends the text where it
    starts; the tokens of the cycle that hit it stay in `tokens` and in `prompt_cache`. A prompt that
    fills the target's context is an error; the answer stops ("length") where the context ends.
    """
    settings = GenerationSettings(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        max_tokens=max_tokens,
        block_size=block_size,
        lookup=lookup,
        seed=seed,
        prefill_step_size=prefill_step_size,
        draft_window=draft_window,
    )
    if tokenizer is not None and not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if tokenizer is None and isinstance(prompt, str):
        raise UserError("a string prompt needs a tokenizer")
    prompt_ids = encode_prompt(tokenizer, prompt)
    if not prompt_ids and (prompt_cache is None or not prompt_cache.pending):
        raise UserError("the prompt is empty: give at least one token")
    target = prepare(model, draft)
    if prompt_cache is not None and (
        prompt_cache.target.model is not target.model or prompt_cache.draft is not draft
    ):
        raise UserError("prompt_cache was made for another model pair")
    if prompt_cache is not None and draft_window not in (None, prompt_cache.draft_window):
        raise UserError(
            f"prompt_cache keeps a draft window of {prompt_cache.draft_window}, not {draft_window}"
        )
    if prompt_cache is not None and prompt_cache.broken:
        raise UserError(
            "this prompt_cache was left half-updated by an interrupted call: make a new "
            "SpeculativeCache (the prompt then holds the whole conversation again)"
        )
    kept = len(prompt_cache.tokens) if prompt_cache is not None else 0
    max_tokens = min(max_tokens, context_room(target, kept + len(prompt_ids), kept))
    if max_tokens == 0:
        if prompt_cache is not None:  # nothing to generate, but the conversation keeps the prompt
            prompt_cache.add(prompt_ids)
        return
    if settings.seed is not None:
        mx.random.seed(settings.seed)
    draw, accept = acceptance(settings, sampler)
    cache = prompt_cache or SpeculativeCache(target, draft, draft_window)
    matched = sampler is not None or settings.greedy  # proposals accepted where they equal the target's
    policy = policy_for(
        target,
        draft,
        block_size=block_size,
        lookup=lookup,
        draft_window=cache.draft_window,
        sampled=not matched,
        fresh=seed is not None,
    )
    q_temperature = 0.0 if matched else settings.temperature
    dflash = (
        DFlashDrafter(draft, block_size or draft.block_size, compile, q_temperature)
        if draft is not None
        else None
    )
    pick = (
        (lambda logits: sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True)))
        if sampler is not None
        else settings.sample
    )
    eos = set(tokenizer.eos_token_ids) if tokenizer is not None else set()
    detok = tokenizer.detokenizer if tokenizer is not None else _NoText()
    detok.reset()
    stops = _StopText(stop)

    tic = time.perf_counter()
    logits = cache.prefill(prompt_ids, prefill_step_size)
    first = int(pick(logits).item())
    prompt_tps = cache.last_prefill / (time.perf_counter() - tic)  # with a kept cache's pending tokens
    tic = time.perf_counter()
    produced = 0

    def respond(
        new: list[int],
        accepted: int | None,
        finish: str | None,
        source: str | None = None,
        proposed: int = 0,
    ) -> GenerationResponse:
        """Turn committed tokens into a response: text (EOS not shown), stop strings, stats."""
        nonlocal produced
        produced += len(new)
        for t in new:
            if t not in eos:
                detok.add_token(t)
        if finish is not None:
            detok.finalize()
        text, hit = stops.feed(detok.last_segment)
        if hit is not None:
            finish = "stop"
        elif finish is not None:
            text += stops.flush()
        elapsed = time.perf_counter() - tic
        return GenerationResponse(
            text,
            new,
            accepted,
            len(prompt_ids),
            prompt_tps,
            produced,
            (produced - 1) / max(elapsed, 1e-9),
            mx.get_peak_memory() / 1e9,
            finish,
            source,
            proposed,
            hit,
        )

    def finish_reason(new: list[int]) -> tuple[list[int], str | None]:
        """Cut new tokens at max_tokens, then after an EOS (an EOS past the limit is never reached)."""
        room = max_tokens - produced
        new = new[:room]
        for i, t in enumerate(new):
            if t in eos:
                return new[: i + 1], "stop"
        return new, ("length" if len(new) == room else None)

    def launch(ready, started: bool):
        """Choose the next cycle and start it -> (choice, proposals, confidences, lookup's match, features,
        accepted count, next token), the last three still being computed. `ready`: a plain step built
        already on the pending token (`started` already), run if the choice is a plain step."""
        if ready is None:
            policy.measure(cache)  # (only past the contexts its costs were measured at)
        last, context = cache.pending[-1], len(cache.tokens)
        found = cache.index.match() if lookup and block_size is None and not started else ([], 0)
        choice = policy.choose(context, found, ready is not None)
        x, q, confidence = mx.array([], dtype=mx.int32), None, []
        if ready is not None:
            if choice.source == PLAIN:
                if not started:
                    cache.launch(*ready)
                return choice, x, confidence, found, ready[0], mx.array(0), ready[1]
            cache.cancel()
        if choice.source == DFLASH:
            x, q, confidence = dflash.propose(last, cache.draft_cache, choice.k, draw)
            k, confidence = policy.narrow(choice, confidence, context)
            x, q = x[:k], None if q is None else q[:k]
        elif choice.source == LOOKUP:
            x = mx.array(found[0][: choice.k], dtype=mx.int32)  # q None: proposed with certainty
        logits, features = cache.verify(mx.concatenate([mx.array([last]), x])[None])
        n, nxt = accept(x, q, logits[0]) if x.size else (mx.array(0), pick(logits[0])[0])
        mx.async_eval(n, nxt)
        return choice, x, confidence, found, features, n, nxt

    def plain_step(token: mx.array):
        """Build (not run) a plain step on a token not yet computed -> (features, next token)."""
        logits, features = cache.verify(token.reshape(1, 1), unrun=True)
        return features, pick(logits[0])[0]

    new, finish = finish_reason([first])
    cache.add([first])
    response = respond(new, None, finish)
    yield response
    cycle = launch(None, False) if finish is None else None
    try:
        # The next cycle starts before this one's tokens are handed out, and a plain step's successor is
        # built while it runs (and started, if the policy is sure of it), so that Python's work overlaps
        # the models', as in plain decoding.
        while cycle is not None:
            choice, x, confidence, found, features, n, nxt = cycle
            k, ready, started = x.size, None, False
            if not k and produced + 1 < max_tokens:
                cache.keep(features, 1)
                ready = plain_step(nxt)
                if policy.plain_next(len(cache.tokens) + 1, cache.index):
                    cache.launch(*ready)
                    started = True
            mx.eval(n, nxt, x)
            n, tokens = n.item(), x.tolist()
            policy.observe(choice, k, n, confidence, found[1])
            new, finish = finish_reason(tokens[:n] + [nxt.item()])
            if ready is None:
                cache.commit(features, new)
            else:
                cache.add(new)
            cycle = launch(ready, started) if finish is None else None
            if ready is not None and cycle is None:
                cache.cancel()
            response = respond(new, n + 1, finish, choice.source if k else PLAIN, k)
            if response.finish_reason is not None and cycle is not None:  # a stop string ended it
                cache.cancel()
                cycle = None
            yield response
    except GeneratorExit:  # the caller stopped between two cycles: the cache goes on from there
        if cycle is not None:
            cache.cancel()
        raise


def generate(model, draft, tokenizer, prompt, *, verbose: bool = False, **kwargs) -> GenerationResult:
    """Run `stream_generate` to the end; return the text, tokens and acceptance statistics."""
    text, tokens, acc, sources, last = [], [], [], [], None
    for last in stream_generate(model, draft, tokenizer, prompt, **kwargs):
        if verbose:
            print(last.text, end="", flush=True)
        text.append(last.text)
        tokens.extend(last.tokens)
        if last.accepted is not None:
            acc.append(last.accepted)
            sources.append(last.source)
    if verbose:
        print()
    if last is None:  # max_tokens=0: nothing generated, the prompt still counted
        return GenerationResult(
            "", [], "length", len(encode_prompt(tokenizer, prompt)), 0.0, 0, 0.0, mx.get_peak_memory() / 1e9
        )
    return GenerationResult(
        "".join(text),
        tokens,
        last.finish_reason,
        last.prompt_tokens,
        last.prompt_tps,
        last.generation_tokens,
        last.generation_tps,
        last.peak_memory,
        acc,
        sources,
    )
