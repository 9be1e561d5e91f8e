"""Sampling distributions and the two acceptance rules of speculative decoding.

The distribution we sample from is exactly the one mlx-lm's `make_sampler` draws from (its own
top-p, min-p and top-k filters on the log-probabilities, then temperature), so a temperature > 0
run follows the same distribution as plain `mlx_lm.generate` with the same settings.

Both rules take a verify pass over `[last, x_1 .. x_{B-1}]` and return (n, next): the number n of
proposals accepted and the token the target contributes after them. Everything stays on the device
until the caller reads the two numbers, so a cycle synchronises once.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass, fields

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from .errors import UserError

# Below this temperature sampling is greedy decoding, as vLLM does: the two differ only where the top two
# logits are within about 1e-4, and 1/temperature overflows float32 long before zero.
MIN_TEMPERATURE = 1e-5
# Past this 1/temperature underflows float32, and -inf (a filtered token) times zero is NaN.
MAX_TEMPERATURE = 1e4
# A top_p at or below 1/vocabulary keeps the most likely token alone whatever its value, so raising a
# smaller one to this floor changes no distribution; below it top_p times the total mass underflows
# float32 in mlx-lm's nucleus filter.
MIN_TOP_P = 1e-8


def _check_types(settings) -> None:
    """Each numeric or boolean field of a settings dataclass holds a value of its annotated kind (or None
    where the annotation allows it): a string or None where a number goes is refused by name, not deep
    inside. NumPy's numbers and booleans are taken, as the Python ones they stand for."""
    for f in fields(settings):
        value, kind = getattr(settings, f.name), str(f.type).split(" ")[0]
        if kind not in ("int", "float", "bool") or (value is None and "None" in str(f.type)):
            continue
        if kind == "bool":
            if not isinstance(value, (bool, np.bool_)):
                raise UserError(f"{f.name} must be True or False, got {value!r}")
            object.__setattr__(settings, f.name, bool(value))
            continue
        number = numbers.Integral if kind == "int" else numbers.Real
        if not isinstance(value, number) or isinstance(value, (bool, np.bool_)):
            raise UserError(
                f"{f.name} must be {'a whole number' if kind == 'int' else 'a number'}, got {value!r}"
            )
        object.__setattr__(settings, f.name, int(value) if kind == "int" else float(value))


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings, checked, and normalised where the math needs it: a temperature below
    MIN_TEMPERATURE becomes 0 (greedy), a top_p below MIN_TOP_P becomes MIN_TOP_P (the same
    distribution)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self):
        _check_types(self)
        if not 0 <= self.temperature <= MAX_TEMPERATURE:  # (NaN fails this too)
            raise UserError(
                f"temperature must be a number from 0 to {MAX_TEMPERATURE:g}, got {self.temperature}"
            )
        if not 0 <= self.top_p <= 1:  # (0, as OpenAI's API takes it: the most likely token alone)
            raise UserError(f"top_p must be from 0 to 1, got {self.top_p}")
        if self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        object.__setattr__(self, "top_p", max(self.top_p, MIN_TOP_P))
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise UserError(f"min_p must be from 0 to 1, got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def sampling_logprobs(self, logits: mx.array) -> mx.array:
        """Log-probabilities (float32) of the distribution plain sampling draws each token from. As in
        mlx-lm, the log-softmax, the filters and the temperature are computed in the logits' own dtype
        (in bfloat16 that decides which tokens sit on a filter's threshold); its categorical draw then
        reads them in float32."""
        x = self.scaled(logits)
        return x - mx.logsumexp(x, axis=-1, keepdims=True)

    def scaled(self, logits: mx.array) -> mx.array:
        """`sampling_logprobs` before their last normalisation: all a categorical draw needs (it
        normalises for itself), a pass over the vocabulary less per token."""
        x = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if 0 < self.top_p < 1:
            x = apply_top_p(x, self.top_p)
        if self.min_p > 0:
            x = apply_min_p(x, self.min_p)
        if 0 < self.top_k < x.shape[-1]:
            x = apply_top_k(x, self.top_k)
        if self.temperature != 1:
            x = x * (1 / self.temperature)
        return x.astype(mx.float32)

    def probs(self, logits: mx.array) -> mx.array:
        return mx.exp(self.sampling_logprobs(logits))

    def sample(self, logits: mx.array) -> mx.array:
        """One token per row of logits (mlx-lm's greedy choice at temperature 0)."""
        if self.greedy:
            return greedy(logits)
        return mx.random.categorical(self.scaled(logits))


def log_probabilities(logits: mx.array, tokens: list[int], k: int) -> list[tuple]:
    """For each row of logits and the token it predicts: (the token's log-probability, the k most likely
    tokens there as (id, log-probability), best first)."""
    lp = logits.astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, mx.array(tokens)[:, None], axis=-1)[:, 0]
    top = mx.zeros((len(tokens), 0), dtype=mx.int32)
    if k:  # (the k largest, then only those sorted)
        top = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
        top = mx.take_along_axis(top, mx.argsort(-mx.take_along_axis(lp, top, axis=-1), axis=-1), axis=-1)
    values = mx.take_along_axis(lp, top, axis=-1)
    return [(c, list(zip(ids, v))) for c, ids, v in zip(chosen.tolist(), top.tolist(), values.tolist())]


def greedy(logits: mx.array) -> mx.array:
    """The token plain mlx-lm decoding picks at temperature 0: the argmax of the log-probabilities in the
    logits' own dtype. In bfloat16 or float16 that is not always argmax(logits): subtracting the
    logsumexp can round two close logits to one value, and the tie goes to the lower token id. In
    float32 such a tie needs logits within about one rounding step, below the noise between a verify
    pass's kernels and a one-token step's, so there the logsumexp, a pass over the whole vocabulary at
    every position, is skipped."""
    if logits.dtype == mx.float32:
        return mx.argmax(logits, axis=-1)
    return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)


