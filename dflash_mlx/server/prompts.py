"""Requests to token ids, off the event loop and within limits.

The chat template and the tokenizer run on worker threads (the tokenizer lets go of the GIL while it
works), so /health and the streams under way go on while a large body is tokenized. Template variables
a client sets (`chat_template_kwargs`) reach the template; the arguments of the template call itself do
not. A client's own chat template is refused unless the server allows them; then it is rendered in a
child process that is killed past a time limit and may write no more than a body's worth of text:
Jinja's sandbox guards what a template may touch, not how long it runs or how much it writes, and a
thread cannot be stopped.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from multiprocessing.connection import Connection

from jinja2 import TemplateError

from ..chat import as_text, chat_text, encode_chat_text, most_chars
from ..errors import unpaired_surrogate
from ..speculative import encode_prompt
from .errors import ApiError, shown

log = logging.getLogger("dflash_mlx.server")

TEMPLATE_SECONDS = 5.0  # the longest a client's own chat template may take to render
SANDBOX_START_SECONDS = 120.0  # the child process's imports, once


@dataclass
class Conversation:
    """A request's messages and template variables, and the text a client's own template made of them."""

    messages: list[dict]
    kwargs: dict
    text: str | None = None


class Prompts:
    """Token ids for requests: chat conversations through the model's template (or an allowed client
    template), raw completion prompts as text or ids."""

    def __init__(
        self, tokenizer, template_kwargs: dict, client_templates: bool, max_chars: int, context: int | None
    ):
        self.tokenizer, self.template_kwargs, self.max_chars = tokenizer, template_kwargs, max_chars
        self.threads = ThreadPoolExecutor(2, thread_name_prefix="dflash-mlx-prompts")
        self.sandbox = TemplateSandbox(tokenizer, max_chars) if client_templates else None
        # A thread of its own, so that requests with the model's template never wait behind clients'
        # templates; those take turns at the sandbox (`turn`), waiting for one at most TEMPLATE_SECONDS.
        self.rendering = ThreadPoolExecutor(1, thread_name_prefix="dflash-mlx-templates")
        self.turn = asyncio.Lock()
        self.reserved = _call_arguments(tokenizer)
        self.context, self.most_chars = context, most_chars(tokenizer, context)

    def close(self) -> None:
        self.threads.shutdown(wait=False, cancel_futures=True)
        self.rendering.shutdown(wait=False, cancel_futures=True)
        if self.sandbox is not None:
            self.sandbox.close()

    async def conversation(
        self, messages: list[dict], tools, variables: dict | None, go_on: bool = False
    ) -> Conversation:
        """A request's conversation, checked, for `chat` to make token ids of; `go_on`: the reply
        continues its last (assistant) message. A client's own template is rendered here, before the
        request takes a place on the server (app.py's `admitted`): its wait for the sandbox holds no
        place that requests with the model's template could have."""
        variables = dict(variables or {})
        template = variables.pop("chat_template", None)
        for name in variables:
            if name in self.reserved:
                raise ApiError(
                    400,
                    f"chat_template_kwargs.{name} is not a template variable: chat_template_kwargs sets "
                    "the template's own variables (e.g. enable_thinking)",
                    param=f"chat_template_kwargs.{name}",
                )
        kwargs = dict(self.template_kwargs, **variables)
        if tools:
            kwargs["tools"] = tools
        if go_on:
            kwargs.update(add_generation_prompt=False, continue_final_message=True)
        if template is None:
            return Conversation(messages, kwargs)
        if self.sandbox is None:
            raise ApiError(
                400,
                "chat_template_kwargs.chat_template: this server uses the model's own chat template "
                "(its operator can allow clients' templates with --allow-client-templates)",
                param="chat_template_kwargs.chat_template",
            )
        if not isinstance(template, str):
            raise ApiError(
                400, "chat_template_kwargs.chat_template must be a string", param="chat_template_kwargs"
            )
        # A request waits for the templates before it at most as long as one may take, then is told to
        # retry: each one's wait stays bounded, however many slow templates come at once.
        try:
            await asyncio.wait_for(self.turn.acquire(), TEMPLATE_SECONDS)
        except asyncio.TimeoutError:  # (not yet TimeoutError itself on Python 3.10)
            raise ApiError(
                429, "the server is rendering other clients' chat templates: try again shortly"
            ) from None
        rendering = asyncio.get_running_loop().run_in_executor(
            self.rendering, self._sandboxed, template, messages, kwargs
        )
        rendering.add_done_callback(lambda _: self.turn.release())  # (when it ends, if its client left)
        return Conversation(messages, kwargs, await asyncio.shield(rendering))

    async def chat(self, conversation: Conversation) -> list[int]:
        """A conversation's token ids (rendered with the model's template, unless a client's did)."""
        text = conversation.text
        if text is None:
            text = await self._run(_render, self.tokenizer, conversation.messages, conversation.kwargs)
        return await self._run(self._encode, text, True)

    def _sandboxed(self, template: str, messages: list[dict], kwargs: dict) -> str:
        """A client template's text, the messages' special tokens' text marked first (`as_text`)."""
        return self.sandbox.render(template, *as_text(self.tokenizer, [messages, kwargs]))

    async def text(self, prompt: str | list[int]) -> list[int]:
        """A completion prompt: text tokenised as is, or token ids as given."""
        if isinstance(prompt, list):
            return prompt
        return await self._run(self._encode, prompt, False)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.threads, fn, *args)

    def _encode(self, text: str, chat: bool) -> list[int]:
        where = "messages" if chat else "prompt"  # (the field the text came from)
        if self.most_chars is not None and len(text) > self.most_chars:
            raise ApiError(
                400,
                f"the prompt is {len(text)} characters, more than the model's context of {self.context} "
                "tokens can hold: shorten the prompt",
                param=where,
            )
        if (at := unpaired_surrogate(text)) is not None:
            character = ascii(text[at])[1:-1]
            raise ApiError(
                400,
                f"the prompt holds an unpaired UTF-16 surrogate ({character}, character {at} of "
                "the prompt): send the text as valid Unicode",
                param=where,
            )
        if chat:
            return encode_chat_text(self.tokenizer, text)
        return encode_prompt(self.tokenizer, text)


