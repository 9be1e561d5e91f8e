"""A drafter's training run as `dflash-mlx train run` makes it: data folders in, a run folder out.

The run folder holds train.py's `checkpoint/` and `log.jsonl`, one record per step and each step once:
a resumed run goes on from its checkpoint with the recipe and architecture it started with (options
given again that differ are refused, not ignored), and steps a crashed process logged after its
last checkpoint are done again. While it trains, SIGINT, SIGTERM or SIGHUP asks for a stop after the step
under way, with a checkpoint (during a check of acceptance, at once, with that step's); a second one
stops at once.

`prepare_run` checks everything and loads the target before anything is written; `PreparedRun.train`
trains. Both tell their caller what happens through callbacks, so a front end only shows it.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .chat import apply_chat_template
from .convert import export_draft, is_drafter
from .data import check_data_tokenizer, shards_target, sharegpt_prompts, training_sets
from .errors import AlreadyExists, UserError
from .files import check_writable
from .loading import load, load_draft, template_kwargs
from .models.dflash import DFlashDraftModel
from .models.targets import Target
from .pairing import context_length
from .phrases import FILE as PHRASES_FILE
from .phrases import Phrases
from .platform import backend, ctrl_c_in_mlx, stop_signals
from .policy import weights_digest
from .settings import GenerationSettings
from .speculative import generate
from .train import (
    TrainConfig,
    check_new_drafter,
    check_same_data,
    check_same_target,
    data_fingerprint,
    saved_run,
    target_fingerprint,
    train,
    usable_sequences,
)

# TrainConfig fields of the drafter's architecture -> its DFlashConfig's names
ARCHITECTURE = {
    "block_size": "block_size",
    "num_layers": "num_hidden_layers",
    "intermediate_size": "intermediate_size",
    "target_layer_ids": "target_layer_ids",
    "mask_token_id": "mask_token_id",
}
HELD_OUT_TOKENS = 96  # per held-out prompt, for the real acceptance length at each evaluation


def _stderr(text: str) -> None:
    print(text, file=sys.stderr)


def flag(key: str) -> str:
    """The command-line option of a TrainConfig field."""
    return "--layers" if key == "num_layers" else "--" + key.replace("_", "-")


def _shown(value) -> str:
    """An option's value as it is typed (a list of layer ids as 1,2,3)."""
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def check_resume(out: Path, run: dict, given: dict, init: str | None) -> None:
    """A resumed run keeps its recipe and architecture, so that its curve continues: an option given on
    the new command (TrainConfig names; None: not given) that differs from the run's is refused, as is
    an --init drafter of another architecture, rather than ignored."""
    differ = []
    for key, mine in given.items():
        if mine is None:
            continue
        theirs = (
            getattr(run["config"], ARCHITECTURE[key])
            if key in ARCHITECTURE
            else run["train_config"].get(key, getattr(TrainConfig, key, None))
        )
        if mine != theirs:
            differ.append(f"{flag(key)} {_shown(mine)} (the run's: {_shown(theirs)})")
    if init:  # (the command that started the run, given again, goes on with it)
        start = load_draft(init).config
        if any(getattr(start, name) != getattr(run["config"], name) for name in ARCHITECTURE.values()):
            differ.append(f"--init {init} (another architecture than the run's)")
    if differ:
        raise UserError(
            f"{out} is a run at step {run['step']}, which keeps its recipe and architecture: "
            f"{'; '.join(differ)}. Leave {'it' if len(differ) == 1 else 'them'} out to resume it, or give "
            "--out a new folder (to start from this run, export it and pass it to --init)"
        )


RUN_FILES = ("checkpoint", "log.jsonl")  # what a run folder holds (and hidden files of a checkpoint swap)


def check_run_folder(out: Path) -> None:
    """--out is a run folder, or new or empty: a data or model folder given by mistake is refused before
    a run is written into it."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file: give --out a folder for the run")
    others = sorted(p.name for p in out.glob("*") if p.name not in RUN_FILES and not p.name.startswith("."))
    if others:
        raise UserError(
            f"{out} holds other files than a training run's ({', '.join(others[:3])}): give --out a new "
            "or empty folder"
        )
    check_writable(out, "--out")


def trim_log(path: Path, step: int) -> None:
    """Keep a run log's records up to `step`, the checkpoint a resumed run goes on from: steps done after
    it (before a crash) are done again, and the log should read as one run, each step once."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):  # a line cut short by the crash
            pass
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


