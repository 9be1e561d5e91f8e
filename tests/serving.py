"""A real server for the tests: the app under uvicorn on a free loopback port, in a thread; and tiny
tokenizers and models in the shapes a server meets (a chat template, thinking and tool-call markers)."""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import uvicorn
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import save_config, save_model
from tiny import CONFIGS, VOCAB, make_target

from dflash_mlx.server.connections import protocol

CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}w3 {% elif m['role'] == 'user' %}w4 "
    "{% else %}w5 {% endif %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w5 {% endif %}"
)


@contextmanager
def serving(app):
    """The app served on 127.0.0.1 at a free port, for the length of the block: -> its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = app.state.config
    http = protocol(config.head_seconds, config.max_connections)  # (as `dflash-mlx serve` runs it)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, http=http))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def word_tokenizer_folder(path: Path, words: list[str], chat_template: str, eos: str) -> Path:
    """A word-level tokenizer over `words` saved as a model folder's tokenizer files (token i is words[i])."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, unk_token=words[0])
    hf.chat_template = chat_template
    hf.save_pretrained(path)
    return path


def chat_tokenizer(path: Path, eos: int = VOCAB - 1):
    """The tiny models' vocabulary (w0 .. w95) with a chat template, loaded as mlx-lm loads a model's. (The
    EOS word is w95: special words are split out of longer ones, and no word starts with w95.)"""
    words = [f"w{i}" for i in range(VOCAB)]
    return load_tokenizer(word_tokenizer_folder(path, words, CHAT_TEMPLATE, f"w{eos}"))


# A vocabulary with thinking and tool-call markers, and the words of one JSON tool call.
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
CALL_WORDS = json.dumps(CALL).split()
# (a call whose argument is half a UTF-16 pair, as a model writes it: a JSON escape)
ODD_WORDS = json.dumps({"name": "get_weather", "arguments": {"city": "\ud800"}}).split()
TOOL_TEMPLATE = (
    "{% if tools %}{% for t in tools %}tool {{ t['function']['name'] }} {% endfor %}{% endif %}"
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} "
    "{% if m.tool_calls %}{% for tool_call in m.tool_calls %}{% if tool_call.function %}"
    "{% set tool_call = tool_call.function %}{% endif %}<tool_call> {{ tool_call.name }} </tool_call> "
    "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}assistant {% endif %}"
)
SCRIPT_WORDS = [
    "<unk>",
    "<eos>",
    "system",
    "user",
    "assistant",
    "tool",
    "tool_result",
    "get_weather",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "hmm",
    "sunny",
    "rain",
    "weather",
    "Paris",
    "think",
    "call",
    "answer",
    "it",
    "is",
    *CALL_WORDS,
    ODD_WORDS[-1],
]


# The scripted model's reply: reasoning, an answer, then a tool call.
REPLY = [
    "<think>",
    "hmm",
    "</think>",
    "it",
    "is",
    "sunny",
    "<tool_call>",
    *CALL_WORDS,
    "</tool_call>",
    "<eos>",
]


def scripted_pair(path: Path, successors: dict[str, str] | None = None):
    """A real mlx-lm Llama whose greedy reply is fixed: its decoder layers add nothing (zero output
    projections), so each next token is successors[this token], through the embedding and the head
    alone. -> (model, tokenizer) with thinking and tool-call markers (mlx-lm infers them and the JSON
    tool parser from the vocabulary and the template)."""
    words = SCRIPT_WORDS
    ids = {w: i for i, w in enumerate(words)}
    if successors is None:
        successors = dict(zip(["assistant", *REPLY], REPLY))
    hidden = 128
    config = dict(CONFIGS["llama"], hidden_size=hidden, vocab_size=len(words), tie_word_embeddings=False)
    model = make_target("llama", **{k: v for k, v in config.items() if k != "model_type"})
    embed = mx.zeros((len(words), hidden))
    head = mx.zeros((len(words), hidden))
    for i in range(len(words)):
        embed[i, i] = 1.0
        head[ids[successors.get(words[i], "<eos>")], i] = 1.0
    zeroed = {}
    for n, layer in enumerate(model.model.layers):
        zeroed[f"model.layers.{n}.self_attn.o_proj.weight"] = mx.zeros_like(layer.self_attn.o_proj.weight)
        zeroed[f"model.layers.{n}.mlp.down_proj.weight"] = mx.zeros_like(layer.mlp.down_proj.weight)
    model.load_weights(
        [("model.embed_tokens.weight", embed), ("lm_head.weight", head), *zeroed.items()], strict=False
    )
    mx.eval(model.parameters())
    save_model(path, model)
    save_config(dict(config, eos_token_id=ids["<eos>"]), path / "config.json")
    word_tokenizer_folder(path, words, TOOL_TEMPLATE, "<eos>")
    return model, load_tokenizer(path)
