"""Gettext catalogs (.mo / .po) -> cleaned (English, German) sentence and phrase pairs.

A catalog maps an English source string (msgid) to its German translation (msgstr). Software
strings carry things that are not text: contexts, plural forms, markup, keyboard accelerators,
format placeholders. `clean_units` turns raw (en, de) units, from catalogs or from aligned
documentation paragraphs (helpdocs.py), into pairs a translation model can learn from:

- context (`ctxt\\x04msgid`) dropped, plural entries reduced to their singular forms;
- markup stripped (`<b>`, `<a href=..>`, `<br/>` -> space), entities unescaped; accelerators removed
  (`_File`, `&File`, `~File`; `&&` -> `&`);
- placeholders (`%s`, `%(name)s`, `%1`, `{name}`, `{0}`, `$VAR`, `%PRODUCTNAME`): a product
  name becomes the product, a placeholder alone in brackets or after a final colon (quoted or
  not) is dropped with them; a pair that still holds one is dropped (removing it from a sentence,
  "Copied to '%s'", leaves a gap);
- paragraphs split into sentences when both sides have the same number of them;
- dropped: untranslated (German equal to English), fewer than `MIN_WORDS` words on both sides,
  longer than `MAX_CHARS`, length ratio outliers, all-capitals, code-like text (paths, URLs,
  `= | { } [ ] \\ # @`, empty brackets left by removed markup), fragments (unbalanced brackets
  or quotes), translator credits.
De-duplication (case- and punctuation-insensitive) is the caller's (modern.py): it spans sources.
"""

from __future__ import annotations

import html
import re
import struct
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePath
from typing import TypeVar

from attnserve.training.pairs import length_ok, normalize

MIN_WORDS = 2  # a pair is kept when at least one side has this many words
MAX_CHARS = 300
PRODUCTS = {"%PRODUCTNAME": "LibreOffice", "$(PRODUCTNAME)": "LibreOffice", "%PRODUCTVERSION": ""}
CREDITS = frozenset(
    {"NAME OF TRANSLATORS", "EMAIL OF TRANSLATORS", "Your names", "Your emails",
     "translator-credits", "translator_credits", "ROLES_OF_TRANSLATORS", "CREDIT_FOR_TRANSLATORS"}
)  # fmt: skip

# -- reading --------------------------------------------------------------------------------

MO_MAGIC = 0x950412DE


def _msgid(raw: str) -> str:
    """The English text of a msgid: without its context (`ctxt\\x04`) and plural (`\\x00...`)."""
    return raw.rsplit("\x04", 1)[-1].split("\x00", 1)[0]


def read_mo(data: bytes) -> Iterator[tuple[str, str]]:
    """(msgid, msgstr) of a compiled catalog; singular forms, no header. Fuzzy entries are never
    compiled, so a .mo holds only finished translations."""
    if len(data) < 20:
        raise ValueError("not a .mo file: too short")
    for order in "<>":
        magic, _, count, ids, strs = struct.unpack(order + "5I", data[:20])
        if magic == MO_MAGIC:
            break
    else:
        raise ValueError("not a .mo file: bad magic number")
    for i in range(count):
        id_len, id_at = struct.unpack_from(order + "2I", data, ids + 8 * i)
        str_len, str_at = struct.unpack_from(order + "2I", data, strs + 8 * i)
        msgid = data[id_at : id_at + id_len].decode("utf-8", "replace")
        msgstr = data[str_at : str_at + str_len].decode("utf-8", "replace")
        if msgid:
            yield _msgid(msgid), msgstr.split("\x00", 1)[0]


_PO_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')
_PO_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "\\": "\\", "r": "\r"}


def _po_unescape(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: _PO_ESCAPES.get(m[1], m[1]), text)


def read_po(text: str) -> Iterator[tuple[str, str]]:
    """(msgid, msgstr) of a .po file's finished entries: no header, fuzzy or obsolete (`#~`)
    entries; the singular (`msgstr[0]`) of plural ones."""
    entry: dict[str, str] = {}
    fuzzy, field = False, ""

    def finished() -> tuple[str, str] | None:
        msgid, msgstr = entry.get("msgid", ""), entry.get("msgstr") or entry.get("msgstr[0]", "")
        return (msgid, msgstr) if msgid and msgstr and not fuzzy else None

    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#~"):
            continue
        new_entry = line.startswith(("#", "msgctxt ", "msgid "))
        if new_entry and any(key.startswith("msgstr") for key in entry):
            if pair := finished():
                yield pair
            entry, fuzzy, field = {}, False, ""
        if line.startswith("#"):
            fuzzy = fuzzy or (line.startswith("#,") and "fuzzy" in line)
            continue
        if not line.startswith('"'):
            field, _, line = line.partition(" ")
        match = _PO_STRING.fullmatch(line.strip())
        if match and field:
            entry[field] = entry.get(field, "") + _po_unescape(match[1])
    if pair := finished():
        yield pair


