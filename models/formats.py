"""Published drafter layouts, one entry each: how a checkpoint's config.json and weight names map onto a
model class here, and back (for export). A checkpoint's `architectures[0]` picks its entry.

Adding a format is one entry in `FORMATS` (and, if its math is new, a model class next to dflash.py).
Whatever a format proposes goes through the same lossless acceptance and the same policy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import UserError
from .dflash import DFlashConfig, DFlashDraftModel, is_drafter_config
from .dflash2 import DFlash2Config, DFlash2DraftModel


@dataclass(frozen=True)
class DrafterFormat:
    model_class: type
    read_config: Callable[[dict], DFlashConfig]  # config.json -> the model's config
    write_config: Callable[[DFlashConfig], dict]  # and back
    renames: tuple[tuple[str, str], ...] = ()  # (checkpoint prefix, model prefix) of weight names

    def weights_in(self, weights: dict) -> dict:
        return {_rename(k, self.renames): v for k, v in weights.items()}

    def weights_out(self, weights: dict) -> dict:
        return {_rename(k, tuple((b, a) for a, b in self.renames)): v for k, v in weights.items()}


def _rename(name: str, renames) -> str:
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


# Meta's Muse-Glimmer assistant is the DFlash drafter under other names: its dflash fields sit at the top
# level, its context projection and norm under `encoder.`, and its config leaves out the vocabulary
# (Muse-Glimmer's) and the attention's causality (none within a block, as in DFlash).
GLIMMER_VOCAB = 202048


def _read_glimmer(cfg: dict) -> DFlashConfig:
    flat = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    flat.setdefault("vocab_size", GLIMMER_VOCAB)
    return DFlashConfig.from_dict(flat)


def _write_glimmer(config: DFlashConfig) -> dict:
    out = config.to_dict()
    out.update(out.pop("dflash_config"))
    out.update(architectures=["MuseGlimmerAssistantModel"], model_type="muse_glimmer_assistant")
    return out


FORMATS = {
    "DFlashDraftModel": DrafterFormat(DFlashDraftModel, DFlashConfig.from_dict, DFlashConfig.to_dict),
    "DFlash2DraftModel": DrafterFormat(DFlash2DraftModel, DFlash2Config.from_dict, DFlash2Config.to_dict),
    "MuseGlimmerAssistantModel": DrafterFormat(
        DFlashDraftModel,
        _read_glimmer,
        _write_glimmer,
        renames=(("encoder.fc.", "fc."), ("encoder.output_norm_enc.", "hidden_norm.")),
    ),
}


def drafter_format(cfg: dict, source: str) -> DrafterFormat:
    """The format of the config.json of a drafter (`source`, as the user named it); one without
    `architectures` is a DFlash drafter."""
    if not is_drafter_config(cfg) and (cfg.get("architectures") or [None])[0] not in FORMATS:
        raise UserError(
            f"{source} is a target (model type {cfg['model_type']}), not a DFlash drafter: pass it as the "
            "target (-m/--model)"
            if "model_type" in cfg
            else f"{source} holds no DFlash drafter (its config.json describes none): give a drafter's folder"
        )
    architecture = (cfg.get("architectures") or ["DFlashDraftModel"])[0]
    if architecture not in FORMATS and "dflash_config" in cfg:
        return FORMATS["DFlashDraftModel"]  # z-lab's layout under another class name
    if architecture not in FORMATS:
        raise UserError(
            f"drafter architecture {architecture} is not one dflash-mlx reads ({', '.join(FORMATS)})"
        )
    return FORMATS[architecture]
