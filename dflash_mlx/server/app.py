"""The HTTP API: OpenAI's chat completions, completions and models, Anthropic's messages, health and
metrics, over one model pair (FastAPI).

Every request is admitted first (429 when the server is full, before any work but a client's own chat
template, which waits for its turn at the sandbox without holding a place), becomes token ids (the
chat template, with tools where the template takes them; prompts.py, off the event loop), goes to
the scheduler, and streams back the answer's pieces as the engine makes them, split into reasoning,
answer and tool calls. Errors are answered in the shape of the API that was called, with a 4xx for
what the client can fix and a 500 with a generic message (the details logged) for the server's own;
either way the connection stays usable and the server goes on serving.
"""

from __future__ import annotations

import asyncio
import codecs
import functools
import hmac
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response, StreamingResponse
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, _byte_decoder
from starlette.exceptions import HTTPException

from ..channels import CONTENT, REASONING, TOOL, Channels, ToolCall, starts_in_reasoning
from ..errors import UserError
from ..pairing import context_length, context_room, prepare
from ..settings import GenerationSettings
from ..speculative import GenerationResponse
from .errors import ANTHROPIC, CLIENT_GONE, INTERNAL, ApiError, Json, dumps, error_body, error_response, shown
from .metrics import Metrics
from .pool import PromptCachePool
from .processes import scheduler_for
from .prompts import Conversation, Prompts
from .scheduler import Busy, Finished, PromptScored, Scheduler, Started
from .scheduler import Request as Job
from .schemas import PROCESSORS, ChatCompletionRequest, CompletionRequest, MessagesRequest, TokenCountRequest

log = logging.getLogger("dflash_mlx.server")


@dataclass(frozen=True)
class ServerConfig:
    model_id: str  # the name /v1/models lists and requests must use
    defaults: GenerationSettings  # sampling and max_tokens where a request does not say
    template_kwargs: dict = field(default_factory=dict)
    api_key: str | None = None
    max_active: int = 4
    max_waiting: int = 16
    workers: int = 1  # threads answering requests, each its share of max_active (scheduler.py)
    processes: int = 1  # ... in each of this many processes (processes.py), which load the pair by:
    names: tuple[str, str | None] | None = None  # the names it was loaded by (load_pair's arguments)
    cache_bytes: int = 4 << 30
    max_body_bytes: int = 8 << 20
    max_body_items: int = 1 << 16  # JSON objects, arrays and keys in a body
    max_body_depth: int = 100  # how deeply a body's JSON may nest
    max_connections: int = 1024  # connections open at once (connections.py)
    head_seconds: float = 60.0  # for a request's headers to arrive (connections.py)
    body_seconds: float = 60.0  # for a request's body to arrive
    request_timeout: float | None = None  # seconds from arrival after which an answer ends ("length")
    client_templates: bool = False  # whether requests may bring their own chat template
    # web pages (origins) other than this machine's own that may call the server from a browser ("*": any)
    allow_origins: tuple[str, ...] = ()


class Guard:
    """ASGI middleware in front of every route: the API key (every path but /health), a cap on the
    request body's size, its count of JSON objects, arrays and keys, and the time it takes to arrive
    (read whole before the route runs, so an oversized body gets its 413 before validating it would
    hold the event loop for seconds, and a body that stops halfway does not hold its connection), the
    count of answers by status, and a 500 for an error inside a route (Starlette's own handler for
    those re-raises them, and uvicorn then drops the connection). Plain ASGI rather than Starlette's
    BaseHTTPMiddleware, which gets in the way of streaming and of noticing that a client has gone."""

    def __init__(self, app, config: ServerConfig, metrics: Metrics):
        self.app, self.config, self.metrics = app, config, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        api = "anthropic" if path.startswith(ANTHROPIC) else "openai"

        async def counted_send(message):
            if message["type"] == "http.response.start" and path.startswith("/v1/"):
                self.metrics.requests.labels(api, str(message["status"])).inc()
            await send(message)

        headers = dict(scope["headers"])
        if self.config.api_key and path != "/health" and not self._authorized(headers):
            message = "a valid API key is needed: Authorization: Bearer <key>" + (
                " or x-api-key: <key>" if api == "anthropic" else ""
            )
            reply = error_response(path, 401, message, code="invalid_api_key")
            return await reply(scope, receive, counted_send)
        if b"transfer-encoding" in headers and b"content-length" in headers:
            # Which one frames the body is what a proxy in front and this server could read otherwise
            # (request smuggling): refused, and the connection closed with what follows on it.
            message = "a request gives Content-Length or Transfer-Encoding, not both"
            reply = error_response(path, 400, message)
            reply.headers["connection"] = "close"
            return await reply(scope, receive, counted_send)
        if headers.get(b"content-encoding", b"identity").strip().lower() not in (b"identity", b""):
            message = "the request body must not be compressed: send it without Content-Encoding"
            return await error_response(path, 415, message)(scope, receive, counted_send)
        if scope["method"] == "POST":  # every body this API takes is JSON, whatever the client labels it
            # (curl -d sends a form's type); FastAPI reads a body as JSON only when labelled so
            kept = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = dict(scope, headers=[*kept, (b"content-type", b"application/json")])
        config, body, more, messages = self.config, 0, True, []
        too_large = f"the request body is over {config.max_body_bytes} bytes"
        length = headers.get(b"content-length", b"").strip()
        if length.isdigit() and int(length) > config.max_body_bytes:
            return await error_response(path, 413, too_large)(scope, receive, counted_send)
        deadline = time.monotonic() + config.body_seconds
        while more and scope["method"] in ("POST", "PUT", "PATCH"):
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except asyncio.TimeoutError:  # (not yet TimeoutError itself on Python 3.10)
                message = f"the request body did not arrive within {config.body_seconds:g} s"
                return await error_response(path, 408, message)(scope, receive, counted_send)
            messages.append(message)
            if message["type"] != "http.request":
                break
            body += len(message.get("body", b""))
            more = message.get("more_body", False)
            if body > config.max_body_bytes:
                return await error_response(path, 413, too_large)(scope, receive, counted_send)
        data = b"".join(m.get("body", b"") for m in messages)
        if b"\0" in data:  # (UTF-16 or 32: Python's JSON reads them too)
            return await error_response(path, 400, NOT_UTF8)(scope, receive, counted_send)
        if data and (refused := _structure_refused(data, config.max_body_items, config.max_body_depth)):
            return await error_response(path, *refused)(scope, receive, counted_send)

        async def replay():
            return messages.pop(0) if messages else await receive()

        started = False

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await counted_send(message)

        try:
            await self.app(scope, replay, watched_send)
        except Exception:  # a bug: answered here, so the connection stays usable
            log.exception("internal error on %s", path)
            if not started:  # (once a response has begun, the server can only end it)
                await error_response(path, 500, INTERNAL)(scope, receive, counted_send)

    def _authorized(self, headers: dict) -> bool:
        key = self.config.api_key.encode()
        scheme, _, token = headers.get(b"authorization", b"").strip().partition(b" ")
        bearer = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)
        return bearer or hmac.compare_digest(headers.get(b"x-api-key", b""), key)


