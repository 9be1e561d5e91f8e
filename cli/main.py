"""The `dflash-mlx` command."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer

from dflash_mlx.errors import AlreadyExists, UserError

app = typer.Typer(help="DFlash speculative decoding for MLX.", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_show_locals=False)


@app.callback()
def main():
    """DFlash block-diffusion speculative decoding for MLX."""


@contextmanager
def user_errors():
    """Bad input (a UserError) or a failed file, permission or network operation (an OSError) ends the command
    with one clear line on stderr and exit code 1; any other exception is a bug, shown with its traceback."""
    try:
        yield
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        raise typer.Exit(141)
    except (UserError, OSError) as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(1)


@app.command()
def convert(
    source: str = typer.Argument(..., help="Drafter or target: Hugging Face id, folder, or .gguf file."),
    output: str = typer.Argument(..., help="Folder to write (must not exist unless --force)."),
    dtype: Optional[str] = typer.Option(None, help="float16, bfloat16 or float32 (drafter default: bfloat16; "
                                                   "a GGUF target keeps its quantization unless given)."),
    quantize: bool = typer.Option(False, "-q", "--quantize", help="Quantize the weights."),
    q_bits: Optional[int] = typer.Option(None, help="Bits per weight when quantizing (default 4)."),
    q_group_size: Optional[int] = typer.Option(None, help="Group size when quantizing (default 64)."),
    export: bool = typer.Option(False, help="Export an MLX drafter to z-lab's Hugging Face layout "
                                            "(bf16; vLLM and SGLang read it)."),
    force: bool = typer.Option(False, help="Replace OUTPUT if it exists."),
):
    """Convert a drafter or a target to an MLX folder, or export a drafter to z-lab's layout."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from dflash_mlx.convert import DTYPES, convert_draft, convert_target, export_draft, is_drafter
    from dflash_mlx.loading import is_gguf

    with user_errors():
        if dtype is not None and dtype not in DTYPES:
            raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype}")
        if export and (dtype is not None or quantize or q_bits is not None or q_group_size is not None):
            raise UserError("--export always writes bf16 weights, unquantized: leave out --dtype, -q and --q-*")
        if not quantize and (q_bits is not None or q_group_size is not None):
            raise UserError("--q-bits and --q-group-size take effect only with -q/--quantize: add it")
        q_bits, q_group_size = 4 if q_bits is None else q_bits, 64 if q_group_size is None else q_group_size
        if Path(output).expanduser().exists() and not force:  # before any download
            raise AlreadyExists(f"{output} already exists (pass --force to replace it)")
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=_stderr()) as bar:
            task = bar.add_task(f"converting {source}")

            def step(what: str):
                bar.update(task, description=f"{source}: {what}")

            src = Path(source).expanduser()
            if export:
                step("exporting drafter")
                out = export_draft(source, output, force)
                kind = "drafter (z-lab layout)"
            elif is_gguf(src):
                out = convert_target(source, output, dtype, quantize, q_bits, q_group_size, force, step)
                kind = "target from GGUF"
            else:
                from dflash_mlx.loading import find_pair, resolve_draft, resolve_target

                step("fetching")
                # A registry name converts its target (as --model reads it); anything else resolves as -d
                # does: a drafter shipped in models/, a folder or a Hugging Face id.
                folder = (resolve_target(source, DTYPES[dtype] if dtype else None)  # a GGUF one at --dtype
                          if find_pair(source) else resolve_draft(source))
                if is_drafter(folder):
                    step("converting drafter")
                    out = convert_draft(str(folder), output, dtype or "bfloat16", quantize, q_bits, q_group_size, force)
                    kind = "drafter"
                else:
                    step("converting target with mlx-lm")
                    out = convert_target(str(folder), output, dtype, quantize, q_bits, q_group_size, force)
                    kind = "target"
            bar.update(task, description=f"{source}: done")
    size = sum(f.stat().st_size for f in Path(out).rglob("*") if f.is_file())
    typer.echo(f"wrote {kind} to {out} ({size / 1e6:.1f} MB)")


DEMO = "smollm2-135m-instruct"
THINK = typer.Option(None, "--think/--no-think", help="Qwen3-style thinking on or off (where the template has it; "
                                                      "default: the registry pair's setting, else the template's).")