def check_export_folder(dest: str | Path, run: str | Path | None = None) -> None:
    """An export may replace an older exported drafter (config.json, weights and a phrase table only),
    never a folder holding anything else, nor the run folder it comes from."""
    dest = Path(dest).expanduser().resolve()
    if run is not None:
        run = Path(run).expanduser().resolve()
        if dest == run or run in dest.parents or dest in run.parents:
            raise UserError(
                f"--export {dest} would overwrite the run folder {run}: export to a folder outside it"
            )
    if not dest.exists():
        check_writable(dest, "--export")  # (a file on its way, a read-only place)
        return
    names = [p.name for p in dest.iterdir()] if dest.is_dir() else None
    only_a_drafter = (
        names is not None
        and all(
            n in ("config.json", PHRASES_FILE) or (n.startswith("model") and n.endswith(".safetensors"))
            for n in names
        )
        and (not names or is_drafter(dest))
    )
    if not only_a_drafter:
        what = "holds more than an exported drafter" if names is not None else "is a file"
        raise AlreadyExists(f"{dest} exists and {what}: give --export a new folder")


def export(checkpoint: str | Path, dest: str | Path) -> Path:
    """The trained drafter in z-lab's layout (bf16), replacing an older drafter at `dest` (and keeping
    the phrase table made for it: the target's, whatever the drafter's weights)."""
    check_export_folder(dest, checkpoint)
    dest = Path(dest).expanduser()
    try:
        phrases = Phrases.load(dest) if dest.is_dir() else None
    except UserError:  # (a broken table is not worth a failed export at the end of a run)
        phrases = None
    path = export_draft(str(checkpoint), dest, force=True)
    if phrases:
        phrases.save(path)
    return path


def answers_on_prompts(
    target: Target,
    draft,
    tokenizer,
    prompts,
    settings: GenerationSettings | None = None,
    template_kwargs: dict | None = None,
) -> Iterator:
    """Each chat prompt's answer from stream_generate, in turn (default settings: greedy, 128 tokens; a
    sampled answer k is seeded with the settings' seed + k), the drafter's own: a fixed block, its block
    size unless the settings name one."""
    settings = (settings or GenerationSettings(max_tokens=128)).answering()
    if settings.block_size is None:
        settings = replace(settings, block_size=draft.block_size)
    for k, messages in enumerate(prompts):
        seed = (settings.seed or 0) + k if settings.temperature else None
        yield generate(
            target,
            draft,
            tokenizer,
            apply_chat_template(tokenizer, messages, **(template_kwargs or {})),
            **asdict(replace(settings, seed=seed)),
        )


def tau_of(answers: list) -> dict:
    """Real acceptance length over answers (their cycles together); also tokens generated."""
    acc = [a for r in answers for a in r.acceptance_lengths]
    return {
        "tau": sum(acc) / max(len(acc), 1),
        "cycles": len(acc),
        "tokens": sum(len(r.tokens) for r in answers),
        "histogram": {int(k): int(v) for k, v in zip(*np.unique(acc, return_counts=True))},
    }


@dataclass
class RunEnd:
    """How a run ended."""

    step: int  # the last step done
    steps: int  # the run's length
    stopped_by: int | None = None  # the signal that asked it to stop, if one did
    interrupted: bool = False  # stopped at once, not after a step: only the last checkpoint is kept
    checkpoint: int | None = None  # interrupted: the step of that checkpoint (None: there is none)
    exported: Path | None = None


