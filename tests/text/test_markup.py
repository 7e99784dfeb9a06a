"""HTML: every tag and attribute kept, text nodes as blocks, inline tags around their words."""

from __future__ import annotations

import html.parser

import pytest

from attnserve.text.markup import Block, HtmlError, locate, parse_html, render_block


class _Checker(html.parser.HTMLParser):
    """Collects the tags (with attributes) of a document and fails on unbalanced ones."""

    VOID = frozenset({"br", "img", "hr", "meta", "input", "link", "wbr"})

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, tuple[tuple[str, str | None], ...]]] = []
        self.stack: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, tuple(attrs)))
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, tuple(attrs)))

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1] == tag, (tag, self.stack)
        self.stack.pop()


def tags_of(markup: str) -> list[tuple[str, tuple[tuple[str, str | None], ...]]]:
    checker = _Checker()
    checker.feed(markup)
    checker.close()
    assert checker.stack == []
    return sorted(checker.tags)


def translate_blocks(markup: str, translate: dict[str, str]) -> str:
    """Each block's plain text translated whole (one unit) by a lookup table."""
    out: list[str] = []
    for piece in parse_html(markup):
        if isinstance(piece, str):
            out.append(piece)
            continue
        plain = piece.plain
        stripped = plain.strip()
        a = plain.index(stripped[0])
        spans = [(a, a + len(stripped))]
        inline = {
            i: translate.get(plain[e.a : e.b].strip(), plain[e.a : e.b].strip())
            for i, e in enumerate(piece.elements)
        }
        out.append(render_block(piece, spans, [translate[stripped]], inline))
    return "".join(out)


def test_blocks_and_verbatim_markup() -> None:
    pieces = parse_html('<div class="x"><p>Hello <b>world</b>.</p>\n<p>Bye.</p></div>')
    blocks = [p for p in pieces if isinstance(p, Block)]
    assert [b.plain for b in blocks] == ["Hello world.", "Bye."]
    assert [(e.start, e.end, e.a, e.b) for e in blocks[0].elements] == [("<b>", "</b>", 6, 11)]
    assert (
        "".join(p for p in pieces if isinstance(p, str)) == '<div class="x"><p></p>\n<p></p></div>'
    )


def test_inline_tag_goes_around_the_matching_words() -> None:
    source = '<p>The <a href="/x" title="T">big house</a> is old.</p>'
    out = translate_blocks(
        source, {"The big house is old.": "Das große Haus ist alt.", "big house": "große Haus"}
    )
    assert out == '<p>Das <a href="/x" title="T">große Haus</a> ist alt.</p>'
    assert tags_of(out) == tags_of(source)


def test_inline_tag_fuzzy_match_and_nesting() -> None:
    source = "<p>I <b>really <i>like</i> it</b> here.</p>"
    out = translate_blocks(
        source,
        {
            "I really like it here.": "Ich mag es hier wirklich.",
            "really like it": "mag es wirklich",
            "like": "mögen",
        },
    )
    assert tags_of(out) == tags_of(source)
    assert out.startswith("<p>Ich <b>")


def test_entities_decoded_for_the_model_and_escaped_back() -> None:
    pieces = parse_html("<p>Fish &amp; chips &lt;3</p>")
    (block,) = [p for p in pieces if isinstance(p, Block)]
    assert block.plain == "Fish & chips <3"
    out = render_block(block, [(0, len(block.plain))], ["Fisch & Pommes <3"], {})
    assert out == "Fisch &amp; Pommes &lt;3"


def test_script_style_pre_and_code_kept_verbatim() -> None:
    source = (
        "<style>p{color:red}</style><pre>a  b</pre><p>Run <code>make test</code> now.</p>"
        '<p translate="no">Name</p>'
    )
    pieces = parse_html(source)
    blocks = [p for p in pieces if isinstance(p, Block)]
    assert [b.plain for b in blocks] == ["Run make test now."]
    (code,) = blocks[0].elements
    assert code.verbatim == "make test"
    out = render_block(blocks[0], [(0, 18)], ["Führe make Test jetzt aus."], {})
    assert "<code>make test</code>" in out


def test_empty_inline_element_and_void_tags() -> None:
    source = '<p>One<br>two <a name="x"></a>three.<img src="a.png" alt="A"/></p>'
    pieces = parse_html(source)
    out = "".join(
        p if isinstance(p, str) else render_block(p, [(0, len(p.plain))], [p.plain.upper()], {})
        for p in pieces
    )
    assert tags_of(out) == tags_of(source)


@pytest.mark.parametrize(
    "broken",
    [
        "<div>never closed",
        "<p><b>x<p>y",
        "<div></p>",
        "text</b>",
        "<p <b>x</b>",
        '<a href="x>y</a>',
    ],
)
def test_broken_html_is_refused(broken: str) -> None:
    with pytest.raises(HtmlError):
        parse_html(broken)


