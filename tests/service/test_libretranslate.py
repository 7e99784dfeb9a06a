"""LibreTranslate's API with its own Python client (libretranslatepy) and raw httpx calls."""

from __future__ import annotations

import urllib.error
from pathlib import Path
from typing import Any

import httpx
import pytest
from libretranslatepy import LibreTranslateAPI

from tests.service.helpers import LiveServer, make_settings, metric_value
from tests.service.test_api import post
from tests.service.test_documents import DOCUMENT, SENTENCES
from tests.text.test_markup import tags_of

ENGLISH = "The meeting has been moved to Tuesday afternoon. Could you send me the report?"


def native(server: LiveServer, text: Any, **fields: Any) -> list[str]:
    response = post(server, "/v1/translate", {"text": text, "target_lang": "de", **fields})
    assert response.status_code == 200, response.text
    return [t["text"] for t in response.json()["translations"]]


def test_the_client_translates_detects_and_lists(live: LiveServer) -> None:
    client = LibreTranslateAPI(live.url)
    assert client.translate(SENTENCES[0], "en", "de") == native(live, SENTENCES[0])[0]
    assert client.translate(DOCUMENT, "en", "de") == native(live, DOCUMENT)[0]
    assert client.translate(ENGLISH, "auto", "de") == native(live, ENGLISH)[0]
    detected = client.detect(ENGLISH)
    assert detected[0]["language"] == "en" and 50 < detected[0]["confidence"] <= 100
    assert client.languages() == [{"code": "en", "name": "English", "targets": ["de", "nl"]}]


def test_json_bodies_lists_html_and_alternatives(live: LiveServer) -> None:
    url = live.url
    texts = [ENGLISH, "Where is the station? I am looking for a pharmacy nearby."]
    body = {"q": texts, "source": "auto", "target": "de"}
    answer = httpx.post(f"{url}/translate", json=body, timeout=60).json()
    assert answer["translatedText"] == native(live, texts)
    assert answer["detectedLanguage"][1] == {
        "confidence": pytest.approx(answer["detectedLanguage"][1]["confidence"]),
        "language": "en",
    }
    html = f'<p class="x">{SENTENCES[1]} <i>{SENTENCES[2]}</i></p>'
    body = {"q": html, "source": "en", "target": "de", "format": "html"}
    answer = httpx.post(f"{url}/translate", json=body, timeout=60).json()
    assert tags_of(answer["translatedText"]) == tags_of(html)
    assert "detectedLanguage" not in answer
    body = {"q": SENTENCES[3], "source": "en", "target": "de", "alternatives": 2}
    response = httpx.post(f"{url}/translate", data=body, timeout=60)  # a form
    assert response.status_code == 200, response.text
    answer = response.json()
    assert len(answer["alternatives"]) == 2
    assert answer["translatedText"] not in answer["alternatives"]


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"source": "en", "target": "de"}, 400, "missing q"),
        ({"q": "hello", "source": "en"}, 400, "missing target"),
        ({"q": "hello", "source": "en", "target": "fr"}, 400, "'fr'"),
        ({"q": "   ", "source": "en", "target": "de"}, 400, "empty"),
        ({"q": "<div>x", "source": "en", "target": "de", "format": "html"}, 400, "never closed"),
        ({"q": "hi", "source": "en", "target": "de", "format": "pdf"}, 400, "format"),
        ({"q": "hi", "source": "en", "target": "de", "alternatives": "x"}, 400, "alternatives"),
        ({"q": 3, "source": "en", "target": "de"}, 400, "q must be"),
        (
            {"q": "Der Zug nach Berlin fällt heute aus.", "source": "auto", "target": "de"},
            400,
            "'de'",
        ),
    ],
)
def test_errors_are_libretranslates(
    live: LiveServer, body: dict[str, Any], status: int, words: str
) -> None:
    response = httpx.post(f"{live.url}/translate", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error, str) and words in error


def test_requests_are_counted_in_the_metrics(live: LiveServer) -> None:
    before = metric_value(
        live.metrics(), "attnserve_requests_total", route="/translate", status="200"
    )
    LibreTranslateAPI(live.url).translate(SENTENCES[4], "en", "de")
    after = metric_value(
        live.metrics(), "attnserve_requests_total", route="/translate", status="200"
    )
    assert after == before + 1


def test_api_key(model_dir: Path) -> None:
    with LiveServer(make_settings(model_dir, api_key="s3cret")) as server:
        with pytest.raises(urllib.error.HTTPError) as refused:
            LibreTranslateAPI(server.url).translate(SENTENCES[0], "en", "de")
        assert refused.value.code == 403
        wrong = LibreTranslateAPI(server.url, api_key="nope")
        with pytest.raises(urllib.error.HTTPError) as refused:
            wrong.detect(ENGLISH)
        assert refused.value.code == 403
        keyed = LibreTranslateAPI(server.url, api_key="s3cret")
        assert keyed.translate(SENTENCES[0], "en", "de")
        assert keyed.detect(ENGLISH)[0]["language"] == "en"
        bearer = {"Authorization": "Bearer s3cret"}
        body = {"q": SENTENCES[0], "source": "en", "target": "de"}
        response = httpx.post(f"{server.url}/translate", json=body, headers=bearer, timeout=30)
        assert response.status_code == 200
        surrogate = '{"q": "Hi", "source": "en", "target": "de", "api_key": "\\ud800"}'
        response = httpx.post(
            f"{server.url}/translate", content=surrogate,
            headers={"content-type": "application/json"}, timeout=30,
        )  # fmt: skip
        # not Unicode text: refused (400, LibreTranslate's shape) before the key is compared
        assert response.status_code == 400 and "lone surrogate" in response.json()["error"]
        # the native routes keep their 401 and their error shape
        assert httpx.post(f"{server.url}/v1/translate", json={"text": "x"}).status_code == 401


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ('{"q": "Hello", "source": "en", "target": "de", "alternatives": 1e999}', "alternatives"),
        ('{"q": "Hello", "source": "en", "target": "de", "alternatives": true}', "alternatives"),
        ("[" * 30_000 + "]" * 30_000, "not JSON"),
        ('{"q": "Hello", "source": "en", "target": "' + "x" * 60_000 + '"}', "longer than"),
    ],
)
def test_odd_bodies_are_400s(live: LiveServer, body: str, words: str) -> None:
    headers = {"content-type": "application/json"}
    response = httpx.post(f"{live.url}/translate", content=body, headers=headers, timeout=30)
    assert response.status_code == 400, response.text[:200]
    assert words in response.json()["error"] and len(response.text) < 1000