@dataclass
class PreparedRun:
    out: Path
    cfg: TrainConfig
    step: int  # where the run starts: 0, or the step of the checkpoint it resumes
    model: str
    target: object  # the mlx-lm model
    tokenizer: object
    seqs: list
    held_out: list  # chat prompts for the real acceptance length
    init: DFlashDraftModel | None  # a new run's starting drafter
    feature_cache_gb: float
    export_to: str | None

    @property
    def done(self) -> bool:
        return self.step >= self.cfg.steps

    def evaluate(self, draft: DFlashDraftModel, note: Callable[[str], None] = _stderr) -> dict:
        # (minutes on a CPU, where a short run's steps took seconds: said, so it does not look stuck)
        n = len(self.held_out)
        note(f"measuring acceptance on {n} held-out prompt{'s' * (n != 1)} (--eval-prompts) ...")
        target = Target(self.target, draft.config.target_layer_ids)
        settings = GenerationSettings(max_tokens=HELD_OUT_TOKENS)
        answers = answers_on_prompts(
            target, draft, self.tokenizer, self.held_out, settings, template_kwargs(self.model)
        )
        return {"tau": tau_of(list(answers))["tau"]}

    def train(self, on_step: Callable[[dict], None], note: Callable[[str], None]) -> RunEnd:
        """Train to the run's last step, or until a signal stops it; export the drafter if asked and done.
        `on_step(record)` sees every step's log record; `note` gets what the run says while training.
        A new run refused before its first checkpoint (a drafter its target cannot have) leaves no folder."""
        made = not self.out.exists()
        self.out.mkdir(parents=True, exist_ok=True)
        log = self.out / "log.jsonl"
        trim_log(log, self.step)
        asked: int | None = None  # the signal that asked for a stop
        reached = self.step
        checking = False  # while the acceptance on held-out prompts is measured (minutes on a CPU)

        def on_signal(signum, frame):
            nonlocal asked
            if asked is not None:
                raise KeyboardInterrupt  # asked twice: at once, keeping the last checkpoint
            asked = signum
            if checking:  # (the step is trained: `train` keeps it, then ends the run)
                note("stopping: the acceptance check ends here; this step's checkpoint is kept")
                raise KeyboardInterrupt
            if reached + 1 >= self.cfg.steps:  # (the run ends with this step: it is finished, not stopped)
                note("the last step: the run finishes with it, unchecked (Ctrl-C again stops at once)")
            else:
                note("stopping after this step, with a checkpoint (Ctrl-C again stops at once)")

        def check(draft: DFlashDraftModel) -> dict:
            nonlocal checking
            if asked is not None:  # (asked for during the step's other checks: the stop skips it)
                return {}
            checking = True
            try:
                return self.evaluate(draft, note)
            finally:
                checking = False

        def step_done(record: dict) -> None:
            nonlocal reached
            f.write(json.dumps(record) + "\n")
            f.flush()
            reached = record["step"]
            on_step(record)

        handlers = {}
        try:
            with ctrl_c_in_mlx(), open(log, "a") as f:
                handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, *stop_signals())}
                train(
                    Target(self.target),
                    self.tokenizer,
                    self.seqs,
                    self.out,
                    self.cfg,
                    draft=self.init,
                    on_step=step_done,
                    evaluate=check if self.held_out else None,
                    feature_cache_gb=self.feature_cache_gb,
                    stop=lambda: asked is not None,
                )
        except UserError:
            if made and saved_run(self.out) is None:
                shutil.rmtree(self.out, ignore_errors=True)
            raise
        except (KeyboardInterrupt, RuntimeError) as e:
            # (a first Ctrl-C that also ended MLX's kernel compiler, whose error came first: the handler
            # has run since, in ctrl_c_in_mlx, and asked for the stop)
            if isinstance(e, RuntimeError) and asked is None:
                raise
            kept = saved_run(self.out)
            return RunEnd(
                reached, self.cfg.steps, asked, interrupted=True, checkpoint=kept["step"] if kept else None
            )
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
        if asked is not None and reached < self.cfg.steps:
            return RunEnd(reached, self.cfg.steps, asked)
        exported = export(self.out / "checkpoint", self.export_to) if self.export_to else None
        return RunEnd(reached, self.cfg.steps, asked, exported=exported)


def backend_defaults() -> dict:
    """A new run's batch size and precision where none is given: a GPU waits on one sequence a step and
    computes bf16 at full rate; a CPU gains nothing from either."""
    if backend() == "cpu":
        return {"batch_size": 1, "precision": "float32"}
    return {"batch_size": 16, "precision": "bf16"}