@app.command("generate")
def generate_cmd(
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="The prompt (default: read stdin)."),
    model: str = typer.Option(DEMO, "--model", "-m", help="Target: registry name, HF id, folder or .gguf."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="Drafter (default: the registry's for --model)."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Most tokens to generate."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling threshold."),
    top_k: int = typer.Option(0, "--top-k", help="Sample from the k most likely tokens (0 = off)."),
    min_p: float = typer.Option(0.0, "--min-p", help="Min-p sampling threshold (0 = off)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed."),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="Tokens per drafted block."),
    no_draft: bool = typer.Option(False, "--no-draft", help="Plain mlx-lm decoding of the target (baseline)."),
    chat_template: bool = typer.Option(True, "--chat-template/--no-chat-template",
                                       help="Wrap the prompt in the model's chat template."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt (with the chat template)."),
    think: Optional[bool] = THINK,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON record instead of the text."),
):
    """Answer one prompt: the text on stdout, the statistics on stderr."""
    import time

    from dataclasses import asdict

    import dflash_mlx
    from dflash_mlx.loading import load, load_pair, template_kwargs
    from dflash_mlx.settings import GenerationSettings

    from .chat import check_utf8

    if prompt is None:
        if sys.stdin.isatty():
            typer.secho("error: give --prompt, or pipe the prompt on stdin", fg="red", err=True)
            raise typer.Exit(2)
        prompt = sys.stdin.read().removesuffix("\n")  # the newline `echo` adds, as $(...) drops it
    with user_errors():
        settings = GenerationSettings(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p, max_tokens=max_tokens,
                                      block_size=block_size, seed=seed)  # checked before loading, for both paths
        if no_draft and (draft is not None or block_size is not None):
            raise UserError("--no-draft decodes without a drafter: drop --draft and --block-size")
        if (system is not None or think is not None) and not chat_template:
            raise UserError("--system and --think/--no-think need the chat template: drop --no-chat-template")
        check_utf8(prompt, "the prompt")
        if no_draft:
            (target, tokenizer), drafter = load(model), None
        else:
            target, drafter, tokenizer = load_pair(model, draft)
        ids = (dflash_mlx.apply_chat_template(tokenizer, prompt, system=system, **template_kwargs(model, think))
               if chat_template else tokenizer.encode(prompt, verbose=False))
        tic = time.perf_counter()
        if drafter is None:
            text, tokens, last, acc = _plain(target, tokenizer, ids, as_json, settings)
        else:
            text, tokens, last, acc = [], [], None, []
            for last in dflash_mlx.stream_generate(target, drafter, tokenizer, ids, **asdict(settings)):
                if not as_json:
                    sys.stdout.write(last.text)
                    sys.stdout.flush()
                text.append(last.text)
                tokens += last.tokens
                if last.accepted is not None:
                    acc.append(last.accepted)
            text = "".join(text)
        wall = time.perf_counter() - tic
        tau = sum(acc) / len(acc) if acc else None
        record = {"text": text, "tokens": tokens, "prompt_tokens": len(ids), "generation_tokens": len(tokens),
                  "mean_acceptance": tau, "cycles": len(acc), "prompt_tps": last.prompt_tps if last else 0.0,
                  "generation_tps": last.generation_tps if last else 0.0, "wall_s": wall,
                  "peak_memory_gb": last.peak_memory if last else 0.0,
                  "finish_reason": last.finish_reason if last else "length",  # (--max-tokens 0, as generate())
                  "model": model, "draft": None if drafter is None else (draft or "registry")}
        if as_json:  # (inside user_errors: a reader gone away ends it quietly, as for the text)
            typer.echo(json.dumps(record))
            return
        typer.echo()
    stats = f"{len(tokens)} tokens"
    if len(tokens) > 1:  # a rate needs a second token (the first comes with the prompt)
        stats += f", {record['generation_tps']:.1f} tokens/s"
    stats += f", prompt {record['prompt_tps']:.0f} tokens/s"
    if tau is not None:
        stats += f", mean acceptance {tau:.2f} over {len(acc)} cycles"
    typer.secho(stats, err=True, dim=True)


