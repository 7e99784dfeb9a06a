"""The OpenAPI page at /docs: Swagger UI from the swagger-ui-bundle-v2 package, served by the app
itself (nothing from another origin), with a Content-Security-Policy.

FastAPI's own page loads Swagger UI from a CDN and starts it with an inline script; this one
starts it from /docs/init.js, so its policy allows scripts from this origin only. Swagger UI
styles its elements inline and draws icons as data: URLs, which the policy allows. `Settings.docs`
false (--no-docs) leaves these routes and /openapi.json out.
"""

from __future__ import annotations

import functools
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import Response

from attnserve.service.ui import StaticFile, answer_file

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
HEADERS = {"Content-Security-Policy": CSP, "Cache-Control": "no-cache"}

# URLs relative to /docs, so that the page works under a proxy's path prefix too.
PAGE = b"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>attnserve API</title>
<link rel="icon" href="data:,">
<link rel="stylesheet" href="docs/swagger-ui.css">
</head>
<body>
<div id="swagger-ui"></div>
<script src="docs/swagger-ui-bundle.js"></script>
<script src="docs/init.js"></script>
</body>
</html>
"""
# FastAPI's Swagger UI settings.
INIT = b"""window.ui = SwaggerUIBundle({
  url: "openapi.json",
  dom_id: "#swagger-ui",
  layout: "BaseLayout",
  deepLinking: true,
  showExtensions: true,
  showCommonExtensions: true,
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
});
"""
ASSETS = ("swagger-ui-bundle.js", "swagger-ui.css")
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}

router = APIRouter(include_in_schema=False)


def swagger_ui_dir() -> Path:
    from swagger_ui_bundle import swagger_ui_path

    return Path(str(swagger_ui_path))


@functools.cache
def docs_files() -> dict[str, StaticFile]:
    """The page, its start-up script and Swagger UI's files, read once (the first request)."""
    contents = {"index.html": PAGE, "init.js": INIT}
    for name in ASSETS:
        contents[name] = (swagger_ui_dir() / name).read_bytes()
    return {
        name: StaticFile.of(body, MEDIA_TYPES[Path(name).suffix]) for name, body in contents.items()
    }


def _answer(name: str, request: Request) -> Response:
    return answer_file(docs_files(), name, request, HEADERS)


@router.get("/docs")
async def page(request: Request) -> Response:
    return _answer("index.html", request)


@router.get("/docs/{name}")
async def asset(name: str, request: Request) -> Response:
    return _answer("" if name == "index.html" else name, request)
