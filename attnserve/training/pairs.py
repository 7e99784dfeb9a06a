"""A sentence pair's text, the same for every source of the corpus: normalisation and the
length-ratio rule (data.py's Bible and Ding, catalogs.py's and the other modern sources')."""

from __future__ import annotations

import re
import unicodedata

MAX_LENGTH_RATIO = 2.0  # characters, longer / shorter side
RATIO_MIN_CHARS = 20  # the ratio test only applies when the longer side is at least this long

_SPACES = re.compile(r"\s+")
_QUOTES = str.maketrans({"’": "'", "‘": "'", "`": "'", "\u00ad": None})  # and soft hyphens


def normalize(text: str) -> str:
    """Unicode NFC, typographic apostrophes -> ', soft hyphens (a line-break hint, invisible)
    removed, whitespace collapsed and trimmed."""
    return _SPACES.sub(" ", unicodedata.normalize("NFC", text.translate(_QUOTES))).strip()


def length_ok(en: str, de: str) -> bool:
    """False for badly length-mismatched pairs (character ratio above MAX_LENGTH_RATIO)."""
    short, long_ = sorted((len(en), len(de)))
    return long_ < RATIO_MIN_CHARS or long_ <= MAX_LENGTH_RATIO * max(short, 1)