def _plain(model, tokenizer, ids, quiet, settings):
    """The baseline: mlx-lm's own decoding of the target."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from dflash_mlx.pairing import context_room

    s = settings
    max_tokens = min(s.max_tokens, context_room(model, len(ids)))  # as stream_generate does
    if max_tokens == 0:  # (mlx-lm would read 0 as an error)
        return "", [], None, []
    if s.seed is not None:
        mx.random.seed(s.seed)
    sampler = make_sampler(s.temperature, top_p=s.top_p if s.top_p < 1 else 0.0, min_p=s.min_p, top_k=s.top_k)
    text, tokens, last = [], [], None
    for last in stream_generate(model, tokenizer, ids, max_tokens=max_tokens, sampler=sampler):
        if not quiet:
            sys.stdout.write(last.text)
            sys.stdout.flush()
        text.append(last.text)
        tokens.append(last.token)
    # mlx-lm counts the first token in its rate but not the time it took; ours counts neither
    last.generation_tps *= (len(tokens) - 1) / len(tokens)
    return "".join(text), tokens, last, []


@app.command()
def chat(
    model: str = typer.Option(DEMO, "--model", "-m", help="Target: registry name, HF id, folder or .gguf."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="Drafter (default: the registry's for --model)."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy)."),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="Tokens per drafted block."),
    max_tokens: int = typer.Option(1024, "--max-tokens", help="Longest answer."),
    think: Optional[bool] = THINK,
    hide_thinking: bool = typer.Option(False, help="Do not show thinking text (it is shown dimmed)."),
):
    """Talk to a model in the terminal; answers stream as the target accepts them."""
    from rich.console import Console

    from dflash_mlx.chat import ChatSession
    from dflash_mlx.loading import draft_for, load_pair, template_kwargs
    from dflash_mlx.platform import backend
    from dflash_mlx.settings import GenerationSettings

    from .chat import run

    console = Console(highlight=False)
    with user_errors():
        GenerationSettings(temperature=temp, block_size=block_size, max_tokens=max_tokens).answering()  # before loading
        with console.status(f"loading {model} ..."):
            target, drafter, tokenizer = load_pair(model, draft)
            name = draft_for(model, draft)
        session = ChatSession(target, drafter, tokenizer, system=system, temperature=temp, block_size=block_size,
                              max_tokens=max_tokens,
                              template_kwargs=template_kwargs(model, think))
    run(session, console, f"[bold]dflash-mlx chat[/bold] · {model} + {name} · {backend()}", hide_thinking)


@app.command()
def models(as_json: bool = typer.Option(False, "--json", help="Print JSON.")):
    """Known target/drafter pairs, and what is already on this machine."""
    from rich.console import Console
    from rich.table import Table

    from dflash_mlx.loading import local_copies, registry

    rows = [dict(name=p.name, target=p.target, draft=p.draft, block_size=p.block_size, family=p.family,
                 disk=p.disk, notes=p.notes, local=local_copies(p)) for p in registry()]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    console = Console()
    for r in rows:
        r["local"] = ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in r["local"].items()) or "-"
    if console.width < 160:  # a seven-column table wraps into slivers: one block per pair instead
        console.print("target / drafter pairs (dflash-mlx chat --model NAME)", style="bold")
        for r in rows:
            console.print(f"\n{r['name']}", style="bold", markup=False, highlight=False)
            for label, key in (("target", "target"), ("drafter", "draft"), ("family", "family"), ("disk", "disk"),
                               ("notes", "notes"), ("here", "local")):
                console.print(f"  {label:<8}{r[key]}", markup=False, highlight=False, soft_wrap=True)
        return
    t = Table(title="target / drafter pairs (dflash-mlx chat --model NAME)")
    for col in ("name", "target", "drafter", "family", "disk", "notes", "on this machine"):
        # Names and ids must stay whole to be copied: the name never wraps, ids fold rather than get cut.
        t.add_column(col, no_wrap=col == "name", overflow="fold" if col in ("target", "drafter") else "ellipsis")
    for r in rows:
        t.add_row(r["name"], r["target"], r["draft"], r["family"], r["disk"], r["notes"], r["local"])
    console.print(t)


@app.command()
def doctor(as_json: bool = typer.Option(False, "--json", help="Print JSON.")):
    """What this machine runs MLX with, and what would make it faster."""
    from dflash_mlx.platform import report

    r = report()
    if as_json:
        typer.echo(json.dumps(r, indent=2))
        return
    for key, value in r["facts"].items():
        typer.echo(f"{key:>18}: {value}")
    for line in r["advice"]:
        typer.secho(f"advice: {line}", fg="yellow")
    if not r["advice"]:
        typer.secho("all good", fg="green")


@app.command()
def bench(
    model: str = typer.Option(DEMO, "--model", "-m", help="Target: registry name, HF id, folder or .gguf."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="Drafter (default: the registry's for --model)."),
    prompts: str = typer.Option("humaneval", help="humaneval, sharegpt-heldout, a .jsonl file, or hf:org/name "
                                                  "(e.g. hf:openai/gsm8k/main:test:question)."),
    limit: Optional[int] = typer.Option(20, help="Use the first N prompts (0: all)."),
    block_sizes: str = typer.Option("16", help="Comma-separated block sizes."),
    temps: str = typer.Option("0", help="Comma-separated temperatures (identity is checked at 0)."),
    max_tokens: int = typer.Option(256, help="Tokens per answer."),
    out: str = typer.Option("bench-results", "--out", "-o", help="Folder for results.json, summary.md, plot.png."),
    think: Optional[bool] = THINK,
):
    """DFlash against plain mlx-lm decoding of the same target, prompt by prompt, in one process."""
    from rich.console import Console
    from rich.markdown import Markdown
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from dflash_mlx.bench import has_matplotlib, markdown, run_bench, settings_grid, write
    from dflash_mlx.loading import draft_for, load_pair, template_kwargs

    with user_errors():
        try:
            bs = [int(x) for x in block_sizes.split(",")]
            ts = [float(x) for x in temps.split(",")]
        except ValueError:
            raise UserError(f"--block-sizes and --temps take comma-separated numbers, e.g. 4,16 and 0,1; "
                             f"got {block_sizes!r} and {temps!r}") from None
        grid = settings_grid(bs, ts, max_tokens)
        folder = Path(out).expanduser()
        if folder.exists() and not folder.is_dir():
            raise UserError(f"--out {out} is a file: give a folder for the results")
        made = not folder.exists()
        try:  # the folder must take files now, not after hours of benchmarking
            folder.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as e:
            raise OSError(f"cannot write the results to --out {out} ({e.strerror or e}): give another folder") from None
        try:
            ps = _first_prompts(prompts, limit)
            target, drafter, tokenizer = load_pair(model, draft)
            name = draft_for(model, draft)
            if not has_matplotlib():
                typer.echo("note: matplotlib is not installed, so no plot.png (pip install 'dflash-mlx[bench]')",
                           err=True)
            with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeRemainingColumn(), console=_stderr()) as bar:
                runs = len({t for _, t in grid}) + len(grid)  # the plain baseline at each temperature, then DFlash
                task = bar.add_task("warming up (not counted)", total=len(ps) * runs)
                results = run_bench(target, drafter, tokenizer, ps, block_sizes=bs, temperatures=ts,
                                    max_tokens=max_tokens, template_kwargs=template_kwargs(model, think),
                                    progress=lambda d, _: bar.update(task, completed=d, description="benchmarking"))
        except BaseException:  # nothing to show: do not leave behind an empty folder this run made
            if made and not any(folder.iterdir()):
                folder.rmdir()
            raise
        results.update(model=model, draft=name, prompt_set=prompts)
        title = f"dflash-mlx bench: {model} + {name} on {prompts}"
        try:
            paths = write(results, folder, title)
        except OSError:
            typer.echo(markdown(results, title))  # the numbers are not lost with the files
            raise
    Console().print(Markdown(paths[1].read_text()))
    typer.echo("wrote " + ", ".join(str(p) for p in paths))
    bad = [s for s in results["summary"] if s["identical"] is False]
    if bad:
        typer.secho(f"error: DFlash output differed from plain greedy decoding on prompts "
                    f"{sorted({p for s in bad for p in s['mismatched_prompts']})}: speculative decoding must be "
                    "lossless, so this is a bug", fg="red", err=True)
    if results["interrupted"]:
        typer.secho(f"stopped with Ctrl-C: the results cover the {len(results['prompts'])} prompts finished by then",
                    fg="yellow", err=True)
        raise typer.Exit(130)
    if bad:
        raise typer.Exit(1)


train_app = typer.Typer(help="Train a DFlash drafter: make data, train, measure.", no_args_is_help=True)
app.add_typer(train_app, name="train")


@train_app.command("data")
def train_data(
    out: str = typer.Option(..., "--out", "-o", help="Folder for the token-id shards (resumes if it has some)."),
    model: str = typer.Option(DEMO, "--model", "-m", help="The target that writes the answers."),
    source: str = typer.Option("sharegpt", help="sharegpt, sharegpt-followup, python-stdlib, humaneval, a .jsonl file, "
                                                 "or hf:org/name\\[/config]\\[:split\\[:field]]."),  # \\[ : literal [ in rich help
    limit: Optional[int] = typer.Option(None, help="Stop after this many sequences."),
    max_new_tokens: int = typer.Option(256, help="Longest answer."),
    max_prompt_tokens: int = typer.Option(384, help="Skip longer prompts."),
    batch_size: int = typer.Option(64, help="Prompts generated together."),
    shard_size: int = typer.Option(64, help="Sequences per shard (the resume granularity)."),
    think: Optional[bool] = THINK,
):
    """Self-distillation: the target answers prompts; its answers become training sequences."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from dflash_mlx.data import generate_data, prompt_source, resume_point
    from dflash_mlx.loading import load, template_kwargs
    from dflash_mlx.models.targets import Target

    with user_errors():
        if limit is not None and limit < 0:
            raise UserError(f"--limit must be >= 0, got {limit}")
        prompts = prompt_source(source)
        total = min(limit or len(prompts), len(prompts))
        folder = Path(out).expanduser()
        done, consumed = resume_point(folder, source, max(shard_size, 1))
        if consumed >= len(prompts) or (limit is not None and done >= limit):
            typer.echo(f"{done} sequences in {out}: nothing left to generate")
            return
        target, tokenizer = load(model)
        Target(target)  # a family `train run` cannot use is refused before hours of generation
        with Progress(TextColumn("generating answers"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      console=_stderr()) as bar:
            task = bar.add_task("", total=total, completed=done)
            n = generate_data(target, tokenizer, prompts, folder, max_new_tokens=max_new_tokens,
                              batch_size=batch_size, shard_size=shard_size, max_prompt_tokens=max_prompt_tokens,
                              limit=limit, source=source, template_kwargs=template_kwargs(model, think),
                              progress=lambda k, _: bar.update(task, completed=k))
            bar.update(task, completed=total)  # done: prompts skipped as too long never count towards the bar
    typer.echo(f"{n} sequences in {out}")


@train_app.command("run")
def train_run(
    data: list[str] = typer.Option(..., "--data", help="Folder made by `dflash-mlx train data` (repeat the "
                                                     "option to mix folders; the first one's first sequences "
                                                     "are held out)."),
    out: str = typer.Option(..., "--out", "-o", help="Run folder: checkpoints, log; resumes if it has one."),
    model: str = typer.Option(DEMO, "--model", "-m", help="The target (frozen)."),
    layers: Optional[int] = typer.Option(None, help="Drafter layers (1-5 is typical; default 2)."),
    intermediate_size: Optional[int] = typer.Option(None, help="Drafter MLP width (default: the target's; "
                                                               "the hidden width is always the target's)."),
    block_size: Optional[int] = typer.Option(None, help="Block size B (default 16, or the --init drafter's)."),
    target_layer_ids: Optional[str] = typer.Option(None, help="Comma-separated target layers to tap "
                                                              "(default: the paper's spread)."),
    mask_token_id: Optional[int] = typer.Option(None, help="Token id used as MASK (default: a spare special token)."),
    steps: Optional[int] = typer.Option(None, help="Training steps, one sequence each (default 2000; resuming: "
                                                   "the run's, and a larger one stretches its schedule)."),
    lr: Optional[float] = typer.Option(None, help="Peak learning rate (default 6e-4)."),
    warmup: Optional[int] = typer.Option(None, help="Warm-up steps (default 100)."),
    anchors: Optional[int] = typer.Option(None, help="Blocks per sequence and step (default 64)."),
    vocab: Optional[str] = typer.Option(None, help="The loss's softmax over the 'full' vocabulary (the paper's, "
                                                   "default) or only the tokens the training answers use, 'data' "
                                                   "(~1.5x faster with a large vocabulary; drafting still uses "
                                                   "all of it)."),
    checkpoint_every: Optional[int] = typer.Option(None, help="Steps between checkpoints (default 100)."),
    eval_every: Optional[int] = typer.Option(None, help="Steps between evaluations (default 0: at the end only)."),
    eval_prompts: int = typer.Option(8, help="Held-out ShareGPT prompts for the real acceptance length."),
    export_to: Optional[str] = typer.Option(None, "--export", help="Write the final drafter here (z-lab layout)."),
    init: Optional[str] = typer.Option(None, "--init", help="Start from this drafter's weights (a new run, "
                                                            "fresh optimizer), e.g. to continue a shipped one."),
    feature_cache_gb: float = typer.Option(4.0, help="RAM for keeping the target's features between epochs "
                                                     "(past it they are recomputed; 0: never kept)."),
):
    """Train a drafter on self-distilled data (the paper's recipe); Ctrl-C checkpoints and stops, re-run to resume.

    A resumed run keeps its recipe and architecture; --steps, --eval-every and --checkpoint-every may change.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from dflash_mlx.train_run import prepare_run

    with user_errors():
        recipe = {"lr": lr, "warmup": warmup, "anchors": anchors, "vocab": vocab, "num_layers": layers,
                  "intermediate_size": intermediate_size, "block_size": block_size, "mask_token_id": mask_token_id,
                  "target_layer_ids": _layer_ids(target_layer_ids) if target_layer_ids else None}
        run = prepare_run(data, out, model, recipe, steps=steps, checkpoint_every=checkpoint_every,
                          eval_every=eval_every, init=init, eval_prompts=eval_prompts,
                          feature_cache_gb=feature_cache_gb, export_to=export_to,
                          note=lambda line: typer.echo(line, err=True))
        with Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                      TimeRemainingColumn(), console=_stderr(), disable=run.done) as bar:
            task = bar.add_task("", total=run.cfg.steps, completed=run.step)

            def on_step(r):
                desc = f"loss {r['loss']:.3f}  {r['block_tokens'] / r['seconds']:.0f} block tokens/s"
                if "offline_tau" in r:
                    desc += f"  offline tau {r['offline_tau']:.2f}" + (f"  tau {r['tau']:.2f}" if "tau" in r else "")
                    bar.console.print(f"step {r['step']}: {desc}")
                if "eval_error" in r:
                    bar.console.print(f"step {r['step']}: the held-out tau check failed ({r['eval_error']}); "
                                      "training goes on")
                bar.update(task, completed=r["step"], description=desc)

            end = run.train(on_step, note=bar.console.print)
    code = 128 + end.stopped_by if end.stopped_by else 130
    if end.interrupted:
        typer.secho(f"interrupted at step {end.step}: " + (f"the checkpoint of step {end.checkpoint} is kept; run "
                    "the same command to go on from it" if end.checkpoint else "no checkpoint yet"), fg="red", err=True)
        raise typer.Exit(code)
    if end.stopped_by and end.step < end.steps:
        typer.echo(f"stopped at step {end.step} of {end.steps} with a checkpoint: run the same command to go on",
                   err=True)
        raise typer.Exit(code)
    if end.exported:
        typer.echo(f"drafter written to {export_to}")


def _layer_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"--target-layer-ids takes comma-separated layer numbers, e.g. 1,14,27; got {text!r}") from None


@train_app.command("eval")
def train_eval(
    draft: str = typer.Option(..., "--draft", "-d", help="The drafter to measure."),
    model: str = typer.Option(DEMO, "--model", "-m", help="Its target."),
    prompts: str = typer.Option("sharegpt-heldout", help="sharegpt-heldout, humaneval, a .jsonl file or hf:..."),
    limit: Optional[int] = typer.Option(None, help="Use the first N prompts (default or 0: all)."),
    block_size: Optional[int] = typer.Option(None, help="Block size (default: the drafter's)."),
    temp: float = typer.Option(0.0, "--temp", help="Temperature (rejection sampling above 0)."),
    max_tokens: int = typer.Option(256, help="Tokens per answer."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    think: Optional[bool] = THINK,
):
    """Mean acceptance length tau of a drafter on a prompt set, from real stream_generate runs."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from dflash_mlx.loading import load_pair, template_kwargs
    from dflash_mlx.settings import GenerationSettings
    from dflash_mlx.train_run import tau_on_prompts

    with user_errors():
        settings = GenerationSettings(temperature=temp, block_size=block_size, max_tokens=max_tokens).answering()
        ps = _first_prompts(prompts, limit)
        target, drafter, tokenizer = load_pair(model, draft)
        with Progress(TextColumn("answering prompts"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      console=_stderr()) as bar:
            task = bar.add_task("", total=len(ps))
            r = tau_on_prompts(target, drafter, tokenizer, ps, settings, template_kwargs=template_kwargs(model, think),
                               progress=lambda k: bar.update(task, completed=k))
    r.update(prompts=prompts, n_prompts=len(ps), block_size=drafter.block_size if block_size is None else block_size,
             temperature=temp)
    typer.echo(json.dumps(r) if as_json else
               f"tau {r['tau']:.2f} over {r['cycles']} cycles, {r['tokens']} tokens, {len(ps)} prompts "
               f"({prompts}, block {r['block_size']}, temperature {temp})")


def _first_prompts(source: str, limit: Optional[int]) -> list:
    """The first `limit` prompts of a prompt set (None or 0: all of them), for bench and train eval."""
    from dflash_mlx.data import prompt_source

    if limit is not None and limit < 0:
        raise UserError(f"--limit must be >= 0 (0: all prompts), got {limit}")
    return prompt_source(source)[:limit or None]


def _stderr():
    from rich.console import Console

    return Console(stderr=True)


@app.command()
def version():
    """Print the installed version."""
    from importlib.metadata import version as v

    typer.echo(f"dflash-mlx {v('dflash-mlx')}")


@app.command()
def profile(
    hidden: int = typer.Option(1024, help="Width of the random target."),
    layers: int = typer.Option(8, help="Decoder layers of the random target."),
    vocab: int = typer.Option(32000, help="Vocabulary size."),
    block_size: int = typer.Option(16, help="Tokens per drafted block."),
    cycles: int = typer.Option(24, help="Cycles (and repeats) to time."),
    as_json: bool = typer.Option(False, "--json", help="Print the raw numbers as JSON."),
):
    """Time one speculative cycle against its two model passes (random float32 models)."""
    from rich.console import Console
    from rich.table import Table

    from dflash_mlx.profile import profile as run

    with user_errors(), Console(stderr=True).status("timing cycles, verify and draft passes ..."):
        r = run(hidden, layers, vocab, block_size, cycles)
    if as_json:
        typer.echo(json.dumps(r, indent=2))
        return
    t = Table(title=f"one speculative cycle, random target {r['config']}", show_header=True)
    t.add_column("")
    t.add_column("draft step compiled", justify="right")
    t.add_column("draft step eager", justify="right")
    t.add_row("cycle (ms)", f"{r['cycle_ms_compiled']:.2f}", f"{r['cycle_ms_eager']:.2f}")
    t.add_row("verify pass alone (ms)", f"{r['verify_ms']:.2f}", f"{r['verify_ms']:.2f}")
    t.add_row("draft step alone (ms)", f"{r['draft_ms_compiled']:.2f}", f"{r['draft_ms_eager']:.2f}")
    t.add_row("runtime overhead", f"{r['overhead_compiled']:+.1%}", f"{r['overhead_eager']:+.1%}")
    Console().print(t)
    line = f"plain decoding: {r['ar_tokens_per_s']:.1f} tokens/s"
    if "ar_tokens_per_s_without_blas_preload" in r:
        line += f" (without the BLAS preload: {r['ar_tokens_per_s_without_blas_preload']:.1f} tokens/s)"
    typer.echo(line)
    typer.echo(f"BLAS: {r['blas']}; draft step traced {r['draft_traces']} time(s)")


if __name__ == "__main__":
    app()