def _accepted_prefix(accept: mx.array) -> mx.array:
    """Length of the leading run of True in a 1-D boolean array."""
    return mx.cumprod(accept.astype(mx.int32)).sum()


def match_accept(proposals: mx.array, target_tokens: mx.array):
    """Accept proposals while they equal the target's own choices; then take the target's token.

    Used at temperature 0 (target_tokens = argmax) and with a custom sampler (target_tokens drawn
    by it at every position: the output is then a draw from that sampler whatever the drafter does,
    because a proposal survives only where it equals the target's own draw).
    """
    n = _accepted_prefix(proposals == target_tokens[:-1])
    return n, target_tokens[n]


def rejection_accept(proposals: mx.array, q: mx.array, p: mx.array):
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    proposals: (B-1,) drawn independently from the drafter's per-position distributions q (B-1, V);
    p: (B, V) the target's distributions at the B verify positions. Proposal k survives with
    probability min(1, p_k(x_k) / q_k(x_k)); at the first rejection the target's token is drawn from
    normalize(max(0, p_k - q_k)); if all survive it is drawn from p_{B-1}. DFlash drafts every
    position from its own marginal, independently of the other proposals, so q_k is exactly the
    distribution x_k was drawn from and the output follows p.
    """
    k = mx.arange(proposals.shape[0])
    px = p[k, proposals]
    qx = q[k, proposals]
    u = mx.random.uniform(shape=px.shape)
    n = _accepted_prefix(u * qx < px)
    residual = mx.concatenate([mx.maximum(p[:-1] - q, 0.0), p[-1:]], axis=0)[n]
    total = residual.sum()
    # An empty residual means p_n == q_n up to rounding, where rejection cannot really happen. (Not
    # normalised: the categorical draw does that itself.)
    residual = mx.where(total > 0, residual, p[n])
    return n, mx.random.categorical(mx.log(residual))


def one_hot_accept(proposals: mx.array, p: mx.array):
    """Speculative sampling for proposals made with certainty (q one-hot, as prompt lookup's): proposal k
    survives with probability p_k(x_k); at the first rejection the token is drawn from p_k without x_k
    (normalize(max(0, p_k - q_k)) for a one-hot q_k); if all survive, from p_{B-1}. Only that one row is
    drawn from (the draw normalises it), so no vocabulary-wide q is ever built."""
    k = mx.arange(proposals.shape[0])
    px = p[k, proposals]
    u = mx.random.uniform(shape=px.shape)
    n = _accepted_prefix(u < px)
    rejected = mx.concatenate([proposals, mx.array([-1], dtype=proposals.dtype)])[n]  # -1: none rejected
    row = mx.where(mx.arange(p.shape[-1]) == rejected, 0.0, p[n])
    row = mx.where(row.sum() > 0, row, p[n])
    return n, mx.random.categorical(mx.log(row))


def guarded(sampler: Callable) -> Callable:
    """A custom sampler whose draws are safe to feed the models: one integer id per row of its logits,
    or a clear error; an id outside the vocabulary becomes -1, which the host refuses when it reads the
    token (`out_of_vocabulary`). MLX reads an embedding row past the table's end from whatever memory
    lies there (or crashes), and the next pass may start before the host has seen the token."""

    def draw(logprobs: mx.array) -> mx.array:
        rows, vocab = logprobs.shape[0], logprobs.shape[-1]
        ids = sampler(logprobs)
        if not isinstance(ids, mx.array) or ids.size != rows or not mx.issubdtype(ids.dtype, mx.integer):
            got = type(ids).__name__
            if isinstance(ids, mx.array):
                got = f"{str(ids.dtype).split('.')[-1]} {tuple(ids.shape)}"
            raise UserError(
                f"a sampler must return an integer mx.array of one token id per row of its logits "
                f"({rows}); it returned {got}"
            )
        ids = ids.reshape(rows).astype(mx.int64)  # (a narrow type cannot be compared with the vocabulary)
        return mx.where((ids >= 0) & (ids < vocab), ids, -1).astype(mx.int32)

    return draw


def out_of_vocabulary() -> UserError:
    return UserError(
        "the sampler returned a token id outside the vocabulary: ids run from 0 to a row's number of "
        "logits less one"
    )


def acceptance(params: SamplingParams, sampler: Callable | None):
    """Pick the drafting and acceptance rules for these settings.

    Returns (draft, accept): draft(logits) -> (proposals, q or None);
    accept(proposals, q, target_logits) -> (n, next_token), where q None marks proposals made with
    certainty (greedy drafting, prompt lookup).
    """
    if sampler is not None:

        def draft(logits):
            return mx.argmax(logits, axis=-1), None

        def accept(x, q, logits):
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            # One call per position, as plain decoding makes: a sampler may draw once per call for all
            # its rows (mlx-lm's XTC flips one coin), which would tie the block's positions together.
            return match_accept(x, mx.concatenate([sampler(lp[i : i + 1]) for i in range(lp.shape[0])]))
    elif params.greedy:

        def draft(logits):
            return mx.argmax(logits, axis=-1), None

        def accept(x, q, logits):
            return match_accept(x, greedy(logits))
    else:

        def draft(logits):
            logq = params.sampling_logprobs(logits)
            return mx.random.categorical(logq), mx.exp(logq)

        def accept(x, q, logits):
            if q is None:
                return one_hot_accept(x, params.probs(logits))
            return rejection_accept(x, q, params.probs(logits))

    return draft, accept
