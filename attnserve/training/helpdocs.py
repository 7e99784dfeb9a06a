"""Translated documentation as parallel text: an English and a German tree of the same pages.

Help systems translated from gettext catalogs (LibreOffice's help, GNOME's Mallard pages built
by itstool, DocBook/HTML manuals built by po4a or publican) keep the structure of the English
page: the same blocks in the same order, often with the same ids. `aligned_units` reads each
page present in both trees and pairs its blocks (paragraphs, headings, list items, table cells):
by `id` when both pages carry ids, else by position when both pages have the same number of
blocks (a page whose structure differs is skipped and counted). Inline markup becomes text;
`<pre>`, `<script>`, `<style>`, `<nav>`, `<footer>`, Mallard's `<code>`/`<screen>` blocks are
left out.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

BLOCKS = frozenset(
    {"p", "h1", "h2", "h3", "h4", "h5", "h6", "li", "td", "th", "dt", "dd", "caption",
     "title", "desc", "subtitle", "para", "simpara", "entry", "term", "glossterm"}
)  # fmt: skip
SKIPPED = frozenset(
    {"pre", "script", "style", "screen", "code", "programlisting", "synopsis", "nav", "footer"}
)
# LibreOffice's help shows one of several system variants of a phrase ("Command" on macOS, the
# default "Ctrl" elsewhere): the variants for named systems are skipped, and so is its debug box.
SKIPPED_CLASSES = frozenset({"MAC", "WIN", "UNX", "debug"})
VOID = frozenset({"br", "img", "input", "meta", "link", "hr", "col", "area", "source", "wbr"})
PAGE_SUFFIXES = (".html", ".htm", ".xhtml", ".page", ".xml")

Block = tuple[str | None, str]  # (id, text)


class _BlockParser(HTMLParser):
    """Text of each innermost block element in document order, with its `id` attribute."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[Block] = []
        self._open: list[tuple[str, str | None, list[str]]] = []
        self._skipping = 0  # depth inside a skipped element

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in VOID:
            self.handle_startendtag(tag, attrs)
        elif self._skipping:
            self._skipping += 1
        elif (tag in SKIPPED and not (tag == "code" and self._open)) or (  # inline <code>: text
            dict(attrs).get("class") in SKIPPED_CLASSES
        ):
            self._skipping = 1
        elif tag in BLOCKS:
            if self._open:  # a nested block ends the text of its parent here
                self._open[-1][2].append("\n")
            self._open.append((tag, dict(attrs).get("id"), []))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "br" and self._open and not self._skipping:
            self._open[-1][2].append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID:
            return
        if self._skipping:
            self._skipping -= 1
            return
        if tag in BLOCKS and self._open and self._open[-1][0] == tag:
            _, block_id, parts = self._open.pop()
            text = re.sub(r"[ \t\r\f\v]+", " ", "".join(parts))
            text = "\n".join(line.strip() for line in text.split("\n") if line.strip())
            self.blocks.append((block_id, text))

    def handle_data(self, data: str) -> None:
        if self._open and not self._skipping:
            self._open[-1][2].append(data.replace("\n", " "))


def page_blocks(path: Path) -> list[Block]:
    """The blocks of one HTML or XML page."""
    parser = _BlockParser()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    parser.close()
    return parser.blocks


def align_blocks(en: list[Block], de: list[Block]) -> list[tuple[str, str]] | None:
    """Pairs of two pages' blocks (by id, else by position), or None if they don't match."""
    if len(en) == len(de) and all(a[0] == b[0] for a, b in zip(en, de, strict=True)):
        return [(a[1], b[1]) for a, b in zip(en, de, strict=True)]
    en_ids = {i: text for i, text in en if i}
    de_ids = {i: text for i, text in de if i}
    if en_ids and de_ids:
        return [(text, de_ids[i]) for i, text in en_ids.items() if i in de_ids]
    return None


def aligned_units(
    en_root: Path, de_root: Path, stats: Counter[str], rename: tuple[str, str] | None = None
) -> Iterator[tuple[str, str]]:
    """(en, de) block texts of every page under `en_root` that has a German twin.

    The twin has the same path under `de_root`, after `rename` (old, new) of the file name
    (debian-reference's `ch01.en.html` -> `ch01.de.html`)."""
    for en_page in sorted(en_root.rglob("*")):
        if en_page.suffix not in PAGE_SUFFIXES or not en_page.is_file():
            continue
        relative = en_page.relative_to(en_root)
        if rename is not None:
            if rename[0] not in relative.name:  # another language's page in the same folder
                continue
            relative = relative.with_name(relative.name.replace(*rename))
        de_page = de_root / relative
        if not de_page.is_file():
            stats["pages_without_german"] += 1
            continue
        pairs = align_blocks(page_blocks(en_page), page_blocks(de_page))
        if pairs is None:
            stats["pages_not_aligned"] += 1
            continue
        stats["pages"] += 1
        yield from ((en, de) for en, de in pairs if en and de)
