"""A GGUF file's tokenizer as a Hugging Face `tokenizers` tokenizer.json, with its chat template.

A GGUF carries no tokenizer.json: its metadata hold the vocabulary (`tokenizer.ggml.tokens`),
the token types, the BPE merges, the special token ids, the add-BOS flag and the chat template.
For `tokenizer.ggml.model == "gpt2"` (byte-level BPE: GPT-2, SmolLM, Llama 3, Qwen ...) this
builds what transformers' GGUF loader builds (integrations/gguf/gguf_tokenizer_mapping.py):

* BPE over the vocabulary with the file's merges (no unknown token, no dropout), tokens written
  in GPT-2's byte alphabet (a token spelled otherwise is mapped to it);
* the byte-level pre-tokenizer with GPT-2's split regex, or, for the pre-tokenizer names that
  need another split (`tokenizer.ggml.pre`: llama3, qwen2, ...), that regex and a byte-level
  step without its own;
* the byte-level decoder;
* CONTROL tokens (type 3) added as special tokens, USER_DEFINED ones (type 4) as added tokens,
  so that both stay whole in text;
* BOS added at encode time only when the file says so (`tokenizer.ggml.add_bos_token`).

tests/convert/test_gguf_tokenizer.py compares the ids with transformers' tokenizer on the same
file. Other tokenizer models (SentencePiece "llama", "t5") are refused with a clear error.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from attnserve.model.text_tokenizer import TextTokenizer

CONTROL, USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex its merges were learned with (GPT-2's when absent)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
SPECIAL_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


class GGUFTokenizerError(ValueError):
    """The GGUF's tokenizer is of a kind attnserve does not build."""


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values to printable characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, codes, strict=True)}


def byte_level_bpe(fields: dict[str, Any]) -> Tokenizer:
    """The byte-level BPE tokenizer of GGUF tokenizer metadata (see the module doc)."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    vocab = {
        token
        if set(token) <= alphabet
        else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    merges = [tuple(m.split(" ")) for m in fields.get("tokenizer.ggml.merges", [])]
    if not merges:
        raise GGUFTokenizerError("the GGUF's byte-level BPE tokenizer has no merges")
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = PRE_TOKENIZER_SPLITS.get(str(fields.get("tokenizer.ggml.pre", "")))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    types = list(fields.get("tokenizer.ggml.token_type", []))
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, types, strict=False)
        if kind == CONTROL and set(t) <= alphabet
    ]
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == USER_DEFINED and t in vocab
    ]
    if control:
        tokenizer.add_special_tokens(control)
    if user:
        tokenizer.add_tokens(user)
    return tokenizer


def gguf_text_tokenizer(fields: dict[str, Any]) -> TextTokenizer:
    """The TextTokenizer (tokenizer.json + tokenizer_config.json) of GGUF metadata: every
    `tokenizer.*` key, arrays as lists."""
    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFTokenizerError(
            f"tokenizer.ggml.model {kind!r} is not supported (byte-level BPE, 'gpt2', is)"
        )
    tokenizer = byte_level_bpe(fields)
    tokens = fields["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {}
    for name, key in SPECIAL_KEYS.items():
        index = fields.get(key)
        if index is not None and 0 <= int(index) < len(tokens):
            config[name] = tokens[int(index)]
    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", False))
    config["add_bos_token"] = add_bos
    config["add_eos_token"] = bool(fields.get("tokenizer.ggml.add_eos_token", False))
    if add_bos and config.get("bos_token"):
        bos = config["bos_token"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    if fields.get("tokenizer.chat_template"):
        config["chat_template"] = str(fields["tokenizer.chat_template"])
    return TextTokenizer(tokenizer, config)
