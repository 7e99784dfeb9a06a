"""A text as the units a translation model decodes: sentences (spans of the text) and the
characters between them, kept verbatim.

`split_document` cuts a text at its line breaks, then each line into sentences (the segmenter of
`attnserve.text.segment`), then a sentence the model could not take whole at clause boundaries,
then between words, and a word longer than the model takes (a URL, a hash) into the longest
pieces that fit, so that every unit fits `fits` and nothing is cut off. `Document.join` puts the
translations of the units back in place of their spans: whitespace, line and paragraph breaks,
and anything that is not a unit come back exactly as sent.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from attnserve.text.segment import Segmenter

Span = tuple[int, int]  # [start, end) of a unit in Document.text
Fits = Callable[[str], bool]  # whether the model takes a unit whole

# Where a sentence too long for the model is cut first: after a clause's punctuation and its
# whitespace (the punctuation stays with the clause before it).
_CLAUSE_END = re.compile(r"[,;:\u2013\u2014\u3001\uff0c\uff1b](?=\s)|\s[\u2013\u2014-](?=\s)")
_WORD = re.compile(r"\S+")
_LINE = re.compile(r"[^\r\n]+")


class TooManyUnits(ValueError):
    """A text of more units than the caller takes (found while splitting, not after)."""


class UnitTooLong(ValueError):
    """Text the model cannot take even one character at a time."""

    def __init__(self, text: str) -> None:
        shown = text if len(text) <= 40 else f"{text[:37]}..."
        super().__init__(f"the model cannot take {shown!r} (not even one character of it)")
        self.text = text


@dataclass(frozen=True)
class Document:
    """`text` and the spans of its units, in order, non-empty and not overlapping."""

    text: str
    spans: tuple[Span, ...]

    @property
    def units(self) -> list[str]:
        return [self.text[a:b] for a, b in self.spans]

    def join(self, translations: Sequence[str]) -> str:
        """The text with each unit's span replaced by its translation."""
        if len(translations) != len(self.spans):
            raise ValueError(f"{len(translations)} translations for {len(self.spans)} units")
        parts: list[str] = []
        at = 0
        for (a, b), translated in zip(self.spans, translations, strict=True):
            parts.append(self.text[at:a])
            parts.append(translated)
            at = b
        parts.append(self.text[at:])
        return "".join(parts)

    def gaps(self) -> list[str]:
        """The verbatim text before each unit, and after the last (len(spans) + 1 strings)."""
        ends = [0, *(b for _, b in self.spans)]
        starts = [*(a for a, _ in self.spans), len(self.text)]
        return [self.text[e:s] for e, s in zip(ends, starts, strict=True)]


def whole(text: str) -> Document:
    """The text as one unit (without its leading and trailing whitespace)."""
    stripped = text.strip()
    if not stripped:
        return Document(text, ())
    start = text.index(stripped[0])
    return Document(text, ((start, start + len(stripped)),))


def split_document(
    text: str,
    segmenter: Segmenter,
    language: str | None = None,
    fits: Fits | None = None,
    prefer: Fits | None = None,
    max_units: int | None = None,
) -> Document:
    """Units of `text`: its sentences, line by line, each cut further until it `fits` (the
    model's limit). A sentence that `fits` but not `prefer` (a length the model translates
    well) is cut at its clause ends, if it has any, into runs of clauses that `prefer` allows.
    TooManyUnits as soon as there are more than `max_units`."""
    spans: list[Span] = []
    for line in _LINE.finditer(text):
        for a, b in segmenter.spans(line.group(), language):
            spans.extend(_fit(text, line.start() + a, line.start() + b, fits, prefer))
            if max_units is not None and len(spans) > max_units:
                raise TooManyUnits(f"more than {max_units} sentences")
    return Document(text, tuple(spans))


def _fit(
    text: str, start: int, end: int, fits: Fits | None, prefer: Fits | None = None
) -> list[Span]:
    """[start, end) as it is if it fits (and is preferred), else cut at clause ends, else
    between words."""
    fits_model = fits is None or fits(text[start:end])
    if fits_model and (prefer is None or prefer(text[start:end])):
        return [(start, end)]
    clauses = _cuts(text, start, end, [m.end() for m in _CLAUSE_END.finditer(text, start, end)])
    if len(clauses) > 1:

        def both(unit: str) -> bool:
            return (fits is None or fits(unit)) and (prefer is None or prefer(unit))

        return _pack(text, clauses, both, lambda a, b: _fit(text, a, b, fits))
    if fits_model or fits is None:
        return [(start, end)]
    words = [(start + m.start(), start + m.end()) for m in _WORD.finditer(text[start:end])]
    if len(words) == 1:
        return _characters(text, start, end, fits)
    return _pack(text, words, fits, lambda a, b: _characters(text, a, b, fits))


def _characters(text: str, start: int, end: int, fits: Fits) -> list[Span]:
    """A word too long for the model (a URL, a hash) in the longest pieces that fit: the
    piece's length found by doubling, then bisection, so each test reads a short piece."""
    out: list[Span] = []
    while start < end:
        if not fits(text[start : start + 1]):
            raise UnitTooLong(text[start:end])
        low, step = start + 1, 1  # [start, low) fits
        while low < end and fits(text[start : min(low + step, end)]):
            low, step = min(low + step, end), step * 2
        high = min(low + step, end) - 1  # [start, high + 1) does not fit (or is the end)
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(text[start:mid]) else (low, mid - 1)
        out.append((start, low))
        start = low
    return out


def _cuts(text: str, start: int, end: int, positions: list[int]) -> list[Span]:
    """[start, end) cut at `positions`, each piece without its surrounding whitespace."""
    pieces: list[Span] = []
    at = start
    for cut in [*positions, end]:
        piece = text[at:cut]
        stripped = piece.strip()
        if stripped:
            a = at + piece.index(stripped[0])
            pieces.append((a, a + len(stripped)))
        at = cut
    return pieces


def _pack(
    text: str, pieces: list[Span], fits: Fits, too_long: Callable[[int, int], list[Span]]
) -> list[Span]:
    """Consecutive pieces joined greedily into the longest runs that fit; a piece that does
    not fit alone goes to `too_long`."""
    out: list[Span] = []
    run: Span | None = None
    for piece in pieces:
        if run is not None and fits(text[run[0] : piece[1]]):
            run = (run[0], piece[1])
            continue
        if run is not None:
            out.append(run)
            run = None
        if fits(text[piece[0] : piece[1]]):
            run = piece
        else:
            out.extend(too_long(*piece))
    if run is not None:
        out.append(run)
    return out
