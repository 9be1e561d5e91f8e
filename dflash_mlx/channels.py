"""A reply's streamed text split into reasoning, answer and tool calls (the server's replies, the chat's
display).

The markers are the ones mlx-lm's tokenizer wrapper infers for the model (`think_start`/`think_end`,
and `tool_call_start`/`tool_call_end` with the `tool_parser` that reads what lies between them); mlx-lm's
own server splits by token ids inside its generation loop, which this server does not use, so the split
is redone here on the text as it streams. Text that may be the start of a marker is held back until the
next piece shows whether it is one, so no marker is ever shown in part.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

REASONING, CONTENT, TOOL = "reasoning", "content", "tool"


@dataclass
class ToolCall:
    name: str
    arguments: dict | str  # as the parser read them (a dict for JSON arguments)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def starts_in_reasoning(tokenizer, prompt: list[int]) -> bool:
    """Whether the prompt leaves the model inside a thinking block (templates that open one for it)."""
    if not getattr(tokenizer, "has_thinking", False):
        return False
    return tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt)


class Channels:
    """Feed it text as it streams; it returns events (channel, text) for REASONING and CONTENT, and
    (TOOL, ToolCall) for each complete tool call."""

    def __init__(self, tokenizer, reasoning: bool, tools: list | None):
        self.state = REASONING if reasoning else CONTENT
        thinking = getattr(tokenizer, "has_thinking", False)
        calling = bool(tools) and getattr(tokenizer, "has_tool_calling", False)
        self.ends = {REASONING: tokenizer.think_end if thinking else None}
        self.starts = {}  # marker -> the channel it opens (from the answer)
        if thinking:
            self.starts[tokenizer.think_start] = REASONING
        if calling:
            self.starts[tokenizer.tool_call_start] = TOOL
            self.ends[TOOL] = tokenizer.tool_call_end
        self.parser, self.tools = getattr(tokenizer, "tool_parser", None), tools
        self.held, self.call = "", ""

    def _markers(self) -> dict[str, str]:
        """The markers that can come next -> the channel each one leads to."""
        if self.state == CONTENT:
            return self.starts
        end = self.ends.get(self.state)
        return {end: CONTENT} if end else {}

    def feed(self, text: str) -> list[tuple]:
        events, buf = [], self.held + text
        while True:
            markers = self._markers()
            found = [(buf.find(m), m) for m in markers if m in buf]
            if not found:
                break
            at, marker = min(found)
            events += self._emit(buf[:at])
            if self.state == TOOL:
                events += self._tool_call()
            self.state, buf = markers[marker], buf[at + len(marker) :]
        keep = max((_overlap(buf, m) for m in self._markers()), default=0)
        self.held = buf[len(buf) - keep :]
        return events + self._emit(buf[: len(buf) - keep])

    def finish(self, cut: bool = False) -> list[tuple]:
        """The end of the reply: held text goes out, and a tool call still open is read as far as it
        goes (formats whose calls have no end marker end with the reply; a call the parser cannot read
        is shown as text, unless the reply was `cut` at its most tokens: then it is a call cut short,
        left out, as mlx-lm's server does, rather than markup shown to the user)."""
        events = self._emit(self.held)
        self.held = ""
        if self.state == TOOL:
            events += self._tool_call(closed=False, cut=cut)
            self.state = CONTENT
        return events

    def _emit(self, text: str) -> list[tuple]:
        if not text:
            return []
        if self.state == TOOL:
            self.call += text
            return []
        return [(self.state, text)]

    def _tool_call(self, closed: bool = True, cut: bool = False) -> list[tuple]:
        text, self.call = self.call, ""
        try:
            parsed = self.parser(text, self.tools)
            calls = [
                ToolCall(c["name"], c.get("arguments", {}))
                for c in (parsed if isinstance(parsed, list) else [parsed])
            ]
        except (ValueError, KeyError, TypeError, AttributeError):  # not a call the parser reads: text
            if cut:
                return []
            start = next(m for m, channel in self.starts.items() if channel == TOOL)
            return [(CONTENT, start + text + (self.ends[TOOL] if closed else ""))]
        return [(TOOL, call) for call in calls]


def _overlap(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is the start of `marker` (a marker maybe in part)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
