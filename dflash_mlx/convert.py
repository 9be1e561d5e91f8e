"""`dflash-mlx convert`: drafters and targets into MLX folders, and drafters back to z-lab's layout.

Every conversion writes its folder whole or not at all (`files.atomic_folder`), so a failed or
interrupted run never leaves a half folder that would later load.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.convert import convert as mlx_lm_convert

from .errors import NotFound, UserError
from .files import atomic_folder
from .gguf import convert_gguf
from .loading import (
    DTYPES,
    check_target_folder,
    gguf_folder,
    is_gguf,
    load_draft,
    read_config,
    reading_target,
    resolve,
    resolve_draft,
)
from .models.dflash import is_drafter_config
from .models.formats import drafter_format


def is_drafter(path: Path) -> bool:
    cfg = path / "config.json"
    return cfg.exists() and is_drafter_config(read_config(path))


def convert_draft(
    source: str,
    dest: str | Path,
    dtype: str | None = None,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    force: bool = False,
) -> Path:
    """A z-lab drafter (HF id or folder) -> MLX folder in `dtype` (default bfloat16), optionally
    quantized."""
    draft = load_draft(source, dtype=DTYPES[dtype or "bfloat16"])
    quantized = any(k.endswith(".scales") for k, _ in tree_flatten(draft.parameters()))
    if quantized and (quantize or dtype is not None):
        raise UserError(
            f"{source} is already quantized: {_from_float(quantize)} the float drafter it came from"
        )
    dtype = dtype or "bfloat16"
    config = dict(draft.config.to_dict(), torch_dtype=dtype)  # (the source's may name another)
    if quantize:
        widths = {
            w.shape[-1] for k, w in tree_flatten(draft.parameters()) if k.endswith(".weight") and w.ndim == 2
        }
        if any(w % q_group_size for w in widths):  # (nn.quantize raises, naming a matrix's shape)
            raise UserError(
                f"--q-group-size {q_group_size} does not divide the drafter's widths "
                f"({', '.join(map(str, sorted(widths)))}): give a group size that does, such as 32"
            )
        nn.quantize(draft, group_size=q_group_size, bits=q_bits)
        config["quantization"] = {"group_size": q_group_size, "bits": q_bits}
    with atomic_folder(dest, force) as tmp:
        mx.save_safetensors(
            str(tmp / "model.safetensors"), dict(tree_flatten(draft.parameters())), metadata={"format": "mlx"}
        )
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if draft.phrases:
            draft.phrases.save(tmp)
    return Path(dest)


def export_draft(source: str, dest: str | Path, force: bool = False) -> Path:
    """An MLX drafter -> its Hugging Face layout (config.json + bf16 safetensors): z-lab's, which vLLM and
    SGLang read, or the one it was published in (a Muse-Glimmer assistant stays one). Not transformers:
    z-lab's checkpoints load there through their own remote code (`auto_map`, dflash.py), which is not
    ours to ship, so `auto_map` is left out rather than pointing at a file that is not there."""
    config = read_config(resolve_draft(source))
    try:
        layout = drafter_format(config, source)  # exported in the layout it came in
    except UserError:
        if "model_type" in config:  # (its advice is the generating commands': -m)
            raise UserError(
                f"{source} is a target: --export writes drafters; convert it without --export"
            ) from None
        raise
    draft = load_draft(source, dtype=None)
    if any(".scales" in k for k, _ in tree_flatten(draft.parameters())):
        raise UserError("cannot export a quantized drafter: export the float one it came from")
    config = layout.write_config(draft.config)
    config.pop("quantization", None)
    config.pop("auto_map", None)
    config["torch_dtype"] = "bfloat16"
    weights = layout.weights_out({k: v.astype(mx.bfloat16) for k, v in tree_flatten(draft.parameters())})
    with atomic_folder(dest, force) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if draft.phrases:
            draft.phrases.save(tmp)
    return Path(dest)


def convert_target(
    source: str,
    dest: str | Path,
    dtype: str | None = None,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    force: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """A target (HF id, folder or .gguf file) -> MLX folder that mlx_lm.load and our load read."""
    src = Path(source).expanduser()
    gguf = is_gguf(src)
    if gguf and quantize and dtype is None:
        raise UserError(
            "a GGUF target keeps its own quantization: leave out -q, or add --dtype float32 to "
            "quantize its weights again from float32"
        )
    if gguf and not src.exists():
        raise NotFound(f"no GGUF file at {source}")
    if gguf and quantize:  # quantized again from its weights in float (as loading caches them)
        source = str(gguf_folder(src, DTYPES[dtype]))
    with atomic_folder(dest, force) as tmp:
        if gguf and not quantize:
            convert_gguf(src, tmp, DTYPES[dtype] if dtype else None, progress)
        else:
            folder = resolve(source)
            config = read_config(folder)
            check_target_folder(folder, config)
            if (quantize or dtype is not None) and "quantization" in config:  # (mlx-lm keeps its weights)
                raise UserError(
                    f"{source} is already quantized ({config['quantization'].get('bits')}-bit): "
                    f"{_from_float(quantize)} the float model it came from (a .gguf file or a registry "
                    "name: `-q --dtype float32` on that)"
                )
            tmp.rmdir()  # mlx-lm's convert insists on creating the folder itself
            # mlx-lm prints its progress ("[INFO] Loading", ...): to `progress`, or to stderr as ours
            # goes, never into stdout
            said = sys.stderr if progress is None else _Lines(progress)
            with reading_target(folder), contextlib.redirect_stdout(said):
                mlx_lm_convert(
                    str(folder),
                    str(tmp),
                    quantize=quantize,
                    q_group_size=q_group_size,
                    q_bits=q_bits,
                    dtype=dtype,
                )
    return Path(dest)


class _Lines(io.TextIOBase):
    """A text stream that hands each whole line printed to it, "[INFO] " left off, to `say`."""

    def __init__(self, say: Callable[[str], None]):
        self.say, self.part = say, ""

    def write(self, text: str) -> int:
        *lines, self.part = (self.part + text).split("\n")
        for line in filter(None, (line.removeprefix("[INFO] ").strip() for line in lines)):
            self.say(line)
        return len(text)


def _from_float(quantize: bool) -> str:
    """What to do instead, for -q (mlx quantizes a quantized layer again into a folder that does not
    load) or --dtype (which leaves quantized weights as they are) on a quantized model."""
    return "quantize" if quantize else "--dtype does not make floats of it again; convert"