def read_catalog(path: Path) -> Iterator[tuple[str, str]]:
    """(msgid, msgstr) of a .mo or .po file."""
    yield from read_catalog_data(path.read_bytes(), path.suffix)


def read_catalog_data(data: bytes, suffix: str) -> Iterator[tuple[str, str]]:
    """(msgid, msgstr) of a .mo or (`suffix` ".po") .po file's contents."""
    if suffix == ".po":
        yield from read_po(data.decode("utf-8", errors="replace"))
    else:
        yield from read_mo(data)


GERMAN = ("de", "de_DE")  # catalog folders; not the regional de_AT, de_CH
AnyPath = TypeVar("AnyPath", bound=PurePath)  # files, or an archive's members


def german_catalogs(paths: Iterable[AnyPath]) -> list[AnyPath]:
    """German gettext catalogs among `paths`: `.mo` under `de/LC_MESSAGES/` (or `de_DE/`), and
    `.po` there where no `.mo` of the same name sits beside it; and Tryton's `locale/de.po`
    (a module's catalog, one file a language)."""
    paths = [
        p for p in paths
        if (p.parent.name == "LC_MESSAGES" and p.parent.parent.name in GERMAN)
        or (p.name == "de.po" and p.parent.name == "locale")
    ]  # fmt: skip
    compiled = {p.with_suffix("") for p in paths if p.suffix == ".mo"}
    return sorted(
        p for p in paths
        if p.suffix == ".mo" or (p.suffix == ".po" and p.with_suffix("") not in compiled)
    )  # fmt: skip


# -- cleaning -------------------------------------------------------------------------------

_TAG = re.compile(r"</?[A-Za-z][\w:-]*(?:\s+[^<>]*)?/?>")
_BREAK = re.compile(r"<br\s*/?>|</?p>|</?li>|</?h\d>|</?div>", re.I)
_ACCEL_AMP = re.compile(r"&(?=[^\W\d_])(?![A-Za-z]+;|#\d+;|#x[0-9a-fA-F]+;)")
_ACCEL = re.compile(r"(?<![\w~])[_~](?=[^\W_])|(?<=[^\W_])[_~](?=[^\W_])")
# printf (%s %d %.2f %1$s %-5d %lu), Python (%(name)s), Qt (%1 %L1), brace ({}, {0}, {name},
# {name!r:>4}), shell ($VAR ${VAR} $(VAR)), LibreOffice ($1, %NAME, #1 ...).
_PLACEHOLDER = re.compile(
    r"%(?:\([\w.-]+\))?[-+#0']*(?:\d+\$)?\d*(?:\.\d+)?(?:hh|h|ll|l|L|q|j|z|t)?[sSdifFeEgGxXoucpaA]"
    r"|%L?\d+|%[A-Z][A-Z_]+%?|\{[\w.!:<>^ -]*\}|\$\{?\w+\}?|\$\(\w+\)|%%|(?<!\w)#\d+"
)
_QUOTED = rf"[\"'«»“”„‘’]?(?:{_PLACEHOLDER.pattern})[\"'«»“”‘’]?"
_ONLY_PLACEHOLDER = re.compile(rf"\s*[(\[]\s*{_QUOTED}\s*[)\]]")  # "Add tag (%s)"
_TRAILING_PLACEHOLDER = re.compile(rf":\s*{_QUOTED}\s*$")  # "Cannot open file: '%s'"
_CODE = re.compile(
    r"https?:|www\.|\S@\S|[={}\[\]|\\<>#@^`_*]|(?:^|\s)[/~.]\w|\w/\w+/|\.\w{2,4}\b(?![.\s])"
    r"|\b\w+\(\)|\(\s*\)|->|::|\bTODO\b"
)
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])[\"'»«“”)]?\s+(?=[\"'„“«»(]?[A-ZÄÖÜ0-9])")
_ABBREVIATION = re.compile(
    r"\b(?:e\.g|i\.e|etc|vs|Mr|Mrs|Dr|Nr|z\.\s?B|d\.\s?h|bzw|usw|ca|ggf|vgl|u\.\s?a|s\.o|Str|St|No|"
    r"Abb|Fig|Hr|Fr|incl|inkl|max|min|approx)\.$",
    re.I,
)
_TRIM = " \t:;,…-–—•·"


