"""The grammar of required and named tool calls, checked with llguidance itself: it compiles
for each syntax, a right call's tokens are consumed and accepted, a wrong name or arguments
outside the schema are refused, call markers that are tokens of the vocabulary are matched as
those tokens, and a random walk through what the grammar allows always ends in calls our
parser reads and the schema validates (what a small model's constrained answer looks like)."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import numpy as np
import pytest

from attnserve.service.tool_grammar import call_schema, tool_grammar
from attnserve.service.tool_parsers import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    ToolSyntax,
    parse_tool_calls,
)
from tests.service.tool_model import EOS, byte_tokenizer

llguidance = pytest.importorskip("llguidance")

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Lyon"]},
            "unit": {"$ref": "#/$defs/Unit"},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city"],
        "additionalProperties": False,
        "$defs": {"Unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    },
}
NOTE = {
    "name": "note",
    "parameters": {
        "type": "object",
        "properties": {"text": {"type": "string", "maxLength": 6}, "pin": {"type": "boolean"}},
        "required": ["text", "pin"],
        "additionalProperties": False,
    },
}
PING = {"name": "ping"}  # no parameters: no arguments


class Vocab:
    """A byte-level tokenizer and its llguidance view."""

    def __init__(self, **tokens: Any) -> None:
        self.hf = byte_tokenizer(**tokens)
        self.ll = llguidance.LLTokenizer(self.hf.to_str(), eos_token=[EOS])
        self.added = {t.content: i for i, t in self.hf.get_added_tokens_decoder().items()}

    def matcher(self, grammar: str) -> Any:
        return llguidance.LLMatcher(self.ll, grammar, log_level=0)

    def accepts(self, grammar: str, text: str) -> bool:
        matcher = self.matcher(grammar)
        ok = matcher.consume_tokens(self.hf.encode(text).ids)
        return bool(ok and matcher.is_accepting() and not matcher.is_error())


@pytest.fixture(scope="module")
def plain() -> Vocab:
    return Vocab()


@pytest.fixture(scope="module")
def marked() -> Vocab:
    """<tool_call> and </tool_call> added tokens (Qwen2.5's), [TOOL_CALLS] special (Mistral's)."""
    return Vocab(added=["<tool_call>", "</tool_call>"], special=["[TOOL_CALLS]"])


def hermes(*calls: str) -> str:
    return "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)


PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}'


def test_the_grammars_compile(plain: Vocab, marked: Vocab) -> None:
    for vocab in (plain, marked):
        for syntax in (HERMES, LLAMA3_JSON, MISTRAL):
            for parallel in (True, False):
                grammar = tool_grammar(
                    [WEATHER, NOTE, PING], syntax, vocab.added, parallel=parallel
                )
                assert llguidance.LLMatcher.validate_grammar(grammar, vocab.ll) == ""
    assert llguidance.LLMatcher.validate_grammar("start: nothing_defined", plain.ll) != ""


def test_gbnf_rule_marks_in_schemas_are_escaped(plain: Vocab) -> None:
    """service/guided.py reads a grammar holding `::=` as GBNF."""
    odd = {
        "name": "define",
        "parameters": {
            "type": "object",
            "properties": {"rule": {"type": "string", "enum": ["a ::= b"]}},
            "required": ["rule"],
        },
    }
    grammar = tool_grammar([odd], HERMES, plain.added, parallel=False)
    assert "::=" not in grammar
    assert plain.accepts(grammar, hermes('{"name": "define", "arguments": {"rule": "a ::= b"}}'))


def test_a_right_call_is_accepted_and_wrong_ones_refused(plain: Vocab) -> None:
    grammar = tool_grammar([WEATHER, NOTE, PING], HERMES, plain.added, parallel=False)
    assert plain.accepts(grammar, hermes(PARIS))
    assert plain.accepts(grammar, hermes('{"name": "get_weather", "arguments": {"city": "Lyon"}}'))
    assert plain.accepts(grammar, hermes('{"name": "ping", "arguments": {}}'))
    assert plain.accepts(
        grammar, hermes('{"name": "note", "arguments": {"text": "hi", "pin": true}}')
    )
    for wrong in [
        '{"name": "get_weathr", "arguments": {"city": "Paris"}}',  # no such function
        '{"name": "get_weather", "arguments": {"city": "Berlin"}}',  # not in the enum
        '{"name": "get_weather", "arguments": {"unit": "celsius"}}',  # city is required
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}',  # $ref
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 9}}',  # maximum
        '{"name": "get_weather", "arguments": {"city": "Paris", "wind": 1}}',  # no extras
        '{"name": "note", "arguments": {"text": "too long", "pin": true}}',  # maxLength
        '{"name": "ping", "arguments": {"x": 1}}',  # no arguments
        '{"name":"ping","arguments":{}}',  # json.dumps' spacing only
    ]:
        assert not plain.accepts(grammar, hermes(wrong)), wrong
    assert not plain.accepts(grammar, "Sure! " + hermes(PARIS))  # calls only
    assert not plain.accepts(grammar, hermes(PARIS, PARIS))  # one call
    parallel = tool_grammar([WEATHER, PING], HERMES, plain.added, parallel=True)
    assert plain.accepts(parallel, hermes(PARIS, '{"name": "ping", "arguments": {}}'))


def test_named_and_other_syntaxes(plain: Vocab) -> None:
    named = tool_grammar([NOTE], HERMES, plain.added, parallel=False)
    assert not plain.accepts(named, hermes(PARIS))
    llama = tool_grammar([WEATHER], LLAMA3_JSON, plain.added, parallel=True)
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert plain.accepts(llama, one) and plain.accepts(llama, f"{one}; {one}")
    assert not plain.accepts(llama, '{"name": "get_weather", "arguments": {"city": "Paris"}}')
    mistral = tool_grammar([WEATHER], MISTRAL, plain.added, parallel=True)
    assert plain.accepts(mistral, f"[TOOL_CALLS] [{PARIS}, {PARIS}]")
    single = tool_grammar([WEATHER], MISTRAL, plain.added, parallel=False)
    assert not plain.accepts(single, f"[TOOL_CALLS] [{PARIS}, {PARIS}]")


def test_markers_that_are_tokens_are_matched_as_tokens(marked: Vocab) -> None:
    grammar = tool_grammar([WEATHER], HERMES, marked.added, parallel=False)
    assert f"<[{marked.added['<tool_call>']}]>" in grammar
    assert marked.accepts(grammar, hermes(PARIS))  # the text encodes to the added tokens
    # the marker spelled in bytes is not the token the model was trained to write
    matcher = marked.matcher(grammar)
    spelled = [t for c in "<tool_call>" for t in marked.hf.encode(c).ids]
    assert not matcher.consume_tokens(spelled)
    mistral = tool_grammar([WEATHER], MISTRAL, marked.added, parallel=False)
    assert marked.accepts(mistral, f"[TOOL_CALLS] [{PARIS}]")


def test_defs_move_to_the_root_of_a_call() -> None:
    schema = call_schema(WEATHER)
    assert "$defs" in schema and "$defs" not in schema["properties"]["arguments"]
    call = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    jsonschema.validate(call, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**call, "arguments": {"city": "Paris", "unit": "k"}}, schema)


def walk(vocab: Vocab, grammar: str, rng: random.Random, limit: int = 2000) -> str:
    """Tokens drawn at random among those the grammar allows until the end of the turn."""
    matcher = vocab.matcher(grammar)
    tokens: list[int] = []
    for _ in range(limit):
        allowed = np.flatnonzero(np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8))
        allowed = allowed[allowed < vocab.hf.get_vocab_size()]
        if EOS in allowed and rng.random() < 0.75:
            break
        token = int(rng.choice([t for t in allowed if t != EOS] or [EOS]))
        if token == EOS:
            break
        assert matcher.consume_token(token), matcher.get_error()
        tokens.append(token)
    else:
        pytest.fail("the walk did not end")
    assert matcher.is_accepting()
    return str(vocab.hf.decode(tokens, skip_special_tokens=False))


@pytest.mark.parametrize("syntax", [HERMES, LLAMA3_JSON, MISTRAL], ids=lambda s: s.name)
def test_whatever_the_grammar_allows_parses_and_validates(
    plain: Vocab, marked: Vocab, syntax: ToolSyntax
) -> None:
    functions = {f["name"]: f for f in (WEATHER, NOTE, PING)}
    rng = random.Random(0)
    for vocab in (plain, marked):
        grammar = tool_grammar(list(functions.values()), syntax, vocab.added, parallel=True)
        for _ in range(4):
            text = walk(vocab, grammar, rng)
            answer = parse_tool_calls(text, syntax)
            assert answer.calls and answer.content is None, text
            for call in answer.calls:
                parameters = functions[call.name].get("parameters", {"type": "object"})
                jsonschema.validate(json.loads(call.arguments), parameters)


def test_objects_that_do_not_say_allow_no_other_properties(plain: Vocab) -> None:
    open_ = {
        "name": "book",
        "parameters": {
            "type": "object",
            "properties": {"guest": {"type": "object", "properties": {"age": {"type": "integer"}}}},
            "anyOf": [{"required": ["guest"]}, {"properties": {"note": {"type": "string"}}}],
        },
    }
    schema = call_schema(open_)
    arguments = schema["properties"]["arguments"]
    assert arguments["additionalProperties"] is False
    assert arguments["properties"]["guest"]["additionalProperties"] is False
    assert arguments["anyOf"][1]["additionalProperties"] is False
    assert "additionalProperties" not in arguments["anyOf"][0]  # no object of its own
    grammar = tool_grammar([open_], HERMES, plain.added, parallel=False)
    good = '{"name": "book", "arguments": {"guest": {"age": 3}}}'
    assert plain.accepts(grammar, hermes(good))
    extra = '{"name": "book", "arguments": {"guest": {"age": 3}, "x": 1}}'
    assert not plain.accepts(grammar, hermes(extra))
    # a schema that says keeps what it says
    said = {
        "type": "object",
        "additionalProperties": {"type": "integer"},
        "allOf": [open_["parameters"]],
    }
    kept = call_schema({"name": "f", "parameters": said})["properties"]["arguments"]
    assert kept["additionalProperties"] == {"type": "integer"}
    assert kept["allOf"] == [open_["parameters"]]
