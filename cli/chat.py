"""`dflash-mlx chat`: a terminal conversation with speculative decoding."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections import Counter
from dataclasses import replace

import typer
from rich.console import Console
from rich.markup import escape

from dflash_mlx.bench import counted
from dflash_mlx.channels import REASONING, Channels
from dflash_mlx.chat import ChatSession
from dflash_mlx.errors import UserError
from dflash_mlx.loading import draft_for, load_pair, template_kwargs
from dflash_mlx.pairing import MAX_BLOCK_SIZE
from dflash_mlx.platform import backend
from dflash_mlx.settings import GenerationSettings

from .options import (
    DEMO,
    SAMPLING,
    BlockSize,
    Draft,
    DraftWindow,
    MaxTokens,
    Model,
    NoLookup,
    RepetitionPenalty,
    Temp,
    Think,
    busy,
    check_lookup,
    check_utf8,
    long_prompt,
    mix_text,
    user_errors,
    warm,
)

LABEL = "[bold blue]model>[/bold blue] "
LABEL_WIDTH = len("model> ")
HELP = """[bold]commands[/bold]
  /help            this list
  /reset           forget the conversation
  /system TEXT     set the system prompt (nothing after it: the template's own)
  /temp X          sampling temperature (0 = greedy, exactly the target's text)
  /block N         a fixed DFlash block of N (0: back to choosing each cycle)
  /max N           answers of up to N tokens
  /stats           totals for this conversation
  /save FILE       write the conversation as JSON
  /exit            quit (or Ctrl-D)
Ctrl-C stops an answer and keeps what was written (before the answer starts, or a second time:
drops the message). End a line with \\ to continue it, or wrap several lines in \"\"\"; a pasted
text is one message, sent with Enter. A message that starts with / starts with a space."""


def chat(
    model: Model = DEMO,
    draft: Draft = None,
    system: str | None = typer.Option(None, "--system", help="System prompt."),
    temp: Temp = 0.0,
    repetition_penalty: RepetitionPenalty = None,
    block_size: BlockSize = None,
    no_lookup: NoLookup = False,
    draft_window: DraftWindow = None,
    max_tokens: MaxTokens = 1024,
    think: Think = None,
    hide_thinking: bool = typer.Option(False, help="Do not show thinking text (it is shown dimmed)."),
):
    """Talk to a model in the terminal; answers stream as the target accepts them."""
    # (text is shown as written: no ":name:" emoji codes, and as one line where no terminal wraps it)
    console = Console(highlight=False, emoji=False, soft_wrap=not sys.stdout.isatty())
    with user_errors(SAMPLING):
        check_lookup(no_lookup, block_size)
        GenerationSettings.answers(
            temperature=temp,
            repetition_penalty=repetition_penalty,
            block_size=block_size,
            lookup=not no_lookup,
            max_tokens=max_tokens,
            draft_window=draft_window,
        )  # before loading
        with busy(console, f"loading {model} ..."):
            target, drafter, tokenizer = load_pair(model, draft)
            name = draft_for(model, draft)
        warm(target, drafter, console, adaptive=block_size is None)
        session = ChatSession(
            target,
            drafter,
            tokenizer,
            system=system,
            temperature=temp,
            repetition_penalty=repetition_penalty,
            block_size=block_size,
            lookup=not no_lookup,
            max_tokens=max_tokens,
            draft_window=draft_window,
            template_kwargs=template_kwargs(model, think, tokenizer),
        )
    banner = f"[bold]dflash-mlx chat[/bold] · {escape(model)} + {escape(name)} · {backend()}"
    run(session, console, banner, hide_thinking)


def warn(console: Console, text: str) -> None:
    console.print(text, style="yellow", markup=False)  # (as written: it may quote the user's brackets)


def ask(console: Console, label: str, colour: str = "") -> str:
    """input() with a prompt. In a terminal the prompt goes to input() itself, its colour codes marked
    zero-width (\\001...\\002), so readline can redraw it (Ctrl-U, arrow keys); printed apart, as rich's
    console.input does, readline thinks the prompt is empty and wipes it."""
    if console.is_terminal and sys.stdin.isatty():
        styled = colour and not console.no_color and console.color_system is not None  # (TERM=dumb)
        return input(f"\001\x1b[{colour}m\002{label}\001\x1b[0m\002 " if styled else f"{label} ")
    return console.input(f"{label} ")


def read_message(console: Console) -> str:
    """One message: a line, lines continued with a trailing backslash, or a \"\"\"-block."""
    line = ask(console, "you>", "1;32")
    opened = line.lstrip()
    # (text may follow the opening quotes; only a line of the quotes alone closes the block, so that a
    # docstring inside it does not; a line that ends with them too is a message of its own)
    if opened.startswith('"""') and (opened.rstrip() == '"""' or not opened.rstrip().endswith('"""')):
        lines = [opened[3:]] if opened[3:].strip() else []
        while True:
            try:
                line = ask(console, "...")
            except EOFError:  # Ctrl-D ends the block (not the chat)
                console.print()
                break
            if line.strip() == '"""':
                break
            lines.append(line)
        return "\n".join(lines)
    lines = [line]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        try:
            lines.append(ask(console, "..."))
        except EOFError:  # Ctrl-D (or the input's end) sends what came, as it ends a """-block
            console.print()
            break
    return "\n".join(lines)


def status_line(turn: dict) -> str:
    parts = [counted(turn["tokens"], "token")]
    if turn["tokens"] > 1:  # a rate needs a second token (the first comes with the prefill)
        parts.append(f"{turn['tokens_per_s']:.1f} tokens/s")
    if turn["mean_acceptance"] is not None:
        parts += [f"tau {turn['mean_acceptance']:.2f}", f"{turn['drafted_share']:.0%} drafted"]
        parts.append(mix_text(turn["mix"]))
    parts.append(f"prefill {turn['prefill_tokens']}")
    if turn["interrupted"]:
        parts.append("stopped")
    elif turn["finish_reason"] == "length":
        parts.append("at the /max limit")
    return " · ".join(parts)


def run(session, console: Console, banner: str, hide_thinking: bool = False) -> None:
    try:
        import readline  # (arrow keys and history for input())
    except ImportError:  # pragma: no cover - Windows
        readline = None
    if readline is not None and "libedit" not in (readline.__doc__ or ""):
        # Python turns GNU readline's bracketed paste off; on, a pasted text with line breaks is one
        # message, sent with Enter, rather than a message per line
        readline.parse_and_bind("set enable-bracketed-paste on")
    console.print(banner)
    console.print("[dim]type /help for commands, Ctrl-D to quit[/dim]")
    while True:
        try:
            text = read_message(console)
        except EOFError:
            console.print()
            return
        except KeyboardInterrupt:
            console.print()
            continue
        except SystemExit:  # SIGTERM or SIGHUP at the prompt: the shell's prompt on a line of its own
            with contextlib.suppress(OSError):
                console.print()
            raise
        if not text.strip():
            continue
        try:
            check_utf8(text, "the message")
        except UserError as e:
            warn(console, str(e))
            continue
        if text.startswith("/"):
            if command(session, console, text.strip()) == "exit":
                return
            continue
        answer(session, console, text, hide_thinking)


def answer(session, console: Console, text: str, hide_thinking: bool) -> None:
    stop = started = False

    def on_sigint(*_):
        """Ctrl-C while the answer streams: stop after this cycle, keeping the answer. Before it starts
        (a long prompt's prefill) or a second time: interrupt at once, which drops the message."""
        nonlocal stop
        if stop or not started:
            raise KeyboardInterrupt
        stop = True

    def reading(done: int, total: int) -> None:
        """A long message's progress after the label while it is read (seconds to minutes on a CPU)."""
        if console.is_terminal and long_prompt(total):
            said = f"reading the message: {done:,} of {total:,} tokens" if done < total else ""
            # (cut to the line: a wrapped line's first row would stay behind at the next update)
            said = said[: max(0, console.width - LABEL_WIDTH - 1)]
            console.file.write("\r\x1b[2K")
            console.print(f"{LABEL}[dim]{said}[/dim]", end="")

    def shown(parts: list[tuple[str, str]]) -> None:
        """The answer as it streams; thinking dimmed (its markers left out), or not at all."""
        for channel, part in parts:
            if channel == REASONING and hide_thinking:
                continue
            style = "dim" if channel == REASONING else None
            console.print(escape(part), end="", style=style, soft_wrap=True)

    channels = None  # (made once the reply's prompt shows whether it starts inside a thinking block)
    messages = len(session.messages)
    pieces = session.reply(text, should_stop=lambda: stop, reading=reading)
    previous = signal.signal(signal.SIGINT, on_sigint)
    echo = _echo_off()
    try:
        console.print(LABEL, end="")
        for piece in pieces:
            started = True
            channels = channels or Channels(session.tokenizer, session.thinking, None)
            shown(channels.feed(piece.text))
        shown(channels.finish() if channels else [])
    except UserError as e:  # a full context (ContextFull) or settings the model refuses: the chat goes on
        if console.is_terminal and not started:  # (the refusal takes the label's place: no answer came)
            console.file.write("\r\x1b[2K")
        else:
            console.print()
        warn(console, str(e))
        return
    except SystemExit:  # SIGTERM, or the terminal closing (SIGHUP): the shell's prompt on a line of its own
        with contextlib.suppress(OSError):
            console.print()
        raise
    except KeyboardInterrupt:
        try:
            pieces.close()  # if it came between two cycles, the answer so far is kept as after one Ctrl-C
        except KeyboardInterrupt:  # (another, while it cleaned up: what it kept stays kept)
            pass
        stop = True
        if len(session.messages) == messages:
            console.print(
                "\n[yellow]interrupted: the message was dropped (the next one reads the "
                "conversation again)[/yellow]"
            )
            return
    finally:
        signal.signal(signal.SIGINT, previous)
        echo()
    console.print()
    if stop:
        console.print("[yellow]stopped; the partial answer stays in the conversation[/yellow]")
    console.print(f"[dim]{status_line(session.turns[-1])}[/dim]")


def _echo_off():
    """Stop the terminal echoing what is typed while an answer streams: Ctrl-C as "^C", and text typed
    ahead, which would land inside the answer's text (readline shows it at the next prompt), and keep
    that text when Ctrl-C stops the answer (the terminal throws its input away on Ctrl-C unless told
    not to: NOFLSH); -> a call that puts the terminal back as it was (if it is still there)."""
    try:
        import termios
    except ImportError:  # pragma: no cover - Windows
        return lambda: None
    try:
        fd = sys.stdin.fileno()
        saved = termios.tcgetattr(fd)
    except (termios.error, OSError, ValueError):  # no terminal
        return lambda: None
    quiet = list(saved)
    quiet[3] = (quiet[3] & ~(termios.ECHOCTL | termios.ECHO)) | termios.NOFLSH
    termios.tcsetattr(fd, termios.TCSANOW, quiet)

    def restore():
        with contextlib.suppress(termios.error, OSError):  # (a terminal that closed)
            termios.tcsetattr(fd, termios.TCSANOW, saved)

    return restore


def _number(text: str, kind, usage: str):
    try:
        return kind(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise UserError(f"{usage} takes {what}, got {text!r}" if text else f"{usage} needs {what}") from None


def command(session, console: Console, line: str) -> str | None:
    name, _, arg = line.partition(" ")
    arg = arg.strip()
    try:
        if arg and name in ("/exit", "/quit", "/help", "/reset", "/stats"):  # (a typo would act anyway)
            raise UserError(f"{name} takes nothing after it")
        if name in ("/exit", "/quit"):
            return "exit"
        if name == "/help":
            console.print(HELP)
        elif name == "/reset":
            session.reset()
            console.print("[dim]conversation cleared[/dim]")
        elif name == "/system":
            session.system = arg or None
            said = "system prompt set" if arg else "system prompt: the template's own (if it has one)"
            console.print(f"[dim]{said}[/dim]")
        elif name == "/temp":
            session.settings = replace(session.settings, temperature=_number(arg, float, "/temp X"))
            console.print(f"[dim]temperature {session.settings.temperature}[/dim]")
        elif name == "/block":
            if not 0 <= (block := _number(arg, int, "/block N")) <= MAX_BLOCK_SIZE:
                raise UserError(
                    f"/block takes a block size of 1 to {MAX_BLOCK_SIZE}, or 0 to choose each cycle"
                )
            session.settings = replace(session.settings, block_size=block or None)
            block = session.settings.block_size
            console.print(f"[dim]{f'block size {block}' if block else 'each cycle chooses'}[/dim]")
        elif name == "/max":
            if (most := _number(arg, int, "/max N")) < 1:
                raise UserError(f"/max takes a number of tokens of 1 or more, got {most}")
            session.settings = replace(session.settings, max_tokens=most)
            console.print(f"[dim]answers of up to {counted(most, 'token')}[/dim]")
        elif name == "/stats":
            turns = session.turns
            toks = sum(t["tokens"] for t in turns)
            cycles = sum(t["cycles"] for t in turns)  # tau over every verify pass, not a mean of answers
            mix = dict(sum((Counter(t["mix"]) for t in turns), Counter()))
            tau = (
                sum(t["mean_acceptance"] * t["cycles"] for t in turns if t["cycles"]) / cycles
                if cycles
                else None
            )
            console.print(
                f"[dim]{counted(len(turns), 'answer')}, {toks} tokens, mean tau "
                f"{'-' if tau is None else f'{tau:.2f}'}, context {session.context_tokens()}"
                f"/{session.max_context} tokens, temperature {session.settings.temperature}, "
                f"{f'block {block}' if (block := session.settings.block_size) else 'adaptive'}, "
                f"cycles {mix_text(mix) or '-'}[/dim]"
            )
        elif name == "/save":
            if arg[:1] in ("'", '"'):  # (a name quoted as in a shell)
                if len(arg) < 2 or arg[-1] != arg[0]:
                    raise UserError("/save: the name's quote is not closed (quotes are optional)")
                arg = arg[1:-1]
            if not arg.strip():
                raise UserError("/save needs a file name")
            there = os.path.lexists(os.path.expanduser(arg))
            saved = escape(str(session.save(arg)))
            console.print(f"[dim]saved to {saved}{' (it replaced the file there)' if there else ''}[/dim]")
        else:
            warn(
                console,
                f"unknown command {name}: /help lists them (a message that starts with / starts with "
                "a space)",
            )
    except (ValueError, OSError) as e:  # a UserError, a number that does not parse, a file /save cannot write
        warn(console, str(e))
    return None
