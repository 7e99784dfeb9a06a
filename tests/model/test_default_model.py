"""The committed default model (checkpoints/ende-small) loads and translates held-out verses.

No quality threshold here: quality lives in the model card (`attnserve eval`).
"""

from __future__ import annotations

import json

import pytest

from attnserve.defaults import default_model_dir
from attnserve.engine.options import DecodingOptions
from attnserve.engine.translator import Translator
from attnserve.service.settings import Settings

DEFAULT_MODEL = default_model_dir()

# Ruth 1:1 and Mark 1:1 (test books: never trained on), King James and Elberfelder.
RUTH_1_1 = (
    "Now it came to pass in the days when the judges ruled, that there was a famine in the land."
)
MARK_1_1 = "Anfang des Evangeliums Jesu Christi, des Sohnes Gottes."


@pytest.fixture(scope="module")
def translator() -> Translator:
    return Translator.from_model_dir(DEFAULT_MODEL, backend="torch", threads=1)


def test_the_default_model_is_committed_and_served_by_default() -> None:
    assert DEFAULT_MODEL.name == "ende-small" and DEFAULT_MODEL.is_dir()
    assert Settings().models == [str(DEFAULT_MODEL)]
    for name in ("config.json", "model.safetensors", "MODEL_CARD.md"):
        assert (DEFAULT_MODEL / name).is_file(), name
    assert (DEFAULT_MODEL / "model.safetensors").stat().st_size < 60 * 2**20
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    assert config["vocab_size"] == 16000


def test_translates_a_test_book_verse_into_german(translator: Translator) -> None:
    assert translator.tokenizer.target_languages == ["de", "en"]
    assert translator.defaults.beam_size == 4  # metadata.json's generation defaults
    options = DecodingOptions(beam_size=4, max_new_tokens=64)
    (german,) = translator.translate([RUTH_1_1], options, target_lang="de")
    assert german.text.strip() and german.text != RUTH_1_1
    assert sum(c.isalpha() for c in german.text) > 10


def test_translates_a_test_book_verse_into_english(translator: Translator) -> None:
    options = DecodingOptions(beam_size=4, max_new_tokens=64)
    (english,) = translator.translate([MARK_1_1], options, target_lang="en")
    assert english.text.strip() and english.text != MARK_1_1
