"""`dflash-mlx profile`."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from dflash_mlx.profile import profile as measure

from .options import Json, stderr, user_errors


def profile(
    hidden: int = typer.Option(1024, help="Width of the random target."),
    layers: int = typer.Option(8, help="Decoder layers of the random target."),
    vocab: int = typer.Option(32000, help="Vocabulary size."),
    block_size: int = typer.Option(16, help="Tokens per drafted block."),
    cycles: int = typer.Option(24, help="Cycles (and repeats) to time."),
    as_json: Json = False,
):
    """Time one speculative cycle against its two model passes (random float32 models)."""
    with user_errors(), stderr().status("timing cycles, verify and draft passes ..."):
        r = measure(hidden, layers, vocab, block_size, cycles)
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
