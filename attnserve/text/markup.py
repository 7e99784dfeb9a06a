"""HTML in, HTML out: text nodes translated, every tag and attribute kept as sent.

`parse_html` reads a fragment or a page into tokens with their exact source text (a tokenizer of
HTML's syntax, not a tree builder: nothing is re-serialised) and refuses markup it could not give
back well-formed (a tag never closed, an end tag that closes nothing, a `<` that starts an
unterminated tag). Every element that is not inline text-level markup (`INLINE`) ends a *block*;
a block's text, entities decoded and inline tags left out, is a document of its own. Inline tags
go back around the words they wrapped:

- an inline element that covers whole sentences wraps their translations;
- one inside a sentence wraps the words of that sentence's translation that best match the
  separate translation of its own text (`HtmlDocument.inline_units`: exact match first, then the
  window of words most similar to it);
- an element of `KEEP` (code, kbd, ... or `translate="no"`) inside a sentence keeps its text
  verbatim in place of the words that match it; as a block (pre, script, style, ...) it is copied.
"""

from __future__ import annotations

import difflib
import html
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

VOID = frozenset({
    "area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source",
    "track", "wbr",
})  # fmt: skip
INLINE = frozenset({
    "a", "abbr", "b", "bdi", "bdo", "big", "cite", "code", "data", "del", "dfn", "em", "font", "i",
    "ins", "kbd", "label", "mark", "q", "s", "samp", "small", "span", "strike", "strong", "sub",
    "sup", "time", "tt", "u", "var",
})  # fmt: skip
KEEP = frozenset({"code", "kbd", "samp", "var"})  # inline, copied verbatim
# Blocks copied verbatim.
RAW = frozenset(
    {"script", "style", "textarea", "title", "pre", "noscript", "template", "svg", "math"}
)

_TAG = re.compile(
    r"""<(?P<end>/)?(?P<name>[A-Za-z][A-Za-z0-9:-]*)"""
    r"""(?P<attrs>(?:\s+[^\s"'>/=]+(?:\s*=\s*(?:"[^"]*"|'[^']*'|[^\s"'=<>`]+))?)*)"""
    r"""\s*(?P<self>/)?>"""
)
_OTHER = re.compile(r"<!--.*?-->|<!\[CDATA\[.*?\]\]>|<![^>]*>|<\?[^>]*>", re.DOTALL)
_NO_TRANSLATE = re.compile(
    r"""\btranslate\s*=\s*["']?no\b|\bclass\s*=\s*["'][^"']*\bnotranslate\b""", re.I
)


class HtmlError(ValueError):
    """Markup that could not be given back well-formed; the message says where."""


@dataclass
class Tag:
    raw: str
    name: str
    end: bool = False
    keep: bool = False  # translate="no" / class="notranslate"


@dataclass
class Element:
    """An inline element of a block: its tags and the [a, b) its text covers in the block."""

    start: str
    end: str
    a: int
    b: int
    keep: bool
    depth: int


@dataclass
class Block:
    """Text and inline elements between two block boundaries, as plain text."""

    plain: str
    elements: list[Element] = field(default_factory=list)


Piece = str | Block  # verbatim markup, or a block to translate


def parse_html(source: str) -> list[Piece]:
    """The markup as verbatim pieces and blocks, in order; HtmlError if not well-formed."""
    pieces: list[Piece] = []
    stack: list[Tag] = []
    block: _BlockBuilder | None = None
    raw_until: str | None = None  # inside a RAW or kept block element: copy until its end tag
    kept_depth = 0
    at = 0
    for token, text in _tokens(source):
        if raw_until is not None:
            if isinstance(token, Tag) and token.end and token.name == raw_until:
                stack.pop()
                raw_until = None
            pieces.append(text)
            continue
        if isinstance(token, str):  # text
            if block is None:
                block = _BlockBuilder()
            block.text(html.unescape(text), keep=kept_depth > 0)
            continue
        if token.name in INLINE and token.name not in VOID:
            if block is None:
                block = _BlockBuilder()
            if token.end:
                opened = _close(stack, token, at)
                if opened.keep:
                    kept_depth -= 1
                block.close(token.raw)
            else:
                token.keep = token.keep or token.name in KEEP or kept_depth > 0
                kept_depth += token.keep
                stack.append(token)
                block.open(token.raw, token.keep)
            continue
        if block is not None:
            pieces.extend(block.finish())
            block = None
        if token.name == "!":
            pieces.append(text)
        elif token.end:
            _close(stack, token, at)
            pieces.append(text)
        else:
            pieces.append(text)
            if token.name not in VOID and not text.endswith("/>"):
                stack.append(token)
                if token.name in RAW or token.keep:
                    raw_until = token.name
        at += len(text)
    if block is not None:
        pieces.extend(block.finish())
    if stack:
        raise HtmlError(f"<{stack[-1].name}> is never closed")
    if raw_until is not None:
        raise HtmlError(f"<{raw_until}> is never closed")
    return pieces


