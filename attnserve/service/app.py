"""The FastAPI app factory. Nothing is loaded at import: `lifespan` loads the models.

Start-up: the server answers at once (/healthz 200, /readyz 503 "loading"); the models load on a
worker thread, each is warmed up with one short translation through its engine, then /readyz
turns 200. A model that fails to load makes the process exit (Lifecycle.on_fatal).
`wait_for_models` (a Ray Serve replica, service/ray_serve.py): the lifespan's start-up itself
loads the models and raises if one fails, so the replica counts as started only once it is ready.
Shutdown (SIGTERM, see server.py): /readyz and new API requests answer 503 at once, in-flight
requests finish within drain_seconds, then the engine threads stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi

from attnserve.engine.memory import MemoryTrimmer
from attnserve.service.docs_page import router as docs_router
from attnserve.service.errors import install_error_handlers
from attnserve.service.libretranslate import router as libretranslate_router
from attnserve.service.middleware import ServiceMiddleware
from attnserve.service.models import BackendFactory, default_backend_factory, load_model, warm_up
from attnserve.service.models import wait_idle as wait_models_idle
from attnserve.service.openai_api import router as openai_router
from attnserve.service.routes import router
from attnserve.service.schemas import FinalEvent, TokenEvent
from attnserve.service.security import HostPolicy
from attnserve.service.server_info import package_version
from attnserve.service.server_info import router as server_info_router
from attnserve.service.settings import Settings
from attnserve.service.state import ServiceState
from attnserve.service.tokenization import router as tokenization_router
from attnserve.service.ui import router as ui_router

log = logging.getLogger(__name__)

DESCRIPTION = """\
Translation with encoder-decoder Transformers, decoded with continuous batching.

Errors are JSON `{"error": {"type", "message", "param", "request_id"}}`: 422 invalid request
(`param` names the field), 404 unknown model, 413 body too large, 429 queue full (Retry-After),
503 not ready or shutting down, 504 deadline exceeded, 401 missing API key (when the server has
one: `Authorization: Bearer <key>`; /healthz, /readyz, /metrics, the docs and the page at /
stay open), 500 a decoding failure of this request (quote its request id); 408 a body too slow
to arrive, 421 a Host the server does not answer to, 403 a browser's request from another site.
Every response carries `X-Request-ID` (the client's, when it sent a valid one).
"""


def create_app(
    settings: Settings | None = None,
    *,
    backend_factory: BackendFactory = default_backend_factory,
    wait_for_models: bool = False,
) -> FastAPI:
    """A new app with its own settings, metrics registry and models (loaded by lifespan)."""
    settings = settings or Settings()
    service = ServiceState(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        hosts = HostPolicy.from_settings(settings.exposed_host, settings.allowed_hosts).describe()
        log.info(
            "answering to the hosts: %s%s",
            hosts,
            " (set ATTNSERVE_ALLOWED_HOSTS to check the Host header)" if hosts == "any" else "",
            extra={"allowed_hosts": hosts},
        )
        loader = asyncio.create_task(load_models(service, backend_factory))
        if wait_for_models:
            await loader
            if service.lifecycle.phase == "failed":
                await asyncio.to_thread(service.registry.stop, 5.0)  # the models that loaded
                raise RuntimeError(f"loading the models failed: {service.lifecycle.detail}")
        try:
            yield
        finally:
            await shut_down(service, loader)

    app = FastAPI(
        title="attnserve",
        version=package_version(),
        description=DESCRIPTION,
        lifespan=lifespan,
        # /docs is docs_page.py's (no CDN); ReDoc's page, which loads from one, is left out.
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json" if settings.docs else None,
    )
    app.state.service = service
    app.openapi = _openapi(app)  # type: ignore[method-assign]
    install_error_handlers(app)
    routers = [router, openai_router, libretranslate_router, tokenization_router]
    routers += [server_info_router, *([ui_router] if settings.ui else [])]
    routers += [docs_router] if settings.docs else []
    for included in routers:
        app.include_router(included)
    # The metrics' route label of a request the middleware answers itself (401, 413, 503):
    # app.routes lists the included routers, not their routes, so those are read here.
    known_paths = frozenset(
        str(getattr(route, "path", ""))
        for route in [*app.routes, *(r for included in routers for r in included.routes)]
    )
    app.add_middleware(ServiceMiddleware, service=service, known_paths=known_paths)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "X-Request-ID"],
            expose_headers=["X-Request-ID", "Retry-After"],
        )
    return app


def _openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """FastAPI's schema plus the event models of the /v1/generate stream (not route bodies)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (TokenEvent, FinalEvent):
            model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            for name, definition in model_schema.pop("$defs", {}).items():
                components.setdefault(name, definition)
            components[model.__name__] = model_schema
        app.openapi_schema = schema
        return schema

    return openapi


async def load_models(service: ServiceState, factory: BackendFactory) -> None:
    """Load and warm up every configured model, then mark the service ready."""
    settings, lifecycle = service.settings, service.lifecycle
    trimmer = MemoryTrimmer(settings.trim_seconds)
    try:
        for directory in settings.model_dirs:
            model = await asyncio.to_thread(
                load_model, directory, settings, service.metrics, factory, trimmer
            )
            service.registry.add(model)
            await warm_up(model)
    except Exception as exc:
        log.exception("loading the models failed")
        lifecycle.fail(f"{type(exc).__name__}: {exc}")
        return
    if lifecycle.phase == "loading":
        lifecycle.phase = "ready"
        names = ", ".join(m.name for m in service.registry)
        log.info("ready: serving %s", names, extra={"models": names})


async def shut_down(service: ServiceState, loader: asyncio.Task[None]) -> None:
    """Refuse new work, let queued and running requests finish (bounded), stop the engines."""
    service.lifecycle.start_draining()
    drain = service.settings.drain_seconds
    if not loader.done():
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(loader), drain)
    if not await wait_models_idle(service.registry, drain):
        log.warning("drain time (%.1fs) over: stopping with requests in flight", drain)
    await asyncio.to_thread(service.registry.stop, 5.0)
    log.info("engines stopped")
