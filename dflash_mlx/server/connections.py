"""How long a connection may take to send a request's head.

uvicorn times a connection only between requests, and only until its first byte: a client that
connects and sends nothing, or sends its headers a byte at a time, holds the connection (a file
descriptor; a Mac allows a process 256 by default) for as long as it likes. uvicorn has no setting
for this, so its h11 protocol is extended here: from a connection's start, and from the end of each
response on it, the next request's head must arrive within `seconds`, or the connection is closed.
A request's body has its own deadline (app.py's Guard).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


def protocol(seconds: float) -> type[H11Protocol]:
    """uvicorn's `http` protocol class for connections whose request heads must arrive in `seconds`."""

    class HeadDeadline(H11Protocol):
        deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
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
