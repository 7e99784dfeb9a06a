"""HTML in, HTML out: text nodes translated, every tag and attribute kept as sent.

`parse_html` reads a fragment or a page into verbatim markup and blocks of text (a scanner of
HTML's syntax with each token's exact source, not a tree builder: nothing is re-serialised),
puts the end tags HTML lets a page leave out (`<p>A<p>B`, `<li>`, table cells and rows: the
standard's optional tags) where a browser ends those elements, and refuses markup it could not
give back well-formed: another tag never closed, an end tag that closes nothing, a tag, comment
or CDATA section that never ends. Every element that is not inline
text-level markup (`INLINE`), or an inline one that holds such an element, ends a *block*; a
block's text, entities decoded and inline tags left out, is a document of its own. Void inline
elements (`ATOMS`: img, input, ...) and comments inside a block stay where they were, between
the same words. Inline tags go back around the words they wrapped:

- an inline element that covers whole sentences wraps their translations;
- one inside a sentence wraps the words of that sentence's translation that match the separate
  translation of its own text (`render_block`'s `inline`: the nearest exact match after the
  previous element's, else the window of words most similar to it); an empty one stays at the
  same place relative to the sentence's length;
- an element of `KEEP` (code, kbd, samp, var) or with `translate="no"` keeps its inner source
  verbatim in place of the words that match it; as a block (pre, script, style, ...) it is
  copied, and a sentence all inside one is not translated.
"""

from __future__ import annotations

import bisect
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
ATOMS = frozenset({"img", "input", "wbr", "embed", "area", "track", "source", "param"})
KEEP = frozenset({"code", "kbd", "samp", "var"})  # inline, copied verbatim
RAW_TEXT = frozenset({"script", "style", "textarea", "title"})  # content is not markup
VERBATIM = frozenset({"pre", "noscript", "template", "svg", "math"})  # blocks copied as sent
MAX_SHOWN = 40  # characters of a tag name an error message shows

# HTML's optional end tags (the HTML Standard's "optional tags"): an element of these ends
# where a start tag named here begins (its next sibling, or a block for a paragraph), where an
# element that holds it ends, or at the end of the document.
_P_ENDS = frozenset({
    "address", "article", "aside", "blockquote", "details", "dialog", "div", "dl", "dd", "dt",
    "fieldset", "figcaption", "figure", "footer", "form", "h1", "h2", "h3", "h4", "h5", "h6",
    "header", "hgroup", "hr", "li", "main", "menu", "nav", "ol", "p", "pre", "search", "section",
    "table", "ul", "center", "dir", "summary", "listing", "xmp", "plaintext",
})  # fmt: skip
_ROWS = frozenset({"tr", "tbody", "thead", "tfoot"})
ENDED_BY: dict[str, frozenset[str]] = {
    "p": _P_ENDS,
    "li": frozenset({"li"}),
    "dt": frozenset({"dt", "dd"}),
    "dd": frozenset({"dt", "dd"}),
    "rb": frozenset({"rb", "rt", "rtc", "rp"}),
    "rt": frozenset({"rb", "rt", "rtc", "rp"}),
    "rtc": frozenset({"rb", "rtc", "rp"}),
    "rp": frozenset({"rb", "rt", "rtc", "rp"}),
    "option": frozenset({"option", "optgroup", "hr"}),
    "optgroup": frozenset({"optgroup", "hr"}),
    "td": frozenset({"td", "th"}) | _ROWS,
    "th": frozenset({"td", "th"}) | _ROWS,
    "tr": _ROWS,
    "thead": frozenset({"tbody", "tfoot"}),
    "tbody": frozenset({"tbody", "tfoot"}),
    "caption": frozenset({"colgroup", "thead", "tbody", "tfoot", "tr"}),
    "colgroup": frozenset({"colgroup", "thead", "tbody", "tfoot", "tr"}),
    "head": frozenset({"body"}),
}
OPTIONAL_END = frozenset(ENDED_BY) | {"tfoot", "html", "body"}
_ROOTS = frozenset({"html", "body"})
# A table's start tags end a cell, row or section through what is open in it (a paragraph or
# list item left open in a cell: `<td><p>a<td>b`), as a browser closes the cell.
_IN_TABLE = OPTIONAL_END - _ROOTS - {"head"}
_THROUGH = {name: _IN_TABLE for name in ("td", "th", "tr", "tbody", "thead", "tfoot", "caption")}
# End tags a browser takes without their start tag: `</p>` (an empty paragraph), and those of
# elements whose start tag a page may leave out.
_LONE_END = frozenset({"p", "html", "head", "body", "tbody"})

