"""A thinking model's reasoning in `reasoning_content` (service/reasoning.py): the splitter on
every way a stream can cut an answer, then a real server whose tiny byte-level model has
`<think>` / `</think>` tokens and a Qwen3-style template (found by "auto"), through the `openai`
client, whole and streamed. Grammars (guided_regex) make the random model write the blocks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from attnserve.model.text_tokenizer import TOKENIZER_CONFIG_FILE
from attnserve.service.launch import check_models
from attnserve.service.reasoning import ThinkSplitter, model_thinks, opened_by_prompt, split
from tests.conftest import byte_tokenizer, write_tiny_lm
from tests.service.helpers import LiveServer, make_settings

# (answer, opened by the prompt) -> (reasoning, content)
CASES: list[tuple[str, bool, tuple[str | None, str | None]]] = [
    ("<think>\nplan a b\n</think>\n\nThe answer.", False, ("plan a b", "The answer.")),
    ("  <think>x</think>y", False, ("x", "y")),
    ("<think>\n\n</think>\n\nOnly this.", False, ("", "Only this.")),
    ("The answer <think>is</think> here.", False, (None, "The answer <think>is</think> here.")),
    ("no block at all\n", False, (None, "no block at all\n")),
    ("<think>cut off in the midd", False, ("cut off in the midd", None)),
    ("<thin", False, (None, "<thin")),
    ("", False, (None, "")),
    ("reasoning first\n</think>\n\nthen content", True, ("reasoning first", "then content")),
    ("all reasoning < / think", True, ("all reasoning < / think", None)),
    ("a</think", True, ("a</think", None)),
    ("</think>x", True, ("", "x")),
]


@pytest.mark.parametrize(("text", "inside", "expected"), CASES)
def test_split_whole_answers(
    text: str, inside: bool, expected: tuple[str | None, str | None]
) -> None:
    assert split(text, inside=inside) == expected


@pytest.mark.parametrize(("text", "inside", "expected"), CASES)
def test_a_stream_cut_anywhere_gives_the_whole_answer(
    text: str, inside: bool, expected: tuple[str | None, str | None]
) -> None:
    """Every cut in two, and one character at a time: the parts join to the whole answer's."""
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        splitter = ThinkSplitter(inside=inside)
        parts = [p for piece in pieces for p in splitter.feed(piece)] + splitter.finish()
        reasoning = "".join(t for kind, t in parts if kind == "reasoning")
        content = "".join(t for kind, t in parts if kind == "content")
        assert reasoning == (expected[0] or ""), pieces
        assert content == (expected[1] or ""), pieces
        assert all(t for _, t in parts), parts  # no empty parts


def test_reasoning_is_released_as_it_comes() -> None:
    """Only a possible end tag (and white space that may precede it) is held back."""
    splitter = ThinkSplitter()
    assert splitter.feed("<thi") == []
    assert splitter.feed("nk>\nStep one") == [("reasoning", "Step one")]
    assert splitter.feed(", two\n</thi") == [("reasoning", ", two")]
    assert splitter.feed("nk>\n\n") == []
    assert splitter.feed("Done") == [("content", "Done")]
    assert splitter.finish() == []


def test_the_prompt_opens_a_block() -> None:
    assert opened_by_prompt("<|im_start|>assistant\n<think>\n")
    assert not opened_by_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opened_by_prompt("<|im_start|>assistant\n")
    assert model_thinks("{{ '<think>' }}", {"<think>": 5, "</think>": 6}.get)
    assert not model_thinks("{{ '<think>' }}", {"<think>": 5}.get)  # no end tag token
    assert not model_thinks("{{ messages }}", {"<think>": 5, "</think>": 6}.get)


# Qwen3's switches: thinking off closes an empty block in the prompt; `open_thinking` (as
# thinking-only models and DeepSeek-R1 do) leaves one open for the answer.
TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% elif open_thinking %}{{ '<think>\n' }}{% endif %}"
    "{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Think first."}]
BLOCK = r"<think>\n[a-z ]{4,24}\n</think>\n\n[a-z]{2,8}"


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The byte-level tiny model with <think> and </think> as tokens of their own."""
    out = tmp_path_factory.mktemp("served") / "tiny-thinker"
    tok = byte_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    write_tiny_lm(out, tokenizer=tok)
    config_path = out / TOKENIZER_CONFIG_FILE
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    settings = make_settings(out, variant="fp32")
    check_models(settings)  # exports the graph
    with LiveServer(settings) as server:
        yield server


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120.0)


def ask(server: LiveServer, regex: str, **kwargs: Any) -> Any:
    extra = {"guided_regex": regex, **kwargs.pop("extra_body", {})}
    return client(server).chat.completions.create(
        **{
            "model": "tiny-thinker",
            "messages": MESSAGES,
            "temperature": 0,
            "max_tokens": 60,
            "extra_body": extra,
            **kwargs,
        }
    )


def streamed(server: LiveServer, regex: str, **extra: Any) -> tuple[str, str, list[str]]:
    """The stream's reasoning and content, and the order their deltas came in."""
    reasoning, content, order = "", "", []
    stream = client(server).chat.completions.create(
        model="tiny-thinker",
        messages=MESSAGES,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=60,
        stream=True,
        extra_body={"guided_regex": regex, **extra},
    )
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        part = (delta.model_extra or {}).get("reasoning_content")
        if part:
            reasoning += part
            order.append("reasoning")
        if delta.content:
            content += delta.content
            order.append("content")
    return reasoning, content, order


def reasoning_of(message: Any) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def test_a_block_the_answer_opens(thinker: LiveServer) -> None:
    message = ask(thinker, BLOCK).choices[0].message
    reasoning, content = reasoning_of(message), message.content
    assert reasoning and content and "<think>" not in reasoning + content
    assert reasoning == reasoning.strip() and content.isalpha()
    assert streamed(thinker, BLOCK)[:2] == (reasoning, content)
    order = streamed(thinker, BLOCK)[2]
    assert order == sorted(order, key=["reasoning", "content"].index)  # reasoning first


def test_a_block_the_prompt_opens(thinker: LiveServer) -> None:
    regex = r"[a-z ]{4,24}\n</think>\n\n[a-z]{2,8}"
    kwargs = {"chat_template_kwargs": {"open_thinking": True}}
    message = ask(thinker, regex, extra_body=kwargs).choices[0].message
    assert reasoning_of(message) and message.content and message.content.isalpha()
    assert streamed(thinker, regex, **kwargs)[:2] == (reasoning_of(message), message.content)


def test_thinking_off_and_reasoning_left_out(thinker: LiveServer) -> None:
    off = ask(
        thinker, r"[a-z]{3,8}", extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert reasoning_of(off.choices[0].message) is None and off.choices[0].message.content
    dropped = ask(thinker, BLOCK, extra_body={"include_reasoning": False}).choices[0].message
    assert reasoning_of(dropped) is None and dropped.content and dropped.content.isalpha()
    assert streamed(thinker, BLOCK, include_reasoning=False)[0] == ""


def test_a_block_cut_by_the_token_limit_is_all_reasoning(thinker: LiveServer) -> None:
    answer = ask(thinker, r"<think>[a-z ]{30,40}</think>x", max_tokens=12)
    assert answer.choices[0].finish_reason == "length"
    message = answer.choices[0].message
    assert message.content is None and reasoning_of(message)
