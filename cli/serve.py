"""`dflash-mlx serve`: the pair behind an OpenAI- and Anthropic-compatible HTTP API."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import os
import re
import resource
import signal
import socket
import threading

import typer
from rich.markup import escape

from dflash_mlx.errors import UserError
from dflash_mlx.loading import draft_for, load_pair, template_kwargs
from dflash_mlx.platform import stop_signals
from dflash_mlx.policy import batch_sizes
from dflash_mlx.settings import GenerationSettings

from .options import (
    DEMO,
    SAMPLING,
    BlockSize,
    Draft,
    DraftWindow,
    MaxTokens,
    MinP,
    Model,
    NoLookup,
    Temp,
    Think,
    TopK,
    TopP,
    check_lookup,
    stderr,
    user_errors,
    warm,
)

GRACE = 5  # seconds uvicorn gives open requests at Ctrl-C
KEY_ENV = "DFLASH_MLX_API_KEY"


def _claim_port(host: str, port: int, backlog: int = 128) -> socket.socket:
    """The address, listened on from now: held through minutes of loading, it cannot be taken meanwhile
    (a socket only bound can be, by one that allows reuse), and connections made meanwhile wait to be
    answered once the server is up."""
    if not 1 <= port <= 65535:
        raise UserError(f"--port must be from 1 to 65535, got {port}")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET  # (as uvicorn chooses)
        return socket.create_server((host, port), family=family, backlog=backlog)
    except OSError as e:  # (the port taken or privileged; else the address is not one of this machine's)
        what = "another --port" if e.errno in (errno.EADDRINUSE, errno.EACCES) else "another --host"
        reason = str(e.strerror or e).split(" (while attempting")[0]
        raise UserError(f"cannot listen on {host}:{port} ({reason}): choose {what}") from None


SPARE_FILES = 128  # open files kept for the server's own use (weights, the sandbox, logs) past connections


def _open_files() -> int:
    """Raise this process's limit on open files as far as the system lets it (a Mac's default is 256;
    each connection is one) -> the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = [n for n in (hard, 65536, 10240) if soft < n and (hard == resource.RLIM_INFINITY or n <= hard)]
    for n in wanted:  # (a Mac refuses more than its OPEN_MAX, 10240, whatever the hard limit says)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))
            return n
        except (ValueError, OSError):
            continue
    return soft