class BrowserAccess(CORSMiddleware):
    """Starlette's CORS, with a refused browser question answered as the APIs' errors are: JSON that
    says what was refused and how the server lets it, where Starlette's is plain text naming a header."""

    def preflight_response(self, request_headers):
        answer = super().preflight_response(request_headers)
        if answer.status_code != 400:
            return answer
        origin, refused = request_headers["origin"], bytes(answer.body).decode()
        why = {
            "origin": f"pages from {origin} may not call this server (`serve --allow-origin {origin}` "
            "lets them)",
            "method": "browsers may call this server with GET, HEAD and POST only",
            "private-network": "pages from the internet may not call this server on its private network",
        }
        failures = set(refused.removeprefix("Disallowed CORS ").split(", "))
        message = "; ".join(text for failure, text in why.items() if failure in failures) or refused
        headers = {k: v for k, v in answer.headers.items() if k.startswith("access-control-") or k == "vary"}

        async def refuse(scope, receive, send):  # (the error's shape follows the path's API)
            body = error_body(scope["path"], 400, message)
            await Json(body, status_code=400, headers=headers)(scope, receive, send)

        return refuse


def _structure_refused(body: bytes, most: int, deepest: int) -> tuple[int, str] | None:
    """(status, why) when the JSON text `body` (UTF-8) holds more than `most` objects, arrays and keys,
    or nests deeper than `deepest`; else None. Validating each item takes microseconds on the event
    loop (pydantic holds the GIL throughout), so millions of tiny ones in an 8 MB body would stall
    every other client for seconds; and what reads messages and tools afterwards (the special tokens'
    marking, chat templates) recurses through them. Counted in the text without a parse; where there
    are many braces, those inside strings (text) are left out: with the escaped backslashes and quotes
    gone, a character is inside a string after an odd number of quotes."""
    opens = body.count(b"{") + body.count(b"[")
    if opens + body.count(b":") <= most and opens <= deepest:
        return None
    text = np.frombuffer(body.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    outside = np.cumsum(text == ord('"'), dtype=np.int32) % 2 == 0
    opening = ((text == ord("{")) | (text == ord("["))) & outside
    if int(np.count_nonzero(opening | ((text == ord(":")) & outside))) > most:
        many = f"over {most} JSON objects, arrays and keys"
        return 413, f"the request body holds {many}: send fewer messages, parts or tools"
    closing = ((text == ord("}")) | (text == ord("]"))) & outside
    if opens > deepest and int(np.cumsum(opening.astype(np.int32) - closing).max()) > deepest:
        return 400, f"the request body nests objects and arrays over {deepest} deep: send them flatter"
    return None


class Generation:
    """One request's events on the event loop: submitted to the scheduler, read as they come, and
    stopped when the reader stops reading (a client that went away)."""

    def __init__(
        self,
        scheduler: Scheduler,
        prompt: list[int],
        settings: GenerationSettings,
        stop: list[str],
        deadline: float | None,
        continues: bool = False,
        scored: bool = False,
    ):
        """Submit an admitted request (`continues`: its answer's text goes on from the prompt's; `scored`:
        its prompt's log-probabilities are wanted too)."""
        loop, self.queue = asyncio.get_running_loop(), asyncio.Queue()

        def emit(event) -> None:
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, event)
            except RuntimeError:  # (a loop closed by a shutdown cut short: no one is left to read it)
                pass

        self.job = Job(
            prompt,
            settings,
            stop,
            emit,
            self.queue.qsize,
            deadline=deadline,
            continues=continues,
            scored=scored,
        )
        self.prompt, self.started = prompt, Started(len(prompt), 0)
        self.prompt_scores: list | None = None  # `scored`: each prompt token's but the first
        self.tokens: list[int] = []
        self.scored: list[tuple] = []  # (token, its log-probability, the most likely there), where asked
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_string: str | None = None
        self.first = None  # an event `begin` read past
        scheduler.submit(self.job)

    def cancel(self) -> None:
        self.job.cancelled.set()

    async def begin(self) -> None:
        """Wait for the request's turn to start (it then knows how much of its prompt was cached)."""
        if self.first is None:
            event = await self.queue.get()
            if isinstance(event, Started):
                self.started = event
            else:
                self.first = event

    async def responses(self) -> AsyncIterator[GenerationResponse]:
        try:
            while True:
                event, self.first = self.first or await self.queue.get(), None
                if isinstance(event, Started):
                    self.started = event
                elif isinstance(event, PromptScored):
                    self.prompt_scores = event.scores
                elif isinstance(event, Finished):
                    if event.error is not None:
                        raise event.error
                    return
                else:
                    self.tokens += event.tokens
                    if event.logprobs is not None:
                        self.scored += zip(event.tokens, event.logprobs, event.top_logprobs)
                    self.text += event.text
                    self.finish_reason = event.finish_reason or self.finish_reason
                    self.stop_string = event.stop or self.stop_string
                    yield event
        finally:
            self.cancel()  # done, or the reader stopped: either way nothing more is wanted

    def usage(self) -> tuple[int, int, int]:
        """(prompt tokens, generated tokens, prompt tokens a kept cache held)."""
        return len(self.prompt), len(self.tokens), self.started.cached_tokens


