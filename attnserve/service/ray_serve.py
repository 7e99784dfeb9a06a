"""attnserve on Ray Serve: `create_app` as a deployment of N replicas behind Serve's HTTP proxy.

Needs the `ray` extra (imported here at the top: import this module only when Ray is wanted).

- `AttnserveReplica`: one replica, the whole app with its own models and engine threads. Serve
  runs the app's lifespan: its start-up loads and warms up the models (`wait_for_models`), so a
  replica takes requests only once ready and one whose models fail to load fails to start;
  Serve's graceful stop waits for the replica's requests, then the lifespan's shutdown stops the
  engines. Every answer carries `X-Attnserve-Replica` (the replica's id).
- `ProxyErrors`: runs in Serve's proxy (`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` names
  `proxy_middlewares`). A request whose replica died before answering gets Serve's bare 500
  (an empty response); here it becomes attnserve's JSON 503 with Retry-After, as do Serve's own
  503s (no replica). Serve adds a second X-Request-ID to each answer; one is kept.
- `application(settings, options)`: the Serve application; `build_app(args)`: the same for a
  Serve config file or `serve run attnserve.service.ray_serve:build_app models=...`;
  `run(settings, options)`: `attnserve serve --replicas N`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from collections.abc import Iterable
from pathlib import Path
from types import FrameType
from typing import Any

import ray
from fastapi import FastAPI
from ray import serve
from ray.serve import Application
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from attnserve.service.app import create_app
from attnserve.service.errors import LIBRETRANSLATE_PATHS, error_body
from attnserve.service.logs import stderr_handler
from attnserve.service.replicas import (
    APP_NAME,
    ReplicaOptions,
    deployment_options,
    proxy_timeout_s,
)
from attnserve.service.settings import Settings

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-attnserve-replica"
# Serve's proxy imports this callback at start and wraps itself in the middlewares it returns.
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = f"{__name__}:proxy_middlewares"
RETRY_AFTER_S = 1


class ReplicaHeader:
    """Adds X-Attnserve-Replica to every answer (pure ASGI)."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_replica(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_with_replica)


@serve.ingress()
class AttnserveReplica:
    """One replica: `overrides` are Settings fields over the replica's ATTNSERVE_* env."""

    def __init__(self, overrides: dict[str, Any]) -> None:
        self.settings = Settings(**overrides)
        self.served: FastAPI | None = None  # (`app` is Serve's: the ASGI app it calls)

    def __serve_build_asgi_app__(self) -> FastAPI:
        _replica_logging(self.settings)
        replica = serve.get_replica_context().replica_tag
        self.served = create_app(self.settings, wait_for_models=True)
        self.served.add_middleware(ReplicaHeader, replica=replica)
        log.info("replica %s: loading %s", replica, ", ".join(self.settings.models))
        return self.served

    def check_health(self) -> None:
        """Serve's periodic health check: a replica whose models failed is restarted."""
        lifecycle = self.served.state.service.lifecycle if self.served is not None else None
        if lifecycle is not None and lifecycle.phase == "failed":
            raise RuntimeError(lifecycle.detail or "failed")


def _replica_logging(settings: Settings) -> None:
    """attnserve's log lines (JSON with the request id) on the replica's stderr, which Ray
    keeps in its worker logs and a local driver prints; Ray's own loggers are left alone."""
    root = logging.getLogger("attnserve")
    root.handlers[:] = [stderr_handler(settings.log_json)]
    root.setLevel(settings.log_level.upper())
    root.propagate = False


class ProxyErrors:
    """Serve's proxy: a request no replica answered gets a retryable 503 (pure ASGI)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = replaced = False

        async def forward(message: Message) -> None:
            nonlocal started, replaced
            if replaced:  # the rest of Serve's own error answer
                return
            if message["type"] == "http.response.start":
                started = True
                headers = _one_request_id(message.get("headers", []))
                from_replica = any(k.lower() == REPLICA_HEADER.encode() for k, _ in headers)
                if not from_replica and message["status"] in (500, 502, 503):
                    replaced = True
                    await _unavailable(send, scope, headers)
                    return
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, forward)
        if not started:  # the replica died before answering: Serve sent nothing
            await _unavailable(send, scope, [])


def _one_request_id(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers with the first X-Request-ID only (the replica's; Serve appends its own)."""
    kept: list[tuple[bytes, bytes]] = []
    seen = False
    for key, value in headers:
        if key.lower() == b"x-request-id":
            if seen:
                continue
            seen = True
        kept.append((key, value))
    return kept