def serve(
    model: Model = DEMO,
    draft: Draft = None,
    host: str = typer.Option(
        "127.0.0.1", help="Address to listen on (another than loopback lets other machines in)."
    ),
    port: int = typer.Option(8080, help="Port to listen on."),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar=KEY_ENV, help="Require this key (Bearer or x-api-key)."
    ),
    max_concurrency: int = typer.Option(4, help="Requests generated at once (batched in each step)."),
    max_queue: int = typer.Option(16, help="Requests waiting beyond those; past that: 429."),
    workers: int = typer.Option(
        1,
        help="Threads that answer requests in each process, each its share of them (on a CPU, "
        "--processes uses several cores better: see docs/server.md).",
    ),
    processes: int = typer.Option(
        1,
        help="Processes answering requests, each with --workers threads and its own copy of the pair "
        "(on a CPU of several cores: more requests at once, see docs/server.md).",
    ),
    cache_gb: float = typer.Option(4.0, help="Memory for kept prompt caches (0: keep none)."),
    request_timeout: float | None = typer.Option(
        None, help="End an answer this many seconds after its request arrived (default: no limit)."
    ),
    allow_client_templates: bool = typer.Option(
        False,
        "--allow-client-templates",
        help="Let requests bring their own chat template (chat_template_kwargs.chat_template), rendered "
        "in a separate process with time and size limits.",
    ),
    allow_origin: list[str] | None = typer.Option(
        None,
        "--allow-origin",
        help="Let web pages from this origin (https://app.example.com; '*' for any) call the server from "
        "a browser; repeat for more. Pages served from this machine (localhost) always may.",
    ),
    temp: Temp = 0.0,
    top_p: TopP = 1.0,
    top_k: TopK = 0,
    min_p: MinP = 0.0,
    max_tokens: MaxTokens = 2048,
    block_size: BlockSize = None,
    no_lookup: NoLookup = False,
    draft_window: DraftWindow = None,
    think: Think = None,
    name: str | None = typer.Option(None, help="The model name clients use (default: --model)."),
    access_log: bool = typer.Option(
        False, "--access-log", help="Log a line per request: its time, client, request line and status."
    ),
):
    """Serve the pair over HTTP: OpenAI chat completions and completions, Anthropic messages."""
    with user_errors(SAMPLING):
        for flag, value, ok, what in (
            ("--max-concurrency", max_concurrency, 1 <= max_concurrency <= 256, "from 1 to 256"),
            ("--max-queue", max_queue, 0 <= max_queue <= 10_000, "from 0 to 10000"),
            ("--workers", workers, 1 <= workers <= 256, "from 1 to 256"),
            ("--processes", processes, 1 <= processes <= 64, "from 1 to 64"),
            ("--cache-gb", cache_gb, 0 <= cache_gb < 1 << 20, "0 or more"),
        ):
            if not ok:
                raise UserError(f"{flag} must be {what}, got {value}")
        if workers * processes > max_concurrency:  # (each worker answers one request at least)
            raise UserError(
                f"{workers * processes} workers (--workers {workers} × --processes {processes}) would "
                f"answer at most {max_concurrency} requests at once (--max-concurrency): raise "
                "--max-concurrency or give fewer workers"
            )
        if request_timeout is not None and not request_timeout > 0:
            raise UserError(f"--request-timeout must be a number of seconds above 0, got {request_timeout}")
        # (empty, each would open the server up: every address, or no key asked for)
        if not host.strip():
            raise UserError("--host is empty: give an address to listen on (127.0.0.1: this machine only)")
        if name is not None and not name.strip():
            raise UserError("--name is empty: give the model name clients use, or leave it out")
        if (api_key is not None and not api_key.strip()) or (api_key is None and KEY_ENV in os.environ):
            # (an environment file whose secret was left unfilled would serve without one)
            raise UserError("the API key (--api-key or DFLASH_MLX_API_KEY) is empty: give one or none")
        for origin in allow_origin or ():  # (as a browser names a page's origin: else it never matches)
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                raise UserError(
                    f"--allow-origin takes an origin as browsers send it (https://app.example.com: a "
                    f"scheme and a host, no path) or '*', got {origin!r}"
                )
        check_lookup(no_lookup, block_size)
        defaults = GenerationSettings.answers(
            temperature=temp,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            max_tokens=max_tokens,
            block_size=block_size,
            lookup=not no_lookup,
            draft_window=draft_window,
        )
        # Connections waiting to be accepted are accepted up to `backlog` at a time, before any is
        # refused: the most open at once leaves room for them below the limit on open files.
        files = _open_files()
        backlog = max(16, min(512, files // 8))
        most = max(16, files - SPARE_FILES - backlog)
        sock = _claim_port(host, port, backlog)  # before minutes of loading, not after
        if api_key is None and not ipaddress.ip_address(sock.getsockname()[0]).is_loopback:
            stderr().print(
                f"note: {host} lets other machines in, and no API key is asked of them (--api-key)",
                markup=False,
                highlight=False,
            )
        target, drafter, tokenizer = load_pair(model, draft)
        template = template_kwargs(model, think, tokenizer)
        # Imported here: FastAPI and uvicorn take about 0.3 s to import, which every other
        # command (each `generate`) would pay too.
        import uvicorn

        from dflash_mlx.server.app import ServerConfig, create_app
        from dflash_mlx.server.connections import protocol
        from dflash_mlx.server.processes import log_to_stderr
        from dflash_mlx.server.scheduler import worker_share

        # Measured now, not in the first request's time; batched passes are priced for the adaptive
        # policy, up to the most requests one worker batches.
        share = worker_share(max_concurrency, workers * processes)[1]
        warm(target, drafter, stderr(), batches=batch_sizes(share) if block_size is None else ())

        config = ServerConfig(
            model_id=name or model,
            defaults=defaults,
            template_kwargs=template,
            api_key=api_key,
            max_active=max_concurrency,
            max_waiting=max_queue,
            workers=workers,
            processes=processes,
            names=(model, draft),
            cache_bytes=int(cache_gb * (1 << 30)),
            request_timeout=request_timeout,
            client_templates=allow_client_templates,
            allow_origins=tuple(allow_origin or ()),
            max_connections=most,
        )
        app = create_app(target, drafter, tokenizer, config)
    log_to_stderr()
    # A second Ctrl-C cancels the answers under way and the app's lifespan, each of which uvicorn would
    # log with its traceback (the lifespan's as the text of one).
    logging.getLogger("uvicorn.error").addFilter(
        lambda record: (
            not (
                (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))
                or record.getMessage().rstrip().endswith("CancelledError")
            )
        )
    )
    if others := len(app.state.scheduler.remotes):  # (none past one a request: --max-concurrency)
        more = "another process" if others == 1 else f"{others} more processes"
        stderr().print(f"loading the pair in {more} ...")
    scheduler, came = app.state.scheduler, []  # came: the signals that stopped the server

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # Ctrl-C: the requests still queued end now, the answers under way a second before uvicorn's
            # grace period is over (it would hold them all to its end, then cut their connections). A
            # second signal, of any kind, stops it at once. Closing runs in a thread of its own: the
            # signal may have come while this thread held a lock that closing takes (telling a worker
            # process), and would wait for itself. The signal is counted first: one that comes while
            # this handler starts that thread must not start another (the two starts broke threading's
            # own bookkeeping).
            first = not came
            came.append(sig)
            if first:
                threading.Thread(target=scheduler.close_queue, args=(GRACE - 1,), daemon=True).start()
            self.force_exit = self.should_exit
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn's, with SIGHUP (a closing terminal) too, which otherwise ended the process inside
            # the event loop; and no signal raised again once the server has stopped (a second Ctrl-C
            # was, into the shutdown, which cut every stream and aborted MLX's work). Nor are the
            # handlers put back: the process only ends from here on, and a signal that came while it
            # did raised into whatever ran (its workers stopping, exit's clean-up). The exit code says
            # which signal came first (below).
            for s in (signal.SIGINT, *stop_signals()):
                signal.signal(s, self.handle_exit)
            yield

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:  # (its worker processes too, which the app's startup waits for)
                where = f"[{host}]" if ":" in host else host  # (an IPv6 address in a URL)
                drafter = escape(draft_for(model, draft))
                stderr().print(
                    f"serving [bold]{escape(config.model_id)}[/bold] with drafter {drafter} on "
                    f"http://{where}:{port}/v1 (OpenAI) and /v1/messages (Anthropic); Ctrl-C stops"
                )

    server = Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            log_config=None,  # (its lines in the server's log, with their times)
            access_log=access_log,
            timeout_graceful_shutdown=GRACE,
            backlog=backlog,
            http=protocol(config.head_seconds, config.max_connections),
        )
    )
    if access_log:  # (uvicorn's line per request: the client's address, the request line, the status)
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # (a Ctrl-C before the server took over its signals)
        pass
    finally:
        # (also where a second signal skipped the app's shutdown: MLX aborts a process that ends with
        # model work running)
        scheduler.stop()
    if not server.started:
        raise UserError("the server did not start (its log above says why)")
    if came and came[0] != signal.SIGINT:
        raise typer.Exit(128 + came[0])  # (SIGTERM 143, SIGHUP 129; Ctrl-C 0)
