"""Everyday phrases from a language course's lesson files: (en, de) pairs for modern.py.

A German course packaged as data (auf-deutsch on PyPI: phrase packs, dialogues, stories, grammar
examples as JSON) pairs each German phrase with an English one: `{"de": ..., "en": ..., ...}`
objects at any depth, and `X_de` / `X_en` fields of one object (a listening exercise's question
and answer, a story's title). They are the one source of everyday speech the registries ship
(shopping, travel, weather, the doctor, the landlord); software catalogs and the Bible have
little of it.

A learner's gloss is not always a translation, so each pair is cleaned:
- a note in parentheses at the end of either side goes ("How old are you? (formal)");
- of alternatives split by " / " the first stays ("Until then! / See you then!"), unless the
  gloss is a sentence and its first alternative is not ("I'm free / spontaneous tonight."):
  then the pair is dropped;
- grammar notation is not a translation: a form ("kommen -> gekommen", "Mittagessen = lunch")
  or a case a verb takes ("helfen + Dat") drops the pair.
Catalogs' rules (catalogs.py: placeholders, a minimum of words, the length ratio) are not
applied: vocabulary entries ("das Gleis" / "the platform") are pairs of single words, like Ding's
terms, and the length ratio, made for aligned sentences, drops good pairs of a course ("I'm
lost." / "Ich habe mich verlaufen.", "to re-register after moving" / "ummelden").
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

Pair = tuple[str, str]

_NOTE = re.compile(r"\s*\([^()]*\)\s*$")
_ALTERNATIVES = re.compile(r"\s+/\s+")
_GRAMMAR_FORM = re.compile(
    r"->|→|=>|\s=\s|\+\s*(?:Akk|Dat|Gen|Nom|accusative|dative|genitive|nominative)", re.IGNORECASE
)
_SENTENCE_END = re.compile(r"[.!?…]$")


def _objects(node: Any) -> Iterator[dict[str, Any]]:
    """Every JSON object in a parsed document, depth first, in document order."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _objects(value)
    elif isinstance(node, list):
        for value in node:
            yield from _objects(value)


def clean_gloss(text: str) -> str:
    """One side of a lesson pair without its trailing note and with its first alternative; ""
    when the gloss is a sentence and its first alternative only part of one."""
    text = " ".join(text.split())
    while True:
        stripped = _NOTE.sub("", text)
        if stripped == text:
            break
        text = stripped
    first = _ALTERNATIVES.split(text, maxsplit=1)[0].strip()
    if first != text and _SENTENCE_END.search(text) and not _SENTENCE_END.search(first):
        return ""
    return first


def _object_pairs(obj: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    """(en, de) values of an object: its `en` / `de` fields, then each `X_en` / `X_de` pair."""
    yield obj.get("en"), obj.get("de")
    for key in obj:
        if key.endswith("_en") and f"{key[:-3]}_de" in obj:
            yield obj[key], obj[f"{key[:-3]}_de"]


def lesson_units(path: Path, stats: Counter[str]) -> Iterator[Pair]:
    """Cleaned (en, de) pairs of one lesson file; `stats` counts what was read and dropped."""
    try:
        document = json.loads(path.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        stats["lesson_unreadable"] += 1
        return
    for obj in _objects(document):
        for en, de in _object_pairs(obj):
            if not isinstance(en, str) or not isinstance(de, str):
                continue
            stats["units"] += 1
            if _GRAMMAR_FORM.search(en) or _GRAMMAR_FORM.search(de):
                stats["lesson_grammar_notation"] += 1
                continue
            en, de = clean_gloss(en), clean_gloss(de)
            if not en or not de:
                stats["lesson_empty_or_partial"] += 1
                continue
            yield en, de