_TAG = re.compile(
    r"""<(?P<end>/)?(?P<name>[A-Za-z][A-Za-z0-9:-]*)"""
    r"""(?P<attrs>(?:\s+[^\s"'>/=]+(?:\s*=\s*(?:"[^"]*"|'[^']*'|[^\s"'=<>`]+))?)*)"""
    r"""\s*(?P<self>/)?>"""
)
_NO_TRANSLATE = re.compile(
    r"""\btranslate\s*=\s*["']?no\b|\bclass\s*=\s*["'][^"']*\bnotranslate\b""", re.I
)


class HtmlError(ValueError):
    """Markup that could not be given back well-formed; the message says where."""


@dataclass
class Tag:
    raw: str
    name: str  # "!" for a comment, declaration or processing instruction
    end: bool = False
    keep: bool = False  # translate="no" / class="notranslate", or a KEEP element
    closed: bool = False  # <x/> or a void element: no end tag follows
    blockish: bool = False  # an inline element that holds a block element: a boundary


@dataclass
class Element:
    """An inline element (or a zero-width atom) of a block: its tags and the [a, b) its text
    covers in the block's plain text; a kept element's inner source in `verbatim`."""

    start: str
    end: str
    a: int
    b: int
    depth: int
    verbatim: str | None = None


@dataclass
class Block:
    """Text and inline elements between two block boundaries, as plain text."""

    plain: str
    elements: list[Element] = field(default_factory=list)
    kept: list[tuple[int, int]] = field(default_factory=list)  # plain ranges of kept elements


Piece = str | Block  # verbatim markup, or a block to translate


def _shown(name: str) -> str:
    return name if len(name) <= MAX_SHOWN else f"{name[:MAX_SHOWN]}..."


def _tokens(source: str) -> list[Tag | str]:
    """Tags and text in order; a raw-text element's content is one text token."""
    out: list[Tag | str] = []
    at = text_start = 0
    while (lt := source.find("<", at)) >= 0:
        end = -1
        tag: Tag | None = None
        for opener, closer in (("<!--", "-->"), ("<![CDATA[", "]]>")):
            if source.startswith(opener, lt):
                end = source.find(closer, lt + len(opener))
                if end < 0:
                    raise HtmlError(f"the {opener} at character {lt} is never closed")
                end += len(closer)
                tag = Tag(source[lt:end], "!", closed=True)
                break
        if tag is None and source.startswith(("<!", "<?"), lt):
            end = source.find(">", lt)
            if end < 0:
                raise HtmlError(f"the declaration at character {lt} is never closed")
            end += 1
            tag = Tag(source[lt:end], "!", closed=True)
        if tag is None:
            m = _TAG.match(source, lt)
            if m is None:
                if source[lt + 1 : lt + 2].isalpha() or source[lt + 1 : lt + 2] == "/":
                    raise HtmlError(f"the tag at character {lt} is not terminated or malformed")
                at = lt + 1  # "a < b": text
                continue
            name = m["name"].lower()
            tag = Tag(m.group(), name, end=bool(m["end"]), closed=bool(m["self"]) or name in VOID)
            tag.keep = not tag.end and (name in KEEP or bool(_NO_TRANSLATE.search(m["attrs"])))
            end = m.end()
        if text_start < lt:
            out.append(source[text_start:lt])
        out.append(tag)
        at = text_start = end
        if tag.name in RAW_TEXT and not tag.end and not tag.closed:
            close = re.compile(rf"</{re.escape(tag.name)}\s*>", re.I).search(source, end)
            if close is None:
                raise HtmlError(f"<{tag.name}> is never closed")
            if close.start() > end:
                out.append(source[end : close.start()])
            out.append(Tag(close.group(), tag.name, end=True))
            at = text_start = close.end()
    if text_start < len(source):
        out.append(source[text_start:])
    return out


