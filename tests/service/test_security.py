"""Host allow-list (DNS rebinding), cross-site requests, security headers, the /docs page served
by the app, echoed names cut short, lone surrogates and unreadable bodies: 4xx JSON answers."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from attnserve.cli import build_parser
from attnserve.service.app import create_app
from attnserve.service.errors import ECHO_CHARS, MESSAGE_CHARS, capped, shown
from attnserve.service.launch import settings_from_args
from attnserve.service.security import HostPolicy, cross_origin, host_name, lone_surrogate
from attnserve.service.settings import Settings
from tests.service.helpers import LiveServer, make_settings, metric_value

KA = {"text": "ka", "target_lang": "de"}
EVIL = "https://evil.example"


# -- Host names ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("localhost:8000", "localhost"),
        ("LocalHost.", "localhost"),
        ("127.0.0.1", "127.0.0.1"),
        ("[::1]:8000", "::1"),
        ("[::1]", "::1"),
        ("api.example.com:443", "api.example.com"),
        ("[::1]x", None),
        ("a:b", None),
        ("::1", None),
        ("", None),
        (None, None),
    ],
)
def test_host_names(header: str | None, name: str | None) -> None:
    assert host_name(header) == name


def test_the_default_host_policy_follows_the_bind_address() -> None:
    loopback = HostPolicy.from_settings("127.0.0.1", [])
    for good in ("localhost:8000", "127.0.0.1:8000", "[::1]:8000", "app.localhost:8000"):
        assert loopback.allows(good), good
    for bad in ("rebind.attacker.example:8000", "127.0.0.1.nip.io", "0.0.0.0:8000", None):
        assert not loopback.allows(bad), bad
    assert HostPolicy.from_settings("::1", []).allows("[::1]:8000")
    assert HostPolicy.from_settings("127.0.0.2", []).allows("127.0.0.2")
    for public in ("0.0.0.0", "::", "10.1.2.3", "attnserve.internal"):
        assert HostPolicy.from_settings(public, []).allows("anything.example"), public
        assert HostPolicy.from_settings(public, []).describe() == "any"


def test_a_configured_host_list() -> None:
    policy = HostPolicy.from_settings("0.0.0.0", ["api.example.com", "*.corp.example", "[::1]"])
    assert policy.allows("api.example.com") and policy.allows("API.example.com:8443")
    assert policy.allows("x.corp.example") and policy.allows("a.b.corp.example")
    assert policy.allows("[::1]:80")
    assert not policy.allows("corp.example") and not policy.allows("localhost")
    assert HostPolicy.from_settings("127.0.0.1", ["*"]).allows("rebind.attacker.example")


# -- Origins ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "trusted", "refused"),
    [
        ({}, [], None),  # curl, SDKs: no browser
        ({"origin": EVIL, "sec-fetch-site": "cross-site"}, [], EVIL),
        ({"origin": EVIL, "sec-fetch-site": "same-site"}, [], EVIL),
        ({"origin": "http://a:1", "sec-fetch-site": "same-origin", "host": "b"}, [], None),
        ({"sec-fetch-site": "none"}, [], None),  # typed into the address bar
        ({"origin": EVIL, "sec-fetch-site": "cross-site"}, [EVIL], None),
        ({"origin": EVIL, "sec-fetch-site": "cross-site"}, ["*"], None),
        ({"origin": "http://127.0.0.1:8000", "host": "127.0.0.1:8000"}, [], None),  # old browser
        ({"origin": EVIL, "host": "127.0.0.1:8000"}, [], EVIL),
        ({"origin": "null", "host": "127.0.0.1:8000"}, [], "null"),
    ],
)
def test_cross_origin(headers: dict[str, str], trusted: list[str], refused: str | None) -> None:
    assert cross_origin(headers, trusted) == refused


# -- Lone surrogates -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"text": "ka"}', None),
        (b'{"text": "\\ud83d\\ude00"}', None),  # a pair: one emoji
        (b'{"text": "\\\\ud800"}', None),  # a backslash, then text
        (b'{"stop": "\\ud800"}', "stop"),
        (b'{"stop": ["a", "\\udfff"]}', "stop"),
        (b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages"),
        (b'{"extra": {"\\ud800": 1}}', "extra"),
        (b'{"\\ud800": 1}', "body"),
        (b'"\\ud800"', "body"),
        (b'{"text": "\\ud800', None),  # not JSON: the route says so
    ],
)
def test_lone_surrogates_are_found(body: bytes, field: str | None) -> None:
    assert lone_surrogate(body) == field


def test_echoed_values_are_cut() -> None:
    assert shown("nope") == "'nope'"
    long = shown("m" * 500_000)
    assert long.startswith("'" + "m" * ECHO_CHARS + "'...") and "500000 characters" in long
    assert len(capped("x" * 10 * MESSAGE_CHARS)) < MESSAGE_CHARS + 50


# -- Settings and flags ----------------------------------------------------------------------


def test_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    parse = build_parser().parse_args
    args = [
        "serve",
        "--model",
        "/m/a",
        "--allowed-hosts",
        "api.example.com, *.corp.example",
        "--header-timeout-seconds",
        "2.5",
        "--body-timeout-seconds",
        "7",
        "--keep-alive-seconds",
        "9",
        "--max-connections",
        "64",
        "--no-docs",
    ]
    settings = settings_from_args(parse(args))
    assert settings.allowed_hosts == ["api.example.com", "*.corp.example"]
    assert (settings.header_timeout_seconds, settings.body_timeout_seconds) == (2.5, 7.0)
    assert (settings.keep_alive_seconds, settings.max_connections) == (9, 64)
    assert settings.docs is False
    monkeypatch.setenv("ATTNSERVE_ALLOWED_HOSTS", "*")
    assert Settings(models=["/m/a"]).allowed_hosts == ["*"]
    defaults = Settings(models=["/m/a"], allowed_hosts=[])
    assert (defaults.header_timeout_seconds, defaults.body_timeout_seconds) == (10.0, 30.0)
    assert (defaults.keep_alive_seconds, defaults.max_connections, defaults.docs) == (5, 1000, True)


# -- Through a server ------------------------------------------------------------------------


def check_error(response: httpx.Response, status: int, kind: str, param: str | None = None) -> Any:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["type"] == kind and error["param"] == param, error
    return error


def test_a_rebinding_host_is_refused_and_probes_still_answer(live: LiveServer) -> None:
    port = live.url.rsplit(":", 1)[1]
    rebound = {"host": f"rebind.attacker.example:{port}"}
    before = metric_value(live.metrics(), "attnserve_rejected_total", reason="host_not_allowed")
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/")):
        answer = httpx.request(method, live.url + path, headers=rebound)
        error = check_error(answer, 421, "misdirected_request")
        assert "rebind.attacker.example" in error["message"]
    answer = httpx.post(live.url + "/v1/translate", json=KA, headers=rebound)
    check_error(answer, 421, "misdirected_request")
    for probe in ("/healthz", "/readyz"):
        assert httpx.get(live.url + probe, headers=rebound).status_code == 200
    for good in (f"localhost:{port}", f"127.0.0.1:{port}"):
        assert httpx.get(live.url + "/v1/models", headers={"host": good}).status_code == 200
    after = metric_value(live.metrics(), "attnserve_rejected_total", reason="host_not_allowed")
    assert after - before == 4


def test_a_cross_site_post_is_refused_and_api_clients_pass(live: LiveServer) -> None:
    cross = {"origin": EVIL, "sec-fetch-site": "cross-site"}
    error = check_error(
        httpx.post(live.url + "/v1/translate", json=KA, headers=cross), 403, "forbidden"
    )
    assert EVIL in error["message"]
    form = httpx.post(live.url + "/translate", data={"q": "ka", "target": "de"}, headers=cross)
    assert form.status_code == 403 and "error" in form.json()  # LibreTranslate's shape
    assert httpx.get(live.url + "/v1/models", headers=cross).status_code == 200  # reads pass
    same = {"origin": live.url, "sec-fetch-site": "same-origin"}
    assert httpx.post(live.url + "/v1/translate", json=KA, headers=same).status_code == 200
    assert httpx.post(live.url + "/v1/translate", json=KA).status_code == 200  # no Origin
    old_browser = {"origin": live.url}  # no Sec-Fetch-Site: Origin against Host
    assert httpx.post(live.url + "/v1/translate", json=KA, headers=old_browser).status_code == 200
    assert (
        metric_value(live.metrics(), "attnserve_rejected_total", reason="origin_not_allowed") >= 2
    )


def test_the_cors_origins_may_post(model_dir: Path) -> None:
    with LiveServer(make_settings(model_dir, cors_origins="https://app.example")) as server:
        app = {"origin": "https://app.example", "sec-fetch-site": "cross-site"}
        answer = httpx.post(server.url + "/v1/translate", json=KA, headers=app)
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == "https://app.example"
        assert answer.headers["x-content-type-options"] == "nosniff"
        other = {"origin": EVIL, "sec-fetch-site": "cross-site"}
        check_error(
            httpx.post(server.url + "/v1/translate", json=KA, headers=other), 403, "forbidden"
        )


def test_a_container_published_on_loopback_answers_to_localhost_names_only(
    model_dir: Path,
) -> None:
    """Bound to 0.0.0.0 (a container) with its port published on 127.0.0.1: the Host check is
    loopback's, so a rebinding page is refused though the server listens everywhere."""
    settings = make_settings(model_dir, host="0.0.0.0", published_host="127.0.0.1")
    with LiveServer(settings) as server:
        port = server.url.rsplit(":", 1)[1]
        rebound = {"host": f"rebind.attacker.example:{port}"}
        check_error(
            httpx.get(server.url + "/v1/models", headers=rebound), 421, "misdirected_request"
        )
        assert httpx.get(server.url + "/v1/models").status_code == 200
    policy = HostPolicy.from_settings(settings.exposed_host, settings.allowed_hosts)
    assert HostPolicy.from_settings("0.0.0.0", []).describe() == "any" != policy.describe()


