"""Language detection for `source_lang: "auto"`: a text in, its language and a confidence out.

The detector is py3langid (BSD-3-Clause; langid.py's 97-language naive Bayes model, shipped
inside the wheel, no download), chosen by measurement against lingua, langid, fasttext's
lid.176 and langdetect (docs/BENCHMARKS.md, "Language detectors"). A text is ranked over all
its languages first, so that a French text sent to an English-German model is named French
(and refused by the caller) rather than forced into English or German, when the model is sure
of it (`FOREIGN`); a text too short or too mixed to tell is decided among the model's own
languages.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SHORT_CHARS = 20
# A text is named as another language than the caller's only when the model is this sure:
# (letters at least, probability at least), from the longest evidence to the shortest.
FOREIGN = ((SHORT_CHARS, 0.9), (6, 0.999))
_LETTERS = re.compile(r"[^\W\d_]")

# English names of the languages most often served (GET /languages); others are named by code.
NAMES = {
    "ar": "Arabic", "bg": "Bulgarian", "ca": "Catalan", "cs": "Czech", "da": "Danish",
    "de": "German", "el": "Greek", "en": "English", "eo": "Esperanto", "es": "Spanish",
    "et": "Estonian", "fa": "Persian", "fi": "Finnish", "fr": "French", "ga": "Irish",
    "he": "Hebrew", "hi": "Hindi", "hr": "Croatian", "hu": "Hungarian", "id": "Indonesian",
    "it": "Italian", "ja": "Japanese", "ko": "Korean", "la": "Latin", "lt": "Lithuanian",
    "lv": "Latvian", "ms": "Malay", "nb": "Norwegian Bokmål", "nl": "Dutch", "no": "Norwegian",
    "pl": "Polish", "pt": "Portuguese", "ro": "Romanian", "ru": "Russian", "sk": "Slovak",
    "sl": "Slovenian", "sq": "Albanian", "sr": "Serbian", "sv": "Swedish", "th": "Thai",
    "tl": "Tagalog", "tr": "Turkish", "uk": "Ukrainian", "ur": "Urdu", "vi": "Vietnamese",
    "zh": "Chinese",
}  # fmt: skip


def language_name(code: str) -> str:
    return NAMES.get(code, code)


@dataclass(frozen=True)
class Detection:
    language: str  # the caller's code for it (a model's language name where one matched)
    confidence: float  # 0-1


class Detector:
    """py3langid's classifier; `languages`: the codes a caller accepts (None: any)."""

    def __init__(self, languages: Sequence[str] | None) -> None:
        from py3langid.langid import MODEL_FILE, LanguageIdentifier

        self._identifier: Any = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
        self._lock = threading.Lock()  # the identifier keeps per-call state in its arrays
        known = set(self._identifier.nb_classes)
        self.languages = list(languages) if languages is not None else None
        # the caller's code for each of its languages that the model knows (deu_Latn -> de)
        self._names: dict[str, str] = {}
        for name in self.languages or []:
            iso = _iso639_1(name)
            if iso in known:
                self._names.setdefault(iso, name)

    def ranked(self, text: str) -> list[Detection]:
        """The likeliest languages first (the caller's ones where it has any; at most 3)."""
        if not _LETTERS.search(text):
            return []
        with self._lock:
            ranking = self._identifier.rank(text)
        if not self._names:
            return [Detection(code, float(p)) for code, p in ranking[:3]]
        ours = [(self._names[c], float(p)) for c, p in ranking if c in self._names]
        total = sum(p for _, p in ours) or 1.0
        return [Detection(name, p / total) for name, p in ours[:3]]

    def detect(self, text: str) -> Detection | None:
        """The text's language; one of the caller's unless the text is clearly another (then
        that one, by its ISO 639-1 code); None for a text without letters."""
        if not _LETTERS.search(text):
            return None
        with self._lock:
            ranking = self._identifier.rank(text)
        best, p = ranking[0]
        if not self._names or best in self._names:
            return Detection(self._names.get(best, best), float(p))
        letters = len(_LETTERS.findall(text))
        if any(letters >= n and p >= sure for n, sure in FOREIGN):
            return Detection(best, float(p))
        ours = self.ranked(text)
        return ours[0] if ours else Detection(best, float(p))


def _iso639_1(name: str) -> str:
    from attnserve.model.languages import ISO639_3_TO_1, code_language

    code = code_language(name)
    return ISO639_3_TO_1.get(code, code) if len(code) == 3 else code


@functools.lru_cache(maxsize=16)
def _detector(languages: tuple[str, ...] | None) -> Detector:
    return Detector(languages)


def detector_for(languages: Sequence[str] | None) -> Detector:
    """One detector per set of languages, built once (loading the model takes ~0.3 s)."""
    return _detector(tuple(languages) if languages is not None else None)
