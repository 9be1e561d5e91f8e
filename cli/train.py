"""`dflash-mlx train`: make data, train a drafter, measure it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from dflash_mlx.bench import counted
from dflash_mlx.data import (
    answer_rows,
    check_data_options,
    check_prompt_room,
    data_settings,
    generate_data,
    load_shards,
    prompt_source,
    resume_point,
    shards_tokenizer,
    training_sets,
    writing_into,
)
from dflash_mlx.errors import AlreadyExists, UserError
from dflash_mlx.loading import load, load_pair, read_config, template_kwargs
from dflash_mlx.models.dflash import is_drafter_config
from dflash_mlx.models.targets import Target
from dflash_mlx.phrases import FILE, MIN_COUNT, Phrases
from dflash_mlx.platform import ctrl_c_in_mlx
from dflash_mlx.settings import GenerationSettings
from dflash_mlx.train import saved_run
from dflash_mlx.train_run import answers_on_prompts, prepare_run, tau_of

from .options import (
    DEMO,
    Json,
    MaxTokens,
    Model,
    Temp,
    Think,
    busy,
    first_prompts,
    interrupted_code,
    progress_bar,
    stderr,
    stopped_by,
    terminated_as_interrupted,
    user_errors,
)

app = typer.Typer(
    help="Train a DFlash drafter: make data, train, measure.", no_args_is_help=True, rich_markup_mode=None
)
# The settings' names in the errors of `train data` and `train run`, and their flags (see `flagged`).
DATA_FLAGS = {
    n: "--" + n.replace(" ", "-")
    for n in ("batch size", "shard size", "max new tokens", "max prompt tokens", "limit")
}
RUN_FLAGS = {
    "the learning rate": "--lr",
    "num_layers": "--layers",
    "intermediate_size": "--intermediate-size",
    **{
        n: "--" + n
        for n in (
            "steps",
            "anchors",
            "checkpoint-every",
            "batch-size",
            "micro-batch",
            "warmup",
            "eval-every",
            "precision",
        )
    },
}


@app.command("data")
def data(
    out: str = typer.Option(
        ..., "--out", "-o", help="Folder for the token-id shards (resumes if it has some)."
    ),
    model: Model = DEMO,
    source: str = typer.Option(
        "sharegpt",
        help="sharegpt, sharegpt-followup, python-stdlib, humaneval, a .jsonl file, "
        "or hf:org/name[/config][:split[:field]].",
    ),
    limit: int | None = typer.Option(None, help="Stop after this many sequences (0: all)."),
    max_new_tokens: int = typer.Option(256, help="Longest answer."),
    max_prompt_tokens: int = typer.Option(384, help="Skip longer prompts."),
    batch_size: int | None = typer.Option(
        None,
        help="Prompts answered together (default: 64 on a CPU; on a GPU as many as fit in a quarter of "
        "its memory, at most 512).",
    ),
    shard_size: int = typer.Option(64, help="Sequences per shard (the resume granularity)."),
    think: Think = None,
    temp: float = typer.Option(0.0, help="Sample answers at this temperature (default 0: greedy)."),
    seed: int = typer.Option(0, help="Seed of sampled answers."),
):
    """Self-distillation: the target answers prompts; its answers become training sequences."""
    with user_errors(DATA_FLAGS):
        if limit is not None and limit < 0:
            raise UserError(f"--limit must be >= 0, got {limit}")
        limit = limit or None  # (0: all, as bench takes it)
        check_data_options(out, batch_size, shard_size, max_new_tokens, max_prompt_tokens, limit, temp)
        folder = Path(out).expanduser()
        with writing_into(folder):  # (before the model loads: a second run into it is refused)
            prompts = prompt_source(source, training=True)
            total = min(limit or len(prompts), len(prompts))
            settings = data_settings(max_new_tokens, temp, seed, template_kwargs(model, think))
            done, consumed = resume_point(folder, source, max(shard_size, 1), prompts, settings)
            if consumed >= len(prompts) or (limit is not None and done >= limit):
                typer.echo(f"{_sequences(done)} in {out}: nothing left to generate")
                return
            target, tokenizer = load(model)
            Target(target)  # a family `train run` cannot use is refused before hours of generation
            rendering = template_kwargs(model, think, tokenizer)  # (a --think it has no switch for: now)
            check_prompt_room(tokenizer, max_prompt_tokens, rendering)  # (generate_data checks again)
            if batch_size is None:
                fits = answer_rows(target, max_prompt_tokens + max_new_tokens)
                batch_size = max(1, min(fits, total - done))
                typer.echo(f"answering {batch_size} prompts at a time (--batch-size)", err=True)
            before, tic = _answer_tokens(load_shards(folder)), time.perf_counter()
            # answer tokens, of unfinished answers too: the bar's speed moves from the first step
            generated = 0

            def speed() -> str:
                return f"{generated / (time.perf_counter() - tic):.0f} tokens/s"

            def step(answered: int, _: int, tokens: int) -> None:
                nonlocal generated
                generated = tokens
                bar.update(task, completed=answered, description=speed())

            def made() -> str:
                seqs = load_shards(folder)
                tokens = _answer_tokens(seqs) - before
                new = f"{tokens} new answer tokens, generated at {speed()}"
                return f"{_sequences(len(seqs))} in {out} ({new})"

            bar = progress_bar("generating answers", detail=True)
            with bar, terminated_as_interrupted() as terminated:
                task = bar.add_task("", total=total, completed=done)
                try:
                    generate_data(
                        target,
                        tokenizer,
                        prompts,
                        folder,
                        max_new_tokens=max_new_tokens,
                        batch_size=batch_size,
                        shard_size=shard_size,
                        max_prompt_tokens=max_prompt_tokens,
                        limit=limit,
                        source=source,
                        template_kwargs=rendering,
                        progress=step,
                        temperature=temp,
                        seed=seed,
                    )
                except KeyboardInterrupt:  # what is on disk is whole answers (see generate_data)
                    bar.stop()
                    typer.echo(f"stopped: {made()}; run the same command to go on", err=True)
                    raise typer.Exit(interrupted_code(terminated)) from None
                # done: prompts skipped as too long never count towards the bar
                bar.update(task, completed=total)
    typer.echo(made())


@app.command("phrases")
def phrases(
    data: list[str] = typer.Option(
        ..., "--data", help="A folder of `train data` shards (repeat for several)."
    ),
    out: str = typer.Option(
        ..., "--out", "-o", help=f"The drafter's folder: the table is written there as {FILE}."
    ),
    force: bool = typer.Option(False, help="Replace the table the folder holds."),
):
    """Learn the target's phrases from its answers: prompt lookup's fallback where the context has no
    match (what the target usually writes next after a few tokens)."""
    with user_errors():
        folder = Path(out).expanduser()
        if not out.strip():
            raise UserError("--out is empty: give the drafter's folder the table is for")
        if not (folder / "config.json").is_file() or not is_drafter_config(read_config(folder)):
            raise UserError(
                f"{out} is not a drafter's folder (a DFlash config.json): give -o the drafter's folder the "
                "table is for"
            )
        if folder.resolve().name == "checkpoint" and saved_run(folder.resolve().parent) is not None:
            raise UserError(
                f"{out} is a training run's checkpoint, which its next one replaces: write the table into "
                "the drafter the run exports (`train run ... --export DIR`, then `train phrases -o DIR`)"
            )
        if (folder / FILE).exists() and not force:
            raise AlreadyExists(f"{out} holds a phrase table already (pass --force to replace it)")
        seqs, made = [], set()
        for d, found in training_sets(data):
            seqs += found
            made.add(shards_tokenizer(d))
        if len(made - {""}) > 1:
            raise UserError("the --data folders come from targets with other vocabularies: give one target's")
        with busy(stderr(), f"learning phrases from {len(seqs)} answers ..."):
            table = Phrases.learn(seqs, next(iter(made - {""}), ""))  # ("": shards that predate the record)
        if not table:
            raise UserError(
                f"no context is followed by the same token {MIN_COUNT} times in these {len(seqs)} answers: "
                "give more"
            )
        path = table.save(folder)
    size = path.stat().st_size / 1e6
    answer = _answer_tokens(seqs)
    typer.echo(f"{len(table)} phrases from {len(seqs)} answers ({answer} tokens) in {path} ({size:.1f} MB)")


def _sequences(n: int) -> str:
    return f"{n} sequence{'' if n == 1 else 's'}"


def _answer_tokens(seqs: list[tuple[list[int], int]]) -> int:
    """Answer tokens (prompts not counted) in `load_shards`' sequences."""
    return sum(len(ids) - plen for ids, plen in seqs)


