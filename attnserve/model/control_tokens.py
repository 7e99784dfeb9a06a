"""Control tokens only where the chat template writes them: the text a client sends is data.

A vocabulary's control tokens are the added tokens tokenizer.json marks special
(`<|im_start|>`, `<|eot_id|>`, `<start_of_turn>`, `[INST]`, `<|end|>`, ...). Hugging Face's
tokenizers find them in any text they encode, so a chat rendered by its template and then
encoded would turn a user's `<|im_end|>` into the real token: a forged turn. Here:

- a text (a raw prompt) is encoded as transformers encodes it with `split_special_tokens=True`:
  a special token's text is tokenized as the characters it is made of. Added tokens that are
  not special (Qwen's `<tool_call>`) stay tokens, as there.
- a chat: every control token's text in the client's strings (the messages, tools and
  template variables, keys included) is replaced by a marker, a private-use character
  sequence the template passes on as it passes any text; the chat is rendered and encoded; the
  control tokens of that encoding are the template's own; the text between two of them that
  holds a marker is encoded again, markers restored, as text. A chat whose strings hold no
  control token's text is encoded exactly as before, in one pass (transformers' ids).

Splitting at the template's control tokens changes no other token: the tokenizer splits its
input at added tokens before anything else (absorbed whitespace of `lstrip` / `rstrip` tokens
included in the match), and each piece between them is normalized, pre-tokenized and merged
on its own. The one exception, Metaspace's `prepend_scheme: "first"` (a "▁" before the first
piece only), is kept by encoding pieces with a copy that never prepends and prepending for the
first piece.

tokenizers' `encode` holds the GIL while it runs (a 1 MB text: most of a second with no other
Python thread running); `encode_batch` releases it, so every encoding here goes through it.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from functools import lru_cache
from typing import Any

from tokenizers import Encoding
from tokenizers import Tokenizer as HFTokenizer

# Markers are drawn from the supplementary private use areas: a character no client string and
# no template holds, then the marker's number, then the character again.
PRIVATE_USE = re.compile("[\U000f0000-\U000ffffd\U00100000-\U0010fffd]")
MARKER_CHARS = (*range(0xF0000, 0xFFFFE), *range(0x100000, 0x10FFFE))


class ControlTokenInText(ValueError):
    """The vocabulary makes a control token out of plain text (its merges reach it)."""


class TokenLimitExceeded(Exception):
    """A text is past the token limit: a prefix of it alone holds more tokens."""

    def __init__(self, at_least: int, limit: int) -> None:
        super().__init__(f"more than {limit} tokens (at least {at_least})")
        self.at_least = at_least
        self.limit = limit


def encode(tokenizer: HFTokenizer, text: str, add_special_tokens: bool) -> Encoding:
    """`tokenizer.encode`, with the GIL released while it runs (`encode_batch`)."""
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]


def strings(data: Any) -> Iterator[str]:
    """Every string in JSON-like data: values, and keys of mappings."""
    if isinstance(data, str):
        yield data
    elif isinstance(data, Mapping):
        for key, value in data.items():
            yield from strings(key)
            yield from strings(value)
    elif isinstance(data, (list, tuple)):
        for item in data:
            yield from strings(item)


def _replace_strings(data: Any, replace: Any) -> Any:
    if isinstance(data, str):
        return replace(data)
    if isinstance(data, Mapping):
        return {_replace_strings(k, replace): _replace_strings(v, replace) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_replace_strings(item, replace) for item in data]
    return data


class Marked:
    """Client data with each control token's text replaced by a marker."""

    def __init__(self, data: Any, texts: list[str], char: str) -> None:
        self.data = data
        self.texts = texts  # marker k stands for texts[k]
        self.char = char
        self._pattern = re.compile(f"{re.escape(char)}([0-9]+){re.escape(char)}")

    def restore(self, text: str) -> str:
        """`text` with each marker replaced by the control token's text it stands for."""
        return self._pattern.sub(lambda m: self.texts[int(m.group(1))], text)


