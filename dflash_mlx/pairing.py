"""Does this drafter fit this target, and what fits in the target's context.

A drafter reads the target's hidden states at its `target_layer_ids` and shares the target's embedding
and lm_head, so its hidden size, vocabulary and the target's depth must be the ones it was made for.
`prepare` checks that once and binds the drafter to the target; everything that runs a pair goes
through it.
"""

from __future__ import annotations

import mlx.nn as nn

from .errors import UserError
from .models.dflash import DFlashDraftModel
from .models.targets import Target

# A block is one drafter pass and one target pass over that many positions. Drafters are trained at
# about 16; far past that the later positions are guesses that cost time and memory.
MAX_BLOCK_SIZE = 256


def check_block_size(block_size: int, least: int = 1) -> int:
    """`least` is 2 for training: a block of one position proposes nothing to learn from."""
    if not least <= block_size <= MAX_BLOCK_SIZE:
        raise UserError(
            f"block size must be between {least} and {MAX_BLOCK_SIZE}, got {block_size} (drafters "
            "are trained at about 16)"
        )
    return block_size


def check_pair(target: Target, draft: DFlashDraftModel) -> None:
    """Fail early, naming both values, when a drafter was not made for this target."""
    cfg = draft.config
    checks = [
        (cfg.hidden_size, target.hidden_size, "hidden size {d}, target hidden size {t}"),
        (cfg.vocab_size, target.vocab_size, "vocab size {d}, target vocab size {t}"),
    ]
    if cfg.num_target_layers is not None:
        checks.append(
            (cfg.num_target_layers, target.num_layers, "num_target_layers {d}, but the target has {t} layers")
        )
    for d, t, what in checks:
        if d != t:
            raise UserError(
                f"this drafter was not made for this target: drafter {what.format(d=d, t=t)} "
                f"(use the drafter trained for this target)"
            )
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise UserError(
            f"drafter mask_token_id {cfg.mask_token_id} is outside the target vocabulary "
            f"(size {target.vocab_size})"
        )


def prepare(model: nn.Module | Target, draft: DFlashDraftModel | None) -> Target:
    """Wrap an mlx-lm model as a Target tapping the drafter's layers, and bind the drafter to it."""
    if not isinstance(model, (nn.Module, Target)) or not (draft is None or isinstance(draft, nn.Module)):
        raise UserError("model and draft must be loaded models (load_pair, load, load_draft), draft or None")
    if isinstance(model, DFlashDraftModel) or not (draft is None or isinstance(draft, DFlashDraftModel)):
        raise UserError("give the target first and its DFlash drafter second (as load_pair returns them)")
    layer_ids = draft.config.target_layer_ids if draft is not None else []
    if isinstance(model, Target):
        if list(model.layer_ids) != list(layer_ids):
            model = Target(model.model, layer_ids)
    else:
        model = Target(model, layer_ids)
    if draft is not None:
        check_pair(model, draft)
        if draft.bound_to is not model.model:
            draft.bind(model)
    return model


def context_length(model: nn.Module | Target) -> int | None:
    """The context the model was trained for (any mlx-lm model, or a Target), if its config says."""
    args = model.args if isinstance(model, Target) else getattr(model, "language_model", model).args
    return getattr(args, "max_position_embeddings", None)


def context_room(model: nn.Module | Target, used: int, kept: int = 0) -> int:
    """How many tokens fit in the context of `model` after a prompt of `used` tokens, `kept` of them
    from an earlier call; a clear error if none do."""
    context = context_length(model) or 1 << 62
    if used >= context:
        raise UserError(
            f"the conversation (this prompt and {kept} kept tokens) is {used} tokens and fills the "
            f"model's context of {context}: start a new cache"
            if kept
            else f"the prompt is {used} tokens and the model's context holds {context}: shorten the prompt"
        )
    return context - used
