"""Structured logs: one JSON object per line (or a plain line), with the request id of the
request being served.

Whatever a client sent may end up in a log line (a path, a model name in a message), so both
formats escape the characters that could forge a line or act on a terminal: controls (C0, C1:
newlines, ESC), format characters (the bidi overrides and isolates such as U+202E, zero widths,
tag characters), line and paragraph separators and lone surrogates. JSON lines keep them as
`\\uXXXX` escapes (the value reads back unchanged); plain lines as Python's `\\x1b`, `\\u202e`.
"""

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
# Unicode's categories Cc, Cf, Cs, Zl and Zp, as of the unicodedata Python ships (a test
# compares this class with them): what a log line must not hold raw.
UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\xad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e"
    "\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\ud800-\udfff\ufeff\ufff9-\ufffb"
    "\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a"
    "\U000e0001\U000e0020-\U000e007f]"
)
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# LogRecord attributes that are not user-supplied `extra=` fields.
_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def new_request_id(supplied: str | None = None) -> str:
    """The client's X-Request-ID when it is a sane token, else a fresh random id."""
    if supplied and _VALID_ID.fullmatch(supplied):
        return supplied
    return uuid.uuid4().hex


def escape_text(text: str) -> str:
    """`text` with every UNSAFE character written as Python writes it in a repr."""
    return UNSAFE.sub(_python_escape, text)


def _python_escape(match: re.Match[str]) -> str:
    char = match.group()
    if char in _SHORT:
        return _SHORT[char]
    code = ord(char)
    return (
        f"\\x{code:02x}"
        if code < 0x100
        else f"\\u{code:04x}"
        if code < 0x10000
        else f"\\U{code:08x}"
    )


def _json_escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000  # a UTF-16 pair, as JSON writes characters outside the BMP
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


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
        # json.dumps escapes C0 controls only; the rest of UNSAFE is escaped here (JSON holds
        # no such character outside its strings, so every match lies inside one).
        return UNSAFE.sub(_json_escape, json.dumps(entry, default=str, ensure_ascii=False))


class PlainFormatter(logging.Formatter):
    """`time level logger [request id]: message`, one line a record: the message escaped;
    a traceback keeps its line breaks, each of its lines indented, so that every line that
    starts at the margin starts a record."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape_text(record.message)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:
        lines = super().formatException(ei).split("\n")
        return "\n".join("  " + escape_text(line) for line in lines)

    def formatStack(self, stack_info: str) -> str:
        return "\n".join("  " + escape_text(line) for line in stack_info.split("\n"))


def stderr_handler(json_lines: bool = True) -> logging.Handler:
    """A handler writing JSON lines (or plain lines) with the request id to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(PlainFormatter())
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
