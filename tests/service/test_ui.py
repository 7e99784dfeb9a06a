"""The page's routes without a browser: its files and their Content-Security-Policy, what they
may load, GET /v1/server, the API key, --no-ui (the browser tests: test_ui_browser.py)."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import httpx
import pytest

from attnserve.cli import build_parser
from attnserve.service.app import create_app
from attnserve.service.launch import settings_from_args
from attnserve.service.settings import Settings
from attnserve.service.ui import CSP, UI_DIR, static_files
from tests.service.conftest import MAX_BODY
from tests.service.helpers import LiveServer, make_settings, wait_for_metric

ROOT = Path(__file__).resolve().parents[2]
KEY = "page-key"


def _directives(csp: str) -> dict[str, list[str]]:
    return {
        name: values for name, *values in (part.split() for part in csp.split(";") if part.strip())
    }


def test_the_page_and_every_file_carry_a_strict_csp(live: LiveServer) -> None:
    names = sorted(static_files())
    assert {"index.html", "app.js", "style.css"} <= set(names)
    for path in ["/", *(f"/ui/{name}" for name in names)]:
        answer = httpx.get(live.url + path)
        assert answer.status_code == 200, path
        assert answer.headers["content-security-policy"] == CSP
        assert answer.headers["x-content-type-options"] == "nosniff"
        expected = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
        suffix = Path(path).suffix or ".html"
        assert answer.headers["content-type"].startswith(expected.get(suffix, "image/svg+xml"))
    policy = _directives(CSP)
    assert policy["default-src"] == ["'self'"] and policy["frame-ancestors"] == ["'none'"]
    for directive in ("script-src", "style-src", "connect-src", "img-src"):
        assert policy[directive] == ["'self'"], directive  # no 'unsafe-inline', no other origin


def test_the_files_load_nothing_from_elsewhere_and_nothing_inline() -> None:
    html = (UI_DIR / "index.html").read_text()
    assert "<style" not in html and not re.search(r"\sstyle=", html)
    assert not re.search(r"\son[a-z]+=", html)  # no inline event handlers
    scripts = re.findall(r"<script([^>]*)>(.*?)</script>", html, flags=re.S)
    assert scripts and all('src="ui/' in attrs and not body.strip() for attrs, body in scripts)
    # relative: a proxy may serve the page under a prefix
    references = re.findall(r'(?:src|href)="([^"#]+)"', html)
    assert references and not [r for r in references if r.startswith(("/", "http:", "https:"))]
    for reference in references:
        if reference.startswith("ui/"):
            assert (UI_DIR / reference.removeprefix("ui/")).is_file(), reference
    for path in UI_DIR.iterdir():
        text = path.read_text().replace('xmlns="http://www.w3.org/2000/svg"', "")
        assert not re.search(r"https?://|url\(\s*['\"]?//", text), path.name
        if path.suffix == ".js":
            assert "innerHTML" not in text and "eval(" not in text, path.name
            for module in re.findall(r'from "\./([^"]+)"', text):
                assert (UI_DIR / module).is_file(), f"{path.name} imports {module}"


def test_files_revalidate_and_unknown_ones_are_404(live: LiveServer) -> None:
    first = httpx.get(live.url + "/ui/app.js")
    again = httpx.get(live.url + "/ui/app.js", headers={"If-None-Match": first.headers["etag"]})
    assert again.status_code == 304 and again.content == b""
    assert httpx.get(live.url + "/ui/missing.js").status_code == 404
    assert httpx.get(live.url + "/ui/../settings.py").status_code == 404


def test_server_info(live: LiveServer, model_dir: Path) -> None:
    info = httpx.get(live.url + "/v1/server").json()
    (model,) = info["models"]
    assert model["name"] == model_dir.name and model["kind"] == "translation"
    assert model["default"] is True and model["threads"] == 1
    assert model["context_length"] == 64 and model["variant"] == "fp32"
    assert model["source_languages"] == ["en"] and model["target_languages"] == ["de", "nl"]
    assert info["languages"] == {"de": "German", "en": "English", "nl": "Dutch"}
    assert info["limits"]["max_body_bytes"] == MAX_BODY and info["phase"] == "ready"


def test_the_page_is_public_and_its_data_needs_the_key(model_dir: Path) -> None:
    with LiveServer(make_settings(model_dir, api_key=KEY)) as server:
        assert httpx.get(server.url + "/").status_code == 200
        assert httpx.get(server.url + "/ui/app.js").status_code == 200
        refused = httpx.get(server.url + "/v1/server")
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "unauthorized"
        given = httpx.get(server.url + "/v1/server", headers={"Authorization": f"Bearer {KEY}"})
        assert given.status_code == 200 and given.json()["models"][0]["name"] == model_dir.name
        # counted under their routes, the refusal too (the middleware answered it)
        for route, status in (("/v1/server", "401"), ("/v1/server", "200"), ("/", "200")):
            total = "attnserve_requests_total"
            assert wait_for_metric(server, total, 1, route=route, status=status) == 1


def _paths(settings: Settings) -> set[str]:
    """The paths the app answers (routes is the app's own and the included routers')."""
    app = create_app(settings)
    routes = [*app.routes]
    for route in app.routes:
        routes += getattr(getattr(route, "original_router", None), "routes", [])
    return {str(getattr(route, "path", "")) for route in routes}


def test_no_ui_leaves_the_page_out(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings(models=["/m/a"]).ui is True
    monkeypatch.setenv("ATTNSERVE_UI", "0")
    assert Settings(models=["/m/a"]).ui is False
    monkeypatch.delenv("ATTNSERVE_UI")
    parse = build_parser().parse_args
    assert settings_from_args(parse(["serve", "--model", "/m/a", "--no-ui"])).ui is False
    assert settings_from_args(parse(["serve", "--model", "/m/a"])).ui is True
    with_page = _paths(Settings(models=["/m/a"]))
    without = _paths(Settings(models=["/m/a"], ui=False))
    assert {"/", "/ui/{name}"} <= with_page and not {"/", "/ui/{name}"} & without
    assert "/v1/server" in without  # an API route, not the page's


def test_the_package_ships_every_file_of_the_page() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["attnserve.service"]
    for path in UI_DIR.iterdir():
        name = f"ui/{path.name}"
        assert any(fnmatch.fnmatch(name, p) for p in patterns), f"{name} is not package data"
