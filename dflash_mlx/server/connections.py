"""How long a connection may take to send a request's head, and how many may be open at once.

uvicorn times a connection only between requests, and only until its first byte: a client that
connects and sends nothing, or sends its headers a byte at a time, holds the connection (a file
descriptor; a Mac allows a process 256 by default) for as long as it likes. Nor does it bound how many
are open: past the process's limit on open files, asyncio's accept loop logs a traceback for each
connection waiting in the listen backlog, thousands a second, and the server can open no file. uvicorn
has no setting for either, so its h11 protocol is extended here: from a connection's start, and from
the end of each response on it, the next request's head must arrive within `seconds`, or the
connection is closed; and a connection past the `most` open is answered 503 and closed at once. A
request that is not HTTP gets its 400 with a JSON error body, as every other error here.
A request's body has its own deadline (app.py's Guard).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body

log = logging.getLogger("dflash_mlx.server")


def _response(status: bytes, message: str) -> bytes:
    """A whole HTTP/1.1 response, the connection closing after it, with an error body as the OpenAI
    API shapes it (the request's path is not known here)."""
    body = json.dumps(error_body("", int(status[:3]), message)).encode()
    head = b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n" % (status, len(body))
    retry = b"retry-after: 1\r\n" if status.startswith(b"5") else b""
    return head + retry + b"connection: close\r\n\r\n" + body


FULL = _response(b"503 Service Unavailable", "the server has too many connections open: try again shortly")
# (uvicorn answers what it cannot parse in plain text: "Invalid HTTP request received.")
UNREAD = _response(
    b"400 Bad Request",
    "the request is not valid HTTP/1.1: check its request line and headers (Content-Length, ...)",
)


def protocol(seconds: float, most: int) -> type[H11Protocol]:
    """uvicorn's `http` protocol class for connections whose request heads must arrive in `seconds`, at
    most `most` of them open."""
    said = [float("-inf")]  # when the log last said the server was full (once a minute at most)

    class HeadDeadline(H11Protocol):
        deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > most:  # (uvicorn's set of open connections, this one in it)
                if time.monotonic() - said[0] > 60:
                    said[0] = time.monotonic()
                    log.warning("%d connections are open, the most allowed: new ones get a 503", most)
                transport.write(FULL)
                transport.close()
                return
            self._wait()

        def send_400_response(self, msg: str) -> None:
            self.transport.write(UNREAD)
            self.transport.close()

        def connection_lost(self, exc) -> None:
            self._stop()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.timeout_keep_alive_task is not None:  # (uvicorn's 5 s: a client pooling connections
                self.timeout_keep_alive_task.cancel()  # for as long, as httpx does, would race its close)
                self.timeout_keep_alive_task = None
            self._wait()

        def _answering(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _wait(self) -> None:
            self._stop()
            self.deadline = self.loop.call_later(seconds, self._late)

        def _stop(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def _late(self) -> None:
            self.deadline = None
            if not self._answering():  # (a request whose head came in time is not cut)
                self.timeout_keep_alive_handler()  # (uvicorn's own close of an idle connection)

    return HeadDeadline
