"""Error answers: every error is JSON `{"error": {"message", "type", "param", "code",
"request_id"}}`, OpenAI's shape with the request id beside.

On the OpenAI routes an invalid request is a 400 (the native routes answer 422), and a 500 or
504 carries `x-should-retry: false`: the openai client retries 5xx answers by default, and a
request that failed or ran out of time must not run again behind its caller's back.

What a client sent comes back in an error only cut short: a name it gave (`shown`) to
ECHO_CHARS characters, and a whole message to MESSAGE_CHARS, so a 500 KB model name does not
make a 1 MB answer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from attnserve.service.logs import request_id_var

# A client's value echoed in an error message: at most this many characters of it.
ECHO_CHARS = 64
# An error message: at most this many characters (its start, then how much was left out).
MESSAGE_CHARS = 1024

# Error types by HTTP status (the `type` field); routes may use a more specific one.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request",
    401: "unauthorized",
    404: "not_found",
    403: "forbidden",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "body_too_large",
    415: "unsupported_media_type",
    421: "misdirected_request",
    422: "invalid_request",
    429: "overloaded",
    500: "internal_error",
    503: "unavailable",
    504: "deadline_exceeded",
}


# The OpenAI-compatible routes (service/openai_api.py).
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
# vLLM's tokenizer routes (service/tokenization.py), answered as the OpenAI routes are.
TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"
TOKENIZER_PATHS = frozenset({TOKENIZE_PATH, DETOKENIZE_PATH})
OPENAI_PATHS = frozenset({CHAT_PATH, COMPLETIONS_PATH}) | TOKENIZER_PATHS
# The LibreTranslate-compatible routes (service/libretranslate.py): errors `{"error": "..."}`,
# 400 for an invalid request, the API key checked by the route (it may come in the body).
LIBRETRANSLATE_PATHS = frozenset({"/translate", "/detect", "/languages"})


def shown(value: object, limit: int = ECHO_CHARS) -> str:
    """A client's value for an error message: its repr, cut after `limit` characters."""
    text = str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def capped(message: str) -> str:
    """An error message of at most about MESSAGE_CHARS characters."""
    if len(message) <= MESSAGE_CHARS:
        return message
    return f"{message[:MESSAGE_CHARS]}... ({len(message) - MESSAGE_CHARS} more characters)"


class ApiError(Exception):
    """An error answer raised by a route (or a helper it calls)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or ERROR_TYPES.get(status, "error")
        self.headers = dict(headers or {})


def error_body(
    status: int, message: str, *, param: str | None = None, type: str | None = None
) -> dict[str, Any]:
    kind = type or ERROR_TYPES.get(status, "error")
    if param is not None and len(param) > ECHO_CHARS:  # a client's unknown field name
        param = param[:ECHO_CHARS] + "..."
    return {
        "error": {
            "message": capped(message),
            "type": kind,
            "param": param,
            "code": kind if status != 422 and status != 400 else None,
            "request_id": request_id_var.get(),
        }
    }


def error_response(error: ApiError, request: Request | None = None) -> JSONResponse:
    status, headers = error.status, dict(error.headers)
    if request is not None and request.url.path in LIBRETRANSLATE_PATHS:
        status = 400 if status == 422 else status
        return JSONResponse({"error": capped(error.message)}, status_code=status, headers=headers)
    param, kind = error.param, error.type
    native = None
    if request is not None and request.url.path in OPENAI_PATHS:
        if status == 422:
            status = 400
        if status in (500, 504):
            headers["x-should-retry"] = "false"
        native, param = param, OPENAI_PARAMS.get(param or "", param)
    message = error.message
    if native is not None and param != native:  # the client's own name in the message too
        message = re.sub(rf"\b{re.escape(native)}\b", str(param), message)
    body = error_body(status, message, param=param, type=kind)
    return JSONResponse(body, status_code=status, headers=headers)


# Native parameter names -> the OpenAI routes' names, for an error's `param`.
OPENAI_PARAMS = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "num_samples": "n",
    "num_hypotheses": "n",
    "beam_size": "best_of",
    "text": "prompt",
}


def _param(loc: Sequence[Any]) -> str | None:
    """("body", "beam_size") -> "beam_size"; ("body", "text", "list[str]", 3) -> "text";
    a body that may be one of several models: ("body", "TokenizeChatRequest", "messages") ->
    "messages" (field names are snake_case, the union's members are named by class)."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    while parts and isinstance(parts[0], str) and parts[0][:1].isupper():
        parts = parts[1:]
    if not parts or not isinstance(parts[0], str):
        return "body" if loc and loc[0] == "body" else None
    return parts[0]


def _describe(error: Mapping[str, Any]) -> str:
    if error.get("type") == "json_invalid":
        detail = (error.get("ctx") or {}).get("error", "")
        return f"request body is not valid JSON: {detail}".rstrip(": ")
    if tuple(error.get("loc", ())) == ("body",) and error.get("type") in (
        "model_attributes_type",
        "dict_type",
        "missing",
    ):
        return "the request body must be a JSON object (Content-Type: application/json)"
    if error.get("type") == "extra_forbidden":
        return f"unknown field {shown(_param(error.get('loc', ())) or '')}"
    param = _param(error.get("loc", ()))
    message = str(error.get("msg", "invalid value"))
    return f"{param}: {message}" if param and param != "body" else message


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    first = errors[0] if errors else {}
    message = "; ".join(dict.fromkeys(_describe(e) for e in errors[:3])) or "invalid request"
    if len(errors) > 3:
        message += f" (and {len(errors) - 3} more)"
    return error_response(ApiError(422, message, param=_param(first.get("loc", ()))), request)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    message = str(exc.detail)
    param = None
    if status == 400:
        # FastAPI's only 400: a body it could not decode. That is a client's invalid request
        # like any other: 422, as for malformed JSON.
        status, param = 422, "body"
        message = _unreadable(exc.__cause__)
    headers = dict(exc.headers or {})
    return error_response(ApiError(status, message, param=param, headers=headers), request)


def _unreadable(cause: BaseException | None) -> str:
    """Why FastAPI could not read a body: it raises its 400 from the parser's exception."""
    if isinstance(cause, UnicodeDecodeError):
        return "request body is not UTF-8"
    if isinstance(cause, RecursionError):
        return "request body is nested too deeply to read as JSON"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return "request body holds a number with too many digits"
    return "request body could not be read"


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc, request)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ApiError, _api_error)
