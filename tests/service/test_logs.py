"""Log lines cannot be forged or act on a terminal: both formats escape controls, bidi and other
format characters, and the access log shows the path URL-quoted."""

from __future__ import annotations

import json
import logging
import sys
import time
import unicodedata

import httpx
import pytest

from attnserve.service.logs import UNSAFE, JsonFormatter, PlainFormatter, escape_text
from tests.service.helpers import LiveServer

HOSTILE = "ok\n2030-01-01 INFO forged\r\x1b[31mred\x85 \u202eevil\u2028 \ud800 \U000e0041 \x00"
UNSAFE_CATEGORIES = {"Cc", "Cf", "Cs", "Zl", "Zp"}


def record(message: str, **extra: object) -> logging.LogRecord:
    made = logging.LogRecord("attnserve.test", logging.INFO, __file__, 1, message, None, None)
    made.request_id = "rid"
    for key, value in extra.items():
        setattr(made, key, value)
    return made


def raw_unsafe(line: str) -> list[str]:
    return [f"U+{ord(c):04X}" for c in line if unicodedata.category(c) in UNSAFE_CATEGORIES]


def test_the_unsafe_class_holds_every_control_and_format_character() -> None:
    for code in range(sys.maxunicode + 1):
        char = chr(code)
        category = unicodedata.category(char)
        matched = UNSAFE.match(char) is not None
        if category in UNSAFE_CATEGORIES:
            assert matched, f"U+{code:04X} ({category}) is not escaped"
        elif matched:  # beyond them only code points this Python's Unicode leaves unassigned
            assert category == "Cn", f"U+{code:04X} ({category}) is escaped"


def test_json_lines_escape_and_read_back_unchanged() -> None:
    line = JsonFormatter().format(record(HOSTILE, model=HOSTILE))
    assert "\n" not in line and raw_unsafe(line) == []
    entry = json.loads(line)
    assert entry["message"] == HOSTILE and entry["model"] == HOSTILE
    line.encode("utf-8")  # no lone surrogate left to break the stream's encoder


def test_plain_lines_escape_the_message() -> None:
    line = PlainFormatter().format(record(HOSTILE))
    assert line.count("\n") == 0 and raw_unsafe(line) == []
    assert "ok\\n2030-01-01 INFO forged\\r\\x1b[31mred\\x85 \\u202eevil\\u2028" in line
    assert "\\ud800 \\U000e0041 \\x00" in line
    assert escape_text("plain text, ümlauts, 漢字 and emoji 🙂") == (
        "plain text, ümlauts, 漢字 and emoji 🙂"
    )


def test_plain_tracebacks_stay_indented_under_their_record() -> None:
    try:
        raise ValueError("bad\nINFO forged \x1b[2J")
    except ValueError:
        made = record("failed")
        made.exc_info = sys.exc_info()
    lines = PlainFormatter().format(made).split("\n")
    assert "[rid]: failed" in lines[0]
    assert all(line.startswith("  ") for line in lines[1:]) and len(lines) > 2
    assert raw_unsafe("".join(lines)) == []


def access_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    found = [r.getMessage() for r in caplog.records if r.name == "attnserve.access"]
    return [line for line in found if line.startswith("GET /x")]


def test_the_access_log_quotes_the_path(live: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="attnserve.access"):
        answer = httpx.get(live.url + "/x%0a2030-01-01%20INFO%20forged%1b[2J%E2%80%AE%C3%BC")
        assert answer.status_code == 404
        end = time.monotonic() + 10  # the line is written once the answer has been sent
        while not (lines := access_lines(caplog)) and time.monotonic() < end:
            time.sleep(0.01)
    line = lines[0]
    assert line.startswith("GET /x%0A2030-01-01%20INFO%20forged%1B%5B2J%E2%80%AE%C3%BC 404")
    assert raw_unsafe(line) == []
