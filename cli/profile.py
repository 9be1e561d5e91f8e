"""`dflash-mlx profile`."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from dflash_mlx.errors import UserError
from dflash_mlx.loading import load_pair
from dflash_mlx.pairing import context_length
from dflash_mlx.platform import cache_home
from dflash_mlx.profile import check_sizes, draft_window_profile, profile_pair
from dflash_mlx.profile import profile as measure
from dflash_mlx.settings import GenerationSettings

from .options import (
    DEMO,
    SAMPLING,
    Draft,
    DraftWindow,
    Json,
    busy,
    measuring,
    progress_bar,
    stderr,
    stdout,
    user_errors,
)

RANDOM = {"--hidden": 1024, "--layers": 8, "--vocab": 32000, "--block-size": 16, "--cycles": 24}


def _random(flag: str, what: str):
    return typer.Option(None, flag, help=f"{what}  [default: {RANDOM[flag]}]", show_default=False)


def profile(
    model: str | None = typer.Option(
        None,
        "--model",
        "-m",
        help="A pair's target (as chat takes it): measure its cost model for the adaptive policy again "
        "and show it, with the policy's own overhead. Without it: a random target.",
    ),
    draft: Draft = None,
    draft_window: DraftWindow = None,
    hidden: int | None = _random("--hidden", "Width of the random target."),
    layers: int | None = _random("--layers", "Decoder layers of the random target."),
    vocab: int | None = _random("--vocab", "Vocabulary size of the random target."),
    block_size: int | None = _random("--block-size", "Tokens per drafted block of the random pair."),
    cycles: int | None = _random("--cycles", "Cycles (and repeats) to time on the random pair."),
    as_json: Json = False,
):
    """Time one speculative cycle against its two model passes (random float32 models), or measure a
    pair's cost model (--model)."""
    sizes = {
        "--hidden": hidden,
        "--layers": layers,
        "--vocab": vocab,
        "--block-size": block_size,
        "--cycles": cycles,
    }
    given = [flag for flag, value in sizes.items() if value is not None]
    with user_errors():
        if given and (model is not None or draft_window is not None):
            one = len(given) == 1
            raise UserError(
                f"{', '.join(given)} {'is' if one else 'are'} for the random pair alone: leave "
                f"{'it' if one else 'them'} out with --model or --draft-window"
            )
    if draft_window is not None:
        return _window(model or DEMO, draft, draft_window, as_json)
    if model is not None:
        return _pair(model, draft, as_json)
    with user_errors():
        if draft is not None:
            raise UserError("--draft goes with --model (or --draft-window): the random target has no drafter")
    with user_errors({n: f"--{n}" for n in ("hidden", "layers", "vocab", "cycles")} | SAMPLING):
        values = [RANDOM[flag] if value is None else value for flag, value in sizes.items()]
        check_sizes(*values)  # (before the note that it started)
        with progress_bar("timing cycles, verify and draft passes") as bar:
            task = bar.add_task("", total=None)
            r = measure(*values, progress=lambda done, total: bar.update(task, completed=done, total=total))
    if as_json:
        typer.echo(json.dumps(r, indent=2))
        return
    shape = " · ".join(f"{k.replace('_', ' ')} {v}" for k, v in r["config"].items())
    t = Table(title=f"one speculative cycle, random target: {shape}", show_header=True)
    t.add_column("")
    t.add_column("draft step compiled", justify="right")
    t.add_column("draft step eager", justify="right")
    t.add_row("cycle (ms)", f"{r['cycle_ms_compiled']:.2f}", f"{r['cycle_ms_eager']:.2f}")
    t.add_row("verify pass alone (ms)", f"{r['verify_ms']:.2f}", f"{r['verify_ms']:.2f}")
    t.add_row("draft step alone (ms)", f"{r['draft_ms_compiled']:.2f}", f"{r['draft_ms_eager']:.2f}")
    t.add_row("runtime overhead", f"{r['overhead_compiled']:+.1%}", f"{r['overhead_eager']:+.1%}")
    stdout().print(t)
    line = f"plain decoding: {r['ar_tokens_per_s']:.1f} tokens/s"
    if "ar_tokens_per_s_without_blas_preload" in r:
        line += f" (without the BLAS preload: {r['ar_tokens_per_s_without_blas_preload']:.1f} tokens/s)"
    typer.echo(line)
    typer.echo(f"BLAS: {r['blas']}; draft step traced {r['draft_traces']} time(s)")


def _pair(model: str, draft: str | None, as_json: bool) -> None:
    with user_errors():
        target, drafter, _ = load_pair(model, draft)
        with measuring("measuring the pair's costs again") as shown:
            r = profile_pair(target, drafter, progress=shown)
    if as_json:
        typer.echo(json.dumps(r, indent=2))
        return
    costs, step = r["costs"], r["plain_step_s"]
    t = Table(title=f"{model}: seconds of a pass, in plain steps ({1000 * step:.1f} ms)")
    t.add_column("context")
    for w in costs["widths"]:
        t.add_column(f"target, {w} wide", justify="right")
    t.add_column("step after a step: started early", justify="right")
    t.add_column("built early", justify="right")
    for k in costs["proposals"]:
        t.add_column(f"drafter, {k}", justify="right")
    for c, row, ahead, built, drafts in zip(
        costs["contexts"],
        costs["target"],
        costs["ahead"],
        costs["built"],
        costs["draft"] or [[]] * len(costs["contexts"]),
    ):
        t.add_row(str(c), *[f"{x / step:.2f}" for x in row + [ahead, built] + drafts])
    stdout().print(t)
    typer.echo(
        f"policy: {1e6 * r['policy_s']:.0f} us a cycle ({r['policy_share_of_a_step']:.2%} of a plain step)"
    )
    if r["costs_file"]:
        typer.echo(f"kept in {r['costs_file']}")
    else:
        typer.echo(f"not kept: {cache_home()} cannot be written (DFLASH_MLX_HOME)", err=True)


def _window(model: str, draft: str | None, window: int, as_json: bool) -> None:
    with user_errors():
        GenerationSettings(draft_window=window)  # checked before loading
        target, drafter, _ = load_pair(model, draft)
        room = (context_length(target) or 1 << 62) - drafter.block_size
        contexts = [c for c in (500, 2000, 8000) if c <= room]
        with busy(stderr(), "timing draft passes over long contexts ..."):
            rows = draft_window_profile(target, drafter, window, contexts)
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    t = Table(title=f"{model}: a draft pass ({drafter.block_size - 1} proposals), ms")
    t.add_column("context")
    t.add_column("whole context", justify="right")
    t.add_column(f"draft window {window}", justify="right")
    for r in rows:
        t.add_row(str(r["context"]), f"{1000 * r['whole_s']:.1f}", f"{1000 * r['window_s']:.1f}")
    stdout().print(t)
