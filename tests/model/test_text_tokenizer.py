"""TextTokenizer: files, ids, and chat templates rendered as transformers does (sandboxed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from attnserve.model.text_tokenizer import ChatTemplateError, TextTokenizer

WORDS = ["<s>", "</s>", "<|eot|>", "<unk>", "hello", "world", "the", "cat", "!", "?", "a", "b"]
LLAMA3_STYLE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{{ '<|start|>' + m['role'] + '\\n' + m['content'] | trim + '<|eot|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant\\n' }}{% endif %}"
)


def word_tokenizer(bos: bool = True) -> Tokenizer:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins with spaces
    tok.add_special_tokens(["<s>", "</s>", "<|eot|>"])
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 0)]
        )
    return tok


def tokenizer(template: str | None = LLAMA3_STYLE) -> TextTokenizer:
    config: dict[str, Any] = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if template:
        config["chat_template"] = template
    return TextTokenizer(word_tokenizer(), config)


def reference(template: str) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=word_tokenizer(),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=template,
    )


def test_ids_special_tokens_and_stop_ids() -> None:
    tok = tokenizer()
    assert tok.encode("hello world") == [0, 4, 5]
    assert tok.encode("hello world", add_special_tokens=False) == [4, 5]
    assert tok.decode([0, 4, 5, 1]) == "hello world"
    assert tok.decode([0, 4, 1], skip_special_tokens=False) == "<s> hello </s>"
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, None)
    assert tok.stop_ids == [1, 2]  # EOS, and the end-of-turn token the template writes
    assert tokenizer(template=None).stop_ids == [1]
    assert tok.id_to_token(7) == "cat"


@pytest.mark.parametrize("prompt", [True, False])
def test_chat_rendering_equals_transformers(prompt: bool) -> None:
    expected = reference(LLAMA3_STYLE)
    tok = tokenizer()
    conversations = [
        [{"role": "user", "content": " hello  "}],
        [{"role": "system", "content": "a"}, {"role": "user", "content": "the cat"}],
    ]
    for messages in conversations:
        rendered = expected.apply_chat_template(
            messages, add_generation_prompt=prompt, tokenize=False
        )
        assert tok.apply_chat_template(messages, prompt) == rendered
        ids = expected.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        assert tok.encode_chat(messages, prompt) == ids


def test_continue_final_message_equals_transformers() -> None:
    """The chat cut after the last message's content, as transformers cuts it (a message the
    template trims, `| trim` here, is found by its stripped text)."""
    expected = reference(LLAMA3_STYLE)
    tok = tokenizer()
    for last in ("the cat", "the cat  ", " a"):
        messages = [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": last},
        ]
        rendered = expected.apply_chat_template(
            messages, add_generation_prompt=False, continue_final_message=True, tokenize=False
        )
        assert tok.apply_chat_template(messages, False, continue_final_message=True) == rendered
        assert rendered.endswith(last.strip())
    with pytest.raises(ChatTemplateError, match="exclude each other"):
        tok.apply_chat_template(messages, True, continue_final_message=True)
    hidden = "{% for m in messages %}{{ m['role'] }}{% endfor %}"  # shows no content
    with pytest.raises(ChatTemplateError, match="does not show"):
        tokenizer(hidden).apply_chat_template(
            [{"role": "user", "content": "the cat"}], False, continue_final_message=True
        )


# Qwen3's switch: the generation prompt opens an empty thinking block when thinking is off.
THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


def test_template_kwargs_equal_transformers() -> None:
    """chat_template_kwargs reach the template as transformers' apply_chat_template(**kwargs)
    passes them; the names the rendering sets itself are refused."""
    expected = reference(THINKING)
    tok = tokenizer(THINKING)
    messages = [{"role": "user", "content": "hello"}]
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        rendered = expected.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **kwargs
        )
        assert tok.apply_chat_template(messages, template_kwargs=kwargs) == rendered
    assert "<think>" in tok.apply_chat_template(
        messages, template_kwargs={"enable_thinking": False}
    )
    assert "<think>" not in tok.apply_chat_template(messages)
    for name in ("messages", "tools", "add_generation_prompt"):
        with pytest.raises(ChatTemplateError, match=name):
            tok.apply_chat_template(messages, template_kwargs={name: []})


def test_template_globals_and_filters() -> None:
    template = (
        "{{ messages | tojson }}|{{ strftime_now('%Y') | length }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}"
        "{% endfor %}"
    )
    tok = tokenizer(template)
    messages = [{"role": "user", "content": "é <b>"}, {"role": "assistant", "content": "x"}]
    assert tok.apply_chat_template(messages) == reference(template).apply_chat_template(
        messages, tokenize=False
    )
    assert json.dumps(messages, ensure_ascii=False) in tok.apply_chat_template(messages)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        ([{"role": "user"}], r"messages\[0\].content"),
        ([{"content": "x"}], r"messages\[0\].role"),
        (["x"], "not an object"),
        ([{"role": "tool", "content": "x"}], "unknown role tool"),
    ],
)
def test_bad_messages_are_refused(messages: Any, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        tokenizer().apply_chat_template(messages)


def test_the_sandbox_stops_a_template_reaching_python() -> None:
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        tokenizer(escape).apply_chat_template([{"role": "user", "content": "x"}])
    mutate = "{{ messages.append(1) }}"
    with pytest.raises(ChatTemplateError):
        tokenizer(mutate).apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tokenizer(None).apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tokenizer("{% for %}").apply_chat_template([{"role": "user", "content": "x"}])


def test_files_round_trip_and_a_separate_template_file(tmp_path: Path) -> None:
    tok = tokenizer()
    tok.save(tmp_path)
    loaded = TextTokenizer.load(tmp_path)
    assert loaded.encode("the cat !") == tok.encode("the cat !")
    assert loaded.chat_template == LLAMA3_STYLE
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text(LLAMA3_STYLE)
    assert TextTokenizer.load(tmp_path).chat_template == LLAMA3_STYLE
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        TextTokenizer.load(tmp_path / "nothing")
