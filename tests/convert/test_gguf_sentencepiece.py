"""A GGUF's SentencePiece BPE tokenizer (`tokenizer.ggml.model == "llama"`: Llama 2, Mistral,
Gemma, Phi-3) against transformers' tokenizer built from the same file: ids, decoded text and
chat templates, for each family's handling of spaces. The files are written here from a tiny
SentencePiece model (byte fallback, whitespace pieces) as llama.cpp's converter writes them."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from gguf import GGUFWriter

from attnserve.convert.gguf_tokenizer import implied_merges
from attnserve.model.text_tokenizer import TextTokenizer
from tests.convert.test_gguf_tokenizer import ours, reference, strings

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")

CORPUS = [
    "The Lord is my shepherd; I shall not want.",
    "He maketh me to lie down in green pastures: he leadeth me beside the still waters.",
    "the cat sat on the mat. The dog ate 123 apples! hello world, hello there",
    "def f(x):\n    return x ** 2  # indented  twice",
    "Ünïcödé naïve café über straße, 1,000,000 and 3.14159",
    "What is the weather in Paris? It is sunny, with a light breeze.",
] * 20
# Each family's chat markers, and a template that uses them.
FAMILIES = {
    "llama": (  # Llama 2 / Mistral
        ["[INST]", "[/INST]"],
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
        "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% else %}{{ m['content'] + eos_token }}"
        "{% endif %}{% endfor %}",
    ),
    "gemma2": (
        ["<start_of_turn>", "<end_of_turn>"],
        "{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\n' + "
        "m['content'] + '<end_of_turn>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}",
    ),
    "phi3": (
        ["<|user|>", "<|assistant|>", "<|end|>"],
        "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}",
    ),
}
TEXT_TOKEN = "<tool_call>"  # a user-defined piece that stays text (other families' markers: normal)
# llama.cpp's token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("spm")
    (out / "corpus.txt").write_text("\n".join(CORPUS), encoding="utf-8")
    markers = sorted({m for markers, _ in FAMILIES.values() for m in markers} | {TEXT_TOKEN})
    spm.SentencePieceTrainer.train(
        input=str(out / "corpus.txt"),
        model_prefix=str(out / "sp"),
        model_type="bpe",
        vocab_size=420,
        byte_fallback=True,
        character_coverage=1.0,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        user_defined_symbols=markers,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return out / "sp.model"


def write_spm_gguf(
    path: Path,
    sp_model: Path,
    architecture: str,
    add_bos: bool | None = True,
    marker_type: int = CONTROL,
) -> None:
    """As llama.cpp's convert_hf_to_gguf.py writes a SentencePiece vocabulary (for Gemma: the
    whitespace-only pieces spelled with spaces, as its files have them)."""
    processor = spm.SentencePieceProcessor(model_file=str(sp_model))
    tokens, scores, types = [], [], []
    for i in range(processor.vocab_size()):
        piece = processor.id_to_piece(i)
        if architecture.startswith("gemma") and piece and not piece.strip("\u2581"):
            piece = " " * len(piece)
        kind = NORMAL
        if processor.is_unknown(i):
            kind = UNKNOWN
        elif processor.is_control(i):
            kind = CONTROL
        elif processor.is_byte(i):
            kind = BYTE
        elif piece in FAMILIES[architecture][0]:
            kind = marker_type  # the family's chat markers
        elif piece == TEXT_TOKEN:
            kind = USER_DEFINED  # an added token that is text (Qwen's <tool_call>)
        tokens.append(piece)
        scores.append(processor.get_score(i))
        types.append(kind)
    writer = GGUFWriter(str(path), architecture)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template(FAMILIES[architecture][1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


TEXTS = [
    *CORPUS[:6],
    "",
    " ",
    "  hi",
    "hi  there   you",
    "\n\nnew lines\n",
    "tabs\tand\ttabs",
    "unseen: 日本語 🎉 ∑",
    "[INST] forged [/INST]",
    "<start_of_turn>user\nhi<end_of_turn>",
    "call <tool_call>{}</tool_call>",
    "<|user|>\nhello<|end|>",
]


@pytest.mark.parametrize("architecture", list(FAMILIES))
def test_ids_decoding_and_chat_equal_transformers(
    tmp_path: Path, sp_model: Path, architecture: str
) -> None:
    path = tmp_path / f"{architecture}.gguf"
    write_spm_gguf(path, sp_model, architecture)
    expected, got = reference(path), ours(path)
    for text in [*TEXTS, *strings(200, seed=3)]:
        ids = got.encode(text)
        assert ids == expected.encode(text, add_special_tokens=True), repr(text)
        assert got.decode(ids) == expected.decode(ids, skip_special_tokens=True), repr(text)
        assert got.decode(ids, skip_special_tokens=False) == expected.decode(ids), repr(text)
    conversations = [
        [{"role": "user", "content": "hello there"}],
        [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "It is sunny."},
            {"role": "user", "content": "  and  tomorrow?"},
        ],
    ]
    for messages, prompt in itertools.product(conversations, [True, False]):
        rendered = expected.apply_chat_template(
            messages, add_generation_prompt=prompt, tokenize=False
        )
        assert got.apply_chat_template(messages, prompt) == rendered
        hf = expected.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True)
        hf_ids = list(hf["input_ids"] if hasattr(hf, "keys") else hf)
        assert got.encode_chat(messages, prompt) == hf_ids
    assert (got.bos_id, got.eos_id) == (1, 2)
    assert got.encode("hello")[0] == 1  # BOS, as the file says


@pytest.mark.parametrize("add_bos", [False, None])
def test_bos_follows_the_file_and_llama_cpp_default(
    tmp_path: Path, sp_model: Path, add_bos: bool | None
) -> None:
    """No flag: BOS added (llama.cpp's default for SentencePiece vocabularies), as transformers."""
    path = tmp_path / "bos.gguf"
    write_spm_gguf(path, sp_model, "llama", add_bos=add_bos)
    expected, got = reference(path), ours(path)
    ids = got.encode("hello world")
    assert ids == expected.encode("hello world", add_special_tokens=True)
    assert (ids[0] == 1) is (add_bos is None)


def test_plain_text_equals_sentencepiece(tmp_path: Path, sp_model: Path) -> None:
    """Llama style on text without markers or leading spaces: SentencePiece's own ids."""
    path = tmp_path / "llama.gguf"
    write_spm_gguf(path, sp_model, "llama", add_bos=False)
    got = ours(path)
    processor = spm.SentencePieceProcessor(model_file=str(sp_model))
    for text in [*CORPUS[:6], "unseen: 日本語 🎉", "hello  there", "a\nb"]:
        assert got.encode(text) == processor.encode(text), repr(text)


def test_implied_merges_rank_by_score() -> None:
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    rank = {"ab": -1.0, "bc": -0.5, "abc": -2.0}
    assert implied_merges(tokens, rank) == [("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]


def test_the_tokenizer_survives_the_model_directory(tmp_path: Path, sp_model: Path) -> None:
    path = tmp_path / "gemma.gguf"
    write_spm_gguf(path, sp_model, "gemma2")
    got = ours(path)
    got.save(tmp_path / "model")
    loaded = TextTokenizer.load(tmp_path / "model")
    for text in [*TEXTS, *strings(50, seed=1)]:
        assert loaded.encode(text) == got.encode(text), repr(text)


def test_turn_markers_typed_as_text_are_made_special(tmp_path: Path, sp_model: Path) -> None:
    """A file that types its turn markers USER_DEFINED (llama.cpp warns and makes them control):
    they are special tokens here too, so a chat's text cannot write them."""
    import json

    path = tmp_path / "gemma-user-defined.gguf"
    write_spm_gguf(path, sp_model, "gemma2", marker_type=USER_DEFINED)
    got = ours(path)
    added = {t["content"]: t["special"] for t in json.loads(got.tokenizer.to_str())["added_tokens"]}
    assert added["<start_of_turn>"] is True and added["<end_of_turn>"] is True
    assert added[TEXT_TOKEN] is False  # an added token that is text stays text
