"""Running the app under uvicorn, with a drain on SIGTERM.

uvicorn alone stops listening at the first SIGTERM, so new requests would be refused at the TCP
level and /readyz would not answer. Here the first SIGTERM (or SIGINT) only starts the drain:
the app keeps listening, /readyz and new API requests answer 503, and once no API request is in
flight (or drain_seconds have passed) uvicorn's own shutdown runs (close the sockets, wait for
connections, lifespan shutdown: stop the engines). A second signal shuts down at once.
"""

from __future__ import annotations

import logging
import math
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI

from attnserve.service.app import create_app
from attnserve.service.connections import ConnectionGuard
from attnserve.service.models import BackendFactory, default_backend_factory
from attnserve.service.settings import Settings
from attnserve.service.state import ServiceState

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal drains in-flight requests before shutting down."""

    def __init__(self, config: uvicorn.Config, service: ServiceState) -> None:
        super().__init__(config)
        self.service = service
        self.failed = False
        self._drain_until: float | None = None
        self._drain_logged = False
        service.lifecycle.on_fatal = self._fatal

    def _fatal(self) -> None:
        self.failed = True
        self.should_exit = True

    def start_drain(self) -> None:
        """What the first SIGTERM does (callable from tests)."""
        self.service.lifecycle.start_draining()
        self._drain_until = time.monotonic() + self.service.settings.drain_seconds

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: set flags only (no logging, no asyncio); on_tick acts on them.
        if self._drain_until is None and not self.should_exit:
            self.start_drain()
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_until is not None and not self.should_exit:
            lifecycle = self.service.lifecycle
            if not self._drain_logged:
                self._drain_logged = True
                log.info(
                    "draining: %d requests in flight, at most %.1fs",
                    lifecycle.in_flight,
                    self.service.settings.drain_seconds,
                )
            if lifecycle.in_flight == 0 or time.monotonic() >= self._drain_until:
                if lifecycle.in_flight:
                    log.warning("drain time over with %d requests in flight", lifecycle.in_flight)
                self.should_exit = True
        return await super().on_tick(counter)


def build_server(app: FastAPI, settings: Settings) -> DrainingServer:
    guard = ConnectionGuard(settings, app.state.service.metrics)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        # h11 with a deadline for headers and a cap on connections (connections.py), whether or
        # not httptools is installed; idle kept-alive connections closed by uvicorn.
        http=guard.protocol(),
        # no WebSocket routes: an Upgrade request is answered as plain HTTP (a WebSocket
        # protocol taking the socket over would leave the guard's count and deadline behind)
        ws="none",
        timeout_keep_alive=settings.keep_alive_seconds,
        log_config=None,  # logs.configure_logging owns the handlers
        access_log=False,  # the middleware logs every request with its id
        lifespan="on",
        timeout_graceful_shutdown=max(1, math.ceil(settings.drain_seconds)),
        server_header=False,
    )
    return DrainingServer(config, app.state.service)


def serve(settings: Settings, *, backend_factory: BackendFactory = default_backend_factory) -> int:
    """Serve until drained after SIGTERM; 1 when the models failed to load."""
    server = build_server(create_app(settings, backend_factory=backend_factory), settings)
    server.run()
    return 1 if server.failed else 0
