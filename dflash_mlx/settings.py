"""The settings of one generation, checked in one place.

Every entry point (stream_generate, the chat, bench, the command line, and a server to come) builds a
GenerationSettings from what it was given; a value out of range is refused there, before anything is
loaded, with an error that names the setting.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from mlx_lm.sample_utils import make_logits_processors

from .errors import UserError
from .pairing import check_block_size
from .sampling import SamplingParams
from .trees import TREE_MAX

MAX_LOGPROBS = 20  # the most likely tokens an answer may give beside each of its own (OpenAI's limit)


@dataclass(frozen=True, kw_only=True)
class GenerationSettings(SamplingParams):
    """SamplingParams (temperature, top_p, top_k, min_p), and how much to generate and how. Its fields are
    `stream_generate`'s keyword arguments: `stream_generate(..., **dataclasses.asdict(settings))`."""

    max_tokens: int = 256
    block_size: int | None = None  # None: chosen cycle by cycle (policy.py); N: a fixed DFlash block
    tree: int | None = None  # N: every cycle verifies a tree in a pass of N, as wide as a block of N
    lookup: bool = True  # prompt lookup among the choices (with block_size None)
    seed: int | None = None  # any integer, taken modulo 2**64 (MLX's seeds are unsigned 64-bit)
    prefill_step_size: int | None = None  # prompt tokens a prefill pass takes (None: cache.prefill_step)
    draft_window: int | None = None  # the drafter keeps only this many latest context positions
    # mlx-lm's logits processors (`make_logits_processors`), applied to the target's logits at every
    # position it verifies, each seeing the tokens before that position: the answer is the one plain
    # decoding with them gives. The penalties look at the latest *_context_size tokens (prompt included).
    repetition_penalty: float | None = None  # recent tokens' logits moved towards less likely by this factor
    repetition_context_size: int = 20
    presence_penalty: float = 0.0  # subtracted from the logits of recent tokens
    presence_context_size: int = 20
    frequency_penalty: float = 0.0  # ... times how often each occurs among them
    frequency_context_size: int = 20
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    # None: no log-probabilities; N: each token's (of the target's processed logits, before sampling's
    # temperature and filters, as mlx-lm gives them) and the N most likely at its position
    logprobs: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.max_tokens < 0:
            raise UserError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.block_size is not None:
            check_block_size(self.block_size)
        if self.tree is not None and not 2 <= self.tree <= TREE_MAX:
            raise UserError(f"tree must be from 2 to {TREE_MAX} (the width of its pass), got {self.tree}")
        if self.tree is not None and self.block_size is not None:
            raise UserError("give a tree or a block size, not both: a tree's pass is as wide as its block")
        if self.prefill_step_size is not None and self.prefill_step_size < 1:
            raise UserError(f"prefill_step_size must be >= 1, got {self.prefill_step_size}")
        if self.draft_window is not None and not 1 <= self.draft_window <= 2**30:  # (positions are int32)
            raise UserError(
                f"draft_window must be from 1 to {2**30:,} (leave it out for the whole context), "
                f"got {self.draft_window}"
            )
        if self.seed is not None:
            object.__setattr__(self, "seed", self.seed % 2**64)
        self._check_processors()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise UserError(
                f"logprobs must be from 0 to {MAX_LOGPROBS} (the most likely tokens given beside each), "
                f"got {self.logprobs}"
            )

    def _check_processors(self) -> None:
        # (bounded where float32 logits stay finite: past them a penalty or bias overflows to inf, and
        # the log-probabilities to NaN)
        if self.repetition_penalty is not None and not 0.01 <= self.repetition_penalty <= 100:
            raise UserError(
                f"repetition_penalty must be from 0.01 to 100 (1: none), got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -100 <= getattr(self, name) <= 100:
                raise UserError(f"{name} must be from -100 to 100 (0: none), got {getattr(self, name)}")
        for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
            if not 1 <= (size := getattr(self, name)) <= 2**30:  # (MLX's slices take 32-bit indices)
                raise UserError(
                    f"{name} must be from 1 to {2**30:,} (the latest tokens looked at), got {size}"
                )
        bias = self.logit_bias
        if bias is not None:
            ok = isinstance(bias, dict) and all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in bias
            )
            values = bias.values() if ok else []
            if not ok or not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values):
                raise UserError(
                    f"logit_bias must map token ids (whole numbers >= 0) to numbers, got {bias!r}"
                )
            if not all(-100 <= v <= 100 for v in values):
                raise UserError(
                    f"logit_bias values must be from -100 to 100 (-100 bans a token), got {bias!r}"
                )
            object.__setattr__(self, "logit_bias", {int(t): float(v) for t, v in bias.items()} or None)

    def processors(self) -> list:
        """mlx-lm's logits processors for these settings (none when they ask for nothing)."""
        return make_logits_processors(
            self.logit_bias,
            None if self.repetition_penalty == 1 else self.repetition_penalty,
            self.repetition_context_size,
            self.presence_penalty,
            self.presence_context_size,
            self.frequency_penalty,
            self.frequency_context_size,
        )

    def answering(self) -> GenerationSettings:
        """These settings where the answer is the point (a chat turn, a benchmark, an acceptance
        measurement): at least one token."""
        _at_least_one(self.max_tokens)
        return self

    @classmethod
    def answers(cls, **fields) -> GenerationSettings:
        """Settings where the answer is the point, max_tokens checked first (so that -1 is not sent
        to try 0, which is refused next)."""
        _at_least_one(fields.get("max_tokens", cls.max_tokens))
        return cls(**fields)


def _at_least_one(max_tokens: int) -> None:
    if max_tokens < 1:
        raise UserError(f"max_tokens must be >= 1, got {max_tokens}")
