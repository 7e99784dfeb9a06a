"""The page for people: GET / and its files under /ui/ (attnserve/service/ui/), with a strict
Content-Security-Policy. No build step and nothing from another origin: plain HTML, CSS and
JavaScript modules.

The files are public and hold no data. The page reads and writes everything through the API
routes (/v1/server, /v1/generate, /v1/translate, /v1/chat/completions, /detect, /metrics) with
the API key the user types in, so the key, the limits and the metrics apply to it as to any
program. `Settings.ui` false (--no-ui, ATTNSERVE_UI=0) leaves these routes out.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import Response

from attnserve.service.errors import ApiError, shown

UI_DIR = Path(__file__).parent / "ui"
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
# Everything from this origin, no inline script or style, no frames around the page.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidated (ETag): a new version shows on the next load
}

router = APIRouter(include_in_schema=False)


@dataclass(frozen=True)
class StaticFile:
    body: bytes
    media_type: str
    etag: str

    @classmethod
    def of(cls, body: bytes, media_type: str) -> StaticFile:
        return cls(body, media_type, '"' + hashlib.sha256(body).hexdigest()[:16] + '"')


@functools.cache
def static_files() -> dict[str, StaticFile]:
    """The page's files by name, read once (the first request)."""
    files = {}
    for path in sorted(UI_DIR.iterdir()):
        media_type = MEDIA_TYPES.get(path.suffix)
        if media_type is None or not path.is_file():
            continue
        files[path.name] = StaticFile.of(path.read_bytes(), media_type)
    return files


def answer_file(
    files: dict[str, StaticFile], name: str, request: Request, headers: dict[str, str]
) -> Response:
    """The file `name` of `files` with `headers` and its ETag (304 when the client has it)."""
    found = files.get(name)
    if found is None:
        raise ApiError(404, f"no file {shown(name)}")
    headers = {**headers, "ETag": found.etag}
    if request.headers.get("if-none-match") == found.etag:
        return Response(status_code=304, headers=headers)
    return Response(found.body, media_type=found.media_type, headers=headers)


def _answer(name: str, request: Request) -> Response:
    return answer_file(static_files(), name, request, HEADERS)


@router.get("/")
async def page(request: Request) -> Response:
    return _answer("index.html", request)


@router.get("/ui/{name}")
async def asset(name: str, request: Request) -> Response:
    return _answer(name, request)
