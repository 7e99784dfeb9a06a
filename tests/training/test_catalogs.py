"""Gettext catalogs and translated help pages -> cleaned pairs (catalogs.py, helpdocs.py)."""

from __future__ import annotations

import struct
from collections import Counter
from pathlib import Path

import pytest

from attnserve.training.catalogs import (
    clean_units,
    dedup_key,
    read_catalog,
    read_mo,
    read_po,
    split_sentences,
)
from attnserve.training.helpdocs import aligned_units, page_blocks


def mo_bytes(entries: list[tuple[str, str]]) -> bytes:
    """A little-endian GNU .mo file of (msgid, msgstr) entries (what msgfmt writes, no hash)."""
    entries = sorted(entries)
    ids = [m.encode() for m, _ in entries]
    strs = [t.encode() for _, t in entries]
    n = len(entries)
    ids_at, strs_at = 28, 28 + 8 * n
    data_at = 28 + 16 * n
    header = struct.pack("<7I", 0x950412DE, 0, n, ids_at, strs_at, 0, data_at)
    tables, blob = [b"", b""], b""
    for which, strings in enumerate((ids, strs)):
        for s in strings:
            tables[which] += struct.pack("<2I", len(s), data_at + len(blob))
            blob += s + b"\0"
    return header + tables[0] + tables[1] + blob


