"""The settings of one generation, checked in one place.

Every entry point (stream_generate, the chat, bench, the command line, and a server to come) builds a
GenerationSettings from what it was given; a value out of range is refused there, before anything is
loaded, with an error that names the setting.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UserError
from .pairing import check_block_size
from .sampling import SamplingParams
from .trees import TREE_MAX


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
                f"draft_window must be from 1 to 2**30 (leave it out for the whole context), "
                f"got {self.draft_window}"
            )
        if self.seed is not None:
            object.__setattr__(self, "seed", self.seed % 2**64)

    def answering(self) -> GenerationSettings:
        """These settings where the answer is the point (a chat turn, a benchmark, an acceptance
        measurement): at least one token."""
        if self.max_tokens < 1:
            raise UserError(f"max_tokens must be >= 1, got {self.max_tokens}")
        return self
