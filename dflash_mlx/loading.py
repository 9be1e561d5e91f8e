"""Find and load targets (through mlx-lm) and DFlash drafters (z-lab checkpoint layout)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from .models.dflash import DFlashConfig, DFlashDraftModel
from .platform import backend


def _default_dtype() -> Optional[mx.Dtype]:
    # On the CPU only float32 goes through BLAS; float16/bfloat16 matmuls are many times slower.
    return mx.float32 if backend() == "cpu" else None


def resolve(name: str, allow_patterns=("*.json", "*.safetensors")) -> Path:
    """A local folder as is; anything else is a Hugging Face repo id, downloaded (and cached)."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{name} is a file; expected a model folder")
        return path
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise FileNotFoundError(f"no model folder at {name} (and it is not a Hugging Face id like org/name)")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name, allow_patterns=list(allow_patterns)))


def load(name: str, dtype: Optional[mx.Dtype] = "auto"):
    """Load a target with mlx-lm -> (model, tokenizer). dtype 'auto' = float32 on the CPU."""
    from mlx_lm import load as mlx_lm_load

    model, tokenizer = mlx_lm_load(str(resolve(name, ("*.json", "*.safetensors", "*.py", "*.model",
                                                      "*.tiktoken", "*.txt", "*.jinja"))))
    dtype = _default_dtype() if dtype == "auto" else dtype
    if dtype is not None:
        model.set_dtype(dtype)
    return model, tokenizer


def load_draft(name: str, dtype: Optional[mx.Dtype] = "auto") -> DFlashDraftModel:
    """Load a DFlash drafter from a z-lab layout folder or Hugging Face id.

    dtype 'auto' = float32 on the CPU, the checkpoint's own dtype elsewhere.
    """
    path = resolve(name)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path} has no config.json: not a model folder")
    config = DFlashConfig.from_dict(json.loads(cfg_file.read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # mlx raises RuntimeError/ValueError with terse texts
            raise ValueError(f"cannot read {f}: {e} (truncated or not a safetensors file?)") from None
    model = DFlashDraftModel(config)
    expected = {k for k, _ in tree_flatten(model.parameters())}
    missing, unexpected = expected - set(weights), set(weights) - expected
    if missing or unexpected:
        raise ValueError(f"{path} does not match a DFlash drafter with this config: "
                         f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.load_weights(list(weights.items()))
    dtype = _default_dtype() if dtype == "auto" else dtype
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    model.eval()
    return model


def load_pair(target: str, draft: str, dtype="auto"):
    """-> (model, draft, tokenizer), checked to fit each other."""
    from .speculative import prepare

    model, tokenizer = load(target, dtype)
    drafter = load_draft(draft, dtype)
    prepare(model, drafter)
    return model, drafter, tokenizer