@app.command("run")
def run(
    data: list[str] = typer.Option(
        ...,
        "--data",
        help="Folder made by `dflash-mlx train data` (repeat the "
        "option to mix folders; the first one's first sequences "
        "are held out).",
    ),
    out: str = typer.Option(..., "--out", "-o", help="Run folder: checkpoints, log; resumes if it has one."),
    model: Model = DEMO,
    layers: int | None = typer.Option(None, help="Drafter layers (1-5 is typical; default 2)."),
    intermediate_size: int | None = typer.Option(
        None, help="Drafter MLP width (default: the target's; the hidden width is always the target's)."
    ),
    block_size: int | None = typer.Option(None, help="Block size B (default 16, or the --init drafter's)."),
    target_layer_ids: str | None = typer.Option(
        None, help="Comma-separated target layers to tap (default: the paper's spread)."
    ),
    mask_token_id: int | None = typer.Option(
        None, help="Token id used as MASK (default: a spare special token)."
    ),
    steps: int | None = typer.Option(
        None,
        help="Training steps, --batch-size sequences each (default 2000; resuming: "
        "the run's, and a larger one stretches its schedule).",
    ),
    lr: float | None = typer.Option(None, help="Peak learning rate (default 6e-4)."),
    warmup: int | None = typer.Option(None, help="Warm-up steps (default 100)."),
    anchors: int | None = typer.Option(None, help="Blocks per sequence and step (default 64)."),
    batch_size: int | None = typer.Option(
        None, help="Sequences per step (default: 16 on a GPU, 1 on a CPU)."
    ),
    micro_batch: int | None = typer.Option(
        None,
        help="Sequences per pass, for memory: a step's passes add their gradients (default: all on a "
        "GPU, 1 on a CPU).",
    ),
    precision: str | None = typer.Option(
        None, help="The drafter's compute: bf16 (float32 master weights; default on a GPU) or float32."
    ),
    vocab: str | None = typer.Option(
        None,
        help="The loss's softmax over the 'full' vocabulary (the paper's, "
        "default) or only the tokens the training answers use, 'data' "
        "(faster with a large vocabulary; drafting still uses all "
        "of it).",
    ),
    checkpoint_every: int | None = typer.Option(None, help="Steps between checkpoints (default 100)."),
    eval_every: int | None = typer.Option(
        None, help="Steps between evaluations (default 0: at the end only)."
    ),
    eval_prompts: int = typer.Option(8, help="Held-out ShareGPT prompts for the real acceptance length."),
    export_to: str | None = typer.Option(
        None, "--export", help="Write the final drafter here (z-lab layout)."
    ),
    init: str | None = typer.Option(
        None,
        "--init",
        help="Start from this drafter's weights (a new run, "
        "fresh optimizer), e.g. to continue a shipped one.",
    ),
    feature_cache_gb: float = typer.Option(
        4.0,
        help="RAM for keeping the target's features between epochs "
        "(past it they are recomputed; 0: never kept).",
    ),
):
    """Train a drafter on self-distilled data (the paper's recipe); Ctrl-C checkpoints and stops, and the
    same command resumes.

    A resumed run keeps its recipe and architecture; --steps, --eval-every, --checkpoint-every,
    --micro-batch, --eval-prompts, --feature-cache-gb and --export may change.
    """
    with user_errors(RUN_FLAGS):
        if not out.strip():  # (not the current folder)
            raise UserError("--out is empty: give the run's folder")
        recipe = {
            "lr": lr,
            "warmup": warmup,
            "anchors": anchors,
            "batch_size": batch_size,
            "precision": precision,
            "vocab": vocab,
            "num_layers": layers,
            "intermediate_size": intermediate_size,
            "block_size": block_size,
            "mask_token_id": mask_token_id,
            "target_layer_ids": _layer_ids(target_layer_ids) if target_layer_ids is not None else None,
        }
        prepared = prepare_run(
            data,
            out,
            model,
            recipe,
            steps=steps,
            checkpoint_every=checkpoint_every,
            eval_every=eval_every,
            micro_batch=micro_batch,
            init=init,
            eval_prompts=eval_prompts,
            feature_cache_gb=feature_cache_gb,
            export_to=export_to,
            note=lambda line: typer.echo(line, err=True),
        )
        with progress_bar("training", detail=True, disable=prepared.done) as bar:
            task = bar.add_task("", total=prepared.cfg.steps, completed=prepared.step)

            def on_step(r):
                desc = f"loss {r['loss']:.3f}  {r['block_tokens'] / r['seconds']:.0f} block tokens/s"
                if "offline_tau" in r:
                    desc += f"  offline tau {r['offline_tau']:.2f}" + (
                        f"  tau {r['tau']:.2f}" if "tau" in r else ""
                    )
                    bar.console.print(f"step {r['step']}: {desc}")
                if r.get("eval_error", "interrupted") != "interrupted":  # (a stop cut it short: said)
                    bar.console.print(
                        f"step {r['step']}: the held-out tau check failed ({r['eval_error']}); "
                        "training goes on",
                        markup=False,
                    )
                bar.update(task, completed=r["step"], description=desc)

            end = prepared.train(on_step, note=lambda line: bar.console.print(line, markup=False))
    code = 128 + end.stopped_by if end.stopped_by else 130
    if end.interrupted:
        typer.secho(
            f"interrupted at step {end.step}: "
            + (
                f"the checkpoint of step {end.checkpoint} is kept; run the same command to go on from it"
                if end.checkpoint
                else "no checkpoint yet"
            ),
            fg="red",
            err=True,
        )
        raise typer.Exit(code)
    if end.stopped_by and end.step < end.steps:
        typer.echo(
            f"stopped at step {end.step} of {end.steps} with a checkpoint: run the same command to go on",
            err=True,
        )
        raise typer.Exit(code)
    if end.exported:
        typer.echo(f"drafter written to {export_to}")


