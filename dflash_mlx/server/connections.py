"""How long a connection may take to send a request's head, and how many may be open at once.

uvicorn times a connection only between requests, and only until its first byte: a client that
connects and sends nothing, or sends its headers a byte at a time, holds the connection (a file
descriptor; a Mac allows a process 256 by default) for as long as it likes. Nor does it bound how many
are open: past the process's limit on open files, asyncio's accept loop logs a traceback for each
connection waiting in the listen backlog, thousands a second, and the server can open no file. uvicorn
has no setting for either, so its h11 protocol is extended here: from a connection's start, and from
the end of each response on it, the next request's head must arrive within `seconds`, or the
connection is closed; and a connection past the `most` open is answered 503 and closed at once.
A request's body has its own deadline (app.py's Guard).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("dflash_mlx.server")

_FULL = json.dumps(
    {
        "error": {
            "message": "the server has too many connections open: try again shortly",
            "type": "server_error",
        }
    }
).encode()
FULL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_FULL), _FULL)
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

        def connection_lost(self, exc) -> None:
            self._stop()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
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
