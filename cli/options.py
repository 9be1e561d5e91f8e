"""What the commands share: the options several of them take, defined once; the console for what is
not a command's output; progress bars; and how an error ends a command."""

from __future__ import annotations

import errno
import os
import signal
import sys
from contextlib import contextmanager
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.text import Text

from dflash_mlx.cache import prefill_step
from dflash_mlx.data import prompt_source
from dflash_mlx.errors import UserError, unpaired_surrogate
from dflash_mlx.files import is_write_error
from dflash_mlx.pairing import prepare
from dflash_mlx.platform import backend, home_advice, kernel_error, stop_signals
from dflash_mlx.policy import costs_for, warm_up

DEMO = "smollm2-135m-instruct"
LONG_PROMPT_CHUNKS = 4  # prompts longer than this many prefill chunks show a bar while they are read

Model = Annotated[str, typer.Option("--model", "-m", help="Target: registry name, HF id, folder or .gguf.")]
Draft = Annotated[
    str | None, typer.Option("--draft", "-d", help="Drafter (default: the registry's for --model).")
]
MaxTokens = Annotated[int, typer.Option("--max-tokens", help="Most tokens per answer.")]
Temp = Annotated[float, typer.Option("--temp", help="Sampling temperature (0 = greedy).")]
TopP = Annotated[float, typer.Option("--top-p", help="Nucleus sampling threshold.")]
TopK = Annotated[int, typer.Option("--top-k", help="Sample from the k most likely tokens (0 = off).")]
MinP = Annotated[float, typer.Option("--min-p", help="Min-p sampling threshold (0 = off).")]
Seed = Annotated[int | None, typer.Option("--seed", help="Random seed.")]
RepetitionPenalty = Annotated[
    float | None,
    typer.Option(
        "--repetition-penalty",
        help="Make the latest 20 tokens less likely by this factor, as mlx-lm's does (1 = off).",
    ),
]
BlockSize = Annotated[
    int | None,
    typer.Option(
        "--block-size",
        help="A fixed DFlash block of N every cycle, without lookup (default: each cycle chooses; see "
        "docs/policy.md).",
    ),
]
Tree = Annotated[
    int | None,
    typer.Option(
        "--tree",
        help="Verify a tree of the drafter's guesses in a pass of N (as wide as a block of N) every "
        "cycle, lookup's match a branch of it unless --no-lookup (default: each cycle chooses, trees "
        "included; see docs/policy.md).",
    ),
]
NoLookup = Annotated[bool, typer.Option("--no-lookup", help="Leave prompt lookup out of the choices.")]
DraftWindow = Annotated[
    int | None,
    typer.Option(
        "--draft-window",
        help="The drafter keeps only the latest N context positions (long prompts; default: all).",
    ),
]
Think = Annotated[
    bool | None,
    typer.Option(
        "--think/--no-think",
        help="Qwen3-style thinking on or off (where the template has it; default: the registry pair's "
        "setting, else the template's).",
    ),
]
Json = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


