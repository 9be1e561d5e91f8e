"""The drafter this project ships for SmolLM2-135M-Instruct: lossless, and better than chance."""

import json

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from dflash_mlx import apply_chat_template, generate, load_draft
from dflash_mlx.chat import ChatSession
from dflash_mlx.data import humaneval_prompts

# A random drafter of the same shape scores tau 1.00 on HumanEval prompts (every proposal rejected): this
# floor catches a broken checkpoint; the drafter's model card says how far above it the shipped one is.
TAU_FLOOR = 1.2


@pytest.fixture(scope="module")
def pair(smollm2):
    model, tokenizer, _ = smollm2
    return model, load_draft("smollm2-135m-instruct-dflash"), tokenizer


def test_shipped_drafter_fits_and_is_lossless(pair):
    model, draft, tokenizer = pair
    assert draft.config.vocab_size == 49152 and draft.config.num_target_layers == 30
    for question in [
        "What is the capital of France?",
        "List three colours.",
        "Write a Python function that adds two numbers.",
    ]:
        ids = apply_chat_template(tokenizer, question)
        want = []
        for tok, _ in generate_step(mx.array(ids), model, max_tokens=48):
            want.append(int(tok))
            if want[-1] in tokenizer.eos_token_ids:
                break
        assert generate(model, draft, tokenizer, ids, max_tokens=48).tokens == want


def test_shipped_drafter_beats_chance_on_humaneval(pair):
    model, draft, tokenizer = pair
    acc = []
    for messages in humaneval_prompts()[:3]:
        acc += generate(
            model,
            draft,
            tokenizer,
            apply_chat_template(tokenizer, messages),
            max_tokens=48,
            block_size=draft.block_size,
        ).acceptance_lengths
    assert sum(acc) / len(acc) > TAU_FLOOR


def test_convert_takes_registry_names(pair, tmp_path):
    from typer.testing import CliRunner

    from dflash_mlx.cli.main import app

    _, draft, _ = pair
    r = CliRunner().invoke(
        app, ["convert", "smollm2-135m-instruct-dflash", str(tmp_path / "d"), "--dtype", "float32"]
    )
    assert r.exit_code == 0 and "wrote drafter" in r.stdout, r.output
    copy = load_draft(str(tmp_path / "d"))
    assert copy.fc.weight.dtype == mx.float32 and mx.array_equal(
        copy.fc.weight, draft.fc.weight.astype(mx.float32)
    )
    r = CliRunner().invoke(app, ["convert", "smollm2-135m-instruct", str(tmp_path / "t")])
    assert r.exit_code == 0 and "wrote target" in r.stdout, r.output
    assert "quantization" in json.loads((tmp_path / "t" / "config.json").read_text())  # the GGUF's own 4 bits
    r = CliRunner().invoke(
        app, ["convert", "smollm2-135m-instruct", str(tmp_path / "t32"), "--dtype", "float32"]
    )
    assert r.exit_code == 0 and "wrote target" in r.stdout, r.output
    assert "quantization" not in json.loads((tmp_path / "t32" / "config.json").read_text())
    weights = mx.load(str(next((tmp_path / "t32").glob("*.safetensors"))))
    assert {v.dtype for v in weights.values()} == {mx.float32}


def test_chat_counts_only_drafted_tokens_it_shows(pair):
    """An answer cut at --max-tokens inside a cycle drops drafted tokens: the share never passes 100%."""
    model, draft, tokenizer = pair
    cut = False
    for n in range(2, 9):
        session = ChatSession(model, draft, tokenizer, block_size=16, max_tokens=n)
        responses = list(session.reply("Write a Python function that checks whether a number is prime."))
        turn = session.turns[-1]
        assert turn["tokens"] == n
        assert turn["drafted_share"] <= (n - 1) / n  # the first token is always the target's own
        cut |= any(r.accepted is not None and r.accepted - 1 > len(r.tokens) for r in responses)
    assert cut  # the case that counted too much happened