def _imply_end_tags(tokens: list[Tag | str]) -> list[Tag | str]:
    """`tokens` with the end tags HTML lets a page leave out (`<p>A<p>B`, `<li>a<li>b</ul>`,
    a table's cells and rows) put where a browser ends the element, as empty tags: the markup
    given back is the source as sent, its blocks end where a browser's would. An end tag a
    browser reads without its start tag (`</p>` after a block ended the paragraph: an empty
    one; `</body>` or `</tbody>` whose start tag was left out) is a boundary, not an error."""
    out: list[Tag | str] = []
    stack: list[str] = []
    opened: dict[str, int] = {}  # open elements by name

    def end(name: str) -> None:
        out.append(Tag("", name, end=True))
        pop()

    def pop() -> None:
        opened[stack[-1]] -= 1
        stack.pop()

    def ended(name: str) -> int:
        """Where on the stack the start tag `name` ends elements from (len: none)."""
        at = len(stack)
        through = _THROUGH.get(name, frozenset())
        for i in range(len(stack) - 1, -1, -1):
            if name in ENDED_BY.get(stack[i], ()):
                at = i
            elif stack[i] not in through:
                break
        return at

    for token in tokens:
        if not isinstance(token, Tag) or token.name == "!":
            out.append(token)
            continue
        if not token.end:
            for _ in range(len(stack) - ended(token.name)):
                end(stack[-1])
            if not token.closed:
                stack.append(token.name)
                opened[token.name] = opened.get(token.name, 0) + 1
        elif not token.closed:
            if opened.get(token.name):
                while stack[-1] != token.name and stack[-1] in OPTIONAL_END:
                    end(stack[-1])
                if stack[-1] == token.name:
                    pop()
            elif token.name in _LONE_END:
                while stack and stack[-1] in OPTIONAL_END and stack[-1] not in _ROOTS:
                    end(stack[-1])
                token.closed = True  # nothing to close: a boundary
        out.append(token)
    while stack and stack[-1] in OPTIONAL_END:
        end(stack[-1])
    return out


def _check_and_mark(tokens: list[Tag | str]) -> None:
    """HtmlError for unbalanced tags; marks inline elements that hold a block element."""
    stack: list[Tag] = []
    marked = 0  # the open elements below this depth are marked already (linear, not n^2)

    def mark() -> None:
        nonlocal marked
        for open_ in stack[marked:]:
            open_.blockish = True
        marked = len(stack)

    for token in tokens:
        if isinstance(token, str) or token.closed:
            if isinstance(token, Tag) and token.name not in INLINE | ATOMS | {"!"}:
                mark()
            continue
        if token.end:
            if not stack or stack[-1].name != token.name:
                still = f"<{_shown(stack[-1].name)}> is still open" if stack else "nothing is open"
                raise HtmlError(
                    f"</{_shown(token.name)}> does not close the element before it ({still})"
                )
            opened = stack.pop()
            marked = min(marked, len(stack))
            token.blockish = opened.blockish
            continue
        if token.name not in INLINE:
            mark()
        stack.append(token)
    if stack:
        raise HtmlError(f"<{_shown(stack[-1].name)}> is never closed")


def parse_html(source: str) -> list[Piece]:
    """The markup as verbatim pieces and blocks, in order; HtmlError if not well-formed."""
    tokens = _imply_end_tags(_tokens(source))
    _check_and_mark(tokens)
    pieces: list[Piece] = []
    block: _BlockBuilder | None = None
    copy_depth = 0  # inside a VERBATIM or kept block element (or a raw-text one)
    for token in tokens:
        text = token if isinstance(token, str) else token.raw
        if copy_depth:
            if isinstance(token, Tag) and not token.closed:
                copy_depth += -1 if token.end else 1
            if block is not None and block.keep_open():
                block.verbatim(text)
            else:
                pieces.append(text)
            continue
        if isinstance(token, str):
            block = block or _BlockBuilder()
            block.text(html.unescape(token), token)
        elif token.name in INLINE and not token.blockish and not token.closed:
            block = block or _BlockBuilder()
            if token.end:
                block.close(token.raw)
            else:
                block.open(token.raw, token.keep)
        elif block is not None and (
            token.name in ATOMS or token.name == "!" or (token.closed and token.name in INLINE)
        ):
            block.atom(token.raw)
        else:
            if block is not None:
                pieces.extend(block.finish())
                block = None
            if text:  # an implied end tag has no text
                pieces.append(text)
            starts_copy = token.name in VERBATIM | RAW_TEXT or token.keep
            if not token.end and not token.closed and starts_copy:
                copy_depth = 1
    if block is not None:
        pieces.extend(block.finish())
    return pieces