class ControlTokens:
    """A tokenizer's control tokens, and the encodings that keep client text from being
    read as them."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.tokenizer = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        self.ids = {token.content: int(i) for i, token in added.items() if token.special}
        self.id_set = frozenset(self.ids.values())
        self._texts = {i: text for text, i in self.ids.items()}
        longest_first = sorted(self.ids, key=len, reverse=True)
        self._pattern = (
            re.compile("|".join(re.escape(t) for t in longest_first)) if self.ids else None
        )
        self._plain: HFTokenizer | None = None
        self._first: str | None = None  # Metaspace's replacement where it prepends "first"
        self._lock = threading.Lock()

    def find(self, text: str) -> str | None:
        """The first control token's text in `text`; None when it holds none."""
        if self._pattern is None:
            return None
        match = self._pattern.search(text)
        return None if match is None else match.group(0)

    # -- text ----------------------------------------------------------------------------------

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of `text` with every control token's text in it tokenized as text (what the
        post-processor adds, BOS, is still added)."""
        encoding = encode(self.tokenizer, text, add_special_tokens)
        ids = encoding.ids
        # no control token's text in it (a regex search): the ids as they are, without a
        # walk over every token (BOS, which the post-processor adds, is a control id too)
        if self.find(text) is None or self.id_set.isdisjoint(ids):
            return list(ids)
        if not self._matched(encoding, text):
            return list(ids)
        return list(self._encode_plain(text, add_special_tokens, at_start=True).ids)

    def _read(self, token: int, text: str, start: int, end: int) -> bool:
        """Whether `token`, at [start, end) of the encoded `text`, is a control token read in
        the text: not one the post-processor added (it covers no text), nor the unknown token
        standing for other text."""
        return token in self.id_set and self._texts[token] in text[start:end]

    def _matched(self, encoding: Encoding, text: str) -> bool:
        """Whether the encoding read a control token in its text."""
        return any(
            self._read(token, text, start, end)
            for token, (start, end) in zip(encoding.ids, encoding.offsets, strict=True)
        )

    def plain(self) -> HFTokenizer:
        """A copy of the tokenizer that reads no control tokens in text (and never prepends
        Metaspace's "▁", see the module docstring)."""
        with self._lock:
            if self._plain is None:
                spec = json.loads(self.tokenizer.to_str())
                self._first = _never_prepend(spec.get("pre_tokenizer"))
                plain = HFTokenizer.from_str(json.dumps(spec))
                plain.encode_special_tokens = True
                self._plain = plain
            return self._plain

    def _encode_plain(self, text: str, add_special_tokens: bool, at_start: bool) -> Encoding:
        plain = self.plain()
        first = self._first
        if at_start and first is not None and text and not text.startswith((" ", first)):
            text = " " + text  # Metaspace's own prepend at the start of the input
        encoding = encode(plain, text, add_special_tokens)
        found = next(
            (
                self._texts[token]
                for token, (start, end) in zip(encoding.ids, encoding.offsets, strict=True)
                if self._read(token, text, start, end)
            ),
            None,
        )
        if found is not None:
            raise ControlTokenInText(
                f"the model's vocabulary reads the text {found!r} as its special token: "
                "leave it out"
            )
        return encoding

    # -- chats ---------------------------------------------------------------------------------

    def mark(self, data: Any, template: str) -> Marked | None:
        """`data` with each control token's text in its strings replaced by a marker; None
        when no string holds one (nothing to mark)."""
        pattern = self._pattern
        if pattern is None or not any(pattern.search(s) for s in strings(data)):
            return None
        taken = {c for s in [*strings(data), template] for c in PRIVATE_USE.findall(s)}
        char = next((chr(c) for c in MARKER_CHARS if chr(c) not in taken), None)
        if char is None:  # every private-use character taken: not a real chat
            raise ValueError("the chat's text holds every private-use character")
        texts: list[str] = []

        def replace(text: str) -> str:
            def one(match: re.Match[str]) -> str:
                texts.append(match.group(0))
                return f"{char}{len(texts) - 1}{char}"

            return pattern.sub(one, text)

        return Marked(_replace_strings(data, replace), texts, char)

    def encode_marked(self, rendered: str, marked: Marked) -> list[int]:
        """Ids of a chat rendered from marked data: the control tokens the template wrote,
        and between them the client's text, markers restored, as text."""
        encoding = encode(self.tokenizer, rendered, False)
        token_ids = encoding.ids
        ids: list[int] = []
        first_token, piece_start = 0, 0

        def piece(last_token: int, end: int) -> list[int]:
            text = rendered[piece_start:end]
            if marked.char not in text:
                return list(token_ids[first_token:last_token])
            restored = marked.restore(text)
            return list(self._encode_plain(restored, False, at_start=piece_start == 0).ids)

        for k, (token, (start, end)) in enumerate(zip(token_ids, encoding.offsets, strict=True)):
            if self._read(token, rendered, start, end):
                ids += piece(k, start)
                ids.append(token)
                first_token, piece_start = k + 1, end
        ids += piece(len(token_ids), len(rendered))
        return ids


def _never_prepend(spec: Any) -> str | None:
    """Turns Metaspace's `prepend_scheme: "first"` into "never" in a pre-tokenizer's JSON (in
    place); returns its replacement character where it did."""
    if not isinstance(spec, dict):
        return None
    if spec.get("type") == "Metaspace" and spec.get("prepend_scheme") == "first":
        spec["prepend_scheme"] = "never"
        return str(spec.get("replacement", "\u2581"))
    found = None
    for inner in spec.get("pretokenizers") or []:
        found = _never_prepend(inner) or found
    return found


def affixes(tokenizer: HFTokenizer) -> tuple[list[int], list[int]]:
    """The ids the post-processor puts before and after a text (BOS, EOS)."""
    probe = "a"
    bare = encode(tokenizer, probe, False).ids
    full = encode(tokenizer, probe, True).ids
    for at in range(len(full) - len(bare) + 1):
        if full[at : at + len(bare)] == bare:
            return list(full[:at]), list(full[at + len(bare) :])
    return [], []


def check_prefix(
    tokenizer: HFTokenizer, text: str, limit: int, chars_per_token: int, margin: int
) -> None:
    """TokenLimitExceeded when a prefix of `text` alone has more than `limit` + `margin`
    tokens. Only texts longer than `chars_per_token` x `limit` characters are looked at; the
    prefix is that long, cut at a white space where there is one near (the margin covers the
    tokens a cut can change)."""
    size = chars_per_token * limit
    if len(text) <= size:
        return
    near = max(0, size - 1024)
    space = max(text.rfind(" ", near, size), text.rfind("\n", near, size))
    cut = space if space > 0 else size
    count = len(encode(tokenizer, text[:cut], False).ids)
    if count > limit + margin:
        raise TokenLimitExceeded(count, limit)


def longest_token_bytes(tokenizer: HFTokenizer) -> int:
    """An upper bound of the UTF-8 bytes one token stands for: the longest entry of the
    vocabulary (a byte-level vocabulary's characters stand for one byte each; an added token
    and any other piece for at most its own UTF-8)."""
    from tokenizers import decoders

    added = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    pieces: Sequence[str] = [p for p in vocab if p not in added]
    byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
    longest = max((len(p) if byte_level else len(p.encode("utf-8")) for p in pieces), default=1)
    return max([longest, *(len(t.encode("utf-8")) for t in added)])


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


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """The bytes of text each token stands for, as OpenAI's logprobs `bytes` lists them: a
    byte-level vocabulary's characters mapped back to their bytes, a byte-fallback piece
    (`<0xF0>`) its byte, "▁" a space, an added token its text. A character of several
    bytes may be spread over tokens: each holds its part, and the parts joined are the text.
    Built once per tokenizer; each id's bytes are kept once asked for."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        from tokenizers import decoders

        self._tokenizer = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        self._added = {i: token.content.encode("utf-8") for i, token in added.items()}
        self.special = frozenset(i for i, token in added.items() if token.special)
        self._byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._values = {char: byte for byte, char in bytes_to_unicode().items()}
        decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
        # ByteFallback decodes each byte of an unfinished character to its own U+FFFD; the
        # byte-level decoder (from_utf8_lossy) the unfinished character to one
        self.byte_fallback = '"ByteFallback"' in json.dumps(decoder)
        self._cache: dict[int, bytes] = {}

    def __call__(self, ids: Sequence[int]) -> list[bytes]:
        return [self.one(int(token)) for token in ids]

    def one(self, token: int) -> bytes:
        cached = self._cache.get(token)
        if cached is None:
            cached = self._cache[token] = self._bytes(token)
        return cached

    def _bytes(self, token: int) -> bytes:
        if token in self._added:
            return self._added[token]
        piece = self._tokenizer.id_to_token(token) or ""
        fallback = _BYTE_PIECE.fullmatch(piece)
        if self._byte_level and all(char in self._values for char in piece):
            return bytes(self._values[char] for char in piece)
        if fallback is not None:
            return bytes([int(fallback.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")


def unfinished_bytes(data: bytes) -> int:
    """How many bytes at the end of UTF-8 `data` start a character of several bytes that the
    bytes after them would finish (0: the last character is whole)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back for the lead
            continue
        wanted = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4
        return back if byte >= 0xC0 and wanted > back else 0
    return 0
