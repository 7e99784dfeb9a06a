"""A language course's lesson files as everyday (en, de) pairs."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from attnserve.training.lessons import clean_gloss, lesson_units

PACK = {
    "pack_id": "shopping",
    "phrases": [
        {
            "id": "shopping_001",
            "de": "Was kostet das?",
            "en": "How much is this?",
            "literal": "What costs that?",
            "examples": [
                {"de": "Was kostet die Jacke?", "en": "How much is the jacket?"},
                {"de": "Stimmt!", "en": "That's right! / True!"},
            ],
            "variations": [{"de": "Wie alt sind Sie?", "en": "How old are you? (formal)"}],
            "tags": ["price"],
        },
        {"de": "kommen -> gekommen", "en": "come / came"},
        {"de": "Mittagessen = lunch", "en": "das Mittagessen"},
        {"de": "helfen + Dat", "en": "to help someone"},
        {"de": "das Gleis", "en": "the platform / track"},
        {"de": "Ich bin heute Abend spontan.", "en": "I'm free / spontaneous tonight."},
        {"de": " ", "en": "(no translation)"},
        {"de": 3, "en": "not text"},
    ],
    "question_de": "Wann fährt der Zug?",
    "question_en": "When does the train leave?",
    "answer_de": "Um acht.",
}


@pytest.mark.parametrize(
    ("gloss", "clean"),
    [
        ("How old are you? (formal)", "How old are you?"),
        ("Until then! / See you then!", "Until then!"),
        ("to go / walk", "to go"),
        ("I'm free / spontaneous tonight.", ""),
        ("I'm thirsty. (literally 'I have thirst')", "I'm thirsty."),
        ("home (towards home) (casual)", "home"),
        ("Hi (there), friend", "Hi (there), friend"),
        ("and/or", "and/or"),
        ("  two   spaces ", "two spaces"),
    ],
)
def test_a_gloss_loses_its_note_and_other_alternatives(gloss: str, clean: str) -> None:
    assert clean_gloss(gloss) == clean


def test_lesson_units_read_every_object_at_any_depth(tmp_path: Path) -> None:
    path = tmp_path / "shopping.json"
    path.write_text(json.dumps(PACK, ensure_ascii=False), "utf-8")
    stats: Counter[str] = Counter()
    assert list(lesson_units(path, stats)) == [
        ("When does the train leave?", "Wann fährt der Zug?"),
        ("How much is this?", "Was kostet das?"),
        ("How much is the jacket?", "Was kostet die Jacke?"),
        ("That's right!", "Stimmt!"),
        ("How old are you?", "Wie alt sind Sie?"),
        ("the platform", "das Gleis"),
    ]
    assert stats == {"units": 11, "lesson_grammar_notation": 3, "lesson_empty_or_partial": 2}


def test_an_unreadable_lesson_file_is_counted_not_fatal(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"de": "Hallo", "en": ', "utf-8")
    stats: Counter[str] = Counter()
    assert list(lesson_units(path, stats)) == []
    assert stats == {"lesson_unreadable": 1}