class _BlockBuilder:
    def __init__(self) -> None:
        self.parts: list[str] = []
        self.length = 0
        self.open_elements: list[Element] = []
        self.elements: list[Element] = []
        self.kept: list[tuple[int, int]] = []
        self._keeping: Element | None = None  # the outermost kept element open
        self._raw: list[str] = []

    def keep_open(self) -> bool:
        return self._keeping is not None

    def text(self, text: str, raw: str) -> None:
        """`text` decoded for the model; `raw` as sent (a kept element's source)."""
        if self._keeping is not None:
            self._raw.append(raw)
        self.parts.append(text)
        self.length += len(text)

    def verbatim(self, raw: str) -> None:
        self._raw.append(raw)

    def atom(self, raw: str) -> None:
        if self._keeping is not None:
            self._raw.append(raw)
            return
        depth = len(self.open_elements)
        self.elements.append(Element(raw, "", self.length, self.length, depth))

    def open(self, raw: str, keep: bool) -> None:
        if self._keeping is not None:
            self._raw.append(raw)
            self.open_elements.append(Element(raw, "", self.length, -1, -1))
            return
        element = Element(raw, "", self.length, -1, len(self.open_elements))
        self.open_elements.append(element)
        self.elements.append(element)
        if keep:
            self._keeping, self._raw = element, []

    def close(self, raw: str) -> None:
        element = self.open_elements.pop()
        if self._keeping is not None and element is not self._keeping:
            self._raw.append(raw)
            return
        element.end, element.b = raw, self.length
        if element is self._keeping:
            element.verbatim = "".join(self._raw)
            self.kept.append((element.a, element.b))
            self._keeping = None

    def finish(self) -> list[Piece]:
        plain = "".join(self.parts)
        if not plain.strip() and not self.elements:
            return [html.escape(plain, quote=False)] if plain else []
        return [Block(plain, self.elements, self.kept)]


# -- putting a translated block back together ------------------------------------------------


def kept_units(block: Block, spans: Sequence[tuple[int, int]]) -> list[int]:
    """Indices of the spans that lie wholly inside kept elements: not to be translated."""
    return [i for i, (a, b) in enumerate(spans) if any(x <= a and b <= y for x, y in block.kept)]


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
    at = length = 0
    for (a, b), translated in zip(spans, translations, strict=True):
        gap = block.plain[at:a]
        out_parts += [gap, translated]
        unit_out.append((length + len(gap), length + len(gap) + len(translated)))
        length += len(gap) + len(translated)
        at = b
    out_parts.append(block.plain[at:])
    text = "".join(out_parts)
    starts = [a for a, _ in spans]

    def unit_of(p: int) -> int | None:
        i = bisect.bisect_right(starts, p) - 1
        return i if i >= 0 and spans[i][0] <= p < spans[i][1] else None

    def position(p: int) -> int:
        """Where plain position p lands: in a gap, the same offset; inside a unit, the same
        share of its translation's length, moved to the nearest space."""
        i = bisect.bisect_right(starts, p) - 1
        if i < 0:
            return p
        (a, b), (oa, ob) = spans[i], unit_out[i]
        if p >= b:
            return ob + (p - b)
        return _word_edge(text, oa + round((p - a) / max(b - a, 1) * (ob - oa)), oa, ob)

    ranges: list[tuple[int, int]] = []
    replace: dict[int, str] = {}
    stack: list[int] = []  # the open ancestors of the element at hand
    after: dict[int, int] = {-1: 0}  # parent -> where its last child's words ended
    for i, element in enumerate(block.elements):
        while stack and block.elements[stack[-1]].depth >= element.depth:
            stack.pop()
        parent = stack[-1] if stack else -1
        stack.append(i)
        inner = block.plain[element.a : element.b]
        x, y = position(element.a), position(element.b)
        unit = unit_of(element.a)
        strictly_inside = (
            unit is not None
            and element.b <= spans[unit][1]
            and (element.a, element.b) != spans[unit]
            and inner.strip() != ""
        )
        if strictly_inside:
            oa, ob = unit_out[unit]  # type: ignore[index]
            lo, hi = max(oa, after.get(parent, 0)), ob
            if parent >= 0:
                lo, hi = max(lo, ranges[parent][0]), min(hi, ranges[parent][1])
            wanted = inner if element.verbatim is not None else inline.get(i, "")
            found = locate(text, wanted.strip(), lo, hi) if lo < hi else None
            if found is not None:
                x, y = found
                if element.verbatim is not None:
                    replace[i] = element.verbatim
            else:
                x = y = position(element.a)
        elif element.verbatim is not None and x < y:
            replace[i] = element.verbatim  # whole sentences, not translated: as sent
        ranges.append((x, y))
        after[parent] = max(after.get(parent, 0), y)
        after[i] = x
    ranges = _nest(block.elements, ranges)
    return _emit(text, block.elements, ranges, replace)


