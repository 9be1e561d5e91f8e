"""Request bodies of the OpenAI and Anthropic APIs, as far as this server reads them (pydantic).

Fields a client may send that the server has no use for (`user`, `metadata`, `service_tier`, ...) are
accepted and ignored, as the official servers accept fields of newer API versions; those that would
change what the answer holds, which it cannot give, are refused (`refused`). Where the APIs let an
option be null, null means its default.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Annotated, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    field_validator,
)

from ..errors import unpaired_surrogate
from ..sampling import MAX_TEMPERATURE
from ..settings import MAX_LOGPROBS
from .errors import ApiError, shown

# Numbers and flags as JSON writes them: pydantic's lax mode would read true as 1 and "0.5" as 0.5.
Number = Annotated[float, Strict()]  # (an integer is a number too)
# A list whose first wrong item ends its validation: pydantic reports every wrong item by default,
# which for millions of them holds the event loop for many seconds.
T = TypeVar("T")
Items = Annotated[list[T], Field(fail_fast=True)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # (NaN passed every range check)


class _Sampling(_Body):
    model: str
    temperature: Number | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: Number | None = Field(None, ge=0, le=1)  # (0 as the APIs allow: the most likely token alone)
    top_k: StrictInt | None = Field(None, ge=0)
    min_p: Number | None = Field(None, ge=0, le=1)
    seed: StrictInt | None = None
    stream: StrictBool | None = False


# ---- OpenAI -----------------------------------------------------------------------------------------


class TextPart(_Body):
    type: str
    text: str | None = None
    refusal: str | None = None  # (an assistant's "refusal" part: its text)


class FunctionCall(_Body):
    name: str
    arguments: str | dict = "{}"


class ToolCallIn(_Body):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Items[TextPart] | None = None
    tool_calls: Items[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class StreamOptions(_Body):
    include_usage: StrictBool = False


MAX_STOPS = 64  # stop strings a request may give (each is looked for in the text after every cycle)
# Fields that, asked for, change what an answer holds, which this server cannot give: refused rather
# than answered without (other fields it has no use for are ignored).
NOT_GIVEN = {
    "echo": "the prompt echoed back in a chat (completions echo it)",
    "suffix": "insertions (a suffix)",
    "best_of": "the best of several answers",
    "audio": "answers in audio",
}
NEUTRAL = {"best_of": 1}  # values of those fields that ask for nothing
FORCED_TOOLS = "this server cannot make the model call a tool; leave tool_choice out or make it "


MEDIA = (
    "image",
    "image_url",
    "input_audio",
    "audio",
    "file",
    "document",
    "video",
)  # (what a text model cannot read)


def _not_text(content, where: str, unread: Callable[[str], bool], parts: str) -> tuple[str, str] | None:
    """(field, why) for the first content part of a kind this text model cannot read in `content` (a
    message's, named `where`), if any, a tool result's own parts too."""
    for j, part in enumerate(content if isinstance(content, list) else []):
        if unread(part.type):
            kind = f"{shown(part.type)!r} {parts}"
            why = (
                f"this model reads text only, not {kind}"
                if part.type in MEDIA
                else f"this server does not read {kind}"
            )
            return f"{where}[{j}]", why
        if found := _not_text(getattr(part, "content", None), f"{where}[{j}].content", unread, parts):
            return found
    return None


def _unread(messages, unread: Callable[[str], bool], parts: str) -> tuple[str, str] | None:
    for i, m in enumerate(messages):
        if found := _not_text(m.content, f"messages[{i}].content", unread, parts):
            return found
    return None


def _digits(key):
    # (pydantic alone reads " 1", "+1" and "1_0" as token ids too)
    if isinstance(key, str) and not re.fullmatch("-?[0-9]+", key):
        raise ValueError('should be a token id written in digits, such as "50256"')
    return key


TokenId = Annotated[int, BeforeValidator(_digits)]  # (a key of a JSON object: a string)


def _unicode(stops: list[str]) -> None:
    """Refuses a stop string that no text holds: one with an unpaired UTF-16 surrogate."""
    for stop in stops:
        if unpaired_surrogate(stop) is not None:
            raise ValueError("a stop string holds an unpaired UTF-16 surrogate: send valid Unicode")


class _OpenAI(_Sampling):
    stop: str | Items[str] | None = Field(None, union_mode="left_to_right")
    n: StrictInt | None = 1
    stream_options: StreamOptions | None = None
    # OpenAI's penalties and biases (in its ranges), and mlx-lm's server's repetition penalty and
    # windows: what mlx-lm's logits processors take (settings.py)
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    logit_bias: (
        Annotated[dict[TokenId, Annotated[Number, Field(ge=-100, le=100)]], Field(fail_fast=True)] | None
    ) = None
    repetition_penalty: Number | None = Field(None, ge=0.01, le=100)
    repetition_context_size: StrictInt | None = Field(None, ge=1, le=2**30)
    presence_context_size: StrictInt | None = Field(None, ge=1, le=2**30)
    frequency_context_size: StrictInt | None = Field(None, ge=1, le=2**30)

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop):
        if isinstance(stop, list) and len(stop) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        _unicode([stop] if isinstance(stop, str) else stop or [])
        return stop

    def refused(self) -> tuple[str, str] | None:
        """(field, why) for the first field asked for that would change what the answer holds, which this
        server cannot give."""
        extra = self.model_extra or {}
        for name in NOT_GIVEN:
            value = extra.get(name)
            if value not in (None, False, 0, "", {}, []) and value != NEUTRAL.get(name):
                return name, f"this server does not give {NOT_GIVEN[name]}; leave it out"
        if extra.get("response_format") not in (None, {"type": "text"}):
            return "response_format", "this server does not constrain answers to a format; leave it out"
        if extra.get("functions") or extra.get("function_call") not in (None, "auto", "none"):
            name = "functions" if extra.get("functions") else "function_call"
            return name, "the deprecated functions are not read here: send tools (and tool_choice) instead"
        if extra.get("modalities") not in (None, ["text"]):
            return "modalities", 'this server answers in text only; leave it out or make it ["text"]'
        if self.stream_options is not None and not self.stream:  # (as OpenAI's API and vLLM answer)
            return "stream_options", "it is for a streamed answer: set stream to true or leave it out"
        return None

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


PROCESSORS = (  # the fields above that settings.py turns into logits processors
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "repetition_penalty",
    "repetition_context_size",
    "presence_context_size",
    "frequency_context_size",
)


def _function_name(function) -> str | None:
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else None


class ChatCompletionRequest(_OpenAI):
    messages: Items[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    tools: Items[dict] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict | None = None
    chat_template_kwargs: dict | None = None  # what vLLM and mlx-lm's server take for e.g. enable_thinking

    def refused(self) -> tuple[str, str] | None:
        if refused := super().refused():
            return refused
        if self.tool_choice not in (None, "auto", "none") and self.allowed_tools is None:
            return "tool_choice", FORCED_TOOLS + '"auto", "none" or allowed tools in mode "auto"'
        given = {_function_name(t.get("function")) for t in self.tools or []}
        if unknown := sorted((self.allowed_tools or set()) - given):
            return "tool_choice", f"allows tools the request does not give ({shown(', '.join(unknown))})"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "comes with each token's log-probability: send logprobs: true too"
        return _unread(self.messages, lambda kind: kind not in ("text", "refusal"), "parts")

    @property
    def allowed_tools(self) -> set[str] | None:
        """The names of the tools a tool_choice of type "allowed_tools" leaves the model, in mode "auto"
        (it may call one of them or none); None for any other tool_choice."""
        choice = self.tool_choice
        if not isinstance(choice, dict) or choice.get("type") != "allowed_tools":
            return None
        allowed = choice.get("allowed_tools")
        if not isinstance(allowed, dict) or allowed.get("mode") != "auto":
            return None
        tools = allowed.get("tools")
        if not isinstance(tools, list):
            return None
        names = [_function_name(t.get("function", t)) if isinstance(t, dict) else None for t in tools]
        return set(names) if all(isinstance(n, str) for n in names) else None

    @property
    def offered(self) -> list[dict] | None:
        """The tools the prompt offers the model: none for tool_choice "none", only the allowed ones."""
        if self.tool_choice == "none" or not self.tools:
            return None
        allowed = self.allowed_tools
        if allowed is None:
            return self.tools
        return [t for t in self.tools if _function_name(t.get("function")) in allowed]

    @property
    def top(self) -> int | None:
        """The most likely tokens to give beside each token's log-probability; None for none."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self, deepest: int) -> list[dict]:
        """The messages as chat templates take them: text parts joined, tool-call arguments as objects
        (refused where they nest deeper than `deepest`)."""
        out = []
        for m in self.messages:
            message = {"role": "system" if m.role == "developer" else m.role, "content": _text(m.content)}
            if m.tool_calls:
                message["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {
                            "name": c.function.name,
                            "arguments": _arguments(c.function.arguments, deepest),
                        },
                    }
                    for c in m.tool_calls
                ]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                message["name"] = m.name
            out.append(message)
        return out


