"""Slow and idle clients: uvicorn's HTTP/1.1 protocol (h11) with a deadline for a request's
headers and a cap on open connections.

uvicorn closes a kept-alive connection that sends nothing for `timeout_keep_alive` seconds, but
has no deadline once a byte of a request has come (headers trickled a byte a second are
served), none for a new connection that sends nothing, and counts connections only once a
request is whole (`limit_concurrency`): a client holding many connections with part of their
headers keeps them for ever. So here:

- a request's line and headers must be whole within `header_timeout_seconds` of the
  connection's opening (its first request) or of the first byte after an answer (the next
  ones); else 408 where part of a request came, and the connection is closed either way;
- a connection past `max_connections` open ones is answered 503 (Retry-After) as soon as it
  sends, or after REFUSED_GRACE seconds, and closed: it never reaches the app;
- a request h11 cannot parse (or headers over its 16 KiB) is answered a JSON 400, not
  uvicorn's plain text, and closed.

A body's deadline is the middleware's (408 through the app: its metrics and logs). Under Ray
Serve the HTTP server is Serve's proxy, not this one (docs/OPERATIONS.md, "Security").
"""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from attnserve.service.errors import error_body
from attnserve.service.metrics import Metrics
from attnserve.service.security import SECURITY_HEADERS
from attnserve.service.settings import Settings

# How long a connection past the cap may take to send its request before it is answered.
REFUSED_GRACE = 1.0


class ConnectionGuard:
    """The limits every connection of one server shares, and its count of open ones."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.header_timeout = settings.header_timeout_seconds
        self.max_connections = settings.max_connections
        self.metrics = metrics
        self.open = 0
        metrics.connections_open.set_function(lambda: self.open)

    def protocol(self) -> type[H11Protocol]:
        """uvicorn's `http` protocol class for this server's connections."""
        return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": self})


def raw_answer(status: int, message: str, headers: dict[str, str] | None = None) -> bytes:
    """An HTTP/1.1 error answer, JSON, that closes the connection: written to the socket
    when no request reached the app."""
    body = json.dumps(error_body(status, message)).encode()
    lines = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{name}: {value}" for name, value in (headers or {}).items()),
        *(f"{name.decode()}: {value.decode()}" for name, value in SECURITY_HEADERS),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with ConnectionGuard's header deadline and connection cap."""

    guard: ClassVar[ConnectionGuard]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._armed_for: Any = None  # the request cycle in progress when the deadline was set
        self._partial = False  # a byte of the awaited request has come
        self._refused = len(self.connections) >= self.guard.max_connections
        if self._refused:
            self.transport = transport
            self.guard.metrics.connection_closed("connection_limit")
            self._deadline = self.loop.call_later(REFUSED_GRACE, self._refuse)
            return
        super().connection_made(transport)
        self.guard.open += 1
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if not self._refused:
            self.guard.open -= 1
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            self._refuse()
            return
        if self._deadline is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the first byte after an answer: the next request's deadline starts
        self._partial = self._partial or bool(data)
        super().data_received(data)
        if self._deadline is not None and self.cycle is not self._armed_for:
            self._disarm()  # a request's headers are whole: the app has it

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()
        if self._deadline is not None and self.cycle is not cycle:
            self._disarm()  # a pipelined request, whole, went to the app

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse, as JSON like every other error."""
        self.guard.metrics.connection_closed("invalid_request")
        self.transport.write(
            raw_answer(400, "invalid HTTP request (malformed, or headers over 16 KiB)")
        )
        self.transport.close()

    def _arm(self) -> None:
        self._disarm()
        self._armed_for, self._partial = self.cycle, False
        self._deadline = self.loop.call_later(self.guard.header_timeout, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        """No whole request line and headers in time: 408 if part of one came, then close."""
        self._deadline = None
        if self.transport.is_closing():
            return
        self.guard.metrics.connection_closed("header_timeout")
        idle = self.cycle is None or self.cycle.response_complete
        if self._partial and idle and self.conn.their_state is h11.IDLE:
            seconds = f"{self.guard.header_timeout:g}"
            self.transport.write(
                raw_answer(408, f"the request's headers did not arrive within {seconds} s")
            )
        self.transport.close()

    def _refuse(self) -> None:
        """503 to a connection past the cap, then close it."""
        self._disarm()
        if not self.transport.is_closing():
            self.transport.write(
                raw_answer(
                    503,
                    f"the server holds its limit of {self.guard.max_connections} connections; "
                    "retry",
                    {"retry-after": "1"},
                )
            )
            self.transport.close()
