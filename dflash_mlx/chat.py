"""Prompts for chat models, and a multi-turn conversation that keeps its caches between turns."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

from .cache import SpeculativeCache
from .channels import starts_in_reasoning
from .errors import UserError, unpaired_surrogate
from .files import atomic_file
from .pairing import context_length, prepare
from .settings import GenerationSettings
from .speculative import GenerationResponse, stream_generate


def most_chars(tokenizer, context: int | None) -> int | None:
    """The longest text that could fit in `context` tokens: no token holds more characters than the
    longest vocabulary entry, so a longer text is refused before minutes of tokenizing (megabytes)."""
    return None if context is None else context * max(max(map(len, tokenizer.get_vocab()), default=1), 1)


def apply_chat_template(
    tokenizer,
    messages: str | list[dict],
    *,
    system: str | None = None,
    add_generation_prompt: bool = True,
    **template_kwargs,
) -> list[int]:
    """Token ids of a conversation rendered with the model's chat template, ready for a reply.

    `messages` is a user message's text, one {"role", "content"} dict or a list of them; extra keyword
    arguments reach the template (e.g. enable_thinking=False for Qwen3). A tokenizer without a chat template
    gets the plain text of the messages. The messages' text is read as text: a special token's text in it
    (say "<|im_start|>") becomes that text's ordinary tokens, never the special token, so no message can
    end its turn or start another one.
    """
    if isinstance(tokenizer, str) or not hasattr(tokenizer, "encode"):
        raise UserError("give the tokenizer first (as load_pair or load returns it), then the messages")
    if "tokenize" in template_kwargs:  # (transformers' and mlx-lm's keyword: here always ids)
        raise UserError(
            "apply_chat_template returns token ids, and takes no tokenize: tokenizer.decode(ids) is the text"
        )
    if not isinstance(add_generation_prompt, bool):  # ("no" would be taken as True)
        raise UserError(f"add_generation_prompt must be True or False, got {add_generation_prompt!r}")
    _check_messages(messages, system)
    text = chat_text(
        tokenizer, messages, system=system, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    return encode_chat_text(tokenizer, text)


def _check_messages(messages, system) -> None:
    """What `apply_chat_template` takes, or one line on what it does not (the template's own errors
    come from deep in jinja2 or transformers, and name neither the message nor what to change)."""
    shape = "messages must be a user message's text, one {'role', 'content'} dict or a non-empty list of them"
    if isinstance(messages, str):
        listed = [{"role": "user", "content": messages}]
    elif isinstance(messages, dict):
        listed = [messages]
    elif isinstance(messages, (list, tuple)) and messages:
        listed = list(messages)
    else:
        got = "an empty list" if isinstance(messages, (list, tuple)) else type(messages).__name__
        raise UserError(f"{shape}, got {got}")
    if system is not None and not isinstance(system, str):
        raise UserError(f"system must be text, got {type(system).__name__}")
    for i, m in enumerate(listed):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            got = "a dict without a 'role' string" if isinstance(m, dict) else type(m).__name__
            raise UserError(f"{shape}: message {i} is {got}")
        content = m.get("content")
        if content is None and m.get("tool_calls"):  # (an assistant's tool calls, without text)
            continue
        if not isinstance(content, str):
            parts = " (join the parts' text into one string)" if isinstance(content, list) else ""
            raise UserError(f"message {i}'s content must be text, got {type(content).__name__}{parts}")
        if system is not None and m["role"] == "system":  # (rendered as two system turns)
            raise UserError(f"system is given, and message {i} is a system message too: give one of them")
    for text in [system, *(m.get("content") for m in listed)]:
        if (at := unpaired_surrogate(text or "")) is not None:
            raise UserError(
                f"an unpaired UTF-16 surrogate ({text[at]!r}) in the messages is not text: remove it"
            )


def chat_text(
    tokenizer,
    messages: str | list[dict],
    *,
    system: str | None = None,
    add_generation_prompt: bool = True,
    **template_kwargs,
) -> str:
    """The conversation as the text `apply_chat_template` tokenizes (see there), special tokens' text in
    the messages and the template's variables marked (`as_text`)."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    elif isinstance(messages, dict):  # (one message)
        messages = [messages]
    if system is not None:
        messages = [{"role": "system", "content": system}, *messages]
    messages, template_kwargs = as_text(tokenizer, [messages, template_kwargs])
    if getattr(tokenizer, "chat_template", None) is None:
        return "\n".join(m["content"] for m in messages)
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs
    )


# Tokenizers read a special token's text anywhere in a text as the special token (mlx-lm and
# transformers alike); which parts of a rendered conversation came from the messages is known only
# before rendering. So each special token's text in the messages (and each MARK already there) is
# replaced by MARK, its number, MARK, which templates copy as they copy any text, and
# `encode_chat_text` tokenizes what the marks hold as plain text.
MARK = "\U0010fffd"  # a private-use character, no tokenizer's special token
_MARKED = re.compile(f"{MARK}([0-9]{{1,9}}){MARK}")


