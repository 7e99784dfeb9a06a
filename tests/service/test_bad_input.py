"""Bad input: every case gets its 4xx JSON error naming the param, never a 5xx."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.service.conftest import MAX_BEAM, MAX_BODY, MAX_TEXTS, MAX_TIMEOUT_MS
from tests.service.helpers import LiveServer

KA = {"text": "ka", "target_lang": "de"}  # a short request the tiny model serves

LONG = " ".join(["kamaru tesino"] * 60)  # well over the model's 64 positions

# (name, path, JSON body, status, param)
JSON_CASES: list[tuple[str, str, Any, int, str | None]] = [
    ("empty text", "/v1/translate", {"text": ""}, 422, "text"),
    ("blank text", "/v1/translate", {"text": "  \n "}, 422, "text"),
    ("empty list", "/v1/translate", {"text": []}, 422, "text"),
    ("empty item", "/v1/translate", {"text": ["ka", ""]}, 422, "text"),
    ("too many texts", "/v1/translate", {"text": ["ka"] * (MAX_TEXTS + 1)}, 422, "text"),
    (
        "too long unsplit",
        "/v1/translate",
        {"text": LONG, "target_lang": "de", "split_sentences": False},
        422,
        "text",
    ),
    (
        "too long in a list",
        "/v1/translate",
        {"text": ["ka", LONG], "target_lang": "de", "split_sentences": False},
        422,
        "text",
    ),
    ("text is a number", "/v1/translate", {"text": 5}, 422, "text"),
    ("text list of numbers", "/v1/translate", {"text": [1, 2]}, 422, "text"),
    ("no text", "/v1/translate", {"beam_size": 2}, 422, "text"),
    ("no target_lang, multi-target model", "/v1/translate", {"text": "ka"}, 422, "target_lang"),
    ("unknown language token typed", "/v1/translate", {"text": ">>xx<< ka"}, 422, "text"),
    ("beam_size a string", "/v1/translate", {"text": "ka", "beam_size": "4"}, 422, "beam_size"),
    ("beam_size a float", "/v1/translate", {"text": "ka", "beam_size": 2.5}, 422, "beam_size"),
    ("beam_size 0", "/v1/translate", {"text": "ka", "beam_size": 0}, 422, "beam_size"),
    (
        "beam_size too large",
        "/v1/translate",
        {"text": "ka", "beam_size": MAX_BEAM + 1},
        422,
        "beam_size",
    ),
    ("beam_size huge", "/v1/generate", {"text": "ka", "beam_size": 10**9}, 422, "beam_size"),
    (
        "n-best > beam",
        "/v1/translate",
        {"text": "ka", "beam_size": 2, "num_hypotheses": 3},
        422,
        "num_hypotheses",
    ),
    (
        "max_new_tokens 0",
        "/v1/translate",
        {"text": "ka", "max_new_tokens": 0},
        422,
        "max_new_tokens",
    ),
    (
        "max_new_tokens too many",
        "/v1/generate",
        {"text": "ka", "max_new_tokens": 10_000},
        422,
        "max_new_tokens",
    ),
    (
        "min > max new tokens",
        "/v1/generate",
        {"text": "ka", "min_new_tokens": 9, "max_new_tokens": 3},
        422,
        "min_new_tokens",
    ),
    (
        "temperature 0 sampling",
        "/v1/generate",
        {"text": "ka", "sampling": True, "temperature": 0},
        422,
        "temperature",
    ),
    (
        "temperature < 0 sampling",
        "/v1/generate",
        {"text": "ka", "sampling": True, "temperature": -1.0},
        422,
        "temperature",
    ),
    ("top_p 0", "/v1/generate", {"text": "ka", "sampling": True, "top_p": 0.0}, 422, "top_p"),
    ("top_p > 1", "/v1/generate", {"text": "ka", "sampling": True, "top_p": 1.5}, 422, "top_p"),
    ("top_k < 0", "/v1/generate", {"text": "ka", "top_k": -1}, 422, "top_k"),
    ("seed < 0", "/v1/generate", {"text": "ka", "sampling": True, "seed": -1}, 422, "seed"),
    (
        "repetition_penalty 0",
        "/v1/generate",
        {"text": "ka", "repetition_penalty": 0},
        422,
        "repetition_penalty",
    ),
    (
        "sampling with beams",
        "/v1/generate",
        {"text": "ka", "sampling": True, "beam_size": 2},
        422,
        "beam_size",
    ),
    ("stream a list", "/v1/generate", {"text": ["ka", "ki"], "stream": True}, 422, "stream"),
    (
        "stream with beams",
        "/v1/generate",
        {"text": "ka", "stream": True, "beam_size": 2},
        422,
        "beam_size",
    ),
    ("sampling on translate", "/v1/translate", {"text": "ka", "sampling": True}, 422, "sampling"),
    ("unknown field", "/v1/translate", {"text": "ka", "beam": 2}, 422, "beam"),
    ("timeout 0", "/v1/translate", {"text": "ka", "timeout_ms": 0}, 422, "timeout_ms"),
    (
        "timeout over max",
        "/v1/translate",
        {"text": "ka", "timeout_ms": MAX_TIMEOUT_MS + 1},
        422,
        "timeout_ms",
    ),
    (
        "length_penalty out of range",
        "/v1/translate",
        {"text": "ka", "length_penalty": 11},
        422,
        "length_penalty",
    ),
    (
        "unknown target language",
        "/v1/translate",
        {"text": "ka", "target_lang": "xx"},
        422,
        "target_lang",
    ),
    (
        "wrong source language",
        "/v1/translate",
        {"text": "ka", "source_lang": "fr"},
        422,
        "source_lang",
    ),
    ("body is a list", "/v1/translate", ["ka"], 422, "body"),
    ("body is a string", "/v1/translate", "ka", 422, "body"),
    ("body is null", "/v1/generate", None, 422, "body"),
    ("unknown model", "/v1/translate", {"text": "ka", "model": "nope"}, 404, "model"),
]

# (name, raw body, content type, status, param)
RAW_CASES: list[tuple[str, bytes, str | None, int, str | None]] = [
    ("lone surrogate", b'{"text": "\\ud800"}', "application/json", 422, "text"),
    ("lone surrogate in a list", b'{"text": ["ka", "\\udfff"]}', "application/json", 422, "text"),
    (
        "lone surrogate, stream",
        b'{"text": "\\ud800", "stream": true}',
        "application/json",
        422,
        "text",
    ),
    (
        "surrogate target_lang",
        b'{"text": "ka", "target_lang": "\\ud800"}',
        "application/json",
        422,
        "target_lang",
    ),
    ("malformed JSON", b'{"text": "ka",', "application/json", 422, "body"),
    ("not UTF-8", b'{"text": "\xff\xfe\xfa"}', "application/json", 422, "body"),
    ("a 5000-digit number", b'{"text": "ka", "beam_size": %s}' % (b"9" * 5000), None, 422, "body"),
    ("NaN", b'{"text": "ka", "length_penalty": NaN}', "application/json", 422, "length_penalty"),
    ("Infinity", b'{"text": "ka", "top_p": Infinity}', "application/json", 422, "top_p"),
    ("empty body", b"", "application/json", 422, "body"),
    ("text/plain body", b"ka", "text/plain", 422, "body"),
    ("deeply nested", b"[" * 30_000 + b"]" * 30_000, "application/json", 422, "body"),
    ("oversized", b'{"text": "' + b"k" * MAX_BODY + b'"}', "application/json", 413, None),
]


def check_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"type", "message", "param", "code", "request_id"}
    assert error["message"] and error["type"]
    assert error["param"] == param, error


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [case[1:] for case in JSON_CASES],
    ids=[case[0] for case in JSON_CASES],
)
def test_json_bad_input(live: LiveServer, path: str, body: Any, status: int, param: str) -> None:
    response = httpx.post(live.url + path, json=body, timeout=30)
    check_error(response, status, param)


@pytest.mark.parametrize(
    ("content", "content_type", "status", "param"),
    [case[1:] for case in RAW_CASES],
    ids=[case[0] for case in RAW_CASES],
)
def test_raw_bad_input(
    live: LiveServer, content: bytes, content_type: str | None, status: int, param: str | None
) -> None:
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(live.url + "/v1/generate", content=content, headers=headers, timeout=30)
    check_error(response, status, param)


def test_oversized_chunked_body_is_refused_while_reading(live: LiveServer) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"text": "'
        for _ in range(2 * MAX_BODY // 1024):
            yield b"k" * 1024
        yield b'"}'

    response = httpx.post(live.url + "/v1/translate", content=chunks(), timeout=30)
    check_error(response, 413, None)


def test_oversized_content_length_is_refused_before_the_body_arrives(live: LiveServer) -> None:
    """The server answers 413 from the headers alone: no body byte is ever sent."""
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000000\r\n\r\n"
        )
        started = time.monotonic()
        received = b""
        while chunk := sock.recv(4096):  # the server closes the connection after its 413
            received += chunk
    answer = received.decode("latin-1")
    assert answer.startswith("HTTP/1.1 413"), answer
    assert time.monotonic() - started < 5
    body = json.loads(answer.split("\r\n\r\n", 1)[1])
    assert body["error"]["type"] == "body_too_large"


def test_unknown_path_and_method(live: LiveServer) -> None:
    check_error(httpx.get(live.url + "/v1/nothing"), 404, None)
    check_error(httpx.get(live.url + "/v1/translate"), 405, None)


def test_the_server_still_serves_after_the_matrix(live: LiveServer) -> None:
    response = httpx.post(live.url + "/v1/translate", json=KA, timeout=30)
    assert response.status_code == 200
    assert "attnserve_requests_total" in live.metrics()
    assert 'status="500"' not in live.metrics()
