"""The `dflash-mlx` command."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import Optional

import typer

app = typer.Typer(help="DFlash speculative decoding for MLX.", no_args_is_help=True, add_completion=False)


@app.callback()
def main():
    """DFlash block-diffusion speculative decoding for MLX."""


@contextmanager
def user_errors():
    """Bad input ends the command with one clear line on stderr and exit code 1, not a traceback."""
    try:
        yield
    except (ValueError, OSError) as e:  # OSError covers missing files, permissions, the network
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(1)


@app.command()
def convert(
    source: str = typer.Argument(..., help="Drafter or target: Hugging Face id, folder, or .gguf file."),
    output: str = typer.Argument(..., help="Folder to write (must not exist unless --force)."),
    dtype: Optional[str] = typer.Option(None, help="float16, bfloat16 or float32 (drafter default: bfloat16; "
                                                   "a GGUF target keeps its quantization unless given)."),
    quantize: bool = typer.Option(False, "-q", "--quantize", help="Quantize the weights."),
    q_bits: int = typer.Option(4, help="Bits per weight when quantizing."),
    q_group_size: int = typer.Option(64, help="Group size when quantizing."),
    export: bool = typer.Option(False, help="Export an MLX drafter to z-lab's Hugging Face layout "
                                            "(bf16; vLLM and SGLang read it)."),
    force: bool = typer.Option(False, help="Replace OUTPUT if it exists."),
):
    """Convert a drafter or a target to an MLX folder, or export a drafter to z-lab's layout."""
    from pathlib import Path

    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from dflash_mlx.convert import DTYPES, convert_draft, convert_target, export_draft, is_drafter

    with user_errors():
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype}")
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
            elif src.suffix == ".gguf":
                out = convert_target(source, output, dtype, quantize, q_bits, q_group_size, force, step)
                kind = "target from GGUF"
            else:
                from dflash_mlx.loading import resolve

                step("fetching")
                folder = resolve(source)
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
    as_json: bool = typer.Option(False, "--json", help="Print one JSON record instead of the text."),
):
    """Answer one prompt: the text on stdout, the statistics on stderr."""
    import time

    import dflash_mlx
    from dflash_mlx.loading import load, load_draft, find_pair

    if prompt is None:
        if sys.stdin.isatty():
            typer.secho("error: give --prompt, or pipe the prompt on stdin", fg="red", err=True)
            raise typer.Exit(2)
        prompt = sys.stdin.read()
    with user_errors():
        target, tokenizer = load(model)
        drafter = None
        if not no_draft:
            name = draft or (find_pair(model).draft if find_pair(model) else None)
            if name is None:
                raise ValueError(f"no known drafter for {model}: pass --draft, or --no-draft for plain decoding")
            drafter = load_draft(name)
        ids = (dflash_mlx.apply_chat_template(tokenizer, prompt, system=system) if chat_template
               else tokenizer.encode(prompt))
        kwargs = dict(max_tokens=max_tokens, temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
        tic = time.perf_counter()
        if drafter is None:
            text, tokens, last, acc = _plain(target, tokenizer, ids, as_json, **kwargs)
        else:
            text, tokens, last, acc = [], [], None, []
            for last in dflash_mlx.stream_generate(target, drafter, tokenizer, ids, block_size=block_size, **kwargs):
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
              "finish_reason": last.finish_reason if last else None, "model": model,
              "draft": None if drafter is None else (draft or "registry")}
    if as_json:
        typer.echo(json.dumps(record))
        return
    typer.echo()
    stats = f"{len(tokens)} tokens, {record['generation_tps']:.1f} tokens/s, prompt {record['prompt_tps']:.0f} tokens/s"
    if tau is not None:
        stats += f", mean acceptance {tau:.2f} over {len(acc)} cycles"
    typer.secho(stats, err=True, dim=True)


def _plain(model, tokenizer, ids, quiet, max_tokens, temperature, top_p, top_k, min_p, seed):
    """The baseline: mlx-lm's own decoding of the target."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    if seed is not None:
        mx.random.seed(seed)
    sampler = make_sampler(temperature, top_p=top_p if top_p < 1 else 0.0, min_p=min_p, top_k=top_k)
    text, tokens, last = [], [], None
    for last in stream_generate(model, tokenizer, ids, max_tokens=max_tokens, sampler=sampler):
        if not quiet:
            sys.stdout.write(last.text)
            sys.stdout.flush()
        text.append(last.text)
        tokens.append(last.token)
    return "".join(text), tokens, last, []


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

    with Console(stderr=True).status("timing cycles, verify and draft passes ..."):
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
