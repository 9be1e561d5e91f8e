"""A real server for the tests: the app under uvicorn on a free loopback port, in a thread; and tiny
tokenizers and models in the shapes a server meets (a chat template, thinking and tool-call markers)."""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import uvicorn
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import save_config, save_model
from tiny import VOCAB, successor_target

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
    """`successor_target` over words, saved at `path` with a tokenizer that has thinking and tool-call
    markers (mlx-lm infers them and the JSON tool parser from the vocabulary and the template): each
    next word is successors[this word], else "<eos>". -> (model, tokenizer)."""
    words = SCRIPT_WORDS
    ids = {w: i for i, w in enumerate(words)}
    if successors is None:
        successors = dict(zip(["assistant", *REPLY], REPLY))
    by_id = {ids[w]: ids[s] for w, s in successors.items()}
    model, config = successor_target(by_id, len(words), other=ids["<eos>"])
    save_model(path, model)
    save_config(dict(config, eos_token_id=ids["<eos>"]), path / "config.json")
    word_tokenizer_folder(path, words, TOOL_TEMPLATE, "<eos>")
    return model, load_tokenizer(path)
