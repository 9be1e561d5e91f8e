"""`dflash-mlx generate`."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, replace

import mlx.core as mx
import typer
from mlx_lm import stream_generate as plain_stream_generate
from mlx_lm.sample_utils import make_sampler

from dflash_mlx.bench import counted
from dflash_mlx.chat import apply_chat_template, most_chars
from dflash_mlx.data import read_text
from dflash_mlx.errors import UserError
from dflash_mlx.loading import draft_for, load, load_pair, template_kwargs
from dflash_mlx.pairing import context_length, context_room
from dflash_mlx.platform import ctrl_c_in_mlx
from dflash_mlx.settings import GenerationSettings
from dflash_mlx.speculative import StopText, stream_generate

from .options import (
    DEMO,
    SAMPLING,
    BlockSize,
    Draft,
    DraftWindow,
    Json,
    MaxTokens,
    MinP,
    Model,
    NoLookup,
    RepetitionPenalty,
    Seed,
    Temp,
    Think,
    TopK,
    TopP,
    Tree,
    check_lookup,
    check_utf8,
    interrupted_code,
    mix_text,
    reading_prompt,
    stderr,
    terminated_as_interrupted,
    user_errors,
    warm,
)


def generate(
    prompt: str | None = typer.Option(None, "--prompt", "-p", help="The prompt (default, or -: read stdin)."),
    model: Model = DEMO,
    draft: Draft = None,
    max_tokens: MaxTokens = 256,
    stop: list[str] = typer.Option(
        [], "--stop", help="End the answer where this text appears (not shown); repeat for several."
    ),
    temp: Temp = 0.0,
    top_p: TopP = 1.0,
    top_k: TopK = 0,
    min_p: MinP = 0.0,
    repetition_penalty: RepetitionPenalty = None,
    seed: Seed = None,
    block_size: BlockSize = None,
    tree: Tree = None,
    no_lookup: NoLookup = False,
    draft_window: DraftWindow = None,
    no_draft: bool = typer.Option(
        False, "--no-draft", help="Plain mlx-lm decoding of the target (baseline)."
    ),
    chat_template: bool = typer.Option(
        True, "--chat-template/--no-chat-template", help="Wrap the prompt in the model's chat template."
    ),
    system: str | None = typer.Option(None, "--system", help="System prompt (with the chat template)."),
    think: Think = None,
    as_json: Json = False,
):
    """Answer one prompt: the text on stdout, the statistics on stderr."""
    with user_errors(SAMPLING):
        if prompt == "-":  # (as Unix tools name stdin)
            prompt = None
        if prompt is None and sys.stdin.isatty():
            raise UserError("give --prompt, or pipe the prompt on stdin")
        if prompt is None:  # the newline `echo` adds is dropped, as $(...) drops it
            prompt = read_text(sys.stdin, "the prompt on stdin").removesuffix("\n")
        settings = GenerationSettings(
            temperature=temp,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            max_tokens=max_tokens,
            block_size=block_size,
            tree=tree,
            lookup=not no_lookup,
            seed=seed,
            draft_window=draft_window,
        )  # checked before loading, for both paths
        if no_draft and (draft is not None or block_size is not None or tree or no_lookup or draft_window):
            raise UserError(
                "--no-draft is mlx-lm's plain decoding: drop --draft, --block-size, --tree, --no-lookup "
                "and --draft-window"
            )
        check_lookup(no_lookup, block_size)
        if (system is not None or think is not None) and not chat_template:
            raise UserError("--system and --think/--no-think need the chat template: drop --no-chat-template")
        check_utf8(prompt, "the prompt")
        check_utf8(system or "", "--system")
        for each in stop:
            check_utf8(each, "--stop")
        if not all(stop):
            raise UserError("--stop is empty: give the text that ends the answer")
        if not prompt.strip():
            raise UserError("the prompt is empty: give some text (--prompt, or on stdin)")
        if no_draft:
            (target, tokenizer), drafter = load(model), None
        else:
            target, drafter, tokenizer = load_pair(model, draft)
            warm(target, drafter, stderr(), adaptive=block_size is None and tree is None)
        most = most_chars(tokenizer, context_length(target))
        if most is not None and len(prompt) + len(system or "") > most:
            raise UserError(
                f"the prompt is {len(prompt)} characters, more than the model's context of "
                f"{context_length(target)} tokens can hold: shorten the prompt"
            )
        ids = (
            apply_chat_template(tokenizer, prompt, system=system, **template_kwargs(model, think, tokenizer))
            if chat_template
            else tokenizer.encode(prompt, verbose=False)
        )
        tic = time.perf_counter()
        text, tokens, last, acc = [], [], None, []
        cycles = []  # [source, proposals verified (a tree's nodes), tokens accepted] per cycle
        interrupted = False
        try:  # (SIGTERM as Ctrl-C: `timeout` and `kill` keep what came too)
            with (
                terminated_as_interrupted() as terminated,
                ctrl_c_in_mlx(),
                reading_prompt(len(ids)) as shown,
            ):
                stream = (
                    _plain(target, tokenizer, ids, settings, stop, shown)
                    if drafter is None
                    else stream_generate(
                        target,
                        drafter,
                        tokenizer,
                        ids,
                        **asdict(settings),
                        stop=stop,
                        continues=not chat_template,
                        prompt_progress_callback=shown,
                    )
                )
                for last in stream:
                    if not as_json:
                        sys.stdout.write(last.text)
                        sys.stdout.flush()
                    text.append(last.text)
                    tokens += last.tokens if drafter is not None else [last.token]
                    if getattr(last, "accepted", None) is not None:
                        acc.append(last.accepted)
                        cycles.append([last.source, last.proposed, last.accepted])
        except KeyboardInterrupt:  # what came so far is kept: the text was shown, the statistics say so
            interrupted = True
        text = "".join(text)
        if drafter is None and tokens:
            # mlx-lm counts the first token in its rate but not the time it took; ours counts neither
            last.generation_tps *= (len(tokens) - 1) / len(tokens)
        wall = time.perf_counter() - tic
        tau = sum(acc) / len(acc) if acc else None
        record = {
            "text": text,
            "tokens": tokens,
            "prompt_tokens": len(ids),
            "generation_tokens": len(tokens),
            "mean_acceptance": tau,
            "cycles": len(acc),
            "mix": dict(Counter(c[0] for c in cycles)),
            "cycle_log": cycles,
            "prompt_tps": last.prompt_tps if last else 0.0,
            "generation_tps": last.generation_tps if last else 0.0,
            "wall_s": wall,
            "peak_memory_gb": last.peak_memory if last else 0.0,
            # (--max-tokens 0: "length", as generate() says)
            "finish_reason": "interrupted" if interrupted else last.finish_reason if last else "length",
            "model": model,
            "draft": None if drafter is None else draft_for(model, draft),  # (as bench names it)
        }
        if as_json:  # (inside user_errors: a reader gone away ends it quietly, as for the text)
            typer.echo(json.dumps(record))
            if interrupted:
                raise typer.Exit(interrupted_code(terminated))
            return
        typer.echo()
    stats = counted(len(tokens), "token")
    if len(tokens) > 1:  # a rate needs a second token (the first comes with the prompt)
        stats += f", {record['generation_tps']:.1f} tokens/s"
    if last is not None:  # (nothing ran: --max-tokens 0)
        stats += f", prompt {record['prompt_tps']:.0f} tokens/s"
    if tau is not None:
        stats += f", mean acceptance {tau:.2f} over {counted(len(acc), 'cycle')} ({mix_text(record['mix'])})"
    typer.secho(stats + (" · interrupted" if interrupted else ""), err=True, dim=True)
    if interrupted:
        raise typer.Exit(interrupted_code(terminated))


def _plain(model, tokenizer, ids, settings: GenerationSettings, stop: Sequence[str] = (), progress=None):
    """The baseline: mlx-lm's own decoding of the target (its responses), ended at a stop string as
    ours is (mlx-lm's stream_generate takes none); `progress`: its prompt_progress_callback."""
    s = settings
    max_tokens = min(s.max_tokens, context_room(model, len(ids)))  # as stream_generate does
    if max_tokens == 0:  # (mlx-lm would read 0 as an error)
        return
    if s.seed is not None:
        mx.random.seed(s.seed)
    sampler = make_sampler(s.temperature, top_p=s.top_p if s.top_p < 1 else 0.0, min_p=s.min_p, top_k=s.top_k)
    stops = StopText(stop)
    for r in plain_stream_generate(
        model,
        tokenizer,
        ids,
        max_tokens=max_tokens,
        sampler=sampler,
        logits_processors=s.processors(),
        prompt_progress_callback=progress,
    ):
        text, hit = stops.feed(r.text)
        if hit is not None:
            yield replace(r, text=text, finish_reason="stop")
            return
        yield replace(r, text=text + (stops.flush() if r.finish_reason is not None else ""))
