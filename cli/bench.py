"""`dflash-mlx bench`."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import typer
from rich.markdown import Markdown

from dflash_mlx.bench import (
    has_matplotlib,
    markdown,
    run_bench,
    run_concurrent,
    run_fresh,
    settings_grid,
    write,
)
from dflash_mlx.errors import UserError
from dflash_mlx.loading import draft_for, load_pair, template_kwargs

from .options import (
    DEMO,
    Draft,
    DraftWindow,
    MaxTokens,
    Model,
    NoLookup,
    Think,
    first_prompts,
    progress_bar,
    stdout,
    user_errors,
)


def bench(
    model: Model = DEMO,
    draft: Draft = None,
    prompts: str = typer.Option(
        "humaneval",
        help="humaneval, sharegpt-heldout, edit, adversarial, long-2k, long-6k, a .jsonl file, or "
        "hf:org/name (e.g. hf:openai/gsm8k/main:test:question).",
    ),
    limit: int | None = typer.Option(20, help="Use the first N prompts (0: all)."),
    block_sizes: str = typer.Option(
        "16,adaptive",
        help="Comma-separated policies: fixed block sizes, treeN (a tree in a pass as wide as a "
        "block of N, every cycle), and 'adaptive' (each cycle chooses).",
    ),
    no_lookup: NoLookup = False,
    draft_window: DraftWindow = None,
    temps: str = typer.Option("0", help="Comma-separated temperatures (identity is checked at 0)."),
    max_tokens: MaxTokens = 256,
    rounds: int = typer.Option(
        1,
        help="Run every prompt this many times (all, then all again); a speedup is the rounds' median "
        "(a noisy machine).",
    ),
    out: str = typer.Option(
        "bench-results", "--out", "-o", help="Folder for results.json, summary.md, plot.png."
    ),
    think: Think = None,
    concurrency: str | None = typer.Option(
        None,
        help="Comma-separated numbers of answers at a time (e.g. 1,2,4,8): all the prompts at once through "
        "our engine and mlx-lm's continuous batching, aggregate tokens/s (adaptive policy, temperature 0).",
    ),
    fresh: int | None = typer.Option(
        None,
        help="Answer each prompt in new processes, as `generate` does (plain decoding and each policy in "
        "one of their own, temperature 0), N times each: the first answer's speed, where a GPU compiles "
        "kernels on first use, and the Nth's.",
    ),
):
    """DFlash against plain mlx-lm decoding of the same target, prompt by prompt (or many at once with
    --concurrency), in one process (or, with --fresh, in new ones)."""
    with user_errors():
        try:
            bs = [_policy(x.strip()) for x in block_sizes.split(",")]
            ts = [float(x) for x in temps.split(",")]
            levels = [int(x) for x in concurrency.split(",")] if concurrency is not None else None
        except ValueError:
            raise UserError(
                f"--block-sizes takes block sizes, trees and 'adaptive', --temps and --concurrency "
                f"numbers, comma-separated, e.g. 4,16,tree16,adaptive, 0,1 and 1,2,4,8; "
                f"got {block_sizes!r}, {temps!r} "
                f"and {concurrency!r}"
            ) from None
        if rounds < 1 or (rounds > 1 and concurrency is not None):
            raise UserError(f"--rounds takes a number of 1 or more, without --concurrency; got {rounds}")
        if fresh is not None and (fresh < 1 or rounds > 1 or levels is not None or set(ts) != {0.0}):
            raise UserError(
                f"--fresh takes a number of answers of 1 or more, at temperature 0, without --rounds or "
                f"--concurrency; got --fresh {fresh}"
            )
        if levels is not None and (not levels or min(levels) < 1):
            raise UserError(f"--concurrency takes numbers of answers of 1 or more, got {concurrency!r}")
        grid = settings_grid(bs, ts, max_tokens, lookup=not no_lookup, draft_window=draft_window)
        folder = Path(out).expanduser()
        if folder.exists() and not folder.is_dir():
            raise UserError(f"--out {out} is a file: give a folder for the results")
        made = not folder.exists()
        try:  # the folder must take files now, not after hours of benchmarking
            folder.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as e:
            raise OSError(
                f"cannot write the results to --out {out} ({e.strerror or e}): give another folder"
            ) from None
        try:
            ps = first_prompts(prompts, limit)
            target, drafter, tokenizer = load_pair(model, draft)
            name = draft_for(model, draft)
            if not has_matplotlib() and levels is None:
                typer.echo(
                    "note: matplotlib is not installed, so no plot.png (pip install 'dflash-mlx[bench]')",
                    err=True,
                )
            with progress_bar("{task.description}") as bar:
                done = lambda d, _: bar.update(task, completed=d, description="benchmarking")  # noqa: E731
                if levels is not None:
                    task = bar.add_task("warming up (not counted)", total=len(levels))
                    results = run_concurrent(
                        target,
                        drafter,
                        tokenizer,
                        ps,
                        concurrency=levels,
                        max_tokens=max_tokens,
                        template_kwargs=template_kwargs(model, think, tokenizer),
                        progress=done,
                    )
                else:
                    common = dict(
                        block_sizes=bs,
                        lookup=not no_lookup,
                        draft_window=draft_window,
                        max_tokens=max_tokens,
                        template_kwargs=template_kwargs(model, think, tokenizer),
                        progress=done,
                    )
                    if fresh is not None:
                        task = bar.add_task("loading", total=len(ps) * (1 + len(grid)))
                        results = run_fresh(
                            (model, draft), target, drafter, tokenizer, ps, answers=fresh, **common
                        )
                    else:
                        runs = len({t for _, t in grid}) + len(grid)  # the plain baseline at each temperature
                        task = bar.add_task("warming up (not counted)", total=rounds * len(ps) * runs)
                        results = run_bench(
                            target, drafter, tokenizer, ps, temperatures=ts, rounds=rounds, **common
                        )
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
    summary = paths[1].read_text()
    if sys.stdout.isatty():
        stdout().print(Markdown(summary))
    else:  # (piped: the Markdown itself, which reads as text and keeps its tables whole)
        typer.echo(summary)
    typer.echo("wrote " + ", ".join(str(p) for p in paths))
    bad = [s for s in results.get("summary", results.get("concurrency")) if s["identical"] is False]
    if bad:
        typer.secho(
            f"error: DFlash output differed from plain greedy decoding on prompts "
            f"{sorted({p for s in bad for p in s['mismatched_prompts']})}: speculative decoding must be "
            "lossless, so this is a bug",
            fg="red",
            err=True,
        )
    if results.get("interrupted"):
        typer.secho(
            f"stopped with Ctrl-C: the results cover the {len(results['prompts'])} prompt runs finished by "
            "then",
            fg="yellow",
            err=True,
        )
        raise typer.Exit(130)
    if bad:
        raise typer.Exit(1)


def _policy(name: str) -> int | str | None:
    """A --block-sizes entry: 'adaptive' -> None, 'treeN' -> itself, 'N' -> N."""
    if name == "adaptive":
        return None
    if name.startswith("tree"):
        int(name[4:])  # (a ValueError if it is not a number)
        return name
    return int(name)