def strip_markup(text: str) -> str:
    """Accelerators, tags and entities out; `<br>` and block tags become line breaks."""
    text = _BREAK.sub("\n", text).replace("&&", "\x00")
    text = _ACCEL_AMP.sub("", text)
    text = _TAG.sub("", text)
    text = html.unescape(text).replace("\x00", "&")
    if text.count("_") + text.count("~") == 1:
        text = _ACCEL.sub("", text)
    return text


_KEY_SUFFIX = re.compile(r"\|[^\s|]{1,2}$")  # LyX's "Export|E"
_QUALIFIER = re.compile(r"^\?[\w-]+:")  # freeciv's "?female:Queen"


def strip_context(en: str, de: str) -> tuple[str, str]:
    """Contexts written into the msgid (`ctx|Text`, `ctx^Text`, `?ctx:Text`) and shortcuts."""
    for mark in "|^":
        if mark in en and mark not in de:
            en = en.rsplit(mark, 1)[1]
    en, de = _KEY_SUFFIX.sub("", en), _KEY_SUFFIX.sub("", de)
    return _QUALIFIER.sub("", en), _QUALIFIER.sub("", de)


def strip_placeholders(text: str) -> str:
    """Product names substituted, removable placeholders removed (the rest stays to be seen)."""
    for name, product in PRODUCTS.items():
        text = text.replace(name, product)
    text = _ONLY_PLACEHOLDER.sub("", text)
    return _TRAILING_PLACEHOLDER.sub("", text)


def _tidy(text: str) -> str:
    text = normalize(text).replace("...", "…").strip(_TRIM)
    return re.sub(r"\s+([.,;:!?])(?=\s|$)", r"\1", text).replace("( ", "(").replace(" )", ")")


def split_sentences(text: str) -> list[str]:
    """Sentences of a paragraph: breaks after `.!?` before a capital, not after abbreviations."""
    parts: list[str] = []
    for piece in _SENTENCE_BREAK.split(text):
        if parts and _ABBREVIATION.search(parts[-1]):
            parts[-1] += " " + piece
        else:
            parts.append(piece)
    return [p.strip() for p in parts if p.strip()]


def _segments(text: str) -> list[str]:
    return [s for line in text.split("\n") for s in split_sentences(_tidy(line))]


def pair_reason(en: str, de: str) -> str | None:
    """Why a cleaned (en, de) pair is not kept, or None to keep it."""
    if not en or not de or not any(c.isalpha() for c in en + de):
        return "empty"
    if en.casefold() == de.casefold():
        return "untranslated"
    if _PLACEHOLDER.search(en) or _PLACEHOLDER.search(de):
        return "placeholder"
    if _CODE.search(en) or _CODE.search(de):
        return "code"
    if any(t.count("(") != t.count(")") or t.count('"') % 2 for t in (en, de)):
        return "fragment"  # a sentence split inside brackets or quotes
    if len(en) > MAX_CHARS or len(de) > MAX_CHARS:
        return "long"
    if len(en.split()) < MIN_WORDS and len(de.split()) < MIN_WORDS:
        return "short"
    if sum(c.isupper() for c in en) > 1 and en.upper() == en:
        return "capitals"
    if not length_ok(en, de):
        return "length_ratio"
    return None


def clean_units(
    units: Iterable[tuple[str, str]], stats: Counter[str], catalog: bool = True
) -> Iterator[tuple[str, str]]:
    """Cleaned (en, de) pairs of raw units; `stats` counts units read and why pairs were dropped.

    `catalog`: the units are catalog strings (contexts, markup, accelerators to strip), not the
    plain text of documentation blocks."""
    for raw_en, raw_de in units:
        stats["units"] += 1
        if raw_en.strip() in CREDITS:
            stats["credits"] += 1
            continue
        en, de = strip_placeholders(raw_en), strip_placeholders(raw_de)
        if catalog:
            en, de = strip_context(en, de)
            en, de = strip_markup(en), strip_markup(de)
        en_parts, de_parts = _segments(en), _segments(de)
        if en_parts and len(en_parts) == len(de_parts):
            pairs = list(zip(en_parts, de_parts, strict=True))
        else:
            pairs = [(_tidy(en), _tidy(de))]
        for en, de in pairs:
            reason = pair_reason(en, de)
            if reason is None:
                yield en, de
            else:
                stats[reason] += 1


def dedup_key(text: str) -> str:
    """Case- and punctuation-insensitive form of a line, for near-duplicate detection."""
    return " ".join(re.sub(r"[\W_]+", " ", text.casefold()).split())