class _Stream(StreamingResponse):
    """Server-sent events of one request, whose generation stops when the response ends, however it
    ends (Starlette does not close the events' generator when the client goes away)."""

    def __init__(self, events: AsyncIterator[str], generation: Generation):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.generation = generation

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.cancel()


async def _watch(request: Request, generation: Generation) -> bool:
    """Stop a non-streamed request's generation if its client goes away: -> whether it went."""
    while not generation.job.cancelled.is_set():
        if await request.is_disconnected():
            generation.job.cancelled.set()
            return True
        await asyncio.sleep(0.1)
    return False


LOCAL_ORIGIN = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"
OFFERED = (
    "this server answers /v1/chat/completions and /v1/completions (OpenAI), /v1/messages and "
    "/v1/messages/count_tokens (Anthropic), /v1/models, /health and /metrics; it makes no embeddings "
    "and has no Responses API (set such a client to chat completions)"
)

# The parts of a pydantic error location that name a branch of a union type rather than a field.
_BRANCH = re.compile(r"^(str|int|float|bool|dict|list|none)$|[\[(]")


def _field(loc) -> str:
    """A pydantic error's location as the client wrote it: messages[0].content."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "body" and not _BRANCH.search(part):
            out += f".{part}" if out else part
    return out


NOT_UTF8 = "the request body is not UTF-8 text: send JSON encoded as UTF-8"


def _unread_body(cause: BaseException | None) -> str | None:
    """Why FastAPI could not read a body as JSON, where it says only "There was an error parsing the
    body" (it names JSON syntax errors alone)."""
    if isinstance(cause, UnicodeDecodeError):
        return NOT_UTF8
    if isinstance(cause, RecursionError):
        return "the request body is nested too deeply to read"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return "the request body holds a number too long to read"
    if isinstance(cause, ValueError):
        return f"the request body could not be read as JSON: {cause}"
    return None


def _wanted(error: dict) -> str:
    """What a pydantic error says the value should be, with no class names in it."""
    if error.get("type") in ("model_type", "model_attributes_type", "dict_type"):
        return "should be an object"
    if error.get("type") == "missing":
        return "is required"
    if error.get("type") == "int_parsing_size":
        return "is too large a number"
    message = error.get("msg", "not valid")
    return message.removeprefix("Input ").removeprefix("Value error, ")


def sse(data: dict | str, event: str | None = None) -> str:
    body = data if isinstance(data, str) else dumps(data)
    return (f"event: {event}\n" if event else "") + f"data: {body}\n\n"


