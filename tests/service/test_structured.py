"""Structured outputs over HTTP (service/guided.py): OpenAI's response_format, vLLM's guided_*
and structured_outputs, and the native /v1/generate, through the real `openai` client and
httpx against a real server with a tiny random model that writes bytes. Outputs follow their
grammar (validated with jsonschema / re); bad schemas, regexes and grammars are 400s (OpenAI)
or 422s (native) naming the field."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest

from tests.service.helpers import LiveServer

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "rank": {"type": "integer", "minimum": 1, "maximum": 99},
        "kind": {"enum": ["town", "city"]},
    },
    "required": ["city", "rank", "kind"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Name a city."}]


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120.0)


def test_response_format_json_schema_strict(byte_lm: LiveServer) -> None:
    answer = client(byte_lm).chat.completions.create(
        model="tiny-byte-lm",
        messages=MESSAGES,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=80,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "place", "schema": SCHEMA, "strict": True},
        },
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_json_object_with_sampling_and_several_choices(byte_lm: LiveServer) -> None:
    answer = client(byte_lm).chat.completions.create(
        model="tiny-byte-lm",
        messages=MESSAGES,  # type: ignore[arg-type]
        temperature=0.8,
        seed=3,
        n=3,
        max_tokens=120,
        response_format={"type": "json_object"},
    )
    for choice in answer.choices:
        if choice.finish_reason == "stop":  # a random model may run out of tokens in a string
            assert isinstance(json.loads(choice.message.content or ""), dict)
        else:
            assert (choice.message.content or "").startswith("{")


def test_streamed_json_schema_answer_concatenates_to_valid_json(byte_lm: LiveServer) -> None:
    chunks = client(byte_lm).chat.completions.create(
        model="tiny-byte-lm",
        messages=MESSAGES,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=80,
        stream=True,
        extra_body={"guided_json": SCHEMA},
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_regex": r"[A-Z][a-z]{2,5}-[0-9]{2}"}, r"[A-Z][a-z]{2,5}-[0-9]{2}"),
        ({"guided_choice": ["yes", "no", "it depends"]}, r"yes|no|it depends"),
        ({"guided_grammar": 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'}, None),
        ({"guided_grammar": 'root ::= "[" [a-c]+ "]"'}, r"\[[a-c]+\]"),
        ({"structured_outputs": {"regex": "[0-9]{4}"}}, r"[0-9]{4}"),
        ({"structured_outputs": {"choice": ["left", "right"]}}, r"left|right"),
    ],
)
def test_vllm_forms_on_completions(
    byte_lm: LiveServer, extra: dict[str, Any], check: str | None
) -> None:
    answer = client(byte_lm).completions.create(
        model="tiny-byte-lm", prompt="Answer:", temperature=0, max_tokens=60, extra_body=extra
    )
    text = answer.choices[0].text
    assert answer.choices[0].finish_reason == "stop"
    if check is not None:
        assert re.fullmatch(check, text), text
    else:
        assert re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", text), text


@pytest.mark.parametrize("beam_size", [1, 3])
def test_native_generate_follows_a_schema_with_greedy_and_beam(
    byte_lm: LiveServer, beam_size: int
) -> None:
    with byte_lm.client() as http:
        answer = http.post(
            "/v1/generate",
            json={
                "text": "Answer:",
                "beam_size": beam_size,
                "num_hypotheses": beam_size,
                "max_new_tokens": 80,
                "guided_json": SCHEMA,
            },
        )
    assert answer.status_code == 200, answer.text
    (result,) = answer.json()["translations"]
    texts = [result["text"]] + [h["text"] for h in result.get("hypotheses") or []]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


BAD = [
    (
        {"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
        "guided_json",
        "invalid JSON schema",
    ),
    (
        {"guided_json": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}},
        "guided_json",
        "not",
    ),
    ({"guided_json": "{not json"}, "guided_json", "not JSON"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "regex"),
    ({"guided_regex": "a[^\\s\\S]"}, "guided_regex", "matches no text"),
    ({"guided_choice": []}, "guided_choice", "choices"),
    ({"guided_grammar": 'start: "a" missing'}, "guided_grammar", "missing"),
    ({"guided_regex": "[0-9]", "guided_choice": ["a"]}, "guided_choice", "one structured output"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format", ""),
]


@pytest.mark.parametrize(("extra", "param", "message"), BAD)
def test_bad_structured_outputs_are_400s_naming_the_field(
    byte_lm: LiveServer, extra: dict[str, Any], param: str, message: str
) -> None:
    with byte_lm.client() as http:
        answer = http.post(
            "/v1/chat/completions",
            json={"messages": MESSAGES, "max_tokens": 8, **extra},
        )
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] is not None and error["param"].startswith(param)
        assert message in error["message"]
        native = http.post("/v1/generate", json={"text": "Answer:", "max_new_tokens": 8, **extra})
        assert native.status_code == 422, native.text


def test_a_translation_model_refuses_structured_outputs(live: LiveServer) -> None:
    with live.client() as http:
        answer = http.post("/v1/translate", json={"text": "Hello.", "guided_regex": "[a-z]+"})
        assert answer.status_code == 422, answer.text
        assert answer.json()["error"]["param"] == "guided_regex"
        answer = http.post("/v1/completions", json={"prompt": "Hello.", "guided_choice": ["a"]})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "guided_choice"


def test_the_grammar_wins_over_min_tokens_and_banned_ngrams(byte_lm: LiveServer) -> None:
    """min_tokens past a choice's end, a no-repeat rule against a repeating regex: the answer
    follows the grammar (greedy, sampling and beam search), never a 500 or an empty choice."""
    oa = client(byte_lm)
    for extra in (
        {"temperature": 0},
        {"temperature": 0.9, "seed": 4},
        {"use_beam_search": True, "best_of": 2, "n": 2},
    ):
        answer = oa.chat.completions.create(
            model="tiny-byte-lm",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=8,
            extra_body={"guided_choice": ["yes", "no"], "min_tokens": 3, **extra},
        )
        assert answer.choices, extra
        for choice in answer.choices:
            assert choice.message.content in ("yes", "no") and choice.finish_reason == "stop"
    with byte_lm.client() as http:
        native = http.post(
            "/v1/generate",
            json={
                "text": "Answer:",
                "max_new_tokens": 12,
                "guided_regex": "(ab){1,3}",
                "no_repeat_ngram_size": 1,
                "beam_size": 2,
            },
        )
    assert native.status_code == 200, native.text
    assert re.fullmatch("(ab){1,3}", native.json()["translations"][0]["text"])


def test_grammars_past_llguidance_limits_or_nested_too_deep_are_400s(byte_lm: LiveServer) -> None:
    """A regex that builds too many lexer states passes the compile check and fails at the
    first token it writes: the request's 400 (OpenAI) / 422 (native) naming the field, or the
    stream's error event; a schema nested too deeply for jsonschema's checker: the same."""
    deep: Any = {"type": "string"}
    for _ in range(300):
        deep = {"type": "array", "items": deep}
    with byte_lm.client() as http:
        for route, body, param, status in [
            (
                "/v1/completions",
                {"prompt": "hi", "guided_regex": "a{1000000}"},
                "guided_regex",
                400,
            ),
            ("/v1/generate", {"text": "hi", "guided_regex": "a{1000000}"}, "guided_regex", 422),
            ("/v1/generate", {"text": "hi", "guided_json": deep}, "guided_json", 422),
            (
                "/v1/chat/completions",
                {
                    "messages": MESSAGES,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "deep", "schema": deep},
                    },
                },
                "response_format",
                400,
            ),
        ]:
            length = "max_new_tokens" if route == "/v1/generate" else "max_tokens"
            answer = http.post(route, json={length: 4, **body})
            assert answer.status_code == status, (route, answer.text)
            error = answer.json()["error"]
            assert error["param"] == param
            assert "too complex" in error["message"] or "nested too deeply" in error["message"]
        streamed = http.post(
            "/v1/completions",
            json={"prompt": "hi", "max_tokens": 4, "stream": True, "guided_regex": "a{1000000}"},
        )
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line[6:8] == '{"']
    assert events[-1]["error"]["param"] == "guided_regex", streamed.text
    assert "too complex" in events[-1]["error"]["message"]


def test_logprobs_of_tokens_that_hold_part_of_a_character(byte_lm: LiveServer) -> None:
    """A byte tokenizer spells 🎉 in four tokens: the first three add "" and the fourth the
    whole character, so tokens join to the text and offsets point at each token's text;
    chat's `bytes` are each token's own byte, which joined decode to the text."""
    text = "🎉 ok 日本"
    oa = client(byte_lm)
    completion = oa.completions.create(
        model="tiny-byte-lm",
        prompt="Party:",
        temperature=0,
        max_tokens=30,
        logprobs=2,
        extra_body={"guided_regex": re.escape(text)},
    )
    assert completion.choices[0].text == text
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert logprobs.tokens[:4] == ["", "", "", "🎉"] and "".join(logprobs.tokens) == text
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))
    ]
    chat = oa.chat.completions.create(
        model="tiny-byte-lm",
        messages=MESSAGES,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=30,
        logprobs=True,
        top_logprobs=2,
        extra_body={"guided_regex": re.escape(text)},
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    written = [entry for entry in content if entry.bytes]  # the stop token has none
    assert [len(entry.bytes or []) for entry in written[:4]] == [1, 1, 1, 1]
    assert bytes(b for entry in written for b in entry.bytes or []).decode() == text
    assert "".join(entry.token for entry in written) == text
    for entry in written:  # one byte a token; none for the stop token
        for alternative in entry.top_logprobs:
            assert len(alternative.bytes or []) == 1 or (alternative.token, alternative.bytes) == (
                "",
                [],
            )
