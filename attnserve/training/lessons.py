"""Everyday phrases from a language course's lesson files: (en, de) pairs for modern.py.

A German course packaged as data (auf-deutsch on PyPI: phrase packs, dialogues, stories, grammar
examples as JSON) pairs each German phrase with an English one: `{"de": ..., "en": ..., ...}`
objects at any depth. They are the one source of everyday speech the registries ship (shopping,
travel, weather, the doctor, the landlord); software catalogs and the Bible have little of it.

A learner's gloss is not always a translation, so each pair is cleaned:
- a note in parentheses at the end of either side goes ("How old are you? (formal)");
- of alternatives split by " / " the first stays ("Until then! / See you then!");
- a grammar form ("kommen -> gekommen") is not a pair: dropped.
Vocabulary entries ("das Gleis" / "the platform") stay: like Ding's terms, they are pairs of
single words and short phrases, which no word-count rule should drop.
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
_GRAMMAR_FORM = re.compile(r"->|→|=>")


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
    """One side of a lesson pair without its trailing note and with its first alternative."""
    text = " ".join(text.split())
    while True:
        stripped = _NOTE.sub("", text)
        if stripped == text:
            break
        text = stripped
    return _ALTERNATIVES.split(text, maxsplit=1)[0].strip()


def lesson_units(path: Path, stats: Counter[str]) -> Iterator[Pair]:
    """Cleaned (en, de) pairs of one lesson file; `stats` counts what was read and dropped."""
    try:
        document = json.loads(path.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        stats["lesson_unreadable"] += 1
        return
    for obj in _objects(document):
        en, de = obj.get("en"), obj.get("de")
        if not isinstance(en, str) or not isinstance(de, str):
            continue
        stats["units"] += 1
        if _GRAMMAR_FORM.search(en) or _GRAMMAR_FORM.search(de):
            stats["lesson_grammar_form"] += 1
            continue
        en, de = clean_gloss(en), clean_gloss(de)
        if not en or not de:
            stats["lesson_empty"] += 1
            continue
        yield en, de