def write_mo(path: Path, entries: list[tuple[str, str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(mo_bytes(entries))
    return path


def test_read_mo_drops_header_context_and_plural_forms(tmp_path: Path) -> None:
    path = write_mo(
        tmp_path / "app.mo",
        [
            ("", "Content-Type: text/plain; charset=UTF-8\n"),
            ("menu\x04Open the file", "Die Datei öffnen"),
            ("One new message\x00%d new messages", "Eine neue Nachricht\x00%d neue Nachrichten"),
        ],
    )
    assert sorted(read_catalog(path)) == [
        ("One new message", "Eine neue Nachricht"),
        ("Open the file", "Die Datei öffnen"),
    ]
    big_endian = struct.pack(">7I", 0x950412DE, 0, 0, 28, 28, 0, 28)
    assert list(read_mo(big_endian)) == []
    with pytest.raises(ValueError, match="magic"):
        list(read_mo(b"\0" * 28))


PO = r"""
msgid ""
msgstr ""
"Content-Type: text/plain; charset=UTF-8\n"

#: app.py:1
msgctxt "button"
msgid "Save the "
"document"
msgstr "Das Dokument "
"speichern"

#, fuzzy
msgid "Print the page"
msgstr "Seite drucken"

#, python-format
msgid "Delete one file"
msgid_plural "Delete %(n)s files"
msgstr[0] "Eine Datei löschen"
msgstr[1] "%(n)s Dateien löschen"

msgid "Say \"hello\""
msgstr "Sag \"hallo\""

msgid "Not translated yet"
msgstr ""

#~ msgid "Old string"
#~ msgstr "Alte Zeichenkette"
"""


def test_read_po_keeps_finished_entries_only() -> None:
    assert list(read_po(PO)) == [
        ("Save the document", "Das Dokument speichern"),
        ("Delete one file", "Eine Datei löschen"),
        ('Say "hello"', 'Sag "hallo"'),
    ]


def clean(en: str, de: str, catalog: bool = True) -> list[tuple[str, str]] | str:
    """The kept pairs of one unit, or the reason it was dropped."""
    stats: Counter[str] = Counter()
    pairs = list(clean_units([(en, de)], stats, catalog=catalog))
    del stats["units"]
    return pairs or next(iter(stats))


@pytest.mark.parametrize(
    ("en", "de", "expected"),
    [
        # accelerators, trailing colons and ellipses
        ("_Open File", "Datei ö_ffnen", [("Open File", "Datei öffnen")]),
        ("&Save As...", "Speichern &unter …", [("Save As", "Speichern unter")]),
        ("~Insert Rows", "Zeilen ~einfügen", [("Insert Rows", "Zeilen einfügen")]),
        ("Print && Preview", "Drucken && Vorschau", [("Print & Preview", "Drucken & Vorschau")]),
        ("Paper size:", "Papierformat:", [("Paper size", "Papierformat")]),
        # markup and entities
        (
            "<b>Delete</b> the file",
            "Die Datei <i>löschen</i>",
            [("Delete the file", "Die Datei löschen")],
        ),
        (
            "Drag &amp; drop files",
            "Dateien ziehen &amp; ablegen",
            [("Drag & drop files", "Dateien ziehen & ablegen")],
        ),
        # placeholders: removable ones go, a pair that keeps one is dropped
        (
            "Could not open the file: %s",
            "Die Datei konnte nicht geöffnet werden: %s",
            [("Could not open the file", "Die Datei konnte nicht geöffnet werden")],
        ),
        (
            "Rename the selected tag (%s)",
            "Die ausgewählte Markierung (%s) umbenennen",
            [("Rename the selected tag", "Die ausgewählte Markierung umbenennen")],
        ),
        (
            "%PRODUCTNAME Writer document",
            "%PRODUCTNAME Writer-Dokument",
            [("LibreOffice Writer document", "LibreOffice Writer-Dokument")],
        ),
        ("Delete %s?", "%s löschen?", "placeholder"),
        ("Copied the file to “%s”", "Die Datei wurde nach „%s“ kopiert", "placeholder"),
        (
            "Cannot open the file: '%s'",
            "Die Datei kann nicht geöffnet werden: „%s“",
            [("Cannot open the file", "Die Datei kann nicht geöffnet werden")],
        ),
        ("%(count)d files were copied", "%(count)d Dateien wurden kopiert", "placeholder"),
        ("Welcome, {name}!", "Willkommen, {name}!", "placeholder"),
        ("File %1 not found", "Datei %1 nicht gefunden", "placeholder"),
        ("Install $PACKAGE now", "$PACKAGE jetzt installieren", "placeholder"),
        # contexts written into the msgid, shortcuts
        ("the object|Make it active", "Aktivieren", [("Make it active", "Aktivieren")]),
        ("race^Wood Elves", "Waldelfen", [("Wood Elves", "Waldelfen")]),
        (
            "Close All Windows|C",
            "Alle Fenster schließen|s",
            [("Close All Windows", "Alle Fenster schließen")],
        ),
        # dropped
        ("Settings", "Einstellungen", "short"),
        ("Open Source", "Open Source", "untranslated"),
        ("SAVE ALL FILES", "ALLE DATEIEN SPEICHERN", "capitals"),
        ("See https://example.org for more", "Siehe https://example.org für mehr", "code"),
        ("Set the path to /usr/share/data here", "Pfad auf /usr/share/data setzen", "code"),
        (
            "The settlement",
            "Das Abrechnungsdatum, an dem die bis dahin aufgelaufenen Zinsen berechnet werden",
            "length_ratio",
        ),
        ("word " * 70, "Wort " * 70, "long"),
        ("translator-credits", "Jemand <jemand@example.org>", "credits"),
    ],
)
def test_cleaning_rules(en: str, de: str, expected: list[tuple[str, str]] | str) -> None:
    assert clean(en, de) == expected


def test_paragraphs_split_into_sentences_when_both_sides_agree() -> None:
    assert clean(
        "Open the file. Then save it, e.g. as text.",
        "Öffnen Sie die Datei. Speichern Sie sie dann.",
    ) == [
        ("Open the file.", "Öffnen Sie die Datei."),
        ("Then save it, e.g. as text.", "Speichern Sie sie dann."),
    ]
    one_german_sentence = "Öffnen Sie die Datei und speichern Sie sie."
    assert clean("Open the file. Then save it.", one_german_sentence) == [
        ("Open the file. Then save it.", one_german_sentence)
    ]
    assert clean("<b>Tip</b><br/>Save often.", "<b>Tipp</b><br/>Oft speichern.") == [
        ("Save often.", "Oft speichern.")  # "Tip" / "Tipp": one word each
    ]
    assert split_sentences("Call Dr. Smith. He is in.") == ["Call Dr. Smith.", "He is in."]


def test_documentation_text_keeps_underscores_and_ampersands() -> None:
    assert clean("Q&A about the_file", "F&A zur Datei the_file", catalog=False) == "code"
    assert clean("Questions & answers here", "Fragen & Antworten hier", catalog=False) == [
        ("Questions & answers here", "Fragen & Antworten hier")
    ]


def test_dedup_key_ignores_case_and_punctuation() -> None:
    assert dedup_key("Delete Column!") == dedup_key("delete column") == "delete column"
    assert dedup_key("Spalte löschen …") == "spalte löschen"


def write_page(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"<html><body>{body}</body></html>", encoding="utf-8")


def test_help_pages_align_by_id_and_by_position(tmp_path: Path) -> None:
    en, de = tmp_path / "en-US", tmp_path / "de"
    ctrl = '<span class="switchinline"><span class="MAC">Command</span><span>Ctrl</span></span>'
    strg = '<span class="switchinline"><span class="MAC">Befehl</span><span>Strg</span></span>'
    write_page(
        en / "text/a.html",
        f'<h1 id="h1">Printing pages</h1><p id="p1">Press {ctrl}+P to print.</p>'
        '<p id="p2">Only in English.</p><pre>lp -d printer</pre>',
    )
    write_page(
        de / "text/a.html",
        f'<h1 id="h1">Seiten drucken</h1><p id="p1">Drücken Sie {strg}+P zum Drucken.</p>',
    )
    write_page(
        en / "b.page",
        "<page><title>Wireless networks</title><p>Connect to a <gui>network</gui>.</p></page>",
    )
    write_page(
        de / "b.page",
        "<page><title>Drahtlosnetzwerke</title>"
        "<p>Mit einem <gui>Netzwerk</gui> verbinden.</p></page>",
    )
    write_page(en / "c.page", "<page><title>One</title><p>Two</p></page>")
    write_page(de / "c.page", "<page><title>Eins</title></page>")  # structure differs: skipped
    write_page(en / "d.page", "<page><p>Missing in German</p></page>")
    stats: Counter[str] = Counter()
    assert list(aligned_units(en, de, stats)) == [
        ("Wireless networks", "Drahtlosnetzwerke"),
        ("Connect to a network.", "Mit einem Netzwerk verbinden."),
        ("Printing pages", "Seiten drucken"),
        ("Press Ctrl+P to print.", "Drücken Sie Strg+P zum Drucken."),
    ]
    assert stats == {"pages": 2, "pages_not_aligned": 1, "pages_without_german": 1}


def test_page_blocks_nested_blocks_and_renamed_twins(tmp_path: Path) -> None:
    write_page(tmp_path / "ch01.en.html", "<ul><li>Item text<p>Inner paragraph</p></li></ul>")
    write_page(tmp_path / "ch01.de.html", "<ul><li>Eintrag<p>Innerer Absatz</p></li></ul>")
    assert page_blocks(tmp_path / "ch01.en.html") == [
        (None, "Inner paragraph"),
        (None, "Item text"),
    ]
    assert list(aligned_units(tmp_path, tmp_path, Counter(), (".en.", ".de."))) == [
        ("Inner paragraph", "Innerer Absatz"),
        ("Item text", "Eintrag"),
    ]


def test_fragments_and_emptied_brackets_are_dropped() -> None:
    assert clean("(Full account name", "(Vollständiger Kontoname") == "fragment"
    assert clean('Say "hello to everyone', 'Sag "Hallo zu allen') == "fragment"
    link = '(<a href="https://example.org">example.org</a>)'
    assert clean(f"Read the wiki {link} first", f"Lies zuerst das Wiki {link}") == "code"
