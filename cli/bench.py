"""`dflash-mlx bench`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.markdown import Markdown

from dflash_mlx.bench import (
    counted,
    has_matplotlib,
    markdown,
    run_bench,
    run_concurrent,
    run_fresh,
    settings_grid,
    write,
)
from dflash_mlx.errors import UserError
from dflash_mlx.files import check_writable
from dflash_mlx.loading import draft_for, load_pair, template_kwargs
from dflash_mlx.pairing import prepare
from dflash_mlx.platform import pip_install
from dflash_mlx.policy import batch_sizes, costs_for

from .options import (
    DEMO,
    Draft,
    DraftWindow,
    MaxTokens,
    Model,
    NoLookup,
    Think,
    first_prompts,
    interrupted_code,
    measuring,
    progress_bar,
    stdout,
    stopped_by,
    terminated_as_interrupted,
    user_errors,
)


def bench(
    model: Model = DEMO,
    draft: Draft = None,
    prompts: str = typer.Option(
        "humaneval",
        help="humaneval, sharegpt-heldout, edit, adversarial, long-2k, long-6k, a .jsonl file, or "
        "hf:org/name (e.g. hf:openai/gsm8k/main:test:question); train data's sources too (sharegpt, "
        "sharegpt-followup, python-stdlib).",
    ),
    limit: int | None = typer.Option(20, help="Use the first N prompts (0: all)."),
    block_sizes: str | None = typer.Option(
        None,
        help="Comma-separated policies: fixed block sizes, treeN (a tree in a pass as wide as a "
        "block of N, every cycle), and 'adaptive' (each cycle chooses).  [default: 16,adaptive]",
        show_default=False,
    ),
    no_lookup: NoLookup = False,
    draft_window: DraftWindow = None,
    temps: str | None = typer.Option(
        None,
        help="Comma-separated temperatures (identity is checked at 0).  [default: 0]",
        show_default=False,
    ),
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
    workers: int = typer.Option(
        1, help="With --concurrency: the worker threads that answer them, as `serve --workers`."
    ),
    processes: int = typer.Option(
        1, help="With --concurrency: the processes answering them, as `serve --processes`."
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
    with user_errors(
        {"temperature": "--temps", "block size": "--block-sizes", "tree": "--block-sizes' treeN"}
    ):
        if concurrency is not None and (block_sizes is not None or temps is not None):
            raise UserError(
                "--concurrency runs the adaptive policy at temperature 0: leave out "
                + " and ".join(
                    f for f, v in (("--block-sizes", block_sizes), ("--temps", temps)) if v is not None
                )
            )
        bs = _listed(
            "--block-sizes",
            "16,adaptive" if block_sizes is None else block_sizes,
            _policy,
            "4,16,tree16,adaptive",
        )
        ts = _listed("--temps", "0" if temps is None else temps, float, "0,0.7")
        if no_lookup and concurrency is None and all(isinstance(b, int) for b in bs):
            raise UserError(
                "--no-lookup leaves lookup out of the adaptive policy's and trees' proposals; fixed blocks "
                "use none: drop it, or add adaptive or treeN to --block-sizes"
            )
        levels = None if concurrency is None else _listed("--concurrency", concurrency, int, "1,2,4,8")
        if rounds < 1 or (rounds > 1 and concurrency is not None):
            raise UserError(f"--rounds takes a number of 1 or more, without --concurrency; got {rounds}")
        if fresh is not None and fresh < 1:
            raise UserError(f"--fresh takes a number of answers of 1 or more, got {fresh}")
        if fresh is not None and (rounds > 1 or levels is not None or set(ts) != {0.0}):
            raise UserError(  # (each fresh process answers greedily, once)
                "--fresh runs at temperature 0 without --rounds or --concurrency: leave out "
                + " and ".join(
                    f
                    for f, v in (
                        ("--temps", set(ts) != {0.0}),
                        ("--rounds", rounds > 1),
                        ("--concurrency", levels),
                    )
                    if v
                )
            )
        if levels is not None and (not levels or min(levels) < 1):
            raise UserError(f"--concurrency takes numbers of answers of 1 or more, got {concurrency!r}")
        for flag, value, most in (("--workers", workers, 256), ("--processes", processes, 64)):
            if not 1 <= value <= most:
                raise UserError(f"{flag} takes a number from 1 to {most}, with --concurrency; got {value}")
            if value > 1 and levels is None:
                raise UserError(f"{flag} sets how a --concurrency run answers: give --concurrency too")
        grid = settings_grid(bs, ts, max_tokens, lookup=not no_lookup, draft_window=draft_window)
        check_writable(out, "--out")  # now, not after hours of benchmarking
        folder = Path(out).expanduser()
        made = not folder.exists()
        folder.mkdir(parents=True, exist_ok=True)
        # SIGTERM (`timeout`, `kill`, a job's time limit) stops it as Ctrl-C does, keeping what finished
        with terminated_as_interrupted() as terminated:
            try:
                ps = first_prompts(prompts, limit)
                if levels is not None and max(levels) > len(ps):  # (each level's batches are priced first)
                    raise UserError(
                        f"--concurrency {max(levels)} runs more answers at once than there are prompts "
                        f"({len(ps)}): give more prompts (--limit) or fewer answers at once"
                    )
                target, drafter, tokenizer = load_pair(model, draft)
                name = draft_for(model, draft)
                rendering = template_kwargs(model, think, tokenizer)  # (a --think it has no switch for: now)
                if not has_matplotlib() and levels is None:
                    typer.echo(
                        f"note: matplotlib is not installed, so no plot.png ({pip_install('matplotlib')})",
                        err=True,
                    )
                if levels is not None or any(b is None for b, _ in grid):  # (not inside the warm-up's bar)
                    with measuring() as shown:
                        batches = batch_sizes(max(levels)) if levels else ()
                        costs_for(prepare(target, drafter), drafter, batches, progress=shown)
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
                            workers=workers,
                            processes=processes,
                            names=(model, draft),
                            max_tokens=max_tokens,
                            lookup=not no_lookup,
                            draft_window=draft_window,
                            template_kwargs=rendering,
                            progress=done,
                        )
                    else:
                        common = dict(
                            block_sizes=bs,
                            lookup=not no_lookup,
                            draft_window=draft_window,
                            max_tokens=max_tokens,
                            template_kwargs=rendering,
                            progress=done,
                        )
                        if fresh is not None:
                            task = bar.add_task("loading", total=len(ps) * (1 + len(grid)))
                            results = run_fresh(
                                (model, draft), target, drafter, tokenizer, ps, answers=fresh, **common
                            )
                        else:
                            # (the plain baseline at each temperature, then each setting)
                            runs = len({t for _, t in grid}) + len(grid)
                            task = bar.add_task("warming up (not counted)", total=rounds * len(ps) * runs)
                            results = run_bench(
                                target, drafter, tokenizer, ps, temperatures=ts, rounds=rounds, **common
                            )
            except BaseException as e:  # nothing to show: do not leave behind an empty folder this run made
                if made and not any(folder.iterdir()):
                    folder.rmdir()
                if isinstance(e, KeyboardInterrupt):
                    typer.secho(
                        f"stopped {stopped_by(terminated)} before anything finished: nothing written",
                        fg="yellow",
                        err=True,
                    )
                    if terminated:
                        raise typer.Exit(143) from None
                raise
        results.update(model=model, draft=name, prompt_set=prompts)
        title = f"dflash-mlx bench: {model} + {name} on {prompts}"
        # A stopped run's part never replaces an earlier run's complete results: it is shown only.
        kept = results.get("interrupted") and _complete(folder / "results.json")
        try:
            paths = [] if kept else write(results, folder, title)
        except OSError:
            typer.echo(markdown(results, title))  # the numbers are not lost with the files
            raise
    summary = markdown(results, title) if kept else paths[1].read_text()
    if sys.stdout.isatty():
        stdout().print(Markdown(summary))
    else:  # (piped: the Markdown itself, which reads as text and keeps its tables whole)
        typer.echo(summary)
    if paths:
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
        done = (
            counted(len(results["concurrency"]), "level")
            if "concurrency" in results
            else counted(len(results["prompts"]), "prompt run")
        )
        kept_note = (
            f"; {out} keeps an earlier run's complete results, so these are not written there (give "
            "another --out to keep them)"
            if kept
            else ""
        )
        typer.secho(
            f"stopped {stopped_by(terminated)}: the results cover the {done} finished by then{kept_note}",
            fg="yellow",
            err=True,
        )
        raise typer.Exit(interrupted_code(terminated))
    if bad:
        raise typer.Exit(1)


def _complete(path: Path) -> bool:
    """Whether `path` holds a bench run's results that were not stopped early."""
    try:
        return json.loads(path.read_text()).get("interrupted") is False
    except (OSError, ValueError, AttributeError):
        return False


def _listed(flag: str, value: str, kind, example: str) -> list:
    """A comma-separated flag's entries, each read by `kind` (a ValueError: not one)."""
    try:
        return [kind(x.strip()) for x in value.split(",")]
    except ValueError:
        raise UserError(f"{flag} takes comma-separated entries such as {example}, got {value!r}") from None


def _policy(name: str) -> int | str | None:
    """A --block-sizes entry: 'adaptive' -> None, 'treeN' -> itself, 'N' -> N."""
    if name == "adaptive":
        return None
    if name.startswith("tree"):
        int(name[4:])  # (a ValueError if it is not a number)
        return name
    return int(name)
