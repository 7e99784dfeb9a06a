"""The request middleware (pure ASGI): request ids, access logs and metrics, the Host and
Origin checks, the API key, readiness and draining, the body's size, time and text, the security
headers, and a JSON 500 for unexpected exceptions.

Order for an API request (`/v1/...`): id -> Host (421) -> Origin (403) -> API key (401) ->
lifecycle (503) -> body size (413, from Content-Length before reading, else while reading), time
(408) and text (a lone surrogate: 422) -> the app. Every request but the probes (/healthz,
/readyz) passes the Host check, and every state-changing one the Origin check; health,
readiness, metrics, the OpenAPI pages and the page at / skip the rest.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Any
from urllib.parse import quote

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from attnserve.service.errors import (
    LIBRETRANSLATE_PATHS,
    OPENAI_PATHS,
    TOKENIZER_PATHS,
    capped,
    error_body,
)
from attnserve.service.logs import new_request_id, request_id_var
from attnserve.service.security import (
    SAFE_METHODS,
    HostPolicy,
    cross_origin,
    lone_surrogate,
    with_security_headers,
)
from attnserve.service.state import ServiceState

log = logging.getLogger("attnserve.access")

REQUEST_ID_HEADER = "x-request-id"
QUIET_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
# Answered whatever the Host: orchestrators probe a pod by its IP address.
PROBE_PATHS = frozenset({"/healthz", "/readyz"})


class ClientGone(Exception):
    """The client disconnected while its body was being read."""


class _Reply:
    """An error answer decided by the middleware before the app runs."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        reason: str | None = None,
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ) -> None:
        self.status, self.message, self.reason = status, message, reason
        self.headers = headers or {}
        self.param = param