def _layer_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        raise UserError(
            f"--target-layer-ids takes comma-separated layer numbers, e.g. 1,14,27; got {text!r}"
        ) from None
    if len(set(ids)) < len(ids):  # (a layer's features twice: a wider input that adds nothing)
        raise UserError(f"--target-layer-ids names a layer twice: {text}")
    return ids


@app.command("eval")
def evaluate(
    draft: str = typer.Option(..., "--draft", "-d", help="The drafter to measure."),
    model: Model = DEMO,
    prompts: str = typer.Option(
        "sharegpt-heldout",
        help="sharegpt-heldout, humaneval, a .jsonl file, hf:..., or any other prompt set bench takes",
    ),
    limit: int | None = typer.Option(None, help="Use the first N prompts (default or 0: all)."),
    block_size: int | None = typer.Option(
        None, help="The fixed DFlash block every cycle drafts (default: the drafter's own; no lookup)."
    ),
    temp: Temp = 0.0,
    max_tokens: MaxTokens = 256,
    as_json: Json = False,
    think: Think = None,
):
    """Mean acceptance length tau of a drafter on a prompt set, from real stream_generate runs."""
    with user_errors():
        settings = GenerationSettings.answers(temperature=temp, block_size=block_size, max_tokens=max_tokens)
        ps = first_prompts(prompts, limit)
        target, drafter, tokenizer = load_pair(model, draft)
        answers, interrupted = [], False
        with progress_bar("answering prompts") as bar, terminated_as_interrupted() as terminated:
            task = bar.add_task("", total=len(ps))
            kwargs = template_kwargs(model, think, tokenizer)
            try:
                with ctrl_c_in_mlx():
                    for answer in answers_on_prompts(target, drafter, tokenizer, ps, settings, kwargs):
                        answers.append(answer)
                        bar.update(task, completed=len(answers))
            except KeyboardInterrupt:  # (the prompts answered so far are measured: hours on a CPU)
                interrupted = True
        if not answers:
            typer.echo(f"stopped {stopped_by(terminated)} before an answer ended: nothing measured", err=True)
            raise typer.Exit(interrupted_code(terminated))
    r = tau_of(answers)
    r.update(
        prompts=prompts,
        n_prompts=len(answers),
        block_size=block_size or drafter.block_size,
        temperature=temp,
        interrupted=interrupted,
    )
    stopped = f", stopped after {len(answers)} of {len(ps)}" if interrupted else ""
    typer.echo(
        json.dumps(r)
        if as_json
        else f"tau {r['tau']:.2f} over {r['cycles']} cycles, {r['tokens']} tokens, "
        f"{counted(len(answers), 'prompt')} ({prompts}, block {r['block_size']}, temperature {temp}{stopped})"
    )
    if interrupted:
        raise typer.Exit(interrupted_code(terminated))