def _word_edge(text: str, p: int, lo: int, hi: int) -> int:
    """The nearest position at or after a space (or the unit's edge) to p."""
    if p <= lo or p >= hi:
        return min(max(p, lo), hi)
    left = text.rfind(" ", lo, p)
    right = text.find(" ", p, hi)
    candidates = [lo if left < 0 else left + 1, hi if right < 0 else right]
    return min(candidates, key=lambda c: abs(c - p))


_WORDS = re.compile(r"\S+")


def locate(
    haystack: str, needle: str, lo: int = 0, hi: int | None = None
) -> tuple[int, int] | None:
    """[start, end) of `needle` in haystack[lo:hi]: as a whole word or words, exactly, then
    case-insensitively, then anywhere; else the window of whole words most similar to it.
    None for an empty needle or window."""
    hi = len(haystack) if hi is None else hi
    window = haystack[lo:hi]
    if not needle or not window.strip():
        return None
    bounded = re.compile(rf"(?<!\w){re.escape(needle)}(?!\w)")
    for pattern in (bounded, re.compile(bounded.pattern, re.I)):
        m = pattern.search(window)
        if m:
            return lo + m.start(), lo + m.end()
    at = window.lower().find(needle.lower())
    if at >= 0:
        return lo + at, lo + at + len(needle)
    words = [(m.start(), m.end()) for m in _WORDS.finditer(window)][:512]
    n = len(needle.split())
    best: tuple[float, int, int] = (-1.0, 0, 0)
    for size in sorted({max(1, n - 1), n, n + 1}):
        for i in range(max(1, len(words) - size + 1)):
            a, b = words[i][0], words[min(i + size, len(words)) - 1][1]
            stripped = window[a:b].strip(".,;:!?\"'()")
            offset = window[a:b].find(stripped) if stripped else 0
            score = difflib.SequenceMatcher(None, stripped.lower(), needle.lower()).ratio()
            if score > best[0]:
                best = (score, a + offset, a + offset + len(stripped))
    return lo + best[1], lo + best[2]


def _nest(elements: Sequence[Element], ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ranges made to nest as the elements do: a child inside its parent, siblings apart (one
    pass: a stack of the open ancestors, each with the end of its last child)."""
    out = list(ranges)
    stack: list[int] = []  # element indices, outermost first
    last_end: dict[int, int] = {-1: 0}  # parent (-1: the block) -> end of its last child
    for i, element in enumerate(elements):
        while stack and elements[stack[-1]].depth >= element.depth:
            stack.pop()
        parent = stack[-1] if stack else -1
        x, y = out[i]
        if parent >= 0:
            px, py = out[parent]
            x, y = min(max(x, px), py), min(max(y, px), py)
        floor = last_end.get(parent, out[parent][0] if parent >= 0 else 0)
        if x < floor:
            x = floor
            y = max(y, x)
        if parent >= 0:
            y = min(y, out[parent][1])
            x = min(x, y)
        out[i] = (x, y)
        last_end[parent] = y
        last_end[i] = x
        stack.append(i)
    return out


def _emit(
    text: str,
    elements: Sequence[Element],
    ranges: Sequence[tuple[int, int]],
    replace: dict[int, str],
) -> str:
    """`text` escaped, with each element's start tag at its range's start and end tag at its
    end (opened outer first, closed inner first); kept elements' source in their range."""
    events: list[tuple[int, int, int, int]] = []  # (position, order, tie, element)
    for i, (x, y) in enumerate(ranges):
        if x == y:
            events.append((x, 1, i, i))  # an empty element: opened and closed in place
        else:
            events.append((x, 2, i, i))
            events.append((y, 0, -i, i))
    events.sort()
    out: list[str] = []
    at = 0
    skip_until = -1
    for position, order, _, i in events:
        if position > at:
            if at >= skip_until:
                out.append(html.escape(text[at:position], quote=False))
            elif position > skip_until:
                out.append(html.escape(text[skip_until:position], quote=False))
            at = position
        element = elements[i]
        if order == 0:
            out.append(element.end)
        elif order == 1:
            out.append(element.start + (element.verbatim or "") + element.end)
        else:
            out.append(element.start)
            if i in replace:
                out.append(replace[i])
                skip_until = max(skip_until, ranges[i][1])
    if at < len(text):
        out.append(html.escape(text[max(at, skip_until) :], quote=False))
    return "".join(out)