@pytest.mark.parametrize(
    ("source", "blocks"),
    [
        ("<p>One.<p>Two.", ["One.", "Two."]),
        ("<div><p>One.<p>Two.</div>", ["One.", "Two."]),
        ("<ul><li>a b<li>c</ul>", ["a b", "c"]),
        ("<table><tr><td>a<td>b<tr><th>c</table>", ["a", "b", "c"]),
        ("<dl><dt>x<dd>y<dt>z</dl>", ["x", "y", "z"]),
        ("<select><option>a<option>b</select>", ["a", "b"]),
        ("<p>A<hr>B", ["A", "B"]),
        ("<html><head><title>T</title><body><p>Hi", ["Hi"]),
        # a block inside a closed paragraph ends it; the </p> after it is an empty one
        ("<p>Intro<div>box</div></p>", ["Intro", "box"]),
        ("<p><ul><li>one</li><li>two</li></ul></p>", ["one", "two"]),
        ("<p>Line<hr></p>", ["Line"]),
        # a cell ends its cell through a paragraph left open in it
        ('<table><tr><td translate="no"><p>Acme<td>Translate me</table>', ["Translate me"]),
        ('<table><tr class="notranslate"><td><p>SKU<tr><td>Translate me</table>', ["Translate me"]),
        # end tags whose start tags a page may leave out
        ("<!DOCTYPE html><head><title>T</title></head><body><p>Hi</p></body></html>", ["Hi"]),
        ("<table><tr><td>x</td></tr></tbody></table>", ["x"]),
        ("<ul><li>a<ul><li>b</ul><li>c</ul>", ["a", "b", "c"]),
    ],
)
def test_optional_end_tags_end_their_elements_where_a_browser_does(
    source: str, blocks: list[str]
) -> None:
    """HTML lets a page leave out some end tags (`<p>`, `<li>`, table cells, ...): each such
    element ends where the next one (or its parent) begins, and the markup given back is the
    source as sent."""
    pieces = parse_html(source)
    assert [p.plain for p in pieces if isinstance(p, Block)] == blocks
    out = "".join(
        p if isinstance(p, str) else render_block(p, [(0, len(p.plain))], [p.plain], {})
        for p in pieces
    )
    assert out == source


def test_a_lone_less_than_is_text() -> None:
    (block,) = [p for p in parse_html("<p>a < b and 3 <4</p>") if isinstance(p, Block)]
    assert block.plain == "a < b and 3 <4"


def test_locate() -> None:
    assert locate("Das große Haus ist alt.", "große Haus") == (4, 14)
    assert locate("Das große Haus ist alt.", "GROSSE haus") is not None
    assert locate("", "x") is None and locate("abc", "") is None


def identity(markup: str) -> str:
    """The markup through parse and render with every sentence and inline element
    "translated" to itself: must give the source back."""
    from attnserve.text.document import split_document
    from attnserve.text.segment import default_segmenter

    out: list[str] = []
    for piece in parse_html(markup):
        if isinstance(piece, str):
            out.append(piece)
            continue
        doc = split_document(piece.plain, default_segmenter(), "en")
        inline = {i: piece.plain[e.a : e.b].strip() for i, e in enumerate(piece.elements)}
        out.append(render_block(piece, doc.spans, doc.units, inline))
    return "".join(out)


@pytest.mark.parametrize(
    "markup",
    [
        '<p><a href="/">Home <img src="x.png"> page</a></p>',
        "<p><b>Hello <!-- note --> world</b> again.</p>",
        "<p><b>line<br>next</b></p>",
        '<a href="/"><div>card</div></a>',
        '<p>Hello <b></b>world. <i class="fa"></i>Bye.</p>',
        "<p>bar<code>  </code>Hello Hello</p>",
        "<p>I <b>do</b> know <b>do</b> it.</p>",
        "<p>Use <code><b>make</b> -j</code> now.</p>",
        '<p><span translate="no">Berlin Hbf</span></p><p><code>print(x)</code></p>',
        "<script>for(i=0;i<n;i++){}</script><p>Hi.</p>",
        "<svg><g><svg></svg></g></svg><p>After.</p>",
        '<div class="notranslate"><div>b</div></div><p>Text.</p>',
        '<p>One<br>two <a name="x"></a>three.<img src="a.png" alt="A"/></p>',
        "<ul><li>First item.</li><li>Second <em>item</em> here.</li></ul>",
        "<p>Fish &amp; chips &lt;3 <b>now</b>.</p>",
        "<p>A <span>b <i>c</i> d</span> e.</p>",
    ],
)
def test_identity_translation_gives_the_source_back(markup: str) -> None:
    assert identity(markup) == markup


@pytest.mark.parametrize("broken", ["<p>hi</p><!-- a > b", "<p><![CDATA[x</p>", "<script>x"])
def test_unterminated_comments_and_raw_text_are_refused(broken: str) -> None:
    with pytest.raises(HtmlError):
        parse_html(broken)


def test_pathological_markup_is_linear() -> None:
    import time

    for markup in ["<p>Hello." + "<b></b>" * 20000 + "</p>", "<!-- x -->" * 20000]:
        began = time.perf_counter()
        identity(markup)
        assert time.perf_counter() - began < 5.0
