"""Sentence segmentation: a line of text in, the spans of its sentences out.

The segmenter is Wikimedia's `sentencex` (MIT, pure Python, no model files): rules and
abbreviation lists for some 250 languages with fallbacks between related ones, character offsets
of each sentence, no download. It was chosen by measurement against pysbd, blingfire, syntok,
NLTK's punkt and a punctuation regex (docs/BENCHMARKS.md, "Sentence segmenters"). A language it
does not know, or none (a text whose language was not given or detected), is segmented with
English's rules.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Protocol

log = logging.getLogger(__name__)

Span = tuple[int, int]
# A list marker sentencex cuts off as a sentence of its own ("1. | Open the box."): joined
# to the sentence after it.
_MARKER = re.compile(r"\(?(?:\d{1,3}|[A-Za-z]|[ivxlcIVXLC]{1,5})[.)]")


class Segmenter(Protocol):
    def spans(self, line: str, language: str | None) -> list[Span]:
        """[start, end) of each sentence of `line`, in order, without surrounding whitespace."""
        ...


class SentencexSegmenter:
    """`sentencex.get_sentence_boundaries`, spans trimmed of their whitespace."""

    def __init__(self) -> None:
        import sentencex  # imported on first use: the service imports this module at start

        self._boundaries = sentencex.get_sentence_boundaries

    def spans(self, line: str, language: str | None) -> list[Span]:
        out: list[Span] = []
        for found in self._boundaries(_code(language), line):
            start, end = int(found["start_index"]), int(found["end_index"])
            piece = line[start:end]
            stripped = piece.strip()
            if stripped:
                a = start + piece.index(stripped[0])
                out.append((a, a + len(stripped)))
        return _join_markers(line, out)


def _join_markers(line: str, spans: list[Span]) -> list[Span]:
    out: list[Span] = []
    for span in spans:
        if out and _MARKER.fullmatch(line[out[-1][0] : out[-1][1]]):
            out[-1] = (out[-1][0], span[1])
        else:
            out.append(span)
    return out


def _code(language: str | None) -> str:
    """ISO 639-1 code of a model's language name (`deu_Latn` -> `de`, `en_XX` -> `en`)."""
    if not language:
        return "en"
    from attnserve.model.languages import ISO639_3_TO_1, code_language

    code = code_language(language)
    return ISO639_3_TO_1.get(code, code) if len(code) == 3 else code


@functools.cache
def default_segmenter() -> Segmenter:
    return SentencexSegmenter()
