"""What the middleware checks besides the API key and the limits, and the headers every answer
carries.

- Host (`HostPolicy`): a server on localhost answers only to the names of localhost, so a web
  page cannot reach it through a DNS-rebinding domain (a name that resolves to 127.0.0.1 after
  the page loaded): the browser sends that name as Host, and it is refused (421).
- Origin (`cross_origin`): a browser's state-changing request from another site is refused
  (403) unless its origin is among the CORS origins. Go's `http.CrossOriginProtection` is the
  model: the browser's own `Sec-Fetch-Site` decides where it is sent, else `Origin` against
  Host; a request with neither (curl, SDKs, servers) is no browser's and passes.
- Text (`lone_surrogate`): a JSON body holding a lone surrogate ("\\ud800") is not Unicode text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from attnserve.service.settings import is_loopback

# On every answer that does not set them itself. An API answer gets a CSP that allows nothing
# (a JSON body opened as a page runs no script); the page at / and /docs set their own.
SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"content-security-policy", b"default-src 'none'; frame-ancestors 'none'"),
)
# Requests that change nothing: never refused for their origin.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "*.localhost")
# A lone surrogate's JSON escape: a high one not followed by a low one, or a low one not
# preceded by a high one (a pair, as json.dumps writes an emoji, is valid text).
_SURROGATE_ESCAPE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)


def with_security_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """An answer's headers plus the SECURITY_HEADERS it does not set."""
    out = list(headers)
    present = {name.lower() for name, _ in out}
    out += [(name, value) for name, value in SECURITY_HEADERS if name not in present]
    return out


def host_name(host: str | None) -> str | None:
    """A Host header's name, lowercase, its port and a final dot left out ("[::1]:8000" ->
    "::1"); None for a header that is not one."""
    if host is None:
        return None
    host = host.strip().lower()
    if host.startswith("["):
        name, bracket, rest = host[1:].partition("]")
        if not bracket or (rest and not (rest[:1] == ":" and rest[1:].isdigit())):
            return None
    else:
        name, colon, port = host.rpartition(":")
        if not colon:
            name = host
        elif not port.isdigit() or ":" in name:
            return None
    name = name.removesuffix(".")
    return name or None


@dataclass(frozen=True)
class HostPolicy:
    """The Host names the server answers to (None: any)."""

    names: frozenset[str] | None
    suffixes: tuple[str, ...] = ()

    @classmethod
    def from_settings(cls, bind_host: str, allowed: Iterable[str]) -> HostPolicy:
        entries = [entry.strip().lower() for entry in allowed if entry.strip()]
        if not entries:
            if not is_loopback(bind_host):
                return cls(None)
            entries = [*LOOPBACK_NAMES, bind_host.strip("[]").lower()]
        if "*" in entries:
            return cls(None)
        names = frozenset(e.strip("[]").removesuffix(".") for e in entries if "*" not in e)
        suffixes = tuple(e[1:] for e in entries if e.startswith("*."))
        return cls(names, suffixes)

    def allows(self, host: str | None) -> bool:
        if self.names is None:
            return True
        name = host_name(host)
        if name is None:
            return False
        return name in self.names or any(name.endswith(s) for s in self.suffixes)

    def describe(self) -> str:
        if self.names is None:
            return "any"
        return ", ".join([*sorted(self.names), *(f"*{s}" for s in self.suffixes)])


def cross_origin(headers: Mapping[str, str], trusted: Iterable[str]) -> str | None:
    """The origin of a browser's request from another site (to refuse unless `trusted`: the
    CORS origins, "*" for all), else None. Safe methods are the caller's to skip."""
    origin = headers.get("origin")
    trusted = set(trusted)
    if "*" in trusted or (origin is not None and origin in trusted):
        return None
    site = headers.get("sec-fetch-site")
    if site is not None:  # the browser says where the request is from
        return None if site in ("same-origin", "none") else (origin or site)
    if origin is None:  # no browser sent it (or one too old to say: it sends Origin on POST)
        return None
    netloc = urlsplit(origin).netloc if origin != "null" else ""
    host = headers.get("host", "")
    return None if netloc and netloc.lower() == host.lower() else origin


def lone_surrogate(body: bytes) -> str | None:
    """The top-level field of a JSON body whose text holds a lone surrogate ("body" when the
    body is one such string); None when it has none, or is not JSON (the route says so)."""
    if _SURROGATE_ESCAPE.search(body) is None:  # no \\ud800-\\udfff escape: none
        return None
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[Any, str]] = [(parsed, "body")]
    while stack:  # no recursion: a body may nest deeply
        value, field = stack.pop()
        if isinstance(value, str):
            if not _is_unicode(value):
                return field
        elif isinstance(value, dict):
            for key, item in value.items():
                inner = key if field == "body" else field
                if not _is_unicode(key):
                    return inner if _is_unicode(inner) else "body"
                stack.append((item, inner))
        elif isinstance(value, list):
            stack.extend((item, field) for item in value)
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