def _specials(tokenizer) -> list[str]:
    """MARK, then the tokenizer's special tokens' texts, longest first (number i: the i-th)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    added = getattr(hf, "added_tokens_decoder", {})
    texts = {t.content for t in added.values() if t.special and t.content}
    return [MARK, *sorted(texts, key=lambda t: (-len(t), t))]


def as_text(tokenizer, value):
    """`value` (strings, and lists and dicts of them: messages, tools) with the special tokens' texts in
    its strings marked, so that `encode_chat_text` reads them as text."""
    specials = _specials(tokenizer)
    number = {text: f"{MARK}{i}{MARK}" for i, text in enumerate(specials)}
    found = re.compile("|".join(map(re.escape, specials)))

    def marked(v):
        if isinstance(v, str):
            return found.sub(lambda m: number[m.group()], v)
        if isinstance(v, list):
            return [marked(x) for x in v]
        if isinstance(v, dict):
            return {marked(k): marked(x) for k, x in v.items()}
        return v

    return marked(value)


def encode_chat_text(tokenizer, text: str) -> list[int]:
    """Token ids of `chat_text`'s text, what its marks hold as plain text. A template writes any BOS
    token it wants itself; without one the tokenizer adds its own. verbose=False: transformers would warn
    that a long conversation "will result in indexing errors"; the context check says the real limit."""
    templated = getattr(tokenizer, "chat_template", None) is not None
    pieces = _MARKED.split(text)  # text, number, text, number, ..., text
    ids = tokenizer.encode(pieces[0], add_special_tokens=not templated, verbose=False)
    if len(pieces) == 1:
        return ids
    specials, hf = _specials(tokenizer), getattr(tokenizer, "_tokenizer", tokenizer)
    literals = {}
    for number in set(pieces[1::2]):
        i = int(number)
        literal = specials[i] if i < len(specials) else f"{MARK}{number}{MARK}"  # (a client template's)
        literals[number] = hf.encode(literal, add_special_tokens=False, split_special_tokens=True)
    after = hf(pieces[2::2], add_special_tokens=False, verbose=False)["input_ids"]  # (one batched call)
    for number, tail in zip(pieces[1::2], after):
        ids += literals[number] + tail
    return ids


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ChatSession:
    """A conversation with one model pair. Each turn renders the whole conversation with the chat
    template, keeps the part of both caches that still matches it, and prefills only the rest, so
    the time to first token does not grow with the history. `settings` may change between turns."""

    def __init__(
        self,
        model,
        draft,
        tokenizer,
        *,
        system: str | None = None,
        temperature: float = 0.0,
        repetition_penalty: float | None = None,
        block_size: int | None = None,
        lookup: bool = True,
        max_tokens: int = 1024,
        max_context: int | None = None,
        template_kwargs: dict | None = None,
        draft_window: int | None = None,
    ):
        self.settings = GenerationSettings(
            temperature=temperature,
            repetition_penalty=repetition_penalty,
            block_size=block_size,
            lookup=lookup,
            max_tokens=max_tokens,
            draft_window=draft_window,
        )
        self.target = prepare(model, draft)
        self.draft, self.tokenizer, self.system = draft, tokenizer, system
        self.max_context = max_context or context_length(self.target) or 4096
        if not 1 <= max_tokens < self.max_context:
            raise UserError(
                f"max_tokens must be from 1 to {self.max_context - 1} (the model's context holds "
                f"{self.max_context}), got {max_tokens}"
            )
        self.template_kwargs = template_kwargs or {}
        self.messages: list[dict] = []
        self.cache = self.new_cache()
        self.turns: list[dict] = []  # per-turn statistics
        # whether the last reply began inside a thinking block (a template that opens one for the model)
        self.thinking = False

    def new_cache(self) -> SpeculativeCache:
        return SpeculativeCache(self.target, self.draft, self.settings.draft_window)

    def reset(self) -> None:
        self.messages, self.turns = [], []
        self.cache = self.new_cache()

    def conversation(self, messages: list[dict] | None = None) -> list[dict]:
        """The system message (if any) and `messages` (by default the whole conversation's)."""
        messages = self.messages if messages is None else messages
        return ([{"role": "system", "content": self.system}] if self.system is not None else []) + messages

    def context_tokens(self) -> int:
        """Tokens the conversation takes: the cache's, or after a dropped cache, the rendered conversation's
        own."""
        if self.cache.tokens or not self.messages:
            return len(self.cache.tokens)
        return len(
            apply_chat_template(
                self.tokenizer, self.conversation(), add_generation_prompt=False, **self.template_kwargs
            )
        )

    def reply(
        self, text: str, should_stop: Callable[[], bool] = lambda: False, reading=None
    ) -> Iterator[GenerationResponse]:
        """Stream the answer to a user message. `should_stop()` is checked after every piece; when it
        turns true (or the caller stops reading) the answer ends there, and the partial answer stays in
        the conversation (so does what came before MLX failed once a stop was asked for: see below).
        `reading(done, total)`: called as the conversation's new tokens are read (stream_generate's
        prompt_progress_callback). On
        an error or a KeyboardInterrupt the message is dropped; if that came inside
        a model pass, the caches it left half-updated are dropped too (the next message prefills the
        conversation again)."""
        message = {"role": "user", "content": text}
        answer, accepted, tokens, drafted, last, mix = [], [], 0, 0, None, Counter()
        recorded = False

        def record(stopped: bool) -> None:
            nonlocal recorded
            recorded = True
            self.messages.append({"role": "assistant", "content": "".join(answer)})
            self.turns.append(
                {
                    "prefill_tokens": self.cache.last_prefill,
                    "tokens": tokens,
                    "tokens_per_s": last.generation_tps if last else 0.0,
                    "mean_acceptance": sum(accepted) / len(accepted) if accepted else None,
                    "cycles": len(accepted),
                    "drafted_share": drafted / tokens if tokens else 0.0,
                    "mix": dict(mix),
                    "interrupted": stopped,
                    "finish_reason": "interrupted" if stopped else last.finish_reason if last else None,
                    "context_tokens": self.context_tokens(),
                }
            )

        try:  # (from the message's arrival on: a Ctrl-C right after it must take it away again)
            self.messages.append(message)
            ids = apply_chat_template(self.tokenizer, self.conversation(), **self.template_kwargs)
            if len(ids) + self.settings.max_tokens > self.max_context:
                alone = None
                if len(self.messages) > 1:  # (would /reset make room for it?)
                    first = self.conversation(self.messages[-1:])
                    alone = len(apply_chat_template(self.tokenizer, first, **self.template_kwargs))
                raise ContextFull(len(ids), self.max_context, self.settings.max_tokens, alone)
            # At least one token goes in: after a message dropped between two cycles, the cache can hold the
            # whole of `ids` (the message and a partial answer), and an empty prompt would be refused.
            keep = min(common_prefix(self.cache.tokens, ids), len(ids) - 1)
            self.thinking = starts_in_reasoning(self.tokenizer, ids)
            if not self.cache.truncate(keep):
                self.cache, keep = self.new_cache(), 0
            stream = stream_generate(
                self.target,
                self.draft,
                self.tokenizer,
                ids[keep:],
                prompt_cache=self.cache,
                prompt_progress_callback=reading,
                **asdict(self.settings),
            )
            try:
                for last in stream:
                    answer.append(last.text)
                    tokens += len(last.tokens)
                    if last.accepted is not None:
                        accepted.append(last.accepted)
                        drafted += min(last.accepted - 1, len(last.tokens))  # a cut at EOS/max drops drafted
                        mix[last.source] += 1
                    try:
                        yield last
                    except GeneratorExit:  # the caller stopped reading, between two cycles: a clean stop
                        record(stopped=True)
                        raise
                    if should_stop():
                        record(stopped=True)
                        return
            finally:
                # Its clean-up (the step under way taken back, what the policy learnt saved) runs now, not
                # whenever it is collected, so that a Ctrl-C during it reaches the caller.
                stream.close()
        except (Exception, KeyboardInterrupt) as e:  # no answer (unless it stopped cleanly first): the
            # message goes, and so does a cache that an interrupted pass left half-updated. But MLX's CPU
            # backend compiles kernels with g++ on first use, and a Ctrl-C reaches the terminal's whole
            # process group: one that asked for a stop meanwhile ended the compiler too, and MLX raised
            # a RuntimeError. That is the stop asked for: the answer so far stays.
            stopped = isinstance(e, RuntimeError) and answer and not recorded and should_stop()
            if not recorded and not stopped and self.messages and self.messages[-1] is message:
                self.messages.pop()
            if self.cache.broken:
                self.cache = self.new_cache()
            if not stopped:
                raise
            record(stopped=True)
            return
        record(stopped=False)

    def save(self, path: str | Path) -> Path:
        """Write the conversation as JSON (whole or not at all); -> the path written."""
        try:
            written = Path(path).expanduser()
        except RuntimeError:  # (pathlib's, for a ~name that names no user)
            raise UserError(f"cannot save to {path}: no user named {str(path)[1:].split('/')[0]!r}") from None
        with atomic_file(path) as tmp:  # (as given: a trailing slash says a folder)
            tmp.write_text(json.dumps({"messages": self.conversation(), "turns": self.turns}, indent=2))
        return written


class ContextFull(UserError):
    def __init__(self, used: int, limit: int, room: int, alone: int | None = None):
        """`alone`: the tokens the message would take in a new conversation (None: it is the first)."""
        what = "this message" if alone is None else "the conversation"
        own = used if alone is None else alone
        fix = (
            "/reset to start a new conversation"
            if own + room <= limit
            else "a shorter message"
            if own >= limit
            else "a shorter message or a lower /max N (the answer's most tokens)"
        )
        super().__init__(
            f"{what} needs {used} tokens plus {room} for the answer, and the model's context holds "
            f"{limit}: {fix}"
        )
