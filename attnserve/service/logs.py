"""Structured logs: one JSON object per line, with the request id of the request being served."""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time
import uuid
from typing import Any

# The id of the request the current task serves (set by the request middleware).
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "attnserve_request_id", default=None
)

_VALID_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
# LogRecord attributes that are not user-supplied `extra=` fields.
_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def new_request_id(supplied: str | None = None) -> str:
    """The client's X-Request-ID when it is a sane token, else a fresh random id."""
    if supplied and _VALID_ID.fullmatch(supplied):
        return supplied
    return uuid.uuid4().hex


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to every record logged while a request is served."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    """{"ts", "level", "logger", "message", "request_id", ...extra fields, "exc_info"?}"""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RESERVED and key != "color_message" and value is not None:
                entry[key] = value
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def stderr_handler(json_lines: bool = True) -> logging.Handler:
    """A handler writing JSON lines (or plain lines) with the request id to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s")
        )
    return handler


def configure_logging(level: str = "info", json_lines: bool = True) -> None:
    """Root logging for the server process (uvicorn's loggers included)."""
    handler = stderr_handler(json_lines)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        uv = logging.getLogger(name)
        uv.handlers.clear()
        uv.propagate = True
    # Our middleware logs every request with its id; uvicorn's access log would repeat it.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
