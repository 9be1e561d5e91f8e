"""`dflash-mlx convert`."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import typer
from rich.markup import escape
from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

from dflash_mlx.convert import convert_draft, convert_target, export_draft, is_drafter
from dflash_mlx.errors import AlreadyExists, UserError
from dflash_mlx.files import folder_bytes
from dflash_mlx.loading import (
    DTYPES,
    check_model_type,
    find_pair,
    is_gguf,
    read_config,
    resolve_draft,
    resolve_target,
    target_name,
)
from dflash_mlx.platform import cache_home

from .options import Bar, stderr, user_errors

Q_BITS, Q_GROUP_SIZES = (2, 3, 4, 5, 6, 8), (32, 64, 128)  # what MLX's affine quantization takes


def convert(
    source: str = typer.Argument(
        ..., metavar="SRC", help="Drafter or target: Hugging Face id, folder, or .gguf file."
    ),
    output: str = typer.Argument(..., metavar="DST", help="Folder to write (must not exist unless --force)."),
    dtype: str | None = typer.Option(
        None,
        help="float16, bfloat16 or float32 (drafter default: bfloat16; "
        "a GGUF target keeps its quantization unless given).",
    ),
    quantize: bool = typer.Option(False, "-q", "--quantize", help="Quantize the weights."),
    q_bits: int | None = typer.Option(None, help="Bits per weight when quantizing (default 4)."),
    q_group_size: int | None = typer.Option(None, help="Group size when quantizing (default 64)."),
    export: bool = typer.Option(
        False, help="Export an MLX drafter to z-lab's Hugging Face layout (bf16; vLLM and SGLang read it)."
    ),
    force: bool = typer.Option(False, help="Replace DST if it is a model folder."),
):
    """Convert a drafter or a target to an MLX folder, or export a drafter to z-lab's layout."""
    with user_errors():
        if dtype is not None and dtype not in DTYPES:
            raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype}")
        if export and (dtype is not None or quantize or q_bits is not None or q_group_size is not None):
            raise UserError(
                "--export always writes bf16 weights, unquantized: leave out --dtype, -q and --q-*"
            )
        if not quantize and (q_bits is not None or q_group_size is not None):
            raise UserError("--q-bits and --q-group-size take effect only with -q/--quantize: add it")
        q_bits, q_group_size = 4 if q_bits is None else q_bits, 64 if q_group_size is None else q_group_size
        if quantize and (q_bits not in Q_BITS or q_group_size not in Q_GROUP_SIZES):
            raise UserError(
                f"MLX quantizes to {', '.join(map(str, Q_BITS))} bits in groups of "
                f"{', '.join(map(str, Q_GROUP_SIZES))}: got --q-bits {q_bits} --q-group-size {q_group_size}"
            )
        if not source.strip():  # (as a path, the current folder)
            raise UserError(
                "the model to convert has no name: give a Hugging Face id, a folder or a .gguf file"
            )
        if not output.strip():
            raise UserError("the output folder needs a name")
        out_path, src = Path(output).expanduser().resolve(), Path(source).expanduser().resolve()
        if src.exists() and (out_path == src or out_path in src.parents):
            what = "is" if out_path == src else "holds"
            raise UserError(f"{output} {what} {source}: write to another folder (it would be replaced)")
        if src.is_dir() and src in out_path.parents:  # (the source folder would then hold its copy)
            raise UserError(f"{output} is inside {source}: write to a folder outside it")
        if src.is_dir():  # (a training run or a folder of no model: said before any progress is shown)
            read_config(src)
        if out_path.is_file():  # (every output is a folder: a file there is no earlier output)
            raise UserError(
                f"{output} is a file: --force replaces a model folder only; give the output another name"
            )
        if out_path.exists() and not force:  # before any download
            raise AlreadyExists(f"{output} already exists (pass --force to replace it)")
        if out_path.is_dir() and any(out_path.iterdir()) and not _model_folder(out_path):
            raise UserError(  # (a mistyped path with --force would wipe whatever it names)
                f"{output} holds files but no model (a config.json with a model_type, and weights): "
                "--force replaces a model folder only; give another folder"
            )
        if out_path.is_dir() and (others := _not_model_files(out_path)):
            raise UserError(  # (the user's own files beside a model's would go with it)
                f"{output} holds other files than a model's ({', '.join(others[:3])}), which --force would "
                "delete with it: move them out, or give another folder"
            )
        made = []
        with Bar(
            SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=stderr()
        ) as bar:
            task = bar.add_task(f"converting {escape(source)}")

            def step(what: str):
                bar.update(task, description=f"{escape(source)}: {what}")

            if export:
                step("exporting drafter")
                out = export_draft(source, output, force)
                kind = "drafter (z-lab layout)"
            elif is_gguf(Path(gguf := target_name(source)).expanduser()):  # (or a registry name for one)
                copies = cache_home() / "gguf"  # (where loading keeps a GGUF target converted)
                kept = set(copies.glob("*"))
                out = convert_target(gguf, output, dtype, quantize, q_bits, q_group_size, force, step)
                kind = "target from GGUF"
                made = sorted(set(copies.glob("*")) - kept)  # (-q: quantized from its float weights)
            else:
                step("fetching")
                # A registry name converts its target (as --model reads it); anything else resolves as -d
                # does: a drafter shipped in models/, a folder or a Hugging Face id.
                folder = (
                    resolve_target(source, DTYPES[dtype] if dtype else None)  # a GGUF one at --dtype
                    if find_pair(source)
                    else resolve_draft(source)
                )
                if is_drafter(folder):
                    step("converting drafter")
                    out = convert_draft(str(folder), output, dtype, quantize, q_bits, q_group_size, force)
                    kind = "drafter"
                else:
                    step("converting target with mlx-lm")
                    out = convert_target(
                        str(folder), output, dtype, quantize, q_bits, q_group_size, force, step
                    )
                    kind = "target"
            bar.update(task, description=f"{escape(source)}: done")
    typer.echo(f"wrote {kind} to {out} ({_megabytes(Path(out))})")
    for folder in made:
        typer.secho(
            f"kept the GGUF's float weights it was quantized from in {folder} ({_megabytes(folder)}): "
            "loading or converting the GGUF again starts from them; remove it to free the space",
            err=True,
            dim=True,
        )


def _megabytes(folder: Path) -> str:
    return f"{folder_bytes(folder) / 1e6:.1f} MB"


# What a model's folder holds (mlx-lm's and Hugging Face's files, a drafter's phrase table): the rest
# is the user's, which --force keeps from being replaced.
MODEL_FILES = "*.json *.safetensors *.jinja *.model *.tiktoken *.py merges.txt vocab.txt phrases.npz".split()
MODEL_FILES += ["README.md", "LICENSE*", ".gitattributes"]


def _not_model_files(path: Path) -> list[str]:
    """The names in a model's folder that are not a model's files (a folder among them)."""
    return sorted(
        p.name
        for p in path.iterdir()
        if not (p.is_file() and any(fnmatch.fnmatch(p.name, pattern) for pattern in MODEL_FILES))
    )


def _model_folder(path: Path) -> bool:
    """A model's folder (which --force may replace): a model's config and weights, not merely a file
    named config.json, which many other folders hold."""
    try:
        check_model_type(path, read_config(path))
    except (UserError, OSError):
        return False
    return any(path.glob("*.safetensors"))
