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

import collections.abc as abc
import inspect
import numbers
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer, TokenizerWrapper

from .cache import SpeculativeCache
from .engine import Engine, Sequence
from .errors import UserError, unpaired_surrogate
from .models.dflash import DFlashDraftModel
from .models.targets import Target
from .pairing import context_room, prepare
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
    source: str | None = None  # what proposed this cycle's tokens: "plain", "lookup", "dflash" or "tree"
    proposed: int = 0  # how many proposals this cycle's verify pass checked (a tree's nodes)
    stop: str | None = None  # the stop string that ended the text, if one did
    # with `logprobs`: each token's log-probability, and the most likely at its position as (id, value)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


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
    sources: list[str] = field(default_factory=list)  # one per cycle: "plain", "lookup", "dflash" or "tree"
    logprobs: list[float] | None = None  # with `logprobs`: as GenerationResponse's, for every token
    top_logprobs: list[list[tuple[int, float]]] | None = None

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
    def mix(self) -> dict[str, int]:
        """Cycles per source."""
        return dict(Counter(self.sources))


def encode_prompt(tokenizer: TokenizerWrapper, prompt) -> list[int]:
    """A prompt as token ids: a string tokenised as is (with BOS unless it starts with one), ids as given."""
    if isinstance(prompt, str):
        if (at := unpaired_surrogate(prompt)) is not None:  # (the tokenizer's own error is a TypeError)
            raise UserError(
                f"an unpaired UTF-16 surrogate ({prompt[at]!r}) in the prompt is not text: remove it"
            )
        bos = tokenizer.bos_token
        return tokenizer.encode(
            prompt, add_special_tokens=bos is None or not prompt.startswith(bos), verbose=False
        )  # our context check, not transformers' warning, says the limit
    if isinstance(prompt, (mx.array, np.ndarray)):
        if prompt.ndim not in (1, 2) or (prompt.ndim == 2 and prompt.shape[0] != 1):
            raise UserError(
                f"one prompt at a time: token ids of shape (n,) or (1, n), got {tuple(prompt.shape)}"
            )
        prompt = prompt.reshape(-1).tolist()  # (floats stay floats, and are refused below)
    if isinstance(prompt, abc.Iterable) and not isinstance(prompt, (bytes, bytearray)):
        ids = list(prompt)
        if all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
            return [int(t) for t in ids]
    raise UserError("the prompt must be a string, or token ids: a list of ints or an integer array")


class _NoText:
    """The detokenizer of a run without a tokenizer (token ids only)."""

    last_segment = ""

    def reset(self):
        pass

    def add_token(self, token):
        pass

    def finalize(self):
        pass


class StopText:
    """Holds back just enough streamed text to never show the start of a stop string."""

    def __init__(self, stops: abc.Sequence[str]):
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
        cut = len(text) - max((self._started(text, s) for s in self.stops), default=0)
        self.held = text[cut:]
        return text[:cut], None

    @staticmethod
    def _started(text: str, stop: str) -> int:
        """How many of the text's last characters begin `stop` (held back: only those could be its start)."""
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                return k
        return 0

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


# What an answer asks of MLX runs in one thread at a time: a pass lends the shared model's layers taps
# (and a tree's mask and positions) while its graph is built, and MLX takes calls from one thread at a
# time (two evaluating at once can deadlock inside it). Answers generated in threads at once crashed,
# took each other's features or hung; now their steps take turns (not held between pieces: a caller
# that stops taking pieces holds up no one). The server needs none: its one generation thread runs all
# its answers.
_MLX_CALLS = threading.RLock()
_THREAD = threading.local()  # of a thread other than the main one that ran an answer: `_StreamsCleared`


class _StreamsCleared:
    """Held by a thread that ran an answer, and dropped in that thread as it ends: MLX keeps streams for
    each thread, which `mx.clear_streams()` must end in their thread, else the process can abort as it
    exits ("terminate called without an active exception")."""

    def __del__(self):
        mx.clear_streams()