def _render(tokenizer, messages: list[dict], kwargs: dict) -> str:
    try:
        return chat_text(tokenizer, messages, **kwargs)
    except TemplateError as e:  # the template's own complaint (raise_exception), or its syntax
        raise ApiError(400, f"the chat template cannot render these messages: {e}") from None
    except Exception:  # noqa: BLE001  (a template that trips over some message shape: said generically)
        log.warning("the chat template failed on a request's messages", exc_info=True)
        raise ApiError(
            400, "the chat template cannot render these messages (the server's log has the details)"
        ) from None


def _call_arguments(tokenizer) -> frozenset[str]:
    """The names apply_chat_template takes for itself rather than passing to the template."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    names = set(inspect.signature(hf.apply_chat_template).parameters)
    names -= {"self", "kwargs", "chat_template"}
    return frozenset(names | {"messages", "tokenize", "conversation"})


class TemplateSandbox:
    """Renders clients' chat templates in a child process of its own, one at a time (its caller's
    turns): killed (and started again) when a template runs past TEMPLATE_SECONDS, and refusing text
    past `max_chars`. On Linux the child's memory is capped too. The child is a fresh interpreter
    (`python -m` this module): a fork would inherit MLX's threads half-made, and multiprocessing's
    spawn would run the server's own main script again."""

    def __init__(self, tokenizer, max_chars: int):
        self.hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self.max_chars = max_chars
        self.process = self.conn = None
        self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send((self.hf, self.max_chars))
        self.ready = False

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None

    def render(self, template: str, messages: list[dict], kwargs: dict) -> str:
        if self.process is None or self.process.poll() is not None:
            self._start()
        try:
            if not self.ready:  # the child's first message says its imports are done
                if not self.conn.poll(SANDBOX_START_SECONDS):
                    raise EOFError
                self.conn.recv()
                self.ready = True
            self.conn.send((template, messages, kwargs))
            if not self.conn.poll(TEMPLATE_SECONDS):
                self.close()
                raise ApiError(
                    400,
                    f"chat_template_kwargs.chat_template took over {TEMPLATE_SECONDS:g} s to render",
                    param="chat_template_kwargs.chat_template",
                )
            ok, value = self.conn.recv()
        except (EOFError, OSError):  # the child died (out of memory) or never started
            self.close()
            raise ApiError(
                400,
                "chat_template_kwargs.chat_template could not be rendered within the server's limits",
                param="chat_template_kwargs.chat_template",
            ) from None
        if not ok:
            raise ApiError(400, f"chat_template_kwargs.chat_template: {value}", param="chat_template_kwargs")
        return value


MEMORY_CAP = 1 << 30  # bytes a client's template may add to the sandbox's data (Linux)
CAUSE_CHARS = 300  # of a client's template's error, what comes back


def _sandbox(conn: Connection) -> None:
    """The sandbox process: render (template, messages, kwargs) requests as they come."""
    hf_tokenizer, max_chars = conn.recv()
    if sys.platform == "linux":  # (macOS does not enforce a data limit; the time limit still holds there)
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        cap = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 + MEMORY_CAP
        if hard != resource.RLIM_INFINITY:
            cap = min(cap, hard)
        with suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    conn.send("ready")
    while True:
        try:
            template, messages, kwargs = conn.recv()
        except EOFError:
            return
        try:
            text = hf_tokenizer.apply_chat_template(
                messages, chat_template=template, tokenize=False, **kwargs
            )
            if not isinstance(text, str):
                raise TypeError("the template did not render text")
            if len(text) > max_chars:
                conn.send((False, f"the template rendered over {max_chars} characters"))
            else:
                conn.send((True, text))
        except MemoryError:
            conn.send((False, "the chat template used too much memory"))
        except TemplateError as e:  # (the client's text: cut, as any that comes back in an error)
            conn.send((False, shown(str(e), CAUSE_CHARS)))
        except Exception as e:  # noqa: BLE001  (the client's template: its author gets the cause)
            cause = shown(f"{type(e).__name__}: {e}", CAUSE_CHARS)
            conn.send((False, f"the template cannot render these messages ({cause})"))


if __name__ == "__main__":
    _sandbox(Connection(int(sys.argv[1])))