def _close(stack: list[Tag], end: Tag, at: int) -> Tag:
    if not stack or stack[-1].name != end.name:
        open_ = f"<{stack[-1].name}> is still open" if stack else "no element is open"
        raise HtmlError(f"</{end.name}> does not close the element before it ({open_})")
    return stack.pop()


def _tokens(source: str) -> list[tuple[Tag | str, str]]:
    """(Tag or text, its source) in order; comments and declarations are Tags named "!"."""
    out: list[tuple[Tag | str, str]] = []
    at = 0
    text_start = 0
    while True:
        lt = source.find("<", at)
        if lt < 0:
            break
        m = _TAG.match(source, lt)
        other = None if m else _OTHER.match(source, lt)
        if m is None and other is None:
            nxt = source[lt + 1 : lt + 2]
            if nxt.isalpha() or nxt in ("/", "!", "?"):
                raise HtmlError(f"a tag at character {lt} is not terminated or malformed")
            at = lt + 1  # "a < b": text
            continue
        if text_start < lt:
            out.append((source[text_start:lt], source[text_start:lt]))
        if m is not None:
            name = m["name"].lower()
            tag = Tag(m.group(), name, end=bool(m["end"]))
            tag.keep = not tag.end and bool(_NO_TRANSLATE.search(m["attrs"] or ""))
            out.append((tag, m.group()))
            at = m.end()
        else:
            assert other is not None
            out.append((Tag(other.group(), "!"), other.group()))
            at = other.end()
        text_start = at
    if text_start < len(source):
        out.append((source[text_start:], source[text_start:]))
    return out


class _BlockBuilder:
    def __init__(self) -> None:
        self.parts: list[str] = []
        self.length = 0
        self.open_elements: list[Element] = []
        self.elements: list[Element] = []

    def text(self, text: str, keep: bool) -> None:
        self.parts.append(text)
        self.length += len(text)

    def open(self, raw: str, keep: bool) -> None:
        element = Element(raw, "", self.length, -1, keep, len(self.open_elements))
        self.open_elements.append(element)
        self.elements.append(element)

    def close(self, raw: str) -> None:
        element = self.open_elements.pop()
        element.end, element.b = raw, self.length

    def finish(self) -> list[Piece]:
        plain = "".join(self.parts)
        if not plain.strip() and not self.elements:
            return [html.escape(plain, quote=False)] if plain else []
        return [Block(plain, self.elements)]


# -- putting a translated block back together ------------------------------------------------


def render_block(
    block: Block,
    spans: Sequence[tuple[int, int]],
    translations: Sequence[str],
    inline: dict[int, str],
) -> str:
    """The block's HTML: its plain text with `spans` replaced by `translations`, the inline
    elements' tags around the matching words. `inline[i]`: the translation of element i's own
    text, for an element inside one sentence."""
    out_parts: list[str] = []
    unit_out: list[tuple[int, int]] = []
    at = 0
    length = 0
    for (a, b), translated in zip(spans, translations, strict=True):
        gap = block.plain[at:a]
        out_parts.append(gap)
        length += len(gap)
        unit_out.append((length, length + len(translated)))
        out_parts.append(translated)
        length += len(translated)
        at = b
    out_parts.append(block.plain[at:])
    text = "".join(out_parts)

    def position(p: int, start: bool) -> int:
        """Where plain position p lands in the output (inside a unit: its start or end)."""
        prev_end_in, prev_end_out = 0, 0
        for (a, b), (oa, ob) in zip(spans, unit_out, strict=True):
            if p <= a:
                return prev_end_out + min(p - prev_end_in, a - prev_end_in)
            if p < b:
                return oa if start else ob
            prev_end_in, prev_end_out = b, ob
        return prev_end_out + (p - prev_end_in)

    ranges: list[tuple[int, int]] = []
    replace: dict[int, str] = {}
    for i, element in enumerate(block.elements):
        x, y = position(element.a, True), position(element.b, False)
        unit = _inside_unit(element, spans)
        if unit is not None and element.b > element.a:
            oa, ob = unit_out[unit]
            wanted = block.plain[element.a : element.b] if element.keep else inline.get(i, "")
            found = locate(text[oa:ob], wanted.strip())
            if found is not None:
                x, y = oa + found[0], oa + found[1]
            if element.keep:
                replace[i] = block.plain[element.a : element.b].strip()
        ranges.append((x, y))
    ranges = _nest(block.elements, ranges)
    return _emit(text, block.elements, ranges, replace)