class Output(Console):
    """rich's console on stdout, but a reader that went away (`| head`) ends the command as it does for
    plain text (`reader_gone`: exit code 141), not with rich's exit code 1, which reads as a failure."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


def stdout() -> Console:
    """A console on stdout; piped into a file or another program, as wide as the lines it prints (rich
    would fold tables into 80 columns)."""
    return Output(emoji=False, width=None if sys.stdout.isatty() else 1000)


def stderr() -> Console:
    """A console on stderr, for progress and notes (made when needed: it reads the terminal's width then)."""
    # (":name:" in a path or a message stays as written; a line in a log is not folded at 80 columns)
    return Console(stderr=True, emoji=False, soft_wrap=not sys.stderr.isatty())


class Bar(Progress):
    """rich's Progress, gone when bad input ends its work: the error is then the one line shown."""

    def __exit__(self, kind, error, traceback):
        if not isinstance(error, (UserError, OSError)):
            return super().__exit__(kind, error, traceback)
        self.live.transient = True
        if not self.disable:  # (Progress.stop would add a blank line to a log)
            self.live.stop()
        return None


def progress_bar(
    label: str, *, detail: bool = False, disable: bool = False, transient: bool = False
) -> Progress:
    """A progress bar on stderr: `label` ("{task.description}" for one that changes), the bar, done/total,
    the task's description if `detail`, and the time left; `transient`: gone once it stops."""
    columns = [TextColumn(label), BarColumn(), MofNCompleteColumn()]
    if detail:
        columns.append(TextColumn("{task.description}"))
    return Bar(*columns, TimeRemainingColumn(), console=stderr(), disable=disable, transient=transient)


def long_prompt(tokens: int) -> bool:
    """Whether a prompt is read long enough to show it (over LONG_PROMPT_CHUNKS prefill chunks: seconds
    to minutes on a CPU)."""
    return tokens > LONG_PROMPT_CHUNKS * prefill_step()


@contextmanager
def reading_prompt(tokens: int):
    """-> a `prompt_progress_callback` that shows a long prompt being read on stderr, a bar that is gone
    once the answer starts (one line where stderr is no terminal); None for a shorter prompt."""
    bar = progress_bar("reading the prompt", transient=True)
    if not long_prompt(tokens):
        yield None
    elif not bar.console.is_terminal:  # (a log: one line, no bar)
        bar.console.print(f"reading the prompt ({tokens} tokens) ...", highlight=False)
        yield None
    else:
        task = bar.add_task("", total=tokens)

        def shown(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)
            if done >= total:
                bar.stop()

        bar.start()
        try:
            yield shown
        finally:
            bar.stop()  # (a Ctrl-C while it was read)


@contextmanager
def busy(console: Console, text: str):
    """A spinner with `text` while the work runs; where the console is no terminal (a log file, a pipe),
    where rich would show nothing, the text as one line, so long work is never silent."""
    if console.is_terminal:
        with console.status(Text(text)):  # (as text: a model's name may hold square brackets)
            yield
    else:
        console.print(text, markup=False, highlight=False, soft_wrap=True)  # (one line, however long)
        yield


def warm(target, drafter, console: Console, adaptive: bool = True, batches=()) -> None:
    """For the `adaptive` policy, measure the pair's costs (and the passes over `batches` sequences) if
    this machine has not yet, with a progress bar, rather than in the first answer's time without a word.
    On a GPU, where MLX compiles kernels on first use, then run each pass shape the policy may choose once
    before the first answer (`warm_up`; the compiled kernels are kept for the next process too)."""
    gpu = backend() != "cpu"
    if adaptive or gpu:  # (the warm-up runs the widths the costs price)
        with measuring() as shown:
            costs_for(prepare(target, drafter), drafter, batches, progress=shown)
    if gpu:
        with busy(console, "warming up: each pass shape once (compiled kernels are kept for next time) ..."):
            warm_up(target, drafter)


@contextmanager
def measuring(label: str = "measuring this machine's costs for the pair"):
    """A progress bar for a measurement of the pair's costs (`costs_for`'s `progress`), shown from the
    first pass timed, if any (half a minute to a few minutes, where they are not kept yet); where
    stderr is no terminal, a line when it starts."""
    bar, task = progress_bar(label), None

    def shown(done: int, total: int) -> None:
        nonlocal task
        if task is None:
            advice = home_advice(("costs",))  # (then measured again by every run: said once each time)
            if advice is not None:
                bar.console.print(f"note: {advice}", markup=False, highlight=False, soft_wrap=True)
            if not bar.console.is_terminal:
                kept = "for this run only" if advice else "kept for later runs"
                bar.console.print(f"{label}: {total} passes, {kept} ...", highlight=False, soft_wrap=True)
            bar.start()
            task = bar.add_task("", total=total)
        bar.update(task, completed=done)

    try:
        yield shown
    finally:
        if task is not None:  # (a bar never started prints nothing, not even an empty line)
            bar.stop()


def check_lookup(no_lookup: bool, block_size: int | None) -> None:
    """--no-lookup with a fixed block, which never uses lookup: a flag with nothing to do is refused."""
    if no_lookup and block_size is not None:
        raise UserError(
            "--no-lookup leaves lookup out of the adaptive policy's choices; a fixed --block-size uses none: "
            "drop one of them"
        )


@contextmanager
def reader_gone():
    """The reader of the output went away (`| head`): the command stops quietly, as Unix tools do."""
    try:
        yield
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        raise typer.Exit(141) from None


@contextmanager
def terminated_as_interrupted():
    """SIGTERM (`kill`, `timeout`, a job scheduler) and SIGHUP (a closing terminal) stop the work as
    Ctrl-C does, keeping what is done; yields a list that holds the signal once one came, for the exit
    code (`interrupted_code`) and `stopped_by`. A signal ignored (SIGHUP under `nohup`) stays ignored."""
    came = []

    def on_term(signum, frame):
        came.append(signum)
        raise KeyboardInterrupt

    previous = {s: signal.getsignal(s) for s in stop_signals()}
    for s in previous:
        signal.signal(s, on_term)
    try:
        yield came
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def interrupted_code(came: list) -> int:
    """The exit code of work stopped by Ctrl-C (130) or by the signal in `came` (128 + its number)."""
    return 128 + came[0] if came else 130


def stopped_by(came: list) -> str:
    return f"by {signal.Signals(came[0]).name}" if came else "with Ctrl-C"


@contextmanager
def user_errors(named: dict[str, str] | None = None):
    """Bad input (a UserError) or a failed file, permission or network operation (an OSError) ends the command
    with one clear line on stderr and exit code 1; any other exception is a bug, shown with its traceback.
    A reader that went away ends it quietly (`reader_gone`). `named`: the command's own flags for
    settings whose flag differs between commands (`flagged`)."""
    try:
        with reader_gone():
            yield
    except (UserError, OSError) as e:
        if isinstance(e, OSError) and e.filename is None and is_write_error(e):
            raise  # (the output itself, `> /dev/full`: said by the entry point, `cli.run`)
        said = flagged(str(e), named)
        if isinstance(e, PermissionError) and e.filename is not None:  # (OSError's own says no more)
            said = (
                f"permission denied on {e.filename}: let this user use it (chmod, chown) or give another path"
            )
        typer.secho(f"error: {said}", fg="red", err=True)
        raise typer.Exit(1) from None
    except RuntimeError as e:
        said = NO_USER if str(e) == NO_SUCH_USER else kernel_error(e)
        if said is None:
            raise
        typer.secho(f"error: {said}", fg="red", err=True)
        raise typer.Exit(1) from None


# The settings' errors name the Python parameter; on the command line, the flag that set it. These
# mean the same flag in every command; a temperature or a block size is --temp and --block-size in some,
# --temps and --block-sizes in bench (`named`).
FLAGS = {
    name: "--" + name.replace("_", "-")
    for name in (
        "max_tokens",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "draft_window",
        "tree",
        "seed",
    )
}
SAMPLING = {"temperature": "--temp", "block size": "--block-size"}  # generate's, chat's, serve's, profile's


def flagged(message: str, named: dict[str, str] | None = None) -> str:
    """An error message that starts with a setting's name ("max_tokens must be ...", "limit cannot be
    ..."), with its flag."""
    for name, flag in {**FLAGS, **(named or {})}.items():
        if message.startswith((name + " must ", name + " cannot ")):
            return flag + message[len(name) :]
    return message


NO_SUCH_USER = "Could not determine home directory."  # (pathlib's, expanding ~name for no such user)
NO_USER = "a path starts with ~name, and no user of that name is on this machine: give another path"


def mix_text(mix: dict) -> str:
    """Cycles per source, e.g. 'dflash 12 · tree 3 · lookup 5 · plain 30'."""
    return " · ".join(f"{s} {mix[s]}" for s in ("dflash", "tree", "lookup", "plain") if mix.get(s))


def check_utf8(text: str, what: str) -> None:
    if (at := unpaired_surrogate(text)) is not None:  # (bytes that are not UTF-8, from stdin)
        raise UserError(
            f"{what} is not UTF-8 text (a stray byte at character {at}): convert it "
            "first, e.g. with iconv -f latin1 -t utf-8"
        )


def first_prompts(source: str, limit: int | None) -> list:
    """The first `limit` prompts of a prompt set (None or 0: all of them), for bench and train eval."""
    if limit is not None and limit < 0:
        raise UserError(f"--limit must be >= 0 (0: all prompts), got {limit}")
    return prompt_source(source)[: limit or None]
