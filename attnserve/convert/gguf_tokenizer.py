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
  so that both stay whole in text; the turn markers (`TURN_MARKERS`: `<end_of_turn>`,
  `<|im_end|>` ...) are special whatever their type, as llama.cpp overrides them, so that a
  chat's text cannot write them (transformers leaves a USER_DEFINED one plain);
* BOS added at encode time only when the file says so (`tokenizer.ggml.add_bos_token`).

For `tokenizer.ggml.model == "llama"` (SentencePiece BPE with byte fallback: Llama 2, Mistral,
Gemma, Phi-3) it builds what transformers builds from the file, a BPE over the vocabulary as
spelled (`▁` for a space, `<0xNN>` byte tokens), with byte fallback:

* the merges the file gives, or, as SentencePiece files list none, the ones its vocabulary
  implies: every split of a token into two tokens, ranked by the token's score (Gemma's scores
  do not follow its merge order; its tokens' order in the file does);
* the family's handling of spaces: Llama and Mistral a `▁` before the text (Metaspace, first
  section only); Phi-3 the same from a normalizer (so "  hi" keeps both spaces); Gemma none,
  spaces as `▁` and tokens of blank runs respelled as `▁` runs;
* BOS added unless the file says not to (llama.cpp's default for these vocabularies).

tests/convert/test_gguf_tokenizer.py compares the ids with transformers' tokenizer on the same
file. Other tokenizer models (Unigram "t5", ...) are refused with a clear error.
"""

from __future__ import annotations

from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from attnserve.model.control_tokens import bytes_to_unicode
from attnserve.model.text_tokenizer import TextTokenizer

CONTROL, USER_DEFINED = 3, 4
SPACE = "\u2581"  # SentencePiece's spelling of a space
# general.architecture -> how its SentencePiece vocabulary treats spaces (others: "llama")
SENTENCEPIECE_STYLES = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "phi3": "phi3"}

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


# Turn markers that some files type USER_DEFINED (plain added text) instead of CONTROL;
# llama.cpp overrides their type to control ("control-looking token ... was not control-type"),
# and so does the import: a chat's text must not be able to write them (service/prompts.py
# treats only special tokens as the template's own).
TURN_MARKERS = frozenset(
    ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>",
     "<|start_header_id|>", "<|end_header_id|>", "<|begin_of_text|>", "<|end_of_text|>",
     "<start_of_turn>", "<end_of_turn>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>",
     "<|im_sep|>", "<EOT>", "<s>", "</s>", "<bos>", "<eos>", "[INST]", "[/INST]")
)  # fmt: skip


def control_type(token: str, kind: int) -> bool:
    """Whether a token of GGUF type `kind` is made a special token: CONTROL ones, and the turn
    markers whatever their type."""
    return kind == CONTROL or (kind == USER_DEFINED and token in TURN_MARKERS)


class GGUFTokenizerError(ValueError):
    """The GGUF's tokenizer is of a kind attnserve does not build."""


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
        if control_type(t, kind) and set(t) <= alphabet
    ]
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == USER_DEFINED and not control_type(t, kind) and t in vocab
    ]
    if control:
        tokenizer.add_special_tokens(control)
    if user:
        tokenizer.add_tokens(user)
    return tokenizer


def implied_merges(tokens: list[str], rank: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a vocabulary without any implies: every split of a token into two tokens of
    the vocabulary, best-ranked token first (ties: the longer left part first), as
    transformers' `generate_merges` orders them."""
    index = {token: i for i, token in enumerate(tokens)}
    found: list[tuple[str, str, float]] = []
    for token, score in rank.items():
        local = [
            (token[:cut], token[cut:], score)
            for cut in range(1, len(token))
            if token[:cut] in index and token[cut:] in index
        ]
        local.sort(key=lambda m: (index[m[0]], index[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def sentencepiece_bpe(fields: dict[str, Any]) -> Tokenizer:
    """The SentencePiece BPE tokenizer of GGUF tokenizer metadata (see the module doc)."""
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    style = SENTENCEPIECE_STYLES.get(str(fields.get("general.architecture", "")), "llama")
    if style == "gemma":  # blank runs are stored as spaces, looked up as ▁ runs
        tokens = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = {token: index for index, token in enumerate(tokens)}
    if fields.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ")) for m in fields["tokenizer.ggml.merges"]]
    else:
        if style == "gemma":
            rank: dict[str, float] = {t: -float(i) for i, t in enumerate(tokens)}
        else:
            scores = list(fields.get("tokenizer.ggml.scores", []))
            if len(scores) != len(tokens):
                raise GGUFTokenizerError("the GGUF's SentencePiece vocabulary has no scores")
            rank = dict(zip(tokens, map(float, scores), strict=True))
        merges = implied_merges(tokens, rank)
    unk_index = fields.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_index)] if style == "gemma" and unk_index is not None else None
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if style == "gemma":
        tokenizer.normalizer = normalizers.Replace(" ", SPACE)
        tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif style == "phi3":
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)]
        )
        steps.append(decoders.Strip(content=" ", left=1))
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE, prepend_scheme="first", split=False
        )
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    types = list(fields.get("tokenizer.ggml.token_type", []))
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, types, strict=False)
        if control_type(t, kind)
    ]
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == USER_DEFINED and not control_type(t, kind)
    ]
    if control:
        tokenizer.add_special_tokens(control)
    if user:
        tokenizer.add_tokens(user)
    return tokenizer


def gguf_text_tokenizer(fields: dict[str, Any]) -> TextTokenizer:
    """The TextTokenizer (tokenizer.json + tokenizer_config.json) of GGUF metadata: every
    `tokenizer.*` key, arrays as lists, and `general.architecture`."""
    kind = fields.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = byte_level_bpe(fields)
        default_bos = False
    elif kind == "llama":
        tokenizer = sentencepiece_bpe(fields)
        default_bos = True  # llama.cpp adds BOS to these unless the file says not to
    else:
        raise GGUFTokenizerError(
            f"tokenizer.ggml.model {kind!r} is not supported (byte-level BPE, 'gpt2', and "
            "SentencePiece BPE, 'llama', are)"
        )
    tokens = fields["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {}
    for name, key in SPECIAL_KEYS.items():
        index = fields.get(key)
        if index is not None and 0 <= int(index) < len(tokens):
            config[name] = tokens[int(index)]
    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", default_bos))
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