def test_every_answer_carries_the_security_headers(live: LiveServer) -> None:
    port = live.url.rsplit(":", 1)[1]
    answers = [
        httpx.get(live.url + "/healthz"),
        httpx.get(live.url + "/metrics"),
        httpx.get(live.url + "/v1/models"),
        httpx.post(live.url + "/v1/translate", json=KA),
        httpx.post(live.url + "/v1/translate", json={"text": ""}),  # 422
        httpx.get(live.url + "/nothing"),  # 404
        httpx.get(live.url + "/v1/models", headers={"host": f"evil.example:{port}"}),  # 421
    ]
    for answer in answers:
        assert answer.headers["x-content-type-options"] == "nosniff", answer.url
        assert answer.headers["x-frame-options"] == "DENY"
        assert answer.headers["referrer-policy"] == "no-referrer"
        csp = answer.headers["content-security-policy"]
        assert csp == "default-src 'none'; frame-ancestors 'none'", answer.url
    page = httpx.get(live.url + "/")
    assert "script-src 'self'" in page.headers["content-security-policy"]  # the page's own
    assert page.headers["content-security-policy"].count("content-security-policy") == 0
    assert len(page.headers.get_list("content-security-policy")) == 1


def test_docs_are_served_by_the_app(live: LiveServer) -> None:
    page = httpx.get(live.url + "/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self';" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe-eval" not in csp and "script-src 'self' 'unsafe-inline'" not in csp
    html = page.text
    assert not re.search(r"https?://", html)  # nothing from another origin
    assert re.search(r"<script>", html) is None  # no inline script
    sources = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert sources[0] == "data:," and 'rel="icon"' in html  # no /favicon.ico request
    sources = sources[1:]
    assert sources == ["docs/swagger-ui.css", "docs/swagger-ui-bundle.js", "docs/init.js"]
    for source in sources:
        asset = httpx.get(f"{live.url}/{source}")
        assert asset.status_code == 200 and asset.content, source
        assert (
            httpx.get(
                f"{live.url}/{source}", headers={"if-none-match": asset.headers["etag"]}
            ).status_code
            == 304
        )
    assert b"SwaggerUIBundle" in httpx.get(live.url + "/docs/swagger-ui-bundle.js").content
    assert httpx.get(live.url + "/openapi.json").json()["info"]["title"] == "attnserve"
    assert httpx.get(live.url + "/docs/nothing.js").status_code == 404
    assert httpx.get(live.url + "/docs/index.html").status_code == 404
    assert httpx.get(live.url + "/redoc").status_code == 404  # it loads from a CDN: left out


def _paths(settings: Settings) -> set[str]:
    """The paths the app answers (its own routes and the included routers')."""
    app = create_app(settings)
    routes = [*app.routes]
    for route in app.routes:
        routes += getattr(getattr(route, "original_router", None), "routes", [])
    return {str(getattr(route, "path", "")) for route in routes}


def test_no_docs_leaves_the_schema_out() -> None:
    docs = {"/docs", "/docs/{name}", "/openapi.json"}
    assert docs <= _paths(Settings(models=["/m/a"]))
    assert not docs & _paths(Settings(models=["/m/a"], docs=False))


def test_long_names_are_not_echoed_whole(live: LiveServer) -> None:
    name = "m" * 60_000
    answer = httpx.post(live.url + "/v1/translate", json={**KA, "model": name})
    error = check_error(answer, 404, "model_not_found", "model")
    assert len(answer.content) < 2_000 and "60000 characters" in error["message"]
    answer = httpx.post(live.url + "/v1/translate", json={**KA, name: 1})
    error = check_error(answer, 422, "invalid_request", "m" * ECHO_CHARS + "...")
    assert len(answer.content) < 2_000 and "unknown field" in error["message"]
    answer = httpx.post(live.url + "/v1/chat/completions", json={"model": name, "messages": []})
    assert answer.status_code in (400, 404) and len(answer.content) < 2_000
    answer = httpx.post(live.url + "/translate", json={"q": "ka", "target": name, "source": "en"})
    assert answer.status_code == 400 and len(answer.content) < 2_000


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/generate", b'{"text": "ka", "target_lang": "de", "stop": "\\ud800"}', 422, "stop"),
        ("/v1/translate", b'{"text": ["ka", "\\udc00"], "target_lang": "de"}', 422, "text"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]}',
            400,
            "stop",
        ),
        ("/v1/completions", b'{"prompt": "ka", "stop": "\\udbff"}', 400, "stop"),
        ("/tokenize", b'{"prompt": "\\ud800"}', 400, "prompt"),
    ],
)
def test_a_lone_surrogate_is_refused_anywhere(
    live: LiveServer, path: str, body: bytes, status: int, param: str
) -> None:
    answer = httpx.post(live.url + path, content=body, headers={"content-type": "application/json"})
    error = check_error(answer, status, "invalid_request", param)
    assert "lone surrogate" in error["message"]


def test_a_surrogate_pair_is_text(live: LiveServer) -> None:
    body = json.dumps({**KA, "text": "ka \U0001f600"}, ensure_ascii=True).encode()
    assert b"\\ud83d\\ude00" in body
    answer = httpx.post(
        live.url + "/v1/translate", content=body, headers={"content-type": "application/json"}
    )
    assert answer.status_code == 200


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"[" * 30_000 + b"]" * 30_000, "nested too deeply"),
        (b'{"text": "\xff\xfe"}', "not UTF-8"),
        (b'{"text": "ka", "beam_size": %s}' % (b"9" * 5000), "too many digits"),
    ],
)
def test_unreadable_bodies_say_why(live: LiveServer, body: bytes, says: str) -> None:
    answer = httpx.post(
        live.url + "/v1/generate", content=body, headers={"content-type": "application/json"}
    )
    error = check_error(answer, 422, "invalid_request", "body")
    assert says in error["message"] and "number too long" not in error["message"]