def stream_generate(
    model: nn.Module | Target,
    draft: DFlashDraftModel | None,
    tokenizer,
    prompt: str | abc.Sequence[int] | mx.array,
    *,
    block_size: int | None = None,
    tree: int | None = None,
    lookup: bool = True,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    sampler: Callable[[mx.array], mx.array] | None = None,
    stop: abc.Sequence[str] | str | None = (),
    prompt_cache: SpeculativeCache | None = None,
    prefill_step_size: int | None = None,
    draft_window: int | None = None,
    repetition_penalty: float | None = None,
    repetition_context_size: int = 20,
    presence_penalty: float = 0.0,
    presence_context_size: int = 20,
    frequency_penalty: float = 0.0,
    frequency_context_size: int = 20,
    logit_bias: dict[int, float] | None = None,
    logprobs: int | None = None,
    logits_processors: abc.Sequence[Callable[[mx.array, mx.array], mx.array]] | None = None,
    compile: bool = True,
    continues: bool = False,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
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
    lookup); `block_size=1` is plain decoding; `tree=N` verifies a tree of the drafter's guesses
    in a pass of N every cycle (see trees.py; the adaptive policy builds trees where they pay).
    `draft_window=N` keeps only the drafter's latest N context positions, so its pass stops growing
    with the context (a `prompt_cache` keeps its own).
    The penalties and `logit_bias` are mlx-lm's (`make_logits_processors`), and `logits_processors`
    takes more of its kind ((tokens, logits) -> logits): applied to the target's logits at every
    position, each seeing the tokens before that position (the prompt's too), so the answer is the one
    plain decoding with them gives; the drafter's proposals are only accepted less often.
    `logprobs=N` gives each token's log-probability (`GenerationResponse.logprobs`, of the target's
    processed logits before sampling's temperature and filters, as mlx-lm gives them) and the N (0 to
    20) most likely tokens at its position (`top_logprobs`).
    `continues=True` says the answer's text goes on from the prompt's (a completion of raw text): its
    first piece keeps the space that joins them, which mlx-lm's detokenizers drop; an empty prompt
    with a `prompt_cache` goes on from the last answer, and always keeps it.
    `prompt_progress_callback(done, total)`, as mlx-lm's, is called as the prompt is read (before the
    prefill's first chunk and after each: tokens processed, of those to process).
    `tokenizer=None` works on token ids alone: no text, no EOS. A stop string ends the text where it
    starts; `tokens` (and `prompt_cache`'s) end with the token that completes it. A prompt that
    fills the target's context is an error; the answer stops ("length") where the context ends.
    """
    settings = GenerationSettings(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        max_tokens=max_tokens,
        block_size=block_size,
        tree=tree,
        lookup=lookup,
        seed=seed,
        prefill_step_size=prefill_step_size,
        draft_window=draft_window,
        repetition_penalty=repetition_penalty,
        repetition_context_size=repetition_context_size,
        presence_penalty=presence_penalty,
        presence_context_size=presence_context_size,
        frequency_penalty=frequency_penalty,
        frequency_context_size=frequency_context_size,
        logit_bias=logit_bias,
        logprobs=logprobs,
    )
    processors = [] if logits_processors is None else logits_processors
    processors = list(processors) if isinstance(processors, abc.Iterable) else [processors]
    if not all(callable(p) and _takes(p, 2) for p in processors):
        raise UserError(
            "logits_processors must be a list of functions (tokens, logits) -> logits, "
            f"e.g. mlx_lm.sample_utils.make_logits_processors(...), got {logits_processors!r}"
        )
    if prompt_progress_callback is not None and not (
        callable(prompt_progress_callback) and _takes(prompt_progress_callback, 2)
    ):
        raise UserError(
            f"prompt_progress_callback must be a function (done, total), got {prompt_progress_callback!r}"
        )
    if sampler is not None and not (callable(sampler) and _takes(sampler, 1)):
        raise UserError(
            f"sampler must be a function of log-probabilities, e.g. mlx_lm.sample_utils.make_sampler(...), "
            f"got {sampler!r}"
        )
    if sampler is not None and (temperature, top_p, top_k, min_p) != (0.0, 1.0, 0, 0.0):
        raise UserError(  # (they would be ignored)
            "a sampler replaces temperature, top_p, top_k and min_p: give the sampler those settings "
            "(mlx_lm.sample_utils.make_sampler) and leave them out here"
        )
    for name, value in (("compile", compile), ("continues", continues)):
        if not isinstance(value, (bool, np.bool_)):
            raise UserError(f"{name} must be True or False, got {value!r}")
    if tokenizer is not None and not hasattr(tokenizer, "decode"):
        raise UserError(
            f"tokenizer must be the target's tokenizer (load_pair's third), got {type(tokenizer).__name__}"
        )
    if tokenizer is not None and not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if tokenizer is None and isinstance(prompt, str):
        raise UserError("a string prompt needs a tokenizer")
    target = prepare(model, draft)  # (models swapped, or not models: said before reading the prompt)
    prompt_ids = encode_prompt(tokenizer, prompt)
    if prompt_cache is not None and not isinstance(prompt_cache, SpeculativeCache):
        raise UserError("prompt_cache must be a SpeculativeCache (SpeculativeCache(model, draft))")
    if prompt_cache is not None and prompt_cache.in_use:
        raise UserError(
            "this prompt_cache is in use by an answer that has not finished (a stream_generate "
            "generator left after a break): close that generator first (.close()), or let it finish"
        )
    if prompt_cache is not None and prompt_cache.broken:
        raise UserError(
            "this prompt_cache was left half-updated (by an interrupted call, or a stop string it "
            "could not go back to): make a new "
            "SpeculativeCache (the prompt then holds the whole conversation again)"
        )
    if not prompt_ids and (prompt_cache is None or not prompt_cache.pending):
        raise UserError("the prompt is empty: give at least one token")
    if prompt_ids and not 0 <= min(prompt_ids) <= max(prompt_ids) < target.vocab_size:
        raise UserError(f"prompt token ids must be in 0..{target.vocab_size - 1}")
    if stop is None or isinstance(stop, str):  # (one stop string, not its characters; or none)
        stops = [stop] if stop else []
    else:  # (read once: a generator too)
        stops = list(stop) if isinstance(stop, abc.Iterable) else [stop]
    if not all(isinstance(s, str) for s in stops):
        raise UserError(f"stop must be a string or a list of strings, got {stop!r}")
    if stops and tokenizer is None:  # (without one there is no text to find them in)
        raise UserError("stop strings are found in the answer's text: give a tokenizer, or leave stop out")
    if block_size is not None and block_size > 1 and draft is None:
        raise UserError("block_size drafts a block: give a drafter (draft), or leave block_size out")
    if prompt_cache is not None and (
        prompt_cache.target.model is not target.model or prompt_cache.draft is not draft
    ):
        raise UserError("prompt_cache was made for another model pair")
    if prompt_cache is not None and draft_window not in (None, prompt_cache.draft_window):
        raise UserError(
            f"prompt_cache keeps a draft window of {prompt_cache.draft_window}, not {draft_window}"
        )
    kept = len(prompt_cache.tokens) if prompt_cache is not None else 0
    max_tokens = min(max_tokens, context_room(target, kept + len(prompt_ids), kept))
    if max_tokens == 0:
        if prompt_cache is not None:  # nothing to generate, but the conversation keeps the prompt
            prompt_cache.add(prompt_ids)
        return
    history = prompt_ids or (prompt_cache.tokens if prompt_cache is not None else [])
    joins = history[-1] if history and (continues or not prompt_ids) else None
    answer = Answer(tokenizer, stops, len(prompt_ids), joins)
    if threading.current_thread() is not threading.main_thread() and not hasattr(_THREAD, "streams"):
        _THREAD.streams = _StreamsCleared()
    with _MLX_CALLS:  # (a first answer measures the pair's costs too)
        if settings.seed is not None:
            mx.random.seed(settings.seed)
        cache = prompt_cache or SpeculativeCache(target, draft, draft_window)
    # The cache is this answer's until its generator ends, is closed or is gone (one left suspended
    # after a `break` holds it: the next call is told to close it rather than find a pass under way).
    cache.in_use = True
    try:
        with _MLX_CALLS:
            eos = frozenset(tokenizer.eos_token_ids) if tokenizer is not None else frozenset()
            seq = Sequence(cache, settings, max_tokens, eos, sampler, compile, processors=processors)
            tic = time.perf_counter()
            first = seq.start(prompt_ids, prompt_progress_callback)
            # (with a kept cache's pending token)
            answer.prompt_tps = cache.last_prefill / (time.perf_counter() - tic)
            response = answer.respond(first, None, seq.finish, scores=seq.scores)
        if response.finish_reason is not None:
            yield response
            return
        engine = Engine(target, draft)
        with _MLX_CALLS:
            engine.add(seq)
            engine.launch()
        try:
            # The next step starts before this one's tokens are handed out (see engine.py), the first
            # token's too, as mlx-lm's loop starts its second step before handing out its first.
            yield response
            while True:
                with _MLX_CALLS:
                    (r,) = engine.collect()
                    if seq.finish is None:
                        engine.launch()
                    response = answer.respond(
                        r.tokens, r.accepted, seq.finish, r.source, r.proposed, r.scores
                    )
                    if response.stop is not None:
                        # a stop string ended it (perhaps in the step that also reached max_tokens or an
                        # EOS): the step under way is taken back, and the tokens committed after the
                        # stop's, so that a kept cache goes on from it
                        engine.remove(seq)
                        # (the stop's token is left pending, as an answer leaves its last, so that an
                        # empty prompt can go on from it)
                        end = len(cache.tokens) - len(r.tokens) + len(response.tokens)
                        last = cache.tokens[end - 1]
                        if cache.truncate(end - 1):
                            cache.add([last])
                        else:
                            cache.broken = True  # (it cannot: the next call says to start a new cache)
                yield response
                if response.finish_reason is not None:
                    return
        except GeneratorExit:  # the caller stopped between two steps: the cache goes on from there
            with _MLX_CALLS:
                engine.remove(seq)
            raise
    finally:
        cache.in_use = False


def _takes(function: Callable, n: int) -> bool:
    """Whether `function` can be called with n arguments (True where Python cannot tell, as for some
    built-in functions)."""
    try:
        inspect.signature(function).bind(*[None] * n)
    except TypeError:
        return False
    except ValueError:
        return True
    return True


class Answer:
    """One answer's tokens as GenerationResponses: text (EOS not shown, held back where a stop string
    may start), the stop string that ended it, and speeds."""

    def __init__(self, tokenizer, stop: abc.Sequence[str], prompt_tokens: int, joins: int | None = None):
        """`joins`: the prompt's last token, where the answer's text continues the prompt's (a completion,
        a reply going on from its assistant message) and so keeps the space that joins them, which
        mlx-lm's streaming detokenizers drop from the start of a text."""
        self.tokenizer = tokenizer
        self.eos = set(tokenizer.eos_token_ids) if tokenizer is not None else set()
        self.joins = joins
        self.detok = self._detokenizer()
        self.stops = StopText(stop)
        self.prompt_tokens, self.prompt_tps = prompt_tokens, 0.0
        self.produced = 0
        self.tokens: list[int] = []  # the answer's tokens so far, EOS left out
        self.tic = None  # when the first token was handed out

    def _detokenizer(self):
        if self.tokenizer is None:
            return _NoText()
        detok = self.tokenizer.detokenizer
        detok.reset()
        if self.joins is not None:
            detok.add_token(self.joins)
            if not isinstance(detok, NaiveStreamingDetokenizer):  # (it decodes its tokens together)
                detok.finalize()
            _ = detok.last_segment  # (read: the prompt's text is not the answer's)
        return detok

    def respond(
        self,
        new: list[int],
        accepted: int | None,
        finish: str | None,
        source: str | None = None,
        proposed: int = 0,
        scores: list | None = None,
    ) -> GenerationResponse:
        self.tic = self.tic or time.perf_counter()
        # Stop strings are looked for token by token, as in plain decoding: of two that overlap, the one
        # whose last token comes first ends the answer, however many tokens this cycle brought.
        pieces, hit = [], None
        for i, t in enumerate(new or [None]):
            if t is not None and t not in self.eos:
                self.detok.add_token(t)
                self.tokens.append(t)
            if finish is not None and i == max(len(new) - 1, 0):
                self.detok.finalize()
            piece, hit = self.stops.feed(self.detok.last_segment)
            pieces.append(piece)
            if hit is not None:
                finish, new = "stop", new[: i + 1]
                break
        text = "".join(pieces)
        if hit is None and finish is not None:
            text += self.stops.flush()
        self.produced += len(new)
        elapsed = time.perf_counter() - self.tic
        return GenerationResponse(
            text,
            new,
            accepted,
            self.prompt_tokens,
            self.prompt_tps,
            self.produced,
            (self.produced - 1) / max(elapsed, 1e-9),
            mx.get_peak_memory() / 1e9,
            finish,
            source,
            proposed,
            hit,
            None if scores is None else [c for c, _ in scores[: len(new)]],
            None if scores is None else [top for _, top in scores[: len(new)]],
        )


def generate(model, draft, tokenizer, prompt, *, verbose: bool = False, **kwargs) -> GenerationResult:
    """Run `stream_generate` to the end; return the text, tokens and acceptance statistics."""
    try:  # (a misspelt argument is named as this function's, not stream_generate's)
        inspect.signature(stream_generate).bind(model, draft, tokenizer, prompt, **kwargs)
    except TypeError as e:
        raise TypeError(f"generate() {e}") from None
    if not isinstance(verbose, (bool, np.bool_)):
        raise UserError(f"verbose must be True or False, got {verbose!r}")
    if isinstance(prompt, abc.Iterator):  # (read once here: max_tokens=0 counts its tokens after)
        prompt = list(prompt)
    text, tokens, acc, sources, last = [], [], [], [], None
    logprobs, top = (None, None) if kwargs.get("logprobs") is None else ([], [])
    for last in stream_generate(model, draft, tokenizer, prompt, **kwargs):
        if verbose:
            print(last.text, end="", flush=True)
        text.append(last.text)
        tokens.extend(last.tokens)
        if logprobs is not None:
            logprobs += last.logprobs
            top += last.top_logprobs
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
        logprobs,
        top,
    )
