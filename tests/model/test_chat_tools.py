"""Chats with tools rendered as transformers renders them (`apply_chat_template(tools=...)`)
on the chat templates of tool-calling models: Qwen2.5's, Llama 3.1's, Mistral v0.3's and
Hermes 2 Pro's (tests/fixtures/chat_templates, written in those models' formats), and the
detection of a template's tools section."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models

from attnserve.model.text_tokenizer import ChatTemplateError, TextTokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city's name."},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "description": "An IANA zone."}},
            "required": ["zone"],
        },
    },
}


def call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chat(parallel: bool) -> list[dict[str, Any]]:
    """A chat with a system prompt, a call (two with `parallel`), its results, an answer and
    a new question."""
    calls = [call("abcdefgh1", "get_weather", {"city": "Paris", "unit": "celsius"})]
    results = [
        {"role": "tool", "tool_call_id": "abcdefgh1", "name": "get_weather", "content": "21 C"}
    ]
    if parallel:
        calls.append(call("abcdefgh2", "get_time", {"zone": "Europe/Paris"}))
        results.append(
            {"role": "tool", "tool_call_id": "abcdefgh2", "name": "get_time", "content": "14:05"}
        )
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        *results,
        {"role": "assistant", "content": "It is 21 C in Paris."},
        {"role": "user", "content": "And in Lyon?"},
    ]


def ours(template: str) -> TextTokenizer:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    return TextTokenizer(
        Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        {**SPECIAL, "chat_template": template},
    )


@pytest.fixture(scope="module")
def transformers_tokenizer() -> Any:
    transformers = pytest.importorskip("transformers")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), **SPECIAL
    )


CASES = [
    ("qwen2.5.jinja", True),
    ("hermes-2-pro.jinja", True),
    ("llama3.1.jinja", False),  # its template refuses more than one call in a turn
    ("mistral-v3.jinja", True),
]


@pytest.mark.parametrize(("name", "parallel"), CASES)
def test_tools_render_as_transformers_renders_them(
    transformers_tokenizer: Any, name: str, parallel: bool
) -> None:
    template = (TEMPLATES / name).read_text(encoding="utf-8")
    tokenizer = ours(template)
    assert tokenizer.renders_tools
    for tools in ([WEATHER, TIME], None):
        for messages in (chat(parallel), chat(parallel)[:2]):
            for prompt in (True, False):
                got = tokenizer.apply_chat_template(messages, prompt, tools=tools)
                want = transformers_tokenizer.apply_chat_template(
                    messages,
                    tools=tools,
                    chat_template=template,
                    tokenize=False,
                    add_generation_prompt=prompt,
                )
                assert got == want, (name, tools is None, len(messages), prompt)
                if tools is not None:
                    assert '"get_weather"' in got and "The city's name." in got
                if len(messages) > 2:  # the past call and its result
                    assert '{"city": "Paris", "unit": "celsius"}' in got and "21 C" in got


def test_a_template_without_tools_section_is_told_apart() -> None:
    smollm2 = ours((TEMPLATES / "smollm2.jinja").read_text(encoding="utf-8"))
    assert not smollm2.renders_tools
    # a mention in a comment or a string is no tools section; a read of the variable is
    assert not ours("{# tools #}{{ 'tools' }}{{ messages[0].content }}").renders_tools
    assert ours("{% if tools %}{{ tools | tojson }}{% endif %}").renders_tools
    assert not ours("{% set tools = 1 %}{{ tools }}").renders_tools


def test_bad_tool_calls_and_tools_are_refused() -> None:
    tokenizer = ours((TEMPLATES / "qwen2.5.jinja").read_text(encoding="utf-8"))
    user = {"role": "user", "content": "hi"}
    for calls in ([], "x", [{"function": {"arguments": {}}}], [{"function": {"name": "f"}}]):
        bad = {"role": "assistant", "content": "", "tool_calls": calls}
        with pytest.raises(ChatTemplateError, match="tool_calls"):
            tokenizer.apply_chat_template([user, bad])
    with pytest.raises(ChatTemplateError, match="tool_call_id"):
        tokenizer.apply_chat_template([user, {"role": "tool", "content": "", "tool_call_id": 3}])
    for tools in ("x", [{"type": "function"}], [{"function": {"name": 1}}]):
        with pytest.raises(ChatTemplateError, match="tools"):
            tokenizer.apply_chat_template([user], tools=tools)  # type: ignore[arg-type]