async def _unavailable(send: Send, scope: Scope, headers: list[tuple[bytes, bytes]]) -> None:
    request_id = next(
        (
            v.decode("latin-1")
            for k, v in [*headers, *scope["headers"]]
            if k.lower() == b"x-request-id"
        ),
        None,
    )
    message = "no replica answered this request (it stopped or none is running); retry it"
    if scope["path"] in LIBRETRANSLATE_PATHS:
        shape: dict[str, Any] = {"error": message}
    else:
        shape = error_body(503, message)
        shape["error"]["request_id"] = request_id
    body = json.dumps(shape).encode()
    out = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()),
    ]
    if request_id is not None:
        out.append((b"x-request-id", request_id.encode("latin-1")))
    await send({"type": "http.response.start", "status": 503, "headers": out})
    await send({"type": "http.response.body", "body": body})


def proxy_middlewares() -> list[Middleware]:
    """The callback Serve's proxy calls (PROXY_CALLBACK_ENV)."""
    return [Middleware(ProxyErrors)]


def application(settings: Settings, options: ReplicaOptions) -> Application:
    """The Serve application of `settings` (every field passed, model paths made absolute; the
    API key goes through the replicas' environment, not the deployment's arguments)."""
    overrides = settings.model_dump(mode="json", exclude={"api_key"})
    overrides["models"] = [str(Path(m).resolve()) for m in settings.models]
    deployment_config = deployment_options(settings, options)
    if settings.api_key is not None:
        deployment_config["ray_actor_options"]["runtime_env"] = {
            "env_vars": {"ATTNSERVE_API_KEY": settings.api_key.get_secret_value()}
        }
    return serve.deployment(**deployment_config)(AttnserveReplica).bind(overrides)


def build_app(args: dict[str, Any]) -> Application:
    """Serve's application builder (`import_path: attnserve.service.ray_serve:build_app`):
    `args` are Settings fields over the ATTNSERVE_* environment, the replicas' too. The models
    are checked (and, with auto_export, exported) here, once, as `attnserve serve` does; a
    config file's `deployments` entry overrides the replica count and the other options."""
    from attnserve.provision import provision

    if "allowed_hosts" not in args:
        # Serve's proxy binds its own address (http_options), not ATTNSERVE_HOST: without a
        # list of its own, the host check follows ATTNSERVE_ALLOWED_HOSTS, else allows any.
        args = {**args, "allowed_hosts": os.environ.get("ATTNSERVE_ALLOWED_HOSTS") or "*"}
    settings = Settings(**args)
    if settings.threads is None:
        settings = settings.model_copy(update={"threads": 1})
    for directory in settings.model_dirs:  # FileNotFoundError: names it and how to get a model
        provision(directory, settings.runtime)
    deployment_config = deployment_options(settings, ReplicaOptions())
    return serve.deployment(**deployment_config)(AttnserveReplica).bind(dict(args))


class _Stop(BaseException):
    """SIGINT or SIGTERM reached `run`."""


def _stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


def run(settings: Settings, options: ReplicaOptions) -> int:
    """Start a local Ray (or join `options.address` / RAY_ADDRESS), deploy the replicas, serve
    until SIGINT / SIGTERM, then stop them: 0, or 1 when the replicas failed to start."""
    address = options.address or os.environ.get("RAY_ADDRESS") or None
    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)  # a local Ray's proxy inherits it
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no reports to Ray's servers
    threads = settings.threads or 1
    init: dict[str, Any] = {"namespace": APP_NAME, "include_dashboard": False}
    if address is None:
        cores = os.cpu_count() or 1
        wanted = options.most_replicas * threads
        if wanted > cores:
            log.warning(
                "%d replicas x %d threads on %d cores", options.most_replicas, threads, cores
            )
        init["num_cpus"] = max(cores, wanted)  # else the replicas past the cores never start
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    url = f"http://{settings.host}:{settings.port}"
    try:
        ray.init(address=address, **init)
        signal.signal(signal.SIGTERM, _stop)  # ray.init sets its own
        serve.start(
            http_options={
                "host": settings.host,
                "port": settings.port,
                "request_timeout_s": proxy_timeout_s(settings),
            }
        )
        serve.run(application(settings, options), name=APP_NAME, route_prefix="/")
        count = (
            f"{options.min_replicas or 1}-{options.most_replicas} (autoscaling)"
            if options.autoscaling
            else str(options.replicas)
        )
        log.info(
            "serving on %s: %s replicas of %d threads on Ray Serve", url, count, threads,
            extra={"replicas": count, "threads": threads},
        )  # fmt: skip
        threading.Event().wait()
    except _Stop as stop:
        log.info("%s: stopping the replicas", stop)
    except RuntimeError as exc:  # serve.run: the replicas did not start (their log says why)
        log.error("the replicas failed to start: %s", exc)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            if ray.is_initialized():
                if address is None:
                    serve.shutdown()
                else:  # a shared cluster: remove only this application
                    serve.delete(APP_NAME)
        finally:
            ray.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return 0