def prepare_run(
    data: list[str],
    out: str | Path,
    model: str,
    recipe: dict,
    *,
    steps: int | None = None,
    checkpoint_every: int | None = None,
    eval_every: int | None = None,
    micro_batch: int | None = None,
    init: str | None = None,
    eval_prompts: int = 8,
    feature_cache_gb: float = 4.0,
    export_to: str | None = None,
    note: Callable[[str], None] = _stderr,
) -> PreparedRun:
    """Read the data folders, resume or begin the run in `out`, and load the target `model`; refuse what
    cannot work before a run folder is written or the target is loaded, where that can be known.

    `recipe`: TrainConfig fields as given (None: not given, the default or the resumed run's); steps,
    checkpoint_every and eval_every may change when a run resumes. `init`: a drafter to start a new run
    from. `eval_prompts`: held-out ShareGPT prompts for the real acceptance length. `note(text)` gets
    what the user should know before training starts.
    """
    out = Path(out).expanduser()
    check_run_folder(out)
    if export_to:
        check_export_folder(export_to, out)  # before hours of training, not after
    if eval_prompts < 0:
        raise UserError(f"--eval-prompts must be >= 0, got {eval_prompts}")
    if not feature_cache_gb >= 0:
        raise UserError(f"--feature-cache-gb must be >= 0, got {feature_cache_gb}")
    folders = training_sets(data)
    seqs = [seq for _, found in folders for seq in found]
    run = saved_run(out)
    control = {
        "steps": steps,
        "checkpoint_every": checkpoint_every,
        "eval_every": eval_every,
        "micro_batch": micro_batch,
    }
    start = None
    if run is not None:  # resume: the run's recipe, the new command's control options where given
        control = {
            k: v if v is not None else run["train_config"].get(k, getattr(TrainConfig, k))
            for k, v in control.items()
        }
        check_resume(out, run, recipe, init)
        if run["step"] < control["steps"]:
            notes = [f"resuming {out} at step {run['step']} of {control['steps']}"]
        else:
            notes = [
                f"{out} is at step {run['step']}, which --steps {control['steps']} does not pass: nothing "
                "to train (give a larger --steps to go on)"
            ]
        if init:
            notes[0] += " (from its own checkpoint, not from --init again)"
        # Before loading the target (train() checks again, for callers from Python).
        check_same_data(run, data_fingerprint(usable_sequences(seqs, TrainConfig(**run["train_config"]))))
    elif init:
        given = [k for k in ARCHITECTURE if k != "block_size" and recipe.get(k) is not None]
        if given:
            raise UserError(
                f"{', '.join(map(flag, given))}: the drafter's architecture comes from --init; drop "
                "the option or start a new drafter"
            )
        start = load_draft(init, dtype=mx.float32)
        if any(k.endswith(".scales") for k, _ in tree_flatten(start.parameters())):
            raise UserError(
                f"{init} is quantized, so almost none of it could train: start from the unquantized drafter"
            )
        if recipe.get("block_size") is None:
            recipe = {**recipe, "block_size": start.block_size}
    if run is None:
        recipe = {**backend_defaults(), **{k: v for k, v in recipe.items() if v is not None}}
    cfg = TrainConfig(**{k: v for k, v in {**recipe, **control}.items() if v is not None})
    if run is None:
        usable_sequences(seqs, cfg)  # refused before a run folder or a progress bar appears
    try:
        held_out = sharegpt_prompts("heldout")[:eval_prompts] if eval_prompts else []
    except UserError as e:  # the package is an extra
        raise UserError(f"{e} (it holds the held-out prompts), or pass --eval-prompts 0") from None
    target, tokenizer = load(model)
    check_data_tokenizer(folders, tokenizer, Target(target).vocab_size, model)
    if run is not None:  # (train() checks again, for callers from Python)
        check_same_target(run, target_fingerprint(Target(target)))
        for line in notes:  # (once the options and the target are known to be good)
            note(line)
    digest = weights_digest(target)
    for folder in (f for f, _ in folders if shards_target(f) not in ("", digest)):
        note(
            f"note: {folder} holds another target's answers (other weights, or the same in another "
            f"precision): the drafter learns to predict that target's text, not {model}'s"
        )
    if run is None and start is None:  # (a new drafter's architecture, refused before the run's bar shows)
        check_new_drafter(Target(target), tokenizer, cfg)
    if run is None and cfg.warmup >= cfg.steps:  # (once the options are known to be good)
        note(
            f"note: the warm-up ({cfg.warmup} steps) is not shorter than the run ({cfg.steps}), so the "
            "learning rate never reaches its peak; a shorter --warmup fixes that"
        )
    context = context_length(target)
    fits = [
        m
        for m in held_out
        if context is None or len(apply_chat_template(tokenizer, m, **template_kwargs(model))) < context
    ]
    if len(fits) < len(held_out):
        note(
            f"note: {len(held_out) - len(fits)} of the {len(held_out)} held-out prompts do not fit the "
            f"target's context of {context} tokens; the tau check leaves them out"
        )
    return PreparedRun(
        out,
        cfg,
        run["step"] if run else 0,
        model,
        target,
        tokenizer,
        seqs,
        fits,
        start,
        feature_cache_gb,
        export_to,
    )