def create_app(target, draft, tokenizer, config: ServerConfig) -> FastAPI:
    metrics = Metrics()
    vocab = prepare(target, draft).vocab_size  # (the text model's: Qwen3.5's outer args have none)
    pool = PromptCachePool(target, draft, config.cache_bytes, config.defaults.draft_window)
    scheduler = scheduler_for(
        target,
        draft,
        tokenizer,
        pool,
        metrics,
        config.max_active,
        config.max_waiting,
        config.workers,
        config.processes,
        config.names,
    )
    prompts = Prompts(
        tokenizer,
        config.template_kwargs,
        config.client_templates,
        config.max_body_bytes,
        context_length(target),
    )

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, scheduler.stop)
        prompts.close()

    app = FastAPI(  # (no generated API pages: the APIs are OpenAI's and Anthropic's, docs/server.md)
        title="dflash-mlx",
        lifespan=lifespan,
        default_response_class=Json,
        redirect_slashes=False,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.add_middleware(Guard, config=config, metrics=metrics)
    # Browsers ask before a page from another origin may call: pages served from this machine may (as
    # Ollama lets them), others where the user named them. Outside the guard: a browser's question
    # carries no API key.
    app.add_middleware(
        BrowserAccess,
        allow_origins=list(config.allow_origins),
        allow_origin_regex=LOCAL_ORIGIN,
        allow_methods=["GET", "HEAD", "POST"],
        allow_headers=["*"],
        max_age=600,
    )
    app.state.scheduler, app.state.pool, app.state.metrics = scheduler, pool, metrics
    app.state.config = config

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return error_response(request.url.path, e.status, e.message, param=e.param, code=e.code)

    @app.exception_handler(UserError)
    async def user_error(request: Request, e: UserError):
        return error_response(request.url.path, 400, str(e))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        errors = e.errors()
        if errors[0].get("type") == "json_invalid":
            return error_response(request.url.path, 400, "the request body is not valid JSON")
        # The deepest place named: where a union's branch that fits the value went wrong (a list of
        # content parts with a bad part), not the other branch's "should be a valid string".
        where = max((_field(x.get("loc", ())) for x in errors), key=lambda f: f.count(".") + f.count("["))
        wants = dict.fromkeys(_wanted(x) for x in errors if _field(x.get("loc", ())) == where)
        where = shown(where)
        message = f"{where or 'body'}: {' or '.join(wants)}"
        return error_response(request.url.path, 400, message, param=where or None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        message = _unread_body(e.__cause__) if e.status_code == 400 else None
        if e.status_code == 404 and e.detail == "Not Found":  # (Starlette's: no such route)
            message = f"{shown(request.url.path)} is not offered here: {OFFERED}"
        reply = error_response(request.url.path, e.status_code, message or str(e.detail))
        reply.headers.update(e.headers or {})  # (a 405's Allow)
        return reply

    def check_given(body) -> None:
        if body.n not in (None, 1):
            raise ApiError(400, "n must be 1: this server makes one choice per request", param="n")
        check_refused(body)

    def check_refused(body) -> None:
        if refused := body.refused():
            name, why = refused
            raise ApiError(400, f"{name}: {why}", param=name)

    def check_model(name: str) -> None:
        if name != config.model_id:
            raise ApiError(
                404,
                f"model {shown(name)!r} is not served here; this server serves {config.model_id!r}",
                param="model",
                code="model_not_found",
            )

    def settings_for(body, max_tokens: int | None) -> GenerationSettings:
        d = config.defaults
        openai = isinstance(body, (ChatCompletionRequest, CompletionRequest))  # (extras are not read)
        bias = body.logit_bias if openai else None
        if bias and not 0 <= min(bias) <= max(bias) < vocab:
            raise ApiError(400, f"logit_bias: token ids must be in 0..{vocab - 1}", param="logit_bias")
        # (OpenAI's APIs take them; a field left out or null keeps its default)
        processors = {
            name: getattr(body, name) for name in PROCESSORS if openai and getattr(body, name) is not None
        }
        return GenerationSettings(
            temperature=d.temperature if body.temperature is None else body.temperature,
            top_p=d.top_p if body.top_p is None else body.top_p,
            top_k=d.top_k if body.top_k is None else body.top_k,
            min_p=d.min_p if getattr(body, "min_p", None) is None else body.min_p,
            max_tokens=max_tokens or d.max_tokens,
            block_size=d.block_size,
            lookup=d.lookup,
            seed=body.seed,
            draft_window=d.draft_window,
            logprobs=body.top if openai else None,
            **processors,
        )

    @asynccontextmanager
    async def admitted():
        """A place for the request, taken before its prompt is made: 429 when there is none."""
        try:
            scheduler.admit()
        except Busy:
            raise ApiError(
                429, "the server is busy: every slot and the queue are taken, try again shortly"
            ) from None
        try:
            yield
        except BaseException:  # (the request never reached the scheduler)
            scheduler.withdraw()
            raise

    def start(
        prompt: list[int],
        settings: GenerationSettings,
        stop: list[str],
        arrived: float,
        continues=False,
        where="messages",  # the field the prompt came from
        scored=False,
    ) -> Generation:
        if not prompt:
            raise ApiError(400, "the prompt is empty", param=where)
        try:
            context_room(target, len(prompt))  # a prompt the context cannot hold is refused here
        except UserError as e:
            raise ApiError(400, str(e), param=where) from None
        deadline = None if config.request_timeout is None else arrived + config.request_timeout
        return Generation(scheduler, prompt, settings, stop, deadline, continues, scored)

    async def answer(request: Request, generation: Generation) -> None:
        """Run a non-streamed request to the end, stopping it if the client goes away."""
        watcher, gone = asyncio.create_task(_watch(request, generation)), False
        try:
            async for _ in generation.responses():
                pass
        finally:
            watcher.cancel()
            with suppress(asyncio.CancelledError):
                gone = await watcher
        if gone:  # (no one reads it: counted as nginx counts such requests, not as a 200)
            raise ApiError(CLIENT_GONE, "the client went away before its answer was whole")

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        # A worker process that ended leaves the server answering at part of its capacity: a 503 here
        # tells a supervisor to restart it, a load balancer to send elsewhere.
        if ended := [r.index for r in scheduler.remotes if r.ended]:
            said = {"status": "degraded", "model": config.model_id, "ended_worker_processes": ended}
            return Response(dumps(said), status_code=503, media_type="application/json")
        return {"status": "ok", "model": config.model_id}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    def prometheus():  # (not on the event loop: other processes' counters are asked for)
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # Both APIs' fields in one shape (each client reads its own and ignores the other's).
    now = time.time()
    served = {
        "id": config.model_id,
        "object": "model",
        "created": int(now),
        "owned_by": "dflash-mlx",
        "type": "model",
        "display_name": config.model_id,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
    }

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        ends = {"first_id": config.model_id, "last_id": config.model_id}
        return {"object": "list", "data": [served], "has_more": False, **ends}

    @app.api_route("/v1/models/{name:path}", methods=["GET", "HEAD"])
    async def model(name: str):
        check_model(name)
        return served

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        arrived = time.monotonic()
        check_model(body.model)
        check_given(body)
        tools = body.offered or None
        settings = settings_for(body, body.max_completion_tokens or body.max_tokens)
        reply = _OpenAIReply(config.model_id, "chat.completion", tokenizer, metrics)
        conversation = await prompts.conversation(
            body.conversation(config.max_body_depth), tools, body.chat_template_kwargs
        )
        async with admitted():
            prompt = await prompts.chat(conversation)
            channels = Channels(tokenizer, starts_in_reasoning(tokenizer, prompt), tools)
            generation = start(prompt, settings, body.stops, arrived)  # (last: it submits)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _Stream(reply.chat_stream(generation, channels, include_usage), generation)
        await answer(request, generation)
        return reply.chat(generation, channels)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        arrived = time.monotonic()
        check_model(body.model)
        check_given(body)
        try:
            prompt = body.one()
        except ValueError as e:
            raise ApiError(400, f"prompt: {e}", param="prompt") from None
        if isinstance(prompt, list) and not all(0 <= t < vocab for t in prompt):
            raise ApiError(400, f"prompt token ids must be in 0..{vocab - 1}", param="prompt")
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(
                400,
                "max_tokens: 0 asks for nothing; give 1 or more, or echo: true to score the prompt alone",
                param="max_tokens",
            )
        # (max_tokens 0: one token is made from the prompt's pass anyway, and left out of the reply)
        settings = settings_for(body, max(body.max_tokens, 1))
        reply = _OpenAIReply(config.model_id, "text_completion", tokenizer, metrics)
        async with admitted():
            tokens = await prompts.text(prompt)
            scored = bool(body.echo) and body.logprobs is not None
            generation = start(tokens, settings, body.stops, arrived, True, "prompt", scored)
        echo = (
            Echo(prompt if isinstance(prompt, str) else tokenizer.decode(prompt), body.max_tokens == 0)
            if body.echo
            else None
        )
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _Stream(reply.completion_stream(generation, include_usage, echo), generation)
        await answer(request, generation)
        return reply.completion(generation, echo)

    async def anthropic_conversation(body: TokenCountRequest) -> Conversation:
        thinking = (body.thinking or {}).get("type")
        extra = {"enable_thinking": thinking == "enabled"} if thinking in ("enabled", "disabled") else None
        go_on = body.messages[-1].role == "assistant"  # Anthropic's way to start the reply for the model
        return await prompts.conversation(body.conversation(), body.function_tools(), extra, go_on)

    @app.post(ANTHROPIC + "/count_tokens")
    async def count_tokens(body: TokenCountRequest):
        check_model(body.model)
        check_refused(body)
        return {"input_tokens": len(await prompts.chat(await anthropic_conversation(body)))}

    @app.post(ANTHROPIC)
    async def messages(body: MessagesRequest, request: Request):
        arrived = time.monotonic()
        check_model(body.model)
        check_refused(body)
        settings = settings_for(body, body.max_tokens)
        reply = _AnthropicReply(config.model_id, metrics)
        conversation = await anthropic_conversation(body)
        async with admitted():
            prompt = await prompts.chat(conversation)
            channels = Channels(tokenizer, starts_in_reasoning(tokenizer, prompt), body.function_tools())
            go_on = body.messages[-1].role == "assistant"  # (the reply continues that message's text)
            generation = start(prompt, settings, body.stop_sequences or [], arrived, go_on)
        if body.stream:
            return _Stream(reply.stream(generation, channels), generation)
        await answer(request, generation)
        return reply.message(generation, channels)

    return app


@dataclass
class Echo:
    """A completion's prompt, given back before its answer (`echo`)."""

    text: str
    alone: bool  # max_tokens 0: the prompt alone, nothing generated


def _stream_error(path: str, e: Exception, metrics: Metrics) -> dict:
    """The error event ending a stream that has begun (its 200 sent, so counted apart: `stream_errors`)."""
    status = e.status if isinstance(e, ApiError) else 400 if isinstance(e, UserError) else 500
    metrics.stream_errors.labels("anthropic" if path == ANTHROPIC else "openai", str(status)).inc()
    if isinstance(e, ApiError):
        return error_body(path, e.status, e.message, e.param, e.code)
    if isinstance(e, UserError):
        return error_body(path, 400, str(e))
    log.error("generation failed on %s", path, exc_info=e)
    return error_body(path, 500, INTERNAL)


def _drain(channels: Channels, text: str, finished: bool, cut: bool = False) -> list[tuple]:
    """`cut`: the reply ended at max_tokens (a tool call it cut short is left out, not shown as text)."""
    events = channels.feed(text)
    return events + channels.finish(cut) if finished else events


class _OpenAIReply:
    def __init__(self, model: str, kind: str, tokenizer, metrics: Metrics):
        self.model, self.kind, self.tokenizer, self.metrics = model, kind, tokenizer, metrics
        self.eos = set(tokenizer.eos_token_ids)
        self.id = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self._decoder, self._chars = codecs.getincrementaldecoder("utf-8")("replace"), 0  # (text_offset)

    def _usage(self, generation: Generation, alone: bool = False) -> dict:
        prompt, completion, cached = generation.usage()
        completion = 0 if alone else completion
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    @staticmethod
    def _finish(generation: Generation, calls: int) -> str | None:
        if generation.finish_reason == "stop" and calls:
            return "tool_calls"
        return generation.finish_reason

    def _scored(self, generation: Generation, start: int, eos: bool = False) -> tuple[list, int]:
        """The answer's scored tokens from `start` on, EOS left out unless `eos` -> ([(text,
        log-probability, the most likely there as (text, log-probability))], where the next ones
        start)."""
        new = [x for x in generation.scored[start:] if eos or x[0] not in self.eos]
        piece = self.piece
        return [(piece(t), lp, [(piece(i), v) for i, v in top]) for t, lp, top in new], len(generation.scored)

    def _prompt_scored(self, generation: Generation) -> list:
        """The prompt's tokens as `_scored` gives an answer's: the first without a log-probability."""
        if generation.prompt_scores is None:  # (cut before its prompt was scored: its time limit, a shutdown)
            raise ApiError(
                503, "the prompt's scoring was cut short (a time limit or a shutdown): send it again"
            )
        piece, prompt = self.piece, generation.prompt
        scored = [
            (piece(t), lp, [(piece(i), v) for i, v in top])
            for t, (lp, top) in zip(prompt[1:], generation.prompt_scores)
        ]
        return [(piece(prompt[0]), None, None)] + scored

    @functools.cached_property
    def piece(self) -> Callable[[int], bytes]:
        """`token_bytes` of the tokenizer, made once for the reply (each streamed chunk reads it)."""
        return token_bytes(self.tokenizer)

    @staticmethod
    def _chat_logprobs(scored: list) -> dict:
        def entry(raw: bytes, logprob: float) -> dict:  # (-9999 for minus infinity, as OpenAI's API)
            return {"token": _text(raw), "logprob": max(logprob, -9999.0), "bytes": list(raw)}

        content = [dict(entry(t, lp), top_logprobs=[entry(*x) for x in top]) for t, lp, top in scored]
        return {"content": content, "refusal": None}

    def _text_logprobs(self, scored: list) -> dict:
        """The legacy layout. `top_logprobs` holds the chosen token too, as OpenAI's API does (up to
        logprobs + 1 entries); `text_offset`: the characters before each token, its own bytes and this
        reply's earlier tokens' (earlier chunks too) decoded together, where a character split over
        tokens counts from the token that completes it."""
        offsets = []
        for raw, _, _ in scored:
            offsets.append(self._chars)
            self._chars += len(self._decoder.decode(raw))
        return {
            "tokens": [_text(t) for t, _, _ in scored],
            "token_logprobs": [None if lp is None else max(lp, -9999.0) for _, lp, _ in scored],
            "top_logprobs": [None if top is None else _best_first([*top, (t, lp)]) for t, lp, top in scored],
            "text_offset": offsets,
        }

    def chat(self, generation: Generation, channels: Channels) -> dict:
        parts = {CONTENT: [], REASONING: [], TOOL: []}
        for kind, value in _drain(channels, generation.text, True, generation.finish_reason == "length"):
            parts[kind].append(value)
        content = "".join(parts[CONTENT])
        message = {"role": "assistant", "content": None if parts[TOOL] and not content.strip() else content}
        if parts[REASONING]:  # (under both names clients read: DeepSeek's and vLLM's, and mlx-lm's)
            message["reasoning_content"] = message["reasoning"] = "".join(parts[REASONING])
        if parts[TOOL]:
            message["tool_calls"] = [_openai_call(c) for c in parts[TOOL]]
        choice = {
            "index": 0,
            "message": message,
            "finish_reason": self._finish(generation, len(parts[TOOL])),
            "logprobs": None,
        }
        if generation.job.settings.logprobs is not None:
            choice["logprobs"] = self._chat_logprobs(self._scored(generation, 0)[0])
        return {**self._head("chat.completion"), "choices": [choice], "usage": self._usage(generation)}

    async def chat_stream(self, generation: Generation, channels: Channels, include_usage: bool):
        usage = {"usage": None} if include_usage else {}  # (the API's: null until the last chunk)

        scoring, start = generation.job.settings.logprobs is not None, 0

        def chunk(delta: dict, finish=None) -> str:
            nonlocal start
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            if scoring and finish is None and delta and "role" not in delta:  # (those scored since the last)
                scored, start = self._scored(generation, start)
                choice["logprobs"] = self._chat_logprobs(scored)
            return sse({**self._head("chat.completion.chunk"), "choices": [choice], **usage})

        calls = 0
        yield chunk({"role": "assistant", "content": ""})
        try:
            async for response in generation.responses():
                for kind, value in _drain(
                    channels,
                    response.text,
                    response.finish_reason is not None,
                    response.finish_reason == "length",
                ):
                    if kind == TOOL:
                        yield chunk({"tool_calls": [dict(_openai_call(value), index=calls)]})
                        calls += 1
                    else:
                        yield chunk(
                            {"reasoning_content": value, "reasoning": value}
                            if kind == REASONING
                            else {"content": value}
                        )
        except Exception as e:  # noqa: BLE001  (the stream has begun: the error goes in it)
            yield sse(_stream_error("/v1/chat/completions", e, self.metrics))
            return
        if scoring and any(t not in self.eos for t, _, _ in generation.scored[start:]):  # (no chunk yet)
            yield chunk({"content": ""})
        yield chunk({}, self._finish(generation, calls))
        if include_usage:
            yield sse(
                {**self._head("chat.completion.chunk"), "choices": [], "usage": self._usage(generation)}
            )
        yield sse("[DONE]")

    def completion(self, generation: Generation, echo: Echo | None = None) -> dict:
        alone = echo is not None and echo.alone
        text = "" if alone else generation.text
        choice = {
            "index": 0,
            "text": text if echo is None else echo.text + text,
            "finish_reason": "length" if alone else generation.finish_reason,
            "logprobs": None,
        }
        if generation.job.settings.logprobs is not None:
            # (an echo's tokens are the document's, its EOS too: harnesses cut the answer's last token)
            scored = [] if alone else self._scored(generation, 0, echo is not None)[0]
            if echo is not None:
                scored = self._prompt_scored(generation) + scored
            choice["logprobs"] = self._text_logprobs(scored)
        usage = self._usage(generation, alone)
        return {**self._head("text_completion"), "choices": [choice], "usage": usage}

    async def completion_stream(self, generation: Generation, include_usage: bool, echo: Echo | None = None):
        usage = {"usage": None} if include_usage else {}

        scoring, start = generation.job.settings.logprobs is not None, 0
        alone, eos = echo is not None and echo.alone, echo is not None

        def chunk(text: str, finish=None, scored=None) -> str:
            nonlocal start
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            if scoring and finish is None:  # (the tokens scored since the last chunk, or those given)
                if scored is None:
                    scored, start = self._scored(generation, start, eos)
                choice["logprobs"] = self._text_logprobs(scored)
            return sse({**self._head("text_completion"), "choices": [choice], **usage})

        try:
            async for response in generation.responses():
                if echo is not None:  # (the prompt's scores, where asked for, came before its first token)
                    yield chunk(echo.text, scored=self._prompt_scored(generation) if scoring else None)
                    echo = None
                if not alone and (response.text or (scoring and response.tokens)):
                    yield chunk(response.text)
        except Exception as e:  # noqa: BLE001
            yield sse(_stream_error("/v1/completions", e, self.metrics))
            return
        yield chunk("", "length" if alone else generation.finish_reason)
        if include_usage:
            totals = self._usage(generation, alone)
            yield sse({**self._head("text_completion"), "choices": [], "usage": totals})
        yield sse("[DONE]")


def _best_first(top: list[tuple[bytes, float]]) -> dict[str, float]:
    """The legacy layout's {text: log-probability}, in the order given (best first, the chosen token
    last where it is not among them); where two tokens read the same, the first (-9999 stands for minus
    infinity, which JSON lacks, as in OpenAI's API)."""
    out = {}
    for raw, value in top:
        out.setdefault(_text(raw), max(value, -9999.0))
    return out


def token_bytes(tokenizer) -> Callable[[int], bytes]:
    """-> a token's own bytes (OpenAI's `bytes`), which may hold part of a character that the next
    tokens complete: a token decoded alone would give U+FFFD there, and (SentencePiece) lose its
    leading space. mlx-lm's streaming detokenizers keep each token's piece; the table that maps a
    byte-level BPE piece's characters back to bytes is private to mlx-lm, hence the import."""
    detok, table = tokenizer.detokenizer, _byte_decoder()
    spm, bpe = isinstance(detok, SPMStreamingDetokenizer), isinstance(detok, BPEStreamingDetokenizer)

    def piece(t: int) -> bytes:
        if (spm or bpe) and t < len(detok.tokenmap):  # (a model's vocabulary may be padded past it)
            if spm:
                return detok.tokenmap[t].replace("\u2581".encode(), b" ")
            if all(c in table for c in detok.tokenmap[t]):
                return bytes(table[c] for c in detok.tokenmap[t])
        return tokenizer.decode([t]).encode()  # (a word-level tokenizer's; a BPE's added token)

    return piece


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def _openai_call(call: ToolCall) -> dict:
    arguments = call.arguments if isinstance(call.arguments, str) else dumps(call.arguments)
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


class _AnthropicReply:
    def __init__(self, model: str, metrics: Metrics):
        self.model, self.metrics = model, metrics
        self.id = "msg_" + uuid.uuid4().hex[:24]

    def _stop(self, generation: Generation, calls: int) -> tuple[str, str | None]:
        if generation.finish_reason == "length":
            return "max_tokens", None
        if calls:
            return "tool_use", None
        hit = generation.stop_string
        return ("stop_sequence", hit) if hit is not None else ("end_turn", None)

    def _usage(self, generation: Generation) -> dict:
        prompt, completion, cached = generation.usage()
        return {
            "input_tokens": prompt - cached,
            "output_tokens": completion,
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
        }

    def message(self, generation: Generation, channels: Channels) -> dict:
        content, calls = [], 0
        for kind, value in _drain(channels, generation.text, True, generation.finish_reason == "length"):
            if kind == TOOL:
                content.append(
                    {"type": "tool_use", "id": _tool_id(value), "name": value.name, "input": _input(value)}
                )
                calls += 1
            elif content and content[-1]["type"] == _BLOCK[kind]:
                content[-1][_FIELD[kind]] += value
            else:
                content.append(_block(kind, value))
        # (Anthropic's API refuses a text block of whitespace alone when the conversation is sent back)
        content = [b for b in content if b["type"] != "text" or b["text"].strip()]
        reason, sequence = self._stop(generation, calls)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": self._usage(generation),
        }

    async def stream(self, generation: Generation, channels: Channels):
        index, open_kind, calls = -1, None, 0
        held = ""  # whitespace that would open a text block: sent once text follows it (as `message`)
        await generation.begin()  # (how much of the prompt was cached goes in message_start)
        head = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**self._usage(generation), "output_tokens": 0},
        }
        yield sse({"type": "message_start", "message": head}, "message_start")
        yield sse({"type": "ping"}, "ping")
        try:
            async for response in generation.responses():
                for kind, value in _drain(
                    channels,
                    response.text,
                    response.finish_reason is not None,
                    response.finish_reason == "length",
                ):
                    if kind == CONTENT and open_kind != CONTENT:
                        held += value
                        if not held.strip():
                            continue
                        value, held = held, ""
                    elif kind != CONTENT:
                        held = ""
                    if kind != open_kind or kind == TOOL:
                        if open_kind is not None:
                            yield sse({"type": "content_block_stop", "index": index}, "content_block_stop")
                        index, open_kind = index + 1, kind
                        if kind == TOOL:
                            block = {
                                "type": "tool_use",
                                "id": _tool_id(value),
                                "name": value.name,
                                "input": {},
                            }
                        else:
                            block = _block(kind, "")
                        yield sse(
                            {"type": "content_block_start", "index": index, "content_block": block},
                            "content_block_start",
                        )
                    if kind == TOOL:
                        delta = {
                            "type": "input_json_delta",
                            "partial_json": dumps(_input(value)),
                        }
                        calls += 1
                    else:
                        delta = {"type": _DELTA[kind], _FIELD[kind]: value}
                    yield sse(
                        {"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta"
                    )
        except Exception as e:  # noqa: BLE001  (the stream has begun: the error goes in it)
            yield sse(_stream_error(ANTHROPIC, e, self.metrics), "error")
            return
        if open_kind is not None:
            yield sse({"type": "content_block_stop", "index": index}, "content_block_stop")
        reason, sequence = self._stop(generation, calls)
        usage = self._usage(generation)
        yield sse(
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage,
            },
            "message_delta",
        )
        yield sse({"type": "message_stop"}, "message_stop")


_BLOCK = {CONTENT: "text", REASONING: "thinking", TOOL: "tool_use"}
_FIELD = {CONTENT: "text", REASONING: "thinking"}
_DELTA = {CONTENT: "text_delta", REASONING: "thinking_delta"}


def _block(kind: str, text: str) -> dict:
    return (
        {"type": "text", "text": text}
        if kind == CONTENT
        else {"type": "thinking", "thinking": text, "signature": ""}
    )


def _tool_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def _input(call: ToolCall) -> dict:
    return call.arguments if isinstance(call.arguments, dict) else {"arguments": call.arguments}
