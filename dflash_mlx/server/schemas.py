"""Request bodies of the OpenAI and Anthropic APIs, as far as this server reads them (pydantic).

Fields a client may send that the server has no use for (`user`, `metadata`, penalties, ...) are
accepted and ignored, as the official servers accept fields of newer API versions.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Sampling(_Body):
    model: str
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stream: bool = False


# ---- OpenAI -----------------------------------------------------------------------------------------


class TextPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str | dict = "{}"


class ToolCallIn(_Body):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class StreamOptions(_Body):
    include_usage: bool = False


MAX_STOPS = 64  # stop strings a request may give (each is looked for in the text after every cycle)
# Fields that, asked for, change what an answer holds, which this server cannot give: refused rather
# than answered without (other fields it has no use for are ignored).
NOT_GIVEN = {
    "logprobs": "log-probabilities",
    "top_logprobs": "log-probabilities",
    "echo": "the prompt echoed back",
    "suffix": "insertions (a suffix)",
    "best_of": "the best of several answers",
    "logit_bias": "token biases",
}
FORCED_TOOLS = "this server cannot make the model call a tool; leave tool_choice out or make it "


def _not_text(messages, unread: Callable[[str], bool], parts: str) -> tuple[str, str] | None:
    """(field, why) for the first content part of a kind this text model cannot read, if any."""
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            if unread(part.type):
                return f"messages[{i}].content[{j}]", f"this model reads text only, not {part.type!r} {parts}"
    return None


class _OpenAI(_Sampling):
    stop: str | list[str] | None = Field(None, union_mode="left_to_right")
    n: int = 1
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop):
        if isinstance(stop, list) and len(stop) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        return stop

    def refused(self) -> tuple[str, str] | None:
        """(field, why) for the first field asked for that would change what the answer holds, which this
        server cannot give."""
        extra = self.model_extra or {}
        for name in NOT_GIVEN:
            value = extra.get(name)
            if value not in (None, False, 0, "", {}) and not (name == "best_of" and value == 1):
                return name, f"this server does not give {NOT_GIVEN[name]}; leave it out"
        if extra.get("response_format") not in (None, {"type": "text"}):
            return "response_format", "this server does not constrain answers to a format; leave it out"
        return None

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_OpenAI):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    chat_template_kwargs: dict | None = None  # what vLLM and mlx-lm's server take for e.g. enable_thinking

    def refused(self) -> tuple[str, str] | None:
        if refused := super().refused():
            return refused
        if self.tool_choice not in (None, "auto", "none"):
            return "tool_choice", FORCED_TOOLS + '"auto" or "none"'
        return _not_text(self.messages, lambda kind: kind != "text", "parts")

    def conversation(self) -> list[dict]:
        """The messages as chat templates take them: text parts joined, tool-call arguments as objects."""
        out = []
        for m in self.messages:
            message = {"role": "system" if m.role == "developer" else m.role, "content": _text(m.content)}
            if m.tool_calls:
                message["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
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
    prompt: str | list[int]
    max_tokens: int = Field(16, ge=1)  # the OpenAI API's default for completions


# ---- Anthropic --------------------------------------------------------------------------------------


class Block(_Body):
    type: str
    text: str | None = None
    thinking: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(_Body):
    name: str
    description: str | None = None
    input_schema: dict = Field(default_factory=dict)


class TokenCountRequest(_Sampling):
    """A messages request as Anthropic's token counting takes it: without max_tokens."""

    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOPS)
    tools: list[AnthropicTool] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None  # {"type": "enabled" | "disabled", ...}

    def refused(self) -> tuple[str, str] | None:
        """(field, why) for a field asked for that would change what the answer holds, which this server
        cannot give."""
        if (self.tool_choice or {}).get("type") not in (None, "auto", "none"):
            return "tool_choice", FORCED_TOOLS + '{"type": "auto"} or {"type": "none"}'
        return _not_text(self.messages, lambda kind: kind in ("image", "document"), "blocks")

    def function_tools(self) -> list[dict] | None:
        """The tools as chat templates take them (OpenAI's function layout)."""
        if not self.tools or (self.tool_choice or {}).get("type") == "none":
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
            for t in self.tools
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
    max_tokens: int = Field(ge=1)


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.text or "" for p in content if p.type == "text")


def _blocks_text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(b.text or "" for b in content if b.type == "text")


def _arguments(arguments: str | dict) -> dict | str:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