def _inside_unit(element: Element, spans: Sequence[tuple[int, int]]) -> int | None:
    """The unit that contains the element's text without being covered by it."""
    for i, (a, b) in enumerate(spans):
        if a <= element.a and element.b <= b:
            inner = (element.a, element.b) != (a, b)
            text_covers = element.a <= a and b <= element.b
            return i if inner and not text_covers else None
    return None


_WORDS = re.compile(r"\S+")


def locate(haystack: str, needle: str) -> tuple[int, int] | None:
    """[start, end) of `needle` in `haystack`: exactly, case-insensitively, else the window of
    whole words most similar to it (None for an empty needle or haystack)."""
    if not needle or not haystack.strip():
        return None
    at = haystack.find(needle)
    if at < 0:
        at = haystack.lower().find(needle.lower())
    if at >= 0:
        return at, at + len(needle)
    words = [(m.start(), m.end()) for m in _WORDS.finditer(haystack)]
    n = len(needle.split())
    best: tuple[float, int, int] = (-1.0, 0, 0)
    for size in {max(1, n - 1), n, n + 1}:
        for i in range(max(1, len(words) - size + 1)):
            a, b = words[i][0], words[min(i + size, len(words)) - 1][1]
            window = haystack[a:b].strip(".,;:!?\"'()")
            score = difflib.SequenceMatcher(None, window.lower(), needle.lower()).ratio()
            if score > best[0]:
                best = (score, a, a + len(window) if haystack[a:b].startswith(window) else b)
    return best[1], best[2]


def _nest(elements: Sequence[Element], ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ranges made to nest as the elements do: a child inside its parent, siblings apart."""
    out = list(ranges)
    for i, element in enumerate(elements):
        x, y = out[i]
        parent = next((j for j in range(i - 1, -1, -1) if elements[j].depth < element.depth), None)
        if parent is not None:
            px, py = out[parent]
            x, y = min(max(x, px), py), min(max(y, px), py)
        sibling = next(
            (
                j
                for j in range(i - 1, -1, -1)
                if elements[j].depth == element.depth and (parent is None or j > parent)
            ),
            None,
        )
        if sibling is not None and x < out[sibling][1]:
            x = max(x, out[sibling][1])
            y = max(y, x)
        out[i] = (x, max(x, y))
    return out


def _emit(
    text: str,
    elements: Sequence[Element],
    ranges: Sequence[tuple[int, int]],
    replace: dict[int, str],
) -> str:
    """`text` escaped, with each element's start tag at its range's start and end tag at its
    end (opened outer first, closed inner first); kept elements' text replaced."""
    opens: dict[int, list[int]] = {}
    closes: dict[int, list[int]] = {}
    for i, (x, y) in enumerate(ranges):
        opens.setdefault(x, []).append(i)
        if y > x:  # an empty element closes right after it opens
            closes.setdefault(y, []).append(i)
    skip_until = -1
    out: list[str] = []
    for p in range(len(text) + 1):
        for i in sorted(closes.get(p, []), key=lambda k: -k):
            out.append(elements[i].end)
        for i in sorted(opens.get(p, [])):
            out.append(elements[i].start)
            if ranges[i][0] == ranges[i][1]:
                out.append(elements[i].end)
            elif i in replace:
                out.append(html.escape(replace[i], quote=False))
                skip_until = max(skip_until, ranges[i][1])
        if p < len(text) and p >= skip_until:
            out.append(html.escape(text[p], quote=False))
    return "".join(out)