class CompletionRequest(_OpenAI):
    # one prompt: text or token ids, alone or as a list of one (a list of several is refused: `one`)
    prompt: str | Items[StrictInt] | Items[str] | Items[Items[StrictInt]] = Field(union_mode="left_to_right")
    max_tokens: StrictInt | None = Field(16, ge=0)  # (0 with echo: the prompt scored, nothing generated)
    logprobs: StrictInt | None = Field(None, ge=0, le=5)  # (the legacy API's: the most likely beside each)
    echo: StrictBool | None = False  # the prompt given back before the answer (with logprobs: scored)

    @field_validator("max_tokens")
    @classmethod
    def _default_length(cls, max_tokens):
        return 16 if max_tokens is None else max_tokens  # the OpenAI API's default for completions

    @property
    def top(self) -> int | None:
        return self.logprobs

    def one(self) -> str | list[int]:
        """The prompt, where the request holds one."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) > 1:
                raise ValueError(
                    f"this server answers one prompt per request, got {len(prompt)}: send them one by one"
                )
            (prompt,) = prompt
        return prompt


# ---- Anthropic --------------------------------------------------------------------------------------


class Block(_Body):
    type: str
    text: str | None = None
    thinking: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict | None = None
    tool_use_id: str | None = None
    content: str | Items[Block] | None = None


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | Items[Block]


class AnthropicTool(_Body):
    type: str | None = None  # a client's own tool: none or "custom"; Anthropic's server tools are typed
    name: str
    description: str | None = None
    input_schema: dict = Field(default_factory=dict)


# The blocks a conversation's text is made of; any other (images, documents, Anthropic's server tools'
# blocks) is refused rather than left out unsaid.
READ_BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


def _unread_block(kind: str) -> bool:
    return kind not in READ_BLOCKS


class TokenCountRequest(_Sampling):
    """A messages request as Anthropic's token counting takes it: without max_tokens."""

    messages: Items[AnthropicMessage] = Field(min_length=1)
    system: str | Items[Block] | None = None
    stop_sequences: Items[str] | None = Field(None, max_length=MAX_STOPS)
    tools: Items[AnthropicTool] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None  # {"type": "enabled" | "disabled", ...}

    @field_validator("stop_sequences")
    @classmethod
    def _unicode_stops(cls, stops):
        _unicode(stops or [])
        return stops

    def refused(self) -> tuple[str, str] | None:
        """(field, why) for a field asked for that would change what the answer holds, which this server
        cannot give."""
        if (self.tool_choice or {}).get("type") not in (None, "auto", "none"):
            return "tool_choice", FORCED_TOOLS + '{"type": "auto"} or {"type": "none"}'
        extra = self.model_extra or {}
        config = extra.get("output_config")
        if extra.get("output_format") or (isinstance(config, dict) and config.get("format")):
            field = "output_format" if extra.get("output_format") else "output_config"
            return (
                field,
                "this server does not constrain answers to a format (structured outputs); leave it out",
            )
        for i, m in enumerate(self.messages):
            for j, b in enumerate(m.content if isinstance(m.content, list) else []):
                if b.type == "tool_use" and not b.name:
                    return (
                        f"messages[{i}].content[{j}].name",
                        "a tool_use block needs the name of the tool called",
                    )
        system = _not_text(self.system, "system", lambda kind: kind != "text", "blocks")
        return system or _unread(self.messages, _unread_block, "blocks")

    def function_tools(self) -> list[dict] | None:
        """The tools as chat templates take them (OpenAI's function layout)."""
        own = [t for t in self.tools or [] if t.type in (None, "custom")]  # (no server tools run here)
        if not own or (self.tool_choice or {}).get("type") == "none":
            return None
        return [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description or "",
                    "parameters": t.input_schema,
                },
            }
            for t in own
        ]

    def conversation(self) -> list[dict]:
        out = [{"role": "system", "content": _blocks_text(self.system)}] if self.system else []
        for m in self.messages:
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
                continue
            text = "".join(b.text or "" for b in m.content if b.type == "text")
            calls = [
                {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input or {}}}
                for b in m.content
                if b.type == "tool_use"
            ]
            results = [b for b in m.content if b.type == "tool_result"]
            for b in results:  # tool results answer the calls of the assistant's last message
                out.append(
                    {"role": "tool", "tool_call_id": b.tool_use_id, "content": _blocks_text(b.content)}
                )
            if text or calls or not results:
                message = {"role": m.role, "content": text}
                if calls:
                    message["tool_calls"] = calls
                out.append(message)
        return out


class MessagesRequest(TokenCountRequest):
    max_tokens: StrictInt = Field(ge=1)


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join((p.text if p.type == "text" else p.refusal) or "" for p in content)


def _blocks_text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(b.text or "" for b in content if b.type == "text")


def _arguments(arguments: str | dict, deepest: int) -> dict | str:
    """A tool call's arguments as templates take them: parsed where they are JSON, else as sent. JSON
    in a string is not seen by the body's own nesting check, and templates recurse through it."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
        deep = _depth(parsed) > deepest
    except RecursionError:
        deep = True
    except ValueError:
        return arguments
    if deep:
        raise ApiError(
            400, f"a tool call's arguments nest over {deepest} deep: send them flatter", "messages"
        )
    return parsed


def _depth(value) -> int:
    """How deeply JSON objects and arrays nest in a parsed value (without recursing)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        value, depth = stack.pop()
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if items is not None:
            deepest = max(deepest, depth + 1)
            stack.extend((item, depth + 1) for item in items)
    return deepest