class ServiceMiddleware:
    def __init__(self, app: ASGIApp, service: ServiceState, known_paths: frozenset[str]) -> None:
        self.app = app
        self.service = service
        self.known_paths = known_paths
        settings = service.settings
        self.hosts = HostPolicy.from_settings(settings.exposed_host, settings.allowed_hosts)
        key = settings.api_key
        self._key = key.get_secret_value().encode() if key is not None else None
        # The bytes a client may send the key as: UTF-8 (curl, httpx bytes), or latin-1 where
        # it fits (Python's http.client, urllib and requests encode header strings so).
        self._key_forms: tuple[bytes, ...] = ()
        if key is not None:
            forms = [key.get_secret_value().encode()]
            try:
                latin1 = key.get_secret_value().encode("latin-1")
            except UnicodeEncodeError:  # not latin-1: only UTF-8 can carry it
                latin1 = forms[0]
            if latin1 != forms[0]:
                forms.append(latin1)
            self._key_forms = tuple(forms)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        request_id = new_request_id(headers.get(REQUEST_ID_HEADER))
        token = request_id_var.set(request_id)
        started = time.perf_counter()
        status = 0
        response_started = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                status, response_started = int(message["status"]), True
                message["headers"] = with_security_headers(
                    [*message.get("headers", []), (REQUEST_ID_HEADER.encode(), request_id.encode())]
                )
            await send(message)

        path: str = scope["path"]
        libre = path in LIBRETRANSLATE_PATHS
        api = path.startswith("/v1/") or libre or path in TOKENIZER_PATHS
        lifecycle = self.service.lifecycle
        counted = False
        try:
            reply = self._screen(scope, headers)
            if reply is None and api:
                reply = self._refuse(scope, headers, check_key=not libre)
            if reply is None and api and scope["method"] in ("POST", "PUT", "PATCH"):
                reply, receive = await self._limit_body(headers, receive)
            if reply is not None:
                if reply.reason:
                    self.service.metrics.reject(reply.reason)
                await _send_error(send_with_id, reply, libre, openai=path in OPENAI_PATHS)
                return
            if api:
                lifecycle.in_flight += 1
                counted = True
            await self.app(scope, receive, send_with_id)
        except ClientGone:
            status = status or 499
        except Exception:
            log.exception("unhandled error serving %s %s", scope["method"], logged_path(path))
            if response_started:
                return
            status = 500
            await _send_error(
                send_with_id,
                _Reply(
                    500,
                    f"internal error; quote request id {request_id} when reporting it",
                    # the openai client retries 5xx by default: not a request that may have run
                    headers={"x-should-retry": "false"} if path in OPENAI_PATHS else None,
                ),
                libre,
            )
        finally:
            if counted:
                lifecycle.in_flight -= 1
            seconds = time.perf_counter() - started
            route = self._route(scope)
            self.service.metrics.observe_request(route, status or 499, seconds)
            log.log(
                logging.DEBUG if path in QUIET_PATHS else logging.INFO,
                "%s %s %d %.1fms",
                scope["method"],
                logged_path(path),
                status or 499,
                seconds * 1000,
                extra={"route": route, "status": status or 499, "duration_ms": seconds * 1000},
            )
            request_id_var.reset(token)

    def _screen(self, scope: Scope, headers: dict[str, str]) -> _Reply | None:
        """421 for a Host the server does not answer to; 403 for a browser's state-changing
        request from another site (security.py)."""
        if scope["path"] not in PROBE_PATHS and not self.hosts.allows(headers.get("host")):
            return _Reply(
                421,
                f"this server does not answer to the host {headers.get('host', '')[:64]!r} "
                "(its allowed hosts: ATTNSERVE_ALLOWED_HOSTS)",
                reason="host_not_allowed",
            )
        if scope["method"] not in SAFE_METHODS:
            origin = cross_origin(headers, self.service.settings.cors_origins)
            if origin is not None:
                return _Reply(
                    403,
                    f"cross-origin request from {origin[:64]!r} refused (the server's CORS "
                    "origins: ATTNSERVE_CORS_ORIGINS)",
                    reason="origin_not_allowed",
                )
        return None

    def _refuse(
        self, scope: Scope, headers: dict[str, str], check_key: bool = True
    ) -> _Reply | None:
        """401 without a valid API key (unless the route checks it); 503 while loading,
        draining or failed."""
        if self._key is not None and check_key:
            scheme, _, supplied = headers.get("authorization", "").partition(" ")
            # The header's own bytes (it was read as latin-1), less HTTP whitespace only:
            # str.strip() would also eat \x85 and \xa0, the last byte of UTF-8 "Å" and "à".
            raw = supplied.encode("latin-1").strip(b" \t")
            matches = [hmac.compare_digest(raw, form) for form in self._key_forms]  # no early exit
            if scheme.lower() != "bearer" or not any(matches):
                return _Reply(
                    401,
                    "missing or invalid API key (Authorization: Bearer <key>)",
                    reason="unauthorized",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        lifecycle = self.service.lifecycle
        if lifecycle.phase == "draining":
            return _Reply(503, "the server is shutting down", reason="draining")
        if lifecycle.phase != "ready":
            detail = "models are still loading" if lifecycle.phase == "loading" else "not ready"
            return _Reply(503, detail, reason="not_ready", headers={"Retry-After": "1"})
        return None

    async def _limit_body(
        self, headers: dict[str, str], receive: Receive
    ) -> tuple[_Reply | None, Receive]:
        """413 when the body exceeds max_body_bytes, 408 when it takes longer than
        body_timeout_seconds to arrive, 422 when a JSON body holds a lone surrogate; else a
        receive that replays the body."""
        settings = self.service.settings
        limit = settings.max_body_bytes
        too_large = _Reply(
            413,
            f"request body exceeds {limit} bytes",
            reason="body_too_large",
            headers={"Connection": "close"},
        )
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return too_large, receive  # refused before reading any of it
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + settings.body_timeout_seconds
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except TimeoutError:
                self.service.metrics.connection_closed("body_timeout")
                return _Reply(
                    408,
                    f"the request body did not arrive within {settings.body_timeout_seconds:g} s",
                    headers={"Connection": "close"},
                ), receive
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return too_large, receive
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if _is_json(headers.get("content-type")):
            field = lone_surrogate(body)
            if field is not None:
                why = f"{field} is not valid Unicode text: it holds a lone surrogate"
                return _Reply(422, why, param=field), receive
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: waits for http.disconnect

        return None, replay

    def _route(self, scope: Scope) -> str:
        """A route template for the metrics label (bounded: unknown paths are "other")."""
        route = scope.get("route")
        template = getattr(route, "path", None)
        if isinstance(template, str):
            return template
        path = scope["path"]
        return path if path in self.known_paths else "other"


def _is_json(content_type: str | None) -> bool:
    """A body FastAPI reads as JSON: no Content-Type, application/json or */*+json."""
    if not content_type:
        return True
    kind = content_type.split(";")[0].strip().lower()
    return kind == "application/json" or (
        kind.startswith("application/") and kind.endswith("+json")
    )


def logged_path(path: str) -> str:
    """The path as a log shows it: URL-quoted again (uvicorn decodes it), so that a %0a or an
    ESC a client sent stays text in the line."""
    return quote(path, safe="/:@!$&'()*+,;=~")


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


async def _send_error(
    send: Send, reply: _Reply, libre: bool = False, *, openai: bool = False
) -> None:
    """The middleware's own error answer, in the route's shape: LibreTranslate's, or attnserve's
    with 400 for an invalid request on the OpenAI routes."""
    status = 400 if reply.status == 422 and (libre or openai) else reply.status
    if libre:
        shape: dict[str, Any] = {"error": capped(reply.message)}
    else:
        shape = error_body(status, reply.message, param=reply.param)
    body = json.dumps(shape).encode()
    headers: list[Any] = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *((k.lower().encode(), v.encode()) for k, v in reply.headers.items()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
