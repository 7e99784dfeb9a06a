"""Tool calls read from answers in each syntax (hermes, llama3_json, mistral): whole answers
and the same answers streamed in pieces of every size, parallel calls, calls cut short, and
answers that only look like calls."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from attnserve.service.tool_parsers import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    ArgumentsDelta,
    CallStart,
    ToolCallParser,
    ToolSyntax,
    detect_syntax,
    new_call_id,
    parse_tool_calls,
)

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}'


def ids() -> Any:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def streamed(text: str, syntax: ToolSyntax, size: int, **kwargs: Any) -> dict[str, Any]:
    """What a client reassembles from the answer fed `size` characters at a time."""
    parser = ToolCallParser(syntax, ids(), **kwargs)
    events = []
    for i in range(0, len(text), size):
        events += parser.feed(text[i : i + size])
    events += parser.finish()
    calls: dict[int, dict[str, str]] = {}
    for event in events:
        if isinstance(event, CallStart):
            assert event.index == len(calls)
            calls[event.index] = {"id": event.id, "name": event.name, "arguments": ""}
        elif isinstance(event, ArgumentsDelta):
            calls[event.index]["arguments"] += event.text
    content = "".join(e for e in events if isinstance(e, str))
    return {"content": content, "calls": list(calls.values())}


def whole(text: str, syntax: ToolSyntax, **kwargs: Any) -> dict[str, Any]:
    answer = parse_tool_calls(text, syntax, ids(), **kwargs)
    calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in answer.calls]
    return {"content": answer.content, "calls": calls}


def check(text: str, syntax: ToolSyntax, content: str | None, calls: list[tuple[str, Any]]) -> None:
    """The whole answer parses to `content` and `calls` ((name, arguments) pairs, arguments
    equal as JSON), and every streaming of it gives the same."""
    answer = whole(text, syntax)
    assert answer["content"] == content
    assert [(c["name"], json.loads(c["arguments"])) for c in answer["calls"]] == calls
    for size in (1, 2, 3, 5, 8, len(text) or 1):
        got = streamed(text, syntax, size)
        assert got["calls"] == answer["calls"], size
        assert got["content"] == (content or ""), size


PARIS = {"city": "Paris", "unit": "celsius"}
ANY_ZONE = {"zone": "Europe/Paris"}


def test_hermes_calls_with_text_before() -> None:
    text = f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>"
    check(text, HERMES, "Let me look.", [("get_weather", PARIS)])
    assert whole(text, HERMES)["calls"][0]["arguments"] == json.dumps(PARIS)


def test_hermes_parallel_calls() -> None:
    text = f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\n"
    check(text, HERMES, None, [("get_weather", PARIS), ("get_time", {"zone": "Europe/Paris"})])
    # without newlines or the last end marker; text after the calls
    text = f"<tool_call>{WEATHER}</tool_call><tool_call>{TIME}"
    check(text, HERMES, None, [("get_weather", PARIS), ("get_time", {"zone": "Europe/Paris"})])
    check(f"<tool_call>{TIME}</tool_call>\n\nDone.", HERMES, "Done.", [("get_time", ANY_ZONE)])
    check(f"<tool_call>{TIME} tail", HERMES, "tail", [("get_time", ANY_ZONE)])  # no end marker
    # the next call cut short by the length limit right in its marker
    check(f"<tool_call>{TIME}</tool_call>\n<tool", HERMES, None, [("get_time", ANY_ZONE)])


def test_hermes_one_call_when_parallel_calls_are_off() -> None:
    text = f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>"
    answer = whole(text, HERMES, max_calls=1)
    assert [c["name"] for c in answer["calls"]] == ["get_weather"]
    for size in (1, 4, len(text)):
        assert streamed(text, HERMES, size, max_calls=1)["calls"] == answer["calls"]


def test_plain_answers_are_content_exactly() -> None:
    for text in ["", "Paris.", "  spaced out  \n", "a < b and tool_call", "x <tool_ca", "{x}"]:
        for syntax in (HERMES, LLAMA3_JSON, MISTRAL):
            check(text, syntax, text, [])


def test_malformed_calls_are_content() -> None:
    for text in [
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',  # not an object
        '<tool_call>\n{"name": "f", "arguments": {"a": 1},}\n</tool_call>',  # not JSON
        f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\nbroken",  # one call broken
    ]:
        assert whole(text, HERMES) == {"content": text, "calls": []}, text
        assert streamed(text, HERMES, 1)["content"].endswith(text[-5:]), text


def test_a_call_cut_short_streams_what_there_was() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    assert whole(text, HERMES) == {"content": text, "calls": []}
    got = streamed(text, HERMES, 3)
    assert got["content"] == ""
    assert got["calls"] == [{"id": "call_0", "name": "get_weather", "arguments": '{"city": "Par'}]


def test_the_name_goes_out_first_then_the_arguments_as_they_grow() -> None:
    parser = ToolCallParser(HERMES, ids())
    assert parser.feed("Sure <tool") == ["Sure"]  # the marker's start is held back
    assert parser.feed('_call>\n{"name": "get_wea') == []
    assert parser.feed('ther", "arguments": {"ci') == [
        CallStart(0, "call_0", "get_weather"),
        ArgumentsDelta(0, '{"ci'),
    ]
    assert parser.feed('ty": "Paris"}}\n</tool_call>') == [ArgumentsDelta(0, 'ty": "Paris"}')]
    assert parser.finish() == []
    # arguments before the name: the call goes out when the object is whole
    parser = ToolCallParser(HERMES, ids())
    assert parser.feed('<tool_call>{"arguments": {"a": "}"}, ') == []
    assert parser.feed('"name": "f"}') == [
        CallStart(0, "call_0", "f"),
        ArgumentsDelta(0, '{"a": "}"}'),
    ]


def test_llama3_json_calls() -> None:
    one = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
    check(one, LLAMA3_JSON, None, [("get_weather", PARIS)])
    check(f" \n<|python_tag|>{one}", LLAMA3_JSON, None, [("get_weather", PARIS)])
    two = f'{one}; {{"name": "get_time", "parameters": {{"zone": "Europe/Paris"}}}}'
    check(two, LLAMA3_JSON, None, [("get_weather", PARIS), ("get_time", ANY_ZONE)])
    # text first: an answer, not a call; JSON that is no call: text
    check(f"The call would be {one}", LLAMA3_JSON, f"The call would be {one}", [])
    check('{"answer": 42}', LLAMA3_JSON, '{"answer": 42}', [])


def test_mistral_calls() -> None:
    text = f"Checking. [TOOL_CALLS] [{WEATHER}, {TIME}]"
    check(text, MISTRAL, "Checking.", [("get_weather", PARIS), ("get_time", ANY_ZONE)])
    check(f"[TOOL_CALLS]{WEATHER}", MISTRAL, None, [("get_weather", PARIS)])  # a bare object
    # arguments as a JSON string holding the object
    text = '[TOOL_CALLS] [{"name": "f", "arguments": "{\\"a\\": 1}"}]'
    assert whole(text, MISTRAL)["calls"][0]["arguments"] == '{"a": 1}'
    check(text, MISTRAL, None, [("f", {"a": 1})])
    check("[TOOL_CALLS] [oops]", MISTRAL, "[TOOL_CALLS] [oops]", [])


def test_unicode_and_escapes_in_arguments() -> None:
    text = '<tool_call>{"name": "say", "arguments": {"text": "Grüße \\"quoted\\" \\\\ {"}}'
    check(text, HERMES, None, [("say", {"text": 'Grüße "quoted" \\ {'})])


@pytest.mark.parametrize(
    ("template", "syntax"),
    [
        ("qwen2.5.jinja", HERMES),
        ("hermes-2-pro.jinja", HERMES),
        ("llama3.1.jinja", LLAMA3_JSON),
        ("mistral-v3.jinja", MISTRAL),
        ("smollm2.jinja", HERMES),
    ],
)
def test_the_syntax_is_read_from_the_template(template: str, syntax: ToolSyntax) -> None:
    assert detect_syntax((TEMPLATES / template).read_text(encoding="utf-8")) is syntax


def test_call_ids() -> None:
    assert new_call_id(HERMES).startswith("call_") and len(new_call_id(HERMES)) == 29
    mistral = new_call_id(MISTRAL)
    assert len(mistral) == 9 and mistral.isalnum()
